"""The job lifecycle: every status change of a job, of every kind, in one place.

    from               event           to          side effects (all in one MULTI/EXEC)
    -                  create          queued      record + index; rq job pushed
    queued             start           running     lease_epoch + 1; lease key (TTL); attempts + 1; a gang job: its
                                                   members by rank (`gang`), each running its rank under the epoch
    queued|running     cancel          cancelled   lease_epoch + 1 (a running worker is fenced out at once and
                                                   stops at its next check); checkpoint kept; retention;
                                                   a pause (OpenAI's /v1) is a cancel marked `paused`
    queued             requeue         queued      (reconciler) its rq job is gone: a new one pushed
    queued             reroute         queued      a worker cannot fit it, or (reconciler) it waited on a busy or
                                                   gone worker's own queue, or the live workers changed so that it
                                                   belongs on the hub queue or off it: routed again, its old rq job
                                                   removed; or (reconciler) only its waiting_for_worker brought up to date;
                                                   or a gang job's leader found fewer free workers than it needs
                                                   (worker/supervisor/gang_claims.py): back on its queue, an event when that changed
    running            complete        completed   fenced; checkpoint dropped; adapter indexed; retention
    running            fail            failed      fenced; retention
    running            hand_back       queued      fenced; lease_epoch + 1; rq job pushed; attempt not counted
    running            lose            queued      worker died, stalled or lease expired: lease_epoch + 1;
                                                   failed_attempts + 1; rq job pushed
    running            lose            failed      ...once failed_attempts reaches max_attempts; retention
    failed|cancelled   resume          queued      spec replaced; failed_attempts = 0; `paused` cleared; TTLs removed;
                                                   rq job pushed
    queued|finished    delete          -           every key of the job deleted (a queued one's rq job too)
    finished           (time)          -           Redis TTLs of MTQ_JOB_RETENTION_S expire every key

"Fenced": only the worker holding the job's current `lease_epoch` may do it; a worker that
lost the job (paused past its lease, then resumed) changes nothing. Progress, checkpoints
and the adapter copy are fenced writes that change no status (shared/fenced_writes.py).

Every transition reads the record under WATCH and commits in one MULTI/EXEC together with
its rq enqueue (rq's `enqueue_call(..., pipeline=...)`), so there is no moment where a job
is `queued` without an rq job, whoever dies when. Each enqueue routes the job again
(shared/routing.py: its model, memory need and lane, read from the record's summary, against
the live workers) and records its rq queue (`queue`) and, when no live worker can run it,
`waiting_for_worker`. The reconciler (worker/supervisor/reconciler.py) repairs what a lost
worker leaves through these transitions. Nothing else in the project writes a job's status.
"""

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import redis
from pydantic import ValidationError
from rq import Queue

from shared import kinds, routing, workers
from shared.adapters import adapter_ref
from shared.events import append_event
from shared.fenced_writes import LeaseLost, encode
from shared.keys import (
    ADAPTERS_INDEX,
    JOBS_INDEX,
    QUEUED_JOBS,
    RUNNING_JOBS,
    adapter_key,
    adapter_name_key,
    checkpoint_key,
    events_key,
    job_key,
    lease_key,
    trackers_key,
)
from shared.settings import load_settings

FINISHED = ("completed", "failed", "cancelled")
RESUMABLE = ("failed", "cancelled")
RUN_JOB_FUNC = "worker.jobs.run_job"  # a string, so enqueuing never imports the worker (or mlx)
RQ_JOB_PREFIX = "rq:job:"

# (from statuses, event, to statuses): the table above, enforced by _commit.
TABLE: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "start": (("queued",), ("running",)),
    "cancel": (("queued", "running"), ("cancelled",)),
    "requeue": (("queued",), ("queued",)),
    "reroute": (("queued",), ("queued",)),
    "complete": (("running",), ("completed",)),
    "fail": (("running",), ("failed",)),
    "hand_back": (("running",), ("queued",)),
    "lose": (("running",), ("queued", "failed")),
    "resume": (RESUMABLE, ("queued",)),
    "delete": (("queued", *FINISHED), ()),
}


@dataclass
class Change:
    """What one transition writes. fields: None deletes a field."""

    status: str | None  # None: delete the job
    fields: dict[str, Any] = field(default_factory=dict)
    event: dict | list[dict] | None = None  # a list: appended in order
    enqueue: bool = False  # push a new rq job for the job
    lease: str | None = None  # set the lease key to this value (start)
    adapter_ref: str | None = None  # index the job's stored adapter under this name (complete)


# --------------------------------------------------------------------------- transitions


