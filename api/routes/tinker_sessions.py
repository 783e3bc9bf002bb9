"""The Tinker API's service and session routes (docs/sessions.md), as the official `tinker` SDK
calls them:

    POST /api/v1/client/config            the SDK's settings: plain JSON and HTTP/1.1, futures polled one by one
    POST /api/v1/client/dynamic_config    {}
    POST /api/v1/telemetry                accepted, dropped
    GET  /api/v1/healthz                  {"status": "ok"}
    GET  /api/v1/get_server_capabilities  the models live workers offer
    POST /api/v1/create_session           {session_id}
    POST /api/v1/session_heartbeat        the session is in use (its jobs end after idle_timeout_s without one)
    POST /api/v1/sessions/{id}/finish     its jobs end once the calls before this are answered
    GET  /api/v1/sessions                 {sessions: [ids]}, newest first (a trainer token: its own)
    GET  /api/v1/sessions/{id}            {training_run_ids, sampler_ids, user_metadata, display_name}
"""

import json
from typing import Any

from fastapi import APIRouter, HTTPException, Query, status
from pydantic import Field

from api.deps import RedisDep
from api.tinker_compat.protocol import ERRORS, Body, KeyDep, KeyWriterDep, TinkerRoute
from api.tinker_compat.jobs import not_found, session_or_404
from shared import sessions, workers
from shared.session_specs import SESSION_ID_PATTERN

router = APIRouter(prefix="/api/v1", tags=["Tinker: sessions"], route_class=TinkerRoute, responses=ERRORS)

# The SDK's defaults are for Tinker's own servers: a Rust HTTP/2 transport, forward_backward
# chunks sent at once and out of order, a batch poller for samples. This server takes each
# model's calls in the order they arrive, so the chunks come one after another.
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}


class CreateSession(Body):
    tags: list[str] = Field(default_factory=list, max_length=64)
    user_metadata: dict[str, str] | None = None
    display_name: str | None = Field(None, max_length=256)


class SessionRef(Body):
    session_id: str = Field(pattern=SESSION_ID_PATTERN)


@router.post("/client/config", summary="The SDK's settings for this server")
def client_config() -> dict[str, Any]:
    return CLIENT_CONFIG


@router.post("/client/dynamic_config", summary="The SDK's refreshed settings: none")
def client_dynamic_config() -> dict[str, Any]:
    return {}


@router.post("/telemetry", summary="The SDK's telemetry: accepted and dropped")
def telemetry(who: KeyDep) -> dict[str, str]:
    return {"status": "accepted"}


@router.get("/healthz", summary="The API is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities", summary="The models the live workers offer")
def server_capabilities(r: RedisDep, who: KeyDep) -> dict[str, Any]:
    names = sorted({m["model_id"] for w in workers.live_workers(r) for m in w.get("models", [])}
                   | {name for w in workers.live_workers(r) for name in w.get("declared", [])})
    return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True} for name in names]}


@router.post("/create_session", summary="A new session: the models and samplers it makes are its")
def create_session(body: CreateSession, r: RedisDep, who: KeyWriterDep) -> dict[str, str]:
    if any(len(t) > 256 for t in body.tags) or len(json.dumps(body.user_metadata or {})) > 65_536:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "tags are 256 characters at most, user_metadata 64 KiB")
    sid = sessions.create_session(r, who.name, who.tenant, body.tags, body.user_metadata or {}, body.display_name)
    return {"session_id": sid, "type": "create_session"}


@router.post("/session_heartbeat", summary="The client is alive")
def session_heartbeat(body: SessionRef, r: RedisDep, who: KeyDep) -> dict[str, str]:
    session_or_404(r, body.session_id, who)
    sessions.seen(r, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish", summary="The client is done with the session")
def finish_session(session_id: str, r: RedisDep, who: KeyDep) -> dict[str, Any]:
    found = sessions.get_session(r, session_id)
    if found is None or not who.sees(found["owner"]):
        raise not_found(f"session {session_id!r}")
    sessions.finish_session(r, session_id)
    return {}


@router.get("/sessions", summary="Sessions, newest first (a trainer token: its own)")
def list_sessions(r: RedisDep, who: KeyDep, limit: int = Query(20, ge=1, le=1000),
                  offset: int = Query(0, ge=0)) -> dict[str, list[str]]:
    return {"sessions": sessions.list_sessions(r, who.tenant, offset, limit)}


@router.get("/sessions/{session_id}", summary="A session's training runs and samplers")
def get_session(session_id: str, r: RedisDep, who: KeyDep) -> dict[str, Any]:
    found = sessions.get_session(r, session_id)
    if found is None or not who.sees(found["owner"]):
        raise not_found(f"session {session_id!r}")
    return {"training_run_ids": sessions.session_members(r, session_id, "runs"),
            "sampler_ids": sessions.session_members(r, session_id, "samplers"),
            "user_metadata": json.loads(found["user_metadata"]), "display_name": found["display_name"] or None}
