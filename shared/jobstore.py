"""Job records in Redis: reading them, and the GRPO-specific parts of creating and resuming.

A job is a hash (shared.keys.job_key) plus an event stream (shared.keys.events_key). Every
status change goes through shared/lifecycle.py; this module reads records and turns API
requests into lifecycle calls.
"""

import json
import uuid
from typing import Any

import redis

from shared import lifecycle
from shared.keys import JOBS_INDEX, events_key, job_key
from shared.adapters import adapter_dir
from shared.schemas import FINISHED_STATUSES, GRPOConfig, Job, JobCreate, JobStatus, UnreadableJob
from shared.settings import load_settings

EVENTS_MAXLEN = lifecycle.EVENTS_MAXLEN
RESUMABLE_STATUSES = lifecycle.RESUMABLE
# Changing these on resume would not fit the checkpoint's LoRA (shape, placement or scale).
LORA_SHAPE_FIELDS = ("lora_rank", "lora_layers", "lora_alpha")


def connect(url: str) -> redis.Redis:
    # Bytes in and out: rq needs a connection without decode_responses.
    return redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5, health_check_interval=30)


def _s(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _f(value: bytes | None) -> float | None:
    return None if value in (None, b"") else float(value)


def max_attempts(config: GRPOConfig) -> int:
    return min(config.max_attempts, load_settings().max_attempts_cap)


def create_job(r: redis.Redis, spec: JobCreate, owner: str | None = None) -> Job:
    """Store a new job as queued and put it on its rq queue (one atomic step). owner: the name
    of the token that created it (api/auth.py)."""
    job_id = uuid.uuid4().hex
    spec = spec.model_copy(update={"adapter_name": spec.adapter_name or f"grpo-{job_id[:8]}"})
    # As the seed server: the adapter's path is known from the start, progress is {} until a step.
    path = adapter_dir(load_settings(), spec.model_id, spec.adapter_name)
    lifecycle.create(r, job_id, "grpo", spec.model_dump_json(by_alias=True),
                     progress="{}", adapter_path=str(path), max_attempts=max_attempts(spec.config),
                     **({"owner": owner} if owner else {}))
    return get_job(r, job_id)  # type: ignore[return-value]


def get_spec(r: redis.Redis, job_id: str) -> JobCreate | None:
    """The job's spec, as its kind's model (GRPO: JobCreate; others: shared/train_specs.py)."""
    from shared.train_specs import spec_model

    kind, raw = r.hmget(job_key(job_id), "kind", "spec")
    if raw is None:
        return None
    return spec_model(kind and kind.decode()).model_validate_json(raw)  # type: ignore[return-value]


def _job_from_hash(job_id: str, h: dict[bytes, bytes]) -> Job:
    spec = JobCreate.model_validate_json(h[b"spec"])
    checkpoint = h.get(b"checkpoint_step")
    phase, phase_note = _phase(h)
    return Job(
        job_id=job_id,
        model_id=spec.model_id,
        prompts=spec.prompts,
        config=spec.config,
        reward=spec.reward,
        adapter_name=spec.adapter_name or "",
        adapter_path=_s(h.get(b"adapter_path")) or str(adapter_dir(load_settings(), spec.model_id, spec.adapter_name or "")),
        status=h[b"status"].decode(),  # type: ignore[arg-type]
        created_at=float(h[b"created_at"]),
        started_at=_f(h.get(b"started_at")) or 0.0,
        finished_at=_f(h.get(b"finished_at")) or 0.0,
        error=_s(h.get(b"error")) or "",
        progress=json.loads(h.get(b"progress") or b"{}"),
        phase=phase,
        phase_note=phase_note,
        waiting_for_worker=_s(h.get(b"waiting_for_worker")),
        worker=_s(h.get(b"worker")),
        checkpoint_step=None if checkpoint is None else int(checkpoint),
        attempts=int(h.get(b"attempts", 0)),
        failed_attempts=int(h.get(b"failed_attempts", 0)),
        max_attempts=int(h.get(b"max_attempts", 0)) or spec.config.max_attempts,
        resumed_from=None if h.get(b"resumed_from") is None else int(h[b"resumed_from"]),
        owner=_s(h.get(b"owner")),
    )


def _phase(h: dict[bytes, bytes]) -> tuple[str | None, str | None]:
    """(phase, note): a queued job waits for a worker (the note says why none could run it, if
    so); a running one is in the phase its training process last wrote (record fields of their
    own: not rewritten per step); a finished one is in none."""
    if h[b"status"] == b"queued":
        return "waiting_for_worker", _s(h.get(b"waiting_for_worker"))
    if h[b"status"] == b"running":
        return _s(h.get(b"phase")) or "starting", _s(h.get(b"phase_note"))
    return None, None


def job_or_unreadable(job_id: str, h: dict[bytes, bytes], load=None) -> Job | UnreadableJob:
    """The job (made by load(job_id, h); default: a GRPO job), or an entry saying its stored
    record cannot be loaded (written by another version, say): one bad record must not break
    listing the others."""
    try:
        return (load or _job_from_hash)(job_id, h)
    except (ValueError, KeyError) as e:  # pydantic's ValidationError is a ValueError
        return UnreadableJob(job_id=job_id, error=f"stored record cannot be loaded: {type(e).__name__}: {e}"[:500],
                             owner=_s(h.get(b"owner")))


def get_job(r: redis.Redis, job_id: str) -> Job | None:
    h = r.hgetall(job_key(job_id))
    return _job_from_hash(job_id, h) if h else None


def get_status(r: redis.Redis, job_id: str) -> JobStatus | None:
    return _s(r.hget(job_key(job_id), "status"))  # type: ignore[return-value]


def list_jobs(
    r: redis.Redis, status: JobStatus | None = None, limit: int = 20, after: str | None = None,
    owner: str | None = None, kind: str = "grpo", load=None,
) -> tuple[list[Job | UnreadableJob], bool]:
    """Newest first. `after` is the last job_id of the previous page; `owner`: only the jobs
    of that token name; `kind`: only jobs of that kind, each made by load(job_id, hash)."""
    load = load or job_or_unreadable
    start = 0
    if after is not None:
        rank = r.zrevrank(JOBS_INDEX, after)
        if rank is None:
            raise KeyError(after)
        start = rank + 1
    jobs: list[Job | UnreadableJob] = []
    chunk = max(limit * 2, 50)
    while True:
        ids = [i.decode() for i in r.zrevrange(JOBS_INDEX, start, start + chunk - 1)]
        if not ids:
            return jobs, False
        with r.pipeline() as p:
            for job_id in ids:
                p.hgetall(job_key(job_id))
            hashes = p.execute()
        expired = [job_id for job_id, h in zip(ids, hashes) if not h]
        if expired:  # records past their retention time: drop them from the index too
            r.zrem(JOBS_INDEX, *expired)
            start -= len(expired)
        for job_id, h in zip(ids, hashes):
            if not h or (status is not None and h.get(b"status") != status.encode()):
                continue
            if owner is not None and h.get(b"owner") != owner.encode():
                continue
            if h.get(b"kind", b"grpo") != kind.encode():
                continue
            if len(jobs) == limit:
                return jobs, True
            jobs.append(load(job_id, h))
        start += chunk


def get_history(r: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    """The per-step metrics a completed job recorded ([] before it completes)."""
    raw = r.hget(job_key(job_id), "history")
    return [] if raw is None else json.loads(raw)


def append_event(r: redis.Redis, job_id: str, event: dict[str, Any]) -> None:
    r.xadd(events_key(job_id), {"data": json.dumps(event)}, maxlen=EVENTS_MAXLEN, approximate=True)


def read_events(
    r: redis.Redis, job_id: str, after_id: str = "0-0", block_ms: int | None = None, count: int = 100
) -> list[tuple[str, dict[str, Any]]]:
    """Events after `after_id` (a stream id); blocks up to block_ms for new ones when given."""
    return decode_events(r.xread({events_key(job_id): after_id}, count=count, block=block_ms))


def decode_events(xread_result: list) -> list[tuple[str, dict[str, Any]]]:
    """(id, event) pairs from XREAD's answer for one stream (also read by api/sse.py's async client)."""
    if not xread_result:
        return []
    return [(eid.decode(), json.loads(fields[b"data"])) for eid, fields in xread_result[0][1]]


def resume_job(r: redis.Redis, job_id: str, config_overrides: dict[str, Any]) -> bool:
    """Re-queue a failed or cancelled job, optionally with changed config fields; the worker
    continues from its last checkpoint. Raises pydantic's ValidationError for bad overrides and
    ValueError for overrides that would not fit the checkpoint; False if the job is not (or no
    longer) resumable."""
    spec = get_spec(r, job_id)
    if spec is None:
        return False
    new = with_config_overrides(spec, config_overrides)
    changed = [name for name in LORA_SHAPE_FIELDS if getattr(new.config, name) != getattr(spec.config, name)]
    if changed:
        raise ValueError(f"cannot change {', '.join(changed)} on resume: the checkpoint's LoRA has another "
                         "shape or scale (only optimisation and sampling settings may change)")
    return lifecycle.resume(r, job_id, new.model_dump_json(by_alias=True), new.config.iters, config_overrides,
                            max_attempts=max_attempts(new.config))


def cancel_requested(r: redis.Redis, job_id: str) -> bool:
    return r.hget(job_key(job_id), "cancel_requested") == b"1"


def with_config_overrides(spec: JobCreate, overrides: dict[str, Any]) -> JobCreate:
    """The spec with some config fields changed (validated: pydantic's ValidationError)."""
    overrides = {("clip_ratio" if k == "epsilon" else k): v for k, v in overrides.items()}
    config = GRPOConfig.model_validate({**spec.config.model_dump(), **overrides})
    return spec.model_copy(update={"config": config})


def is_finished(status: str | None) -> bool:
    return status in FINISHED_STATUSES