def create(r: redis.Redis, job_id: str, kind: str, spec, *, max_attempts: int, **fields: Any) -> dict[str, str]:
    """Store a new job as queued and push its rq job on the queue it is routed to, atomically.
    Returns the record as written."""
    now = time.time()
    record = {"kind": kind, **spec_fields(spec), "created_at": repr(now), "attempts": 0,
              "failed_attempts": 0, "max_attempts": max_attempts, **fields}
    with r.pipeline() as p:
        p.multi()
        p.zadd(JOBS_INDEX, {job_id: now})
        written = _write(p, r, job_id, {}, Change("queued", record, enqueue=True))
        p.execute()
    return written


def start(r: redis.Redis, job_id: str, worker: str, lease_ttl_s: float, gang: list[str] | None = None) -> int | None:
    """A worker takes a queued job (gang: its leader, for these workers by rank, worker/supervisor/gang_claims.py).
    Returns the new lease epoch; None if it is not queued."""
    def decide(rec):
        epoch = int(rec.get("lease_epoch", 0)) + 1
        fields = {"lease_epoch": epoch, "worker": worker, "attempts": int(rec.get("attempts", 0)) + 1,
                  "error": None, "finished_at": None, "phase": None, "phase_note": None, "phase_since": None,
                  "memory_plan": None, "waiting_for_worker": None, "gang": None if gang is None else json.dumps(gang)}
        if not rec.get("started_at"):
            fields["started_at"] = repr(time.time())
        return Change("running", fields, lease=f"{worker}:{epoch}")

    change = _commit(r, job_id, "start", decide, lease_ttl_s=lease_ttl_s)
    return None if change is None else int(change.fields["lease_epoch"])


def cancel(r: redis.Redis, job_id: str, paused: bool = False) -> bool:
    """Cancel a queued or running job at once: a running one's worker is fenced out (it can
    write nothing more) and stops at its next check. False if the job is unknown or finished.
    paused: the job is marked `paused` (until it resumes), so that OpenAI's API says so."""
    def decide(rec):
        fields = {"cancel_requested": 1, "lease_epoch": int(rec.get("lease_epoch", 0)) + 1}
        return Change("cancelled", {**fields, **({"paused": 1} if paused else {})},
                      {"type": "cancelled", **({"paused": True} if paused else {})})

    return _commit(r, job_id, "cancel", decide) is not None


def finish(r: redis.Redis, job_id: str, epoch: int, status: str, event: dict | list[dict], *,
           adapter: tuple[str, str] | None = None, **fields: Any) -> None:
    """The holder's last word: completed or failed. adapter: (model_id, adapter_name) of the
    adapter a completed job stored, for the adapters index. Raises LeaseLost if it no longer
    holds the job."""
    name = {"completed": "complete", "failed": "fail"}[status]
    ref = None if adapter is None else adapter_ref(*adapter)
    _fenced_commit(r, job_id, name, epoch, lambda rec: Change(status, fields, event, adapter_ref=ref))


def hand_back(r: redis.Redis, job_id: str, epoch: int, reason: str) -> None:
    """The holder is shutting down: back on the queue; the attempt does not count."""
    def decide(rec):
        event = {"type": "requeued", "reason": reason, "lost_worker": rec.get("worker"), "counted": False}
        return Change("queued", {"lease_epoch": int(rec["lease_epoch"]) + 1}, event, enqueue=True)

    _fenced_commit(r, job_id, "hand_back", epoch, decide)


def lose(r: redis.Redis, job_id: str, reason: str, epoch: int | None = None) -> str | None:
    """The job's worker died, stalled, or its lease expired. With `epoch`: the supervisor that
    holds the lease says so; without: the reconciler, only while the lease key is gone.
    Re-queues the job, or fails it once it has ended max_attempts workers. Returns the new
    status, or None if nothing was done."""
    def decide(rec):
        if epoch is None and rec.get("_lease_alive"):
            return None
        if epoch is not None and rec.get("lease_epoch") != str(epoch):
            return None
        fenced = {"lease_epoch": int(rec.get("lease_epoch", 0)) + 1}
        failed = int(rec.get("failed_attempts", 0)) + 1
        limit = int(rec.get("max_attempts", 3))
        step = json.loads(rec.get("progress") or "{}").get("iter", 0)
        if failed >= limit:
            error = (f"gave up after {failed} attempts: each ended its worker (max_attempts={limit}); "
                     f"last: {reason} (after step {step})")
            return Change("failed", {**fenced, "failed_attempts": failed, "error": error},
                          {"type": "failed", "error": error})
        event = {"type": "requeued", "reason": reason, "lost_worker": rec.get("worker"), "counted": True,
                 "failed_attempts": failed, "checkpoint_step": int(rec.get("checkpoint_step", 0))}
        return Change("queued", {**fenced, "failed_attempts": failed}, event, enqueue=True)

    change = _commit(r, job_id, "lose", decide, check_lease=epoch is None)
    return None if change is None else change.status


