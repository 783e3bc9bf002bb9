"""Job records in Redis: the one place both the API and the worker read and write jobs.

A job is a hash (shared.keys.job_key) plus an event stream (shared.keys.events_key).
Status changes go through `transition`, an atomic compare-and-set, so that e.g. a
worker can never move a cancelled job back to running.
"""

import json
import time
import uuid
from typing import Any, Iterable

import redis
from rq import Queue

from shared.keys import JOBS_INDEX, RUNNING_JOBS, adapter_key, checkpoint_key, events_key, job_key, lease_key
from shared.schemas import FINISHED_STATUSES, GRPOConfig, Job, JobCreate, JobStatus, Progress, UnreadableJob
from shared.settings import QUEUE_NAME

EVENTS_MAXLEN = 10_000
RESUMABLE_STATUSES = ("failed", "cancelled")
RUN_JOB_FUNC = "worker.jobs.run_grpo_job"  # a string, so enqueuing never imports the worker (or mlx)

_TRANSITION_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
local allowed = cjson.decode(ARGV[1])
local ok = false
for _, s in ipairs(allowed) do if s == status then ok = true end end
if not ok then return 0 end
for i = 2, #ARGV, 2 do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i])
  else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
return 1
"""


def connect(url: str) -> redis.Redis:
    # Bytes in and out: rq needs a connection without decode_responses.
    return redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5, health_check_interval=30)


def _s(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _f(value: bytes | None) -> float | None:
    return None if value in (None, b"") else float(value)


def create_job(r: redis.Redis, spec: JobCreate, owner: str | None = None) -> Job:
    """Store a new job as queued and put it on the rq queue. owner: the name of the token
    that created it (api/auth.py)."""
    job_id = uuid.uuid4().hex
    spec = spec.model_copy(update={"adapter_name": spec.adapter_name or f"grpo-{job_id[:8]}"})
    now = time.time()
    progress = Progress(iter=0, total_iters=spec.config.iters)
    with r.pipeline() as p:
        p.hset(job_key(job_id), mapping={
            "spec": spec.model_dump_json(by_alias=True),
            "status": "queued",
            "created_at": repr(now),
            "progress": progress.model_dump_json(),
            **({"owner": owner} if owner else {}),
        })
        p.zadd(JOBS_INDEX, {job_id: now})
        p.execute()
    enqueue(r, job_id)
    return get_job(r, job_id)  # type: ignore[return-value]


def enqueue(r: redis.Redis, job_id: str, attempt: int = 0) -> None:
    """Put the job on rq's queue. Each attempt is its own rq job (`<job_id>-r<attempt>`), so
    rq's bookkeeping of an abandoned attempt never touches the next one."""
    # job_timeout -1: training runs as long as it takes; liveness is the worker's business (worker/lease.py).
    Queue(QUEUE_NAME, connection=r).enqueue_call(
        RUN_JOB_FUNC, args=(job_id,), job_id=job_id if attempt == 0 else f"{job_id}-r{attempt}",
        timeout=-1, result_ttl=3600, failure_ttl=7 * 86400,
    )


def get_spec(r: redis.Redis, job_id: str) -> JobCreate | None:
    raw = r.hget(job_key(job_id), "spec")
    return None if raw is None else JobCreate.model_validate_json(raw)


def _job_from_hash(job_id: str, h: dict[bytes, bytes]) -> Job:
    spec = JobCreate.model_validate_json(h[b"spec"])
    checkpoint = h.get(b"checkpoint_step")
    return Job(
        job_id=job_id,
        model_id=spec.model_id,
        prompts=spec.prompts,
        config=spec.config,
        reward=spec.reward,
        adapter_name=spec.adapter_name or "",
        adapter_path=_s(h.get(b"adapter_path")),
        status=h[b"status"].decode(),  # type: ignore[arg-type]
        created_at=float(h[b"created_at"]),
        started_at=_f(h.get(b"started_at")),
        finished_at=_f(h.get(b"finished_at")),
        error=_s(h.get(b"error")),
        progress=Progress.model_validate_json(h[b"progress"]),
        worker=_s(h.get(b"worker")),
        checkpoint_step=None if checkpoint is None else int(checkpoint),
        attempts=int(h.get(b"attempts", 0)),
        resumed_from=None if h.get(b"resumed_from") is None else int(h[b"resumed_from"]),
        owner=_s(h.get(b"owner")),
    )


def _job_or_unreadable(job_id: str, h: dict[bytes, bytes]) -> Job | UnreadableJob:
    """The job, or an entry saying its stored record cannot be loaded (written by another
    version, say): one bad record must not break listing the others."""
    try:
        return _job_from_hash(job_id, h)
    except (ValueError, KeyError) as e:  # pydantic's ValidationError is a ValueError
        return UnreadableJob(job_id=job_id, error=f"stored record cannot be loaded: {type(e).__name__}: {e}"[:500],
                             owner=_s(h.get(b"owner")))


