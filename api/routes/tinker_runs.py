"""The Tinker API's training runs and checkpoints (docs/sessions.md), as the SDK's RestClient
reads them. A training run is a training client's model id; its checkpoints are what
save_weights (`weights/<name>`: weights and optimizer state) and save_weights_for_sampler
(`sampler_weights/<name>`: weights as mlx_lm's adapter files) stored in Redis:

    GET    /api/v1/training_runs                                   {training_runs, cursor}, newest first
    GET    /api/v1/training_runs/{id}                              one run
    GET    /api/v1/training_runs/{id}/checkpoints                  {checkpoints}
    DELETE /api/v1/training_runs/{id}/checkpoints/{checkpoint_id}  (checkpoint_id: weights/<name> | sampler_weights/<name>)
    GET    /api/v1/training_runs/{id}/checkpoints/{checkpoint_id}/archive   its files as .tar.gz (not the SDK's:
                                                                    mlx_lm.load(base, adapter_path=<extracted>) loads it)
    GET    /api/v1/checkpoints                                     every run's checkpoints (a trainer token: its own)
"""

from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Query, Response

from api.deps import RedisDep
from api.routes.adapters import archive_response
from api.tinker_compat.jobs import not_found, run_or_404
from api.tinker_compat.protocol import ERRORS, KeyDep, KeyWriterDep, TinkerRoute
from shared import sessions

router = APIRouter(prefix="/api/v1", tags=["Tinker: training runs"], route_class=TinkerRoute, responses=ERRORS)

CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def checkpoint(model_id: str, checkpoint_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {"checkpoint_id": checkpoint_id, "checkpoint_type": CHECKPOINT_TYPES[checkpoint_id.split("/")[0]],
            "time": iso(meta["time"]), "tinker_path": sessions.tinker_path(model_id, checkpoint_id),
            "size_bytes": meta["size_bytes"], "public": False,
            "expires_at": iso(meta["expires_at"]) if meta.get("expires_at") else None}


def training_run(r, model_id: str, run: dict[str, Any]) -> dict[str, Any]:
    saved = sorted(((m["time"], c, m) for c, m in sessions.checkpoints(r, model_id).items()), key=lambda x: x[0])
    last = {kind: next((checkpoint(model_id, c, m) for _, c, m in reversed(saved) if CHECKPOINT_TYPES[c.split("/")[0]] == kind),
                       None) for kind in ("training", "sampler")}
    return {"training_run_id": model_id, "base_model": run["base_model"], "model_owner": run["owner"], "is_lora": True,
            "corrupted": False, "lora_rank": run["lora"]["rank"], "last_request_time": iso(float(run["last_request_at"])),
            "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
            "user_metadata": run["user_metadata"] or None}


@router.get("/training_runs", summary="Training runs, newest first (a trainer token: its own)")
def list_training_runs(r: RedisDep, who: KeyDep, limit: int = Query(20, ge=1, le=1000),
                       offset: int = Query(0, ge=0)) -> dict[str, Any]:
    ids, total = sessions.list_runs(r, who.tenant, offset, limit)
    runs = [(m, sessions.get_run(r, m)) for m in ids]
    return {"training_runs": [training_run(r, m, run) for m, run in runs if run is not None],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{model_id}", summary="A training run")
def get_training_run(model_id: str, r: RedisDep, who: KeyDep) -> dict[str, Any]:
    return training_run(r, model_id, run_or_404(r, model_id, who))


@router.get("/training_runs/{model_id}/checkpoints", summary="A training run's checkpoints, oldest first")
def list_checkpoints(model_id: str, r: RedisDep, who: KeyDep) -> dict[str, Any]:
    run_or_404(r, model_id, who)
    saved = sorted(sessions.checkpoints(r, model_id).items(), key=lambda x: x[1]["time"])
    return {"checkpoints": [checkpoint(model_id, c, m) for c, m in saved]}


@router.get("/checkpoints", summary="Every training run's checkpoints (a trainer token: its own), newest first")
def all_checkpoints(r: RedisDep, who: KeyDep, limit: int = Query(100, ge=1, le=1000),
                    offset: int = Query(0, ge=0)) -> dict[str, Any]:
    ids, _ = sessions.list_runs(r, who.tenant, 0, 1_000_000)
    saved = sorted(((m["time"], model_id, c, m) for model_id in ids for c, m in sessions.checkpoints(r, model_id).items()),
                   key=lambda x: x[0], reverse=True)
    return {"checkpoints": [checkpoint(model_id, c, m) for _, model_id, c, m in saved[offset:offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(saved)}}


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}", summary="Delete a checkpoint")
def delete_checkpoint(model_id: str, checkpoint_id: str, r: RedisDep, who: KeyWriterDep) -> dict[str, Any]:
    run_or_404(r, model_id, who)
    if not sessions.delete_checkpoint(r, model_id, checkpoint_id):
        raise not_found(f"checkpoint {checkpoint_id!r} of {model_id!r}")
    return {}


@router.get("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/archive", response_class=Response,
            summary="A checkpoint's files as .tar.gz")
def checkpoint_archive(model_id: str, checkpoint_id: str, r: RedisDep, who: KeyDep) -> Response:
    run_or_404(r, model_id, who)
    files = sessions.checkpoint_files(r, model_id, checkpoint_id)
    if not files:
        raise not_found(f"checkpoint {checkpoint_id!r} of {model_id!r}")
    return archive_response(files, checkpoint_id.replace("/", "-"))