def resume(r: redis.Redis, job_id: str, spec, overrides: dict, *, max_attempts: int) -> bool:
    """Re-queue a failed or cancelled job with its (possibly changed) spec; its worker continues
    from the last checkpoint. False if it is not (or no longer) resumable."""
    def decide(rec):
        progress = json.loads(rec.get("progress") or "{}")
        if hasattr(spec.config, "iters"):  # a kind that steps (an export has no steps)
            progress["total_iters"] = spec.config.iters
        if "total_steps" in progress:  # the seed's SFT progress (worker/runtime/reports.py)
            progress["total_steps"] = spec.config.iters
        fields = {**spec_fields(spec), "error": None, "finished_at": None, "cancel_requested": None, "need_gb": None,
                  "paused": None,
                  "failed_attempts": 0, "max_attempts": max_attempts, "progress": json.dumps(progress)}
        event = {"type": "resume_requested", "config_overrides": overrides}
        return Change("queued", fields, event, enqueue=True)

    return _commit(r, job_id, "resume", decide) is not None


def delete(r: redis.Redis, job_id: str) -> bool:
    """Delete a finished job and everything it stored. False if it is not finished."""
    return _commit(r, job_id, "delete", lambda rec: Change(None)) is not None


def requeue_if_orphaned(r: redis.Redis, job_id: str, rq_job_id: str) -> bool:
    """Reconciler: push a new rq job for a queued job whose rq job `rq_job_id` is gone."""
    def decide(rec):
        if rec.get("rq_job") != rq_job_id:
            return None  # someone re-queued it meanwhile
        return Change("queued", {}, {"type": "requeued", "reason": f"rq job {rq_job_id} was lost", "counted": False},
                      enqueue=True)

    return _commit(r, job_id, "requeue", decide) is not None


def reroute(r: redis.Redis, job_id: str, rq_job_id: str, reason: str, need_gb: float | None = None) -> bool:
    """Route a queued job again, its rq job `rq_job_id` taken off its queue: a worker found it
    needs `need_gb` (more than that worker has), or it waited on a worker's own queue that
    the worker is not coming back to (the job then goes to the shared queue)."""
    def decide(rec):
        if rec.get("rq_job") != rq_job_id:
            return None  # routed or started meanwhile
        fields = {} if need_gb is None else {"need_gb": max(need_gb, float(rec.get("need_gb") or 0))}
        return Change("queued", fields, {"type": "rerouted", "reason": reason, "from_queue": rec.get("queue")}, enqueue=True)

    return _commit(r, job_id, "reroute", decide) is not None


def wait_for_gang(r: redis.Redis, job_id: str, rq_job_id: str) -> bool:
    """A gang job's leader (worker/supervisor/gang_claims.py) found fewer free workers than the job needs: back on
    its queue, not started (no attempt); an event only when what it waits for changed."""
    def decide(rec):
        if rec.get("rq_job") != rq_job_id:
            return None  # routed or started meanwhile
        waiting = _route(r, rec, read_summary(rec), warm=False).waiting_for_worker
        event = None if waiting == rec.get("waiting_for_worker") else {"type": "waiting", "waiting_for_worker": waiting}
        return Change("queued", {}, event, enqueue=True)

    return _commit(r, job_id, "reroute", decide) is not None


def refresh_route(r: redis.Redis, job_id: str, rq_job_id: str, live: list[dict]) -> str | None:
    """A queued job's route against the live workers as they are now: "moved" when it waits on
    the hub queue and a live worker now has its model, or the other way round (no holder is
    left and a hub worker can download it); "updated" when it stays on its queue and only its
    waiting_for_worker changed; None otherwise. Moves between memory classes are left to the
    worker that dequeues the job (worker/supervisor/admission.py), which measures it."""
    outcome = {}

    def decide(rec):
        if rec.get("rq_job") != rq_job_id:
            return None  # routed or started meanwhile
        spec = read_spec(rec)  # a record this version cannot read stays where it is (ValueError)
        where = _route(r, rec, spec, live, warm=False)
        queue = rec.get("queue") or ""
        if routing.is_hub_queue(where.queue) != routing.is_hub_queue(queue):
            model = spec.model_id
            reason = (f"no live worker has model {model!r} any more" if routing.is_hub_queue(where.queue)
                      else f"a live worker now has model {model!r}")
            outcome["done"] = "moved"
            return Change("queued", {}, {"type": "rerouted", "reason": reason, "from_queue": queue}, enqueue=True)
        if where.queue == queue and where.waiting_for_worker != rec.get("waiting_for_worker"):
            outcome["done"] = "updated"
            return Change("queued", {"waiting_for_worker": where.waiting_for_worker})
        return None

    return outcome["done"] if _commit(r, job_id, "reroute", decide) is not None else None


