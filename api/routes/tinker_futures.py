"""The Tinker API's futures (docs/sessions.md): every training and sampling call answers a
future at once, `{request_id}`, and its result comes from

    POST /api/v1/retrieve_future   {request_id} -> the result: JSON, or protobuf for forward_backward
                                   and sample; {"error", "category"} if the call failed; or, after
                                   waiting up to LONG_POLL_S, {"type": "try_again"} (the SDK asks again at once)
    POST /api/v1/cancel_future     {request_id}: a call not yet taken by its worker fails as cancelled

A call whose session's job ended before answering it (a lost worker, a cancel) fails with a
message that says what to do; an unknown or expired future is a 404 (another token's too).
"""

import json
import time

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from api.deps import AsyncRedisDep, RedisDep
from api.tinker_compat.jobs import ended, not_found
from api.tinker_compat.protocol import ERRORS, Body, KeyDep, KeyWriterDep, TinkerRoute
from shared import lifecycle, sessions
from shared.keys import job_key

router = APIRouter(prefix="/api/v1", tags=["Tinker: futures"], route_class=TinkerRoute, responses=ERRORS)

LONG_POLL_S = 20.0  # the SDK gives up on one poll after 45 s, and asks again at once after a try_again
WAIT_SLICE_S = 1.0  # one BRPOPLPUSH of the wait: below the async client's socket timeout (MTQ_REDIS_TIMEOUT_S)


class FutureRef(Body):
    request_id: str = Field(pattern=r"^[a-f0-9]{32}$")


async def visible(ar, request_id: str, who) -> dict:
    rec = sessions.future_record(await ar.hgetall(sessions.future_key(request_id)))
    if rec is None or not who.sees(rec["owner"]):
        raise not_found(f"future {request_id!r}")
    return rec


@router.post("/retrieve_future", summary="A call's result, once its worker answered it (long poll)")
async def retrieve_future(body: FutureRef, r: RedisDep, ar: AsyncRedisDep, who: KeyDep) -> Response:
    rid = body.request_id
    rec = await visible(ar, rid, who)
    deadline = time.monotonic() + LONG_POLL_S
    while rec["status"] == "pending" and (left := deadline - time.monotonic()) > 0:
        state, error = await ar.hmget(job_key(rec["job_id"]), "status", "error")
        if state is None or state.decode() in lifecycle.FINISHED:  # nobody will answer it
            why = ended(rec["job_id"], state and state.decode(), (error or b"").decode())
            await run_in_threadpool(sessions.fail, r, rid, why, "server")
        else:
            await ar.brpoplpush(sessions.done_key(rid), sessions.done_key(rid), timeout=min(left, WAIT_SLICE_S))
        rec = await visible(ar, rid, who)
    if rec["status"] == "pending":
        queued = await ar.hget(job_key(rec["job_id"]), "status") == b"queued"
        return JSONResponse({"type": "try_again", "request_id": rid,
                             "queue_state": "paused_capacity" if queued else "active"})
    if rec["status"] == "failed":
        return JSONResponse({"error": rec["error"], "category": rec["category"]})
    if rec["content_type"] == "application/json":
        return JSONResponse(json.loads(rec["result"]))
    return Response(rec["result"], media_type=rec["content_type"])


@router.post("/cancel_future", summary="Fail a call its worker has not taken yet")
def cancel_future(body: FutureRef, r: RedisDep, who: KeyWriterDep) -> dict:
    rec = sessions.get_future(r, body.request_id)
    if rec is None or not who.sees(rec["owner"]):
        raise not_found(f"future {body.request_id!r}")
    if sessions.unqueue(r, rec["job_id"], body.request_id):
        sessions.fail(r, body.request_id, "cancelled by the client", "user")
    return {}
