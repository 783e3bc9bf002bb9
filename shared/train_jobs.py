"""Job records of the supervised kinds (SFT, DPO, ORPO, reward models): creating, reading,
listing and resuming them. Every status change goes through shared/lifecycle.py, as for GRPO;
the record's `kind` selects the worker module (worker/training_process.py KINDS). Every kind
is routed by its model and memory need (shared/routing.py), and every `mtq worker` runs every kind.
"""

import json
import uuid
from typing import Any

import redis

from shared import jobstore, lifecycle
from shared.keys import job_key
from shared.train_specs import SPECS, TrainJob

# Changing these on resume would not fit the checkpoint's adapter (shape, placement or scale).
ADAPTER_SHAPE_FIELDS = ("lora_rank", "lora_layers", "lora_alpha", "fine_tune_type", "quantize_base", "quant_bits")


def create_job(r: redis.Redis, spec, owner: str | None = None) -> TrainJob:
    job_id = uuid.uuid4().hex
    spec = spec.model_copy(update={"adapter_name": spec.adapter_name or f"{spec.kind}-{job_id[:8]}"})
    lifecycle.create(r, job_id, spec.kind, spec.model_dump_json(), progress="{}",
                     max_attempts=jobstore.max_attempts(spec.config), **({"owner": owner} if owner else {}))
    # The job as created (a worker may have started it already: that is the next GET's news).
    job = get_job(r, job_id)
    return job.model_copy(update={"status": "queued", "started_at": 0.0, "worker": None, "attempts": 0, "progress": {}})  # type: ignore[union-attr]


def job_from_hash(job_id: str, h: dict[bytes, bytes]) -> TrainJob:
    """The job object; raises KeyError / ValueError for a record of another kind or version."""
    kind = h[b"kind"].decode()
    spec = SPECS[kind].model_validate_json(h[b"spec"])
    rec = {k.decode(): v.decode() for k, v in h.items() if k not in (b"spec", b"history")}

    def num(name, cast=float, default=None):
        return cast(rec[name]) if rec.get(name) else default

    return TrainJob(
        job_id=job_id, kind=kind, **spec.model_dump(exclude={"config"}), config=spec.config.model_dump(),
        adapter_path=rec.get("adapter_path") or None, status=rec["status"], created_at=float(rec["created_at"]),
        started_at=num("started_at", default=0.0), finished_at=num("finished_at", default=0.0),
        error=rec.get("error") or "", progress=json.loads(rec.get("progress") or "{}"), worker=rec.get("worker"),
        waiting_for_worker=rec.get("waiting_for_worker"),
        checkpoint_step=num("checkpoint_step", int), attempts=num("attempts", int, 0),
        failed_attempts=num("failed_attempts", int, 0), max_attempts=num("max_attempts", int, 3),
        resumed_from=num("resumed_from", int), owner=rec.get("owner"),
    )


def get_job(r: redis.Redis, job_id: str, kind: str | None = None) -> TrainJob | None:
    """The job, or None if there is none of that kind (or its record cannot be loaded)."""
    h = r.hgetall(job_key(job_id))
    if not h or (kind is not None and h.get(b"kind") != kind.encode()):
        return None
    try:
        return job_from_hash(job_id, h)
    except (KeyError, ValueError):
        return None


def job_or_unreadable(job_id: str, h: dict[bytes, bytes]):
    return jobstore.job_or_unreadable(job_id, h, load=job_from_hash)


def with_config_overrides(spec, overrides: dict[str, Any]):
    """The spec with some config fields changed (pydantic's ValidationError if invalid;
    ValueError for a change the checkpoint's adapter cannot take)."""
    new = spec.model_copy(update={"config": type(spec.config).model_validate({**spec.config.model_dump(), **overrides})})
    changed = [f for f in ADAPTER_SHAPE_FIELDS if getattr(new.config, f, None) != getattr(spec.config, f, None)]
    if changed:
        raise ValueError(f"cannot change {', '.join(changed)} on resume: the checkpoint's adapter has another "
                         "shape or scale (only optimisation settings may change)")
    return new


def resume_job(r: redis.Redis, job_id: str, spec, overrides: dict[str, Any]) -> bool:
    new = with_config_overrides(spec, overrides)
    return lifecycle.resume(r, job_id, new.model_dump_json(), new.config.iters, overrides,
                            max_attempts=jobstore.max_attempts(new.config))