# --------------------------------------------------------------------------- the one place that commits


def _commit(r: redis.Redis, job_id: str, name: str, decide: Callable[[dict], Change | None], *,
            lease_ttl_s: float | None = None, check_lease: bool = False) -> Change | None:
    """Read the record under WATCH; if its status allows event `name`, write decide(record)
    and everything that goes with it in one MULTI/EXEC. None when nothing was written."""
    from_statuses, to_statuses = TABLE[name]
    with r.pipeline() as p:
        while True:
            try:
                p.watch(job_key(job_id), lease_key(job_id))
                rec = {k.decode(): v.decode() for k, v in p.hgetall(job_key(job_id)).items()}
                if rec.get("status") not in from_statuses:
                    return None
                if check_lease:
                    rec["_lease_alive"] = bool(p.exists(lease_key(job_id)))
                change = decide(rec)
                if change is None:
                    return None
                assert (change.status in to_statuses) or (change.status is None and not to_statuses), (name, change)
                p.multi()
                _write(p, r, job_id, rec, change, lease_ttl_s)
                p.execute()
                return change
            except redis.WatchError:
                continue


def _fenced_commit(r: redis.Redis, job_id: str, name: str, epoch: int, decide: Callable[[dict], Change]) -> None:
    def fenced(rec):
        if rec.get("lease_epoch") != str(epoch):
            return None
        return decide(rec)

    if _commit(r, job_id, name, fenced) is None:
        raise LeaseLost(f"job {job_id}: lease epoch {epoch} is no longer current")


def _write(p, r: redis.Redis, job_id: str, rec: dict, change: Change, lease_ttl_s: float | None = None) -> dict[str, str]:
    """Queue on pipeline `p` every write of `change`: status, fields, event, the sets the
    reconciler scans, the lease, the rq job (routed by the record's summary as the change
    leaves it), and retention. Returns the record's fields as written."""
    keys = [job_key(job_id), events_key(job_id), checkpoint_key(job_id), adapter_key(job_id), trackers_key(job_id)]
    if change.status is None:  # delete: its rq jobs too, every attempt's
        _unqueue(p, rec)
        p.delete(*keys, lease_key(job_id), *(RQ_JOB_PREFIX + rq_id for rq_id in _rq_jobs(job_id, rec)))
        if rec.get("adapter_ref"):  # its claim on the adapter name (shared/adapters.py claim_name)
            p.srem(adapter_name_key(rec["adapter_ref"]), job_id)
        p.zrem(JOBS_INDEX, job_id)
        p.srem(QUEUED_JOBS, job_id)
        p.srem(RUNNING_JOBS, job_id)
        return {}
    fields = {"status": change.status, **change.fields}
    if change.status in FINISHED:
        fields["finished_at"] = repr(time.time())
    if change.enqueue:
        attempt = int(rec.get("enqueues", 0))
        rq_id = _rq_job_id(job_id, attempt)
        fields.update(enqueues=attempt + 1, rq_job=rq_id)
        if rec.get("rq_job"):  # the previous attempt's rq job: rq's own bookkeeping may keep it otherwise
            p.expire(RQ_JOB_PREFIX + rec["rq_job"], _retention_s())
        # job_timeout -1: training runs as long as it takes; liveness is the supervisor's business.
        # rq's own record of the attempt lives no longer than ours.
        record = {**rec, **change.fields}
        summary = read_summary(record)
        where = _route(r, record, summary)
        fields.update(queue=where.queue, waiting_for_worker=where.waiting_for_worker, enqueued_at=repr(time.time()))
        _unqueue(p, rec)  # re-queued while queued (rerouted, repaired): its old rq job leaves its queue
        description = f"{record['kind']} job {job_id} on {summary['model_id']} (run {attempt + 1})"
        Queue(where.queue, connection=r).enqueue_call(
            RUN_JOB_FUNC, args=(job_id,), job_id=rq_id, timeout=-1, pipeline=p, description=description,
            result_ttl=min(3600, _retention_s()), failure_ttl=min(7 * 86400, _retention_s()),
        )
    sets = {"queued": QUEUED_JOBS, "running": RUNNING_JOBS}
    for status, key in sets.items():
        (p.sadd if change.status == status else p.srem)(key, job_id)
    written = {k: v if isinstance(v, str) else encode(v) for k, v in fields.items() if v is not None}
    p.hset(job_key(job_id), mapping=written)
    to_delete = [k for k, v in fields.items() if v is None]
    if to_delete:
        p.hdel(job_key(job_id), *to_delete)
    for event in change.event if isinstance(change.event, list) else [change.event] if change.event else []:
        append_event(p, job_id, event)
    if change.adapter_ref is not None:
        p.hset(ADAPTERS_INDEX, change.adapter_ref, job_id)
    if change.lease is not None:
        p.set(lease_key(job_id), change.lease, px=int(lease_ttl_s * 1000))
    elif change.status != "running":
        p.delete(lease_key(job_id))
    if change.status in FINISHED:
        if _unqueue(p, rec):  # cancelled while queued: its rq job will never run
            p.delete(RQ_JOB_PREFIX + rec["rq_job"])
        if change.status == "completed":
            p.delete(checkpoint_key(job_id))  # nothing left to resume
        for key in keys + ([RQ_JOB_PREFIX + rec["rq_job"]] if rec.get("rq_job") else []):
            p.expire(key, _retention_s())
    elif rec.get("status") in FINISHED:  # resumed: keep everything again
        for key in keys:
            p.persist(key)
    # Its claim on the adapter name (shared/adapters.py claim_name) lasts while it is queued or
    # running, and as long as its other keys once it has finished (its last job's, of a name).
    ref = fields.get("adapter_ref") or rec.get("adapter_ref")
    if ref:
        (p.expire(adapter_name_key(ref), _retention_s()) if change.status in FINISHED
         else p.persist(adapter_name_key(ref)))
    return written