def get_job_entry(r: redis.Redis, job_id: str) -> Job | UnreadableJob | None:
    """Like get_job, for the API: an unreadable record is reported, not raised."""
    h = r.hgetall(job_key(job_id))
    return _job_or_unreadable(job_id, h) if h else None


def get_job(r: redis.Redis, job_id: str) -> Job | None:
    h = r.hgetall(job_key(job_id))
    return _job_from_hash(job_id, h) if h else None


def get_status(r: redis.Redis, job_id: str) -> JobStatus | None:
    return _s(r.hget(job_key(job_id), "status"))  # type: ignore[return-value]


def list_jobs(
    r: redis.Redis, status: JobStatus | None = None, limit: int = 20, after: str | None = None,
    owner: str | None = None,
) -> tuple[list[Job | UnreadableJob], bool]:
    """Newest first. `after` is the last job_id of the previous page; `owner`: only the jobs
    of that token name."""
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
            if len(jobs) == limit:
                return jobs, True
            jobs.append(_job_or_unreadable(job_id, h))
        start += chunk


def transition(r: redis.Redis, job_id: str, allowed_from: Iterable[str], **fields: Any) -> bool:
    """Set `fields` (None deletes one) only if the job's status is one of `allowed_from`."""
    args = [json.dumps(list(allowed_from)), *field_args(fields)]
    return r.eval(_TRANSITION_LUA, 1, job_key(job_id), *args) == 1


def field_args(fields: dict[str, Any]) -> list[str]:
    """Hash fields as the Lua scripts take them: name, value, ...; '' means delete the field."""
    args: list[str] = []
    for name, value in fields.items():
        args += [name, "" if value is None else value if isinstance(value, str) else _encode(value)]
    return args


def _encode(value: Any) -> str:
    if hasattr(value, "model_dump_json"):
        return value.model_dump_json()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


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


def request_cancel(r: redis.Redis, job_id: str) -> JobStatus | None:
    """Cancel a job: a queued one ends at once, a running one at its next check.

    Returns the status after the request, or None for an unknown job.
    """
    now = repr(time.time())
    if transition(r, job_id, ["queued"], status="cancelled", finished_at=now, cancel_requested="1"):
        append_event(r, job_id, {"type": "cancelled"})
        return "cancelled"
    transition(r, job_id, ["running"], cancel_requested="1")
    return get_status(r, job_id)


def cancel_requested(r: redis.Redis, job_id: str) -> bool:
    return r.hget(job_key(job_id), "cancel_requested") == b"1"


def resume_job(r: redis.Redis, job_id: str, config_overrides: dict[str, Any]) -> bool:
    """Re-queue a failed or cancelled job, optionally with changed config fields; the worker
    continues from its last checkpoint. Raises pydantic's ValidationError for bad overrides;
    False if the job is not (or no longer) resumable."""
    spec = get_spec(r, job_id)
    if spec is None:
        return False
    spec = with_config_overrides(spec, config_overrides)
    config = spec.config
    if not transition(r, job_id, RESUMABLE_STATUSES, status="queued", spec=spec.model_dump_json(by_alias=True),
                      error=None, finished_at=None, cancel_requested=None,
                      progress=Progress.model_validate_json(r.hget(job_key(job_id), "progress")).model_copy(
                          update={"total_iters": config.iters})):
        return False
    with r.pipeline() as p:  # finishing set a retention time on these
        for key in (job_key(job_id), events_key(job_id), checkpoint_key(job_id)):
            p.persist(key)
        p.hincrby(job_key(job_id), "attempts", 1)
        attempt = p.execute()[-1]
    append_event(r, job_id, {"type": "resume_requested", "config_overrides": config_overrides, "attempt": attempt})
    enqueue(r, job_id, attempt=attempt)
    return True


def with_config_overrides(spec: JobCreate, overrides: dict[str, Any]) -> JobCreate:
    """The spec with some config fields changed (validated: pydantic's ValidationError)."""
    overrides = {("clip_ratio" if k == "epsilon" else k): v for k, v in overrides.items()}
    config = GRPOConfig.model_validate({**spec.config.model_dump(), **overrides})
    return spec.model_copy(update={"config": config})


def delete_job(r: redis.Redis, job_id: str) -> None:
    with r.pipeline() as p:
        p.delete(job_key(job_id), events_key(job_id), adapter_key(job_id), checkpoint_key(job_id), lease_key(job_id))
        p.zrem(JOBS_INDEX, job_id)
        p.srem(RUNNING_JOBS, job_id)
        p.execute()


def is_finished(status: str | None) -> bool:
    return status in FINISHED_STATUSES