def _rq_job_id(job_id: str, enqueue: int) -> str:
    """The rq job of the job's enqueue number `enqueue` (0, 1, ...)."""
    return job_id if enqueue == 0 else f"{job_id}-r{enqueue}"


def _rq_jobs(job_id: str, rec: dict) -> list[str]:
    """The ids of every rq job pushed for the job."""
    return [_rq_job_id(job_id, n) for n in range(int(rec.get("enqueues", 0)))]


def _unqueue(p, rec: dict) -> bool:
    """Take a queued job's rq job off its rq queue (if it is still there)."""
    if rec.get("status") != "queued" or not rec.get("rq_job"):
        return False
    p.lrem(f"rq:queue:{rec['queue']}", 0, rec["rq_job"])
    return True


def spec_fields(spec) -> dict[str, str]:
    """The record's fields of a spec: the spec, and its summary (shared/routing.py
    spec_summary), so that the list and the workers never read a spec of megabytes of prompts
    to learn its model, config or memory need."""
    return {"spec": spec.model_dump_json(by_alias=True), "summary": json.dumps(routing.spec_summary(spec))}


def read_spec(rec: dict):
    """The spec of a job record (decoded fields), as its kind's model. ValueError if this
    version cannot read it (pydantic's ValidationError is one)."""
    return kinds.of_record(rec.get("kind")).spec_model.model_validate_json(rec["spec"])


def current_summary(rec: dict) -> dict[str, Any] | None:
    """The record's summary (decoded fields), if it holds what routing reads (its `step`);
    None for a record written before summaries did. ValueError if it is not JSON."""
    summary = json.loads(rec["summary"]) if rec.get("summary") else {}
    return summary if "step" in summary else None


def read_summary(rec: dict) -> dict[str, Any]:
    """The record's summary, made from its spec for a record written before summaries held
    the step (rec["spec"] is then read). ValueError if this version cannot read it."""
    return current_summary(rec) or routing.spec_summary(read_spec(rec))


def unreadable(e: ValueError) -> str:
    """A worker's error for a job whose record it cannot load: the job fails, never retried."""
    what = f"{e.error_count()} invalid fields" if isinstance(e, ValidationError) else str(e)
    return f"the stored job record cannot be loaded: {what}"


def _route(r: redis.Redis, rec: dict, job, live: list[dict] | None = None, warm: bool = True) -> routing.Route:
    """Where the job goes now: its spec or summary against the live workers (shared/routing.py)."""
    floor = float(rec.get("need_gb") or 0) or None
    return routing.route(kinds.of_record(rec.get("kind")).name, job, workers.live_workers(r) if live is None else live,
                         floor_gb=floor, warm=warm,
                         finished=lambda job_id: r.hget(job_key(job_id), "status") != b"running")


def _retention_s() -> int:
    return load_settings().job_retention_s
