"""The reconciler: repairs what a lost worker leaves, run by every worker's heartbeat. It re-queues
a `running` job whose lease expired, a `queued` job whose rq job is gone (its worker died
between dequeuing it and starting), and routes again a job left on a gone or busy worker's own
queue; and when the live workers change, the jobs that wait on the hub queue or for a worker
(`follow_workers`). Every repair is a lifecycle transition (shared/lifecycle.py). It also drops
the rank jobs a gang's leader pushed on the own queue of a member that is gone
(`drop_dead_ranks`): no one else serves that queue, and the attempt they were for is over."""

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import redis
from rq import Queue
from rq.exceptions import DeserializationError

from shared import routing, workers
from shared.keys import QUEUED_JOBS, RUNNING_JOBS, job_key, lease_key
from shared.lifecycle import RQ_JOB_PREFIX, lose, refresh_route, requeue_if_orphaned, reroute
from worker.supervisor.gang_claims import RANK_JOB_FUNC

log = logging.getLogger(__name__)


@dataclass
class Reconciler:
    """Run every few seconds by every worker: re-queues running jobs whose lease has been gone
    for `grace_s` (so a live owner can renew after, say, a Redis restart), queued jobs
    whose rq job is gone or was abandoned by a dead worker, and routes again jobs that wait on
    a worker's own queue while that worker is gone or busy, and, when the live workers change,
    jobs on the hub queue or waiting for a worker."""

    r: redis.Redis
    grace_s: float
    missing_since: dict[str, float] = field(default_factory=dict)
    workers_seen: tuple | None = None  # what the live workers offered at the last follow_workers

    def scan(self) -> list[str]:
        self.drop_dead_ranks()
        return self.scan_running() + self.scan_queued()

    def drop_dead_ranks(self) -> list[str]:
        """Delete the rank jobs (gang_claims.RANK_JOB_FUNC) waiting over `grace_s` on the own
        queue of a worker that is not live: its gang's attempt ended when the rank did not join
        (MTQ_GANG_JOIN_S), and a worker of that name that comes back must not find it. The rq
        job ids dropped."""
        keys = [k.decode() for k in self.r.smembers(Queue.redis_queues_keys)]
        own = [k for k in keys if routing.queue_owner(k.removeprefix(Queue.redis_queue_namespace_prefix))]
        with self.r.pipeline(transaction=False) as p:
            for key in own:
                p.llen(key)
            waiting = [key for key, n in zip(own, p.execute()) if n]
        if not waiting:
            return []
        live = {w["name"] for w in workers.live_workers(self.r)}
        dropped = []
        for key in waiting:
            name = key.removeprefix(Queue.redis_queue_namespace_prefix)
            if routing.queue_owner(name) in live:
                continue
            for job in Queue(name, connection=self.r).get_jobs():
                try:
                    rank_job = job.func_name == RANK_JOB_FUNC
                except DeserializationError:  # not one this version pushed: it stays
                    continue
                enqueued = (job.enqueued_at or datetime.now(timezone.utc)).replace(tzinfo=timezone.utc)
                if rank_job and (datetime.now(timezone.utc) - enqueued).total_seconds() > self.grace_s:
                    job.delete()
                    log.warning("%s: dropped from %s: its worker is gone", job.description, name)
                    dropped.append(job.id)
        return dropped

    def scan_running(self) -> list[str]:
        running = [j.decode() for j in self.r.smembers(RUNNING_JOBS)]
        with self.r.pipeline(transaction=False) as p:
            for job_id in running:
                p.exists(lease_key(job_id))
            alive = p.execute()
        now = time.monotonic()
        self.missing_since = {j: self.missing_since.get(j, now) for j, a in zip(running, alive) if not a}
        reaped = []
        for job_id, since in list(self.missing_since.items()):
            if now - since >= self.grace_s:
                del self.missing_since[job_id]
                if lose(self.r, job_id, "worker lost (its lease expired)"):
                    reaped.append(job_id)
        return reaped

    def scan_queued(self) -> list[str]:
        queued = [j.decode() for j in self.r.smembers(QUEUED_JOBS)]
        with self.r.pipeline(transaction=False) as p:
            for job_id in queued:
                p.hmget(job_key(job_id), "rq_job", "queue", "enqueued_at", "waiting_for_worker")
            recs = [[None if v is None else v.decode() for v in values] for values in p.execute()]
        rq_ids = [rq_id for rq_id, _, _, _ in recs]
        with self.r.pipeline(transaction=False) as p:
            for rq_id in rq_ids:
                p.hmget(RQ_JOB_PREFIX + (rq_id or "-"), "status", "worker_name")
            rq_states = p.execute()
        with self.r.pipeline(transaction=False) as p:
            for status, worker in rq_states:
                p.exists(f"rq:worker:{(worker or b'-').decode()}")
            workers_alive = p.execute()
        repaired = []
        for job_id, rq_id, (status, _), worker_alive in zip(queued, rq_ids, rq_states, workers_alive):
            if rq_id is None:
                continue  # the record is gone (expired or deleted)
            status = None if status is None else status.decode()
            if status in ("queued", "scheduled", "deferred") or (status == "started" and worker_alive):
                continue
            if requeue_if_orphaned(self.r, job_id, rq_id):
                repaired.append(job_id)
        waiting = [(job_id, rq_id, queue) for job_id, (rq_id, queue, at, _), (status, _) in zip(queued, recs, rq_states)
                   if status == b"queued" and queue and routing.queue_owner(queue)
                   and time.time() - float(at or 0) > routing.WARM_WAIT_S]
        unserved = [(job_id, rq_id) for job_id, (rq_id, queue, _, why), (status, _) in zip(queued, recs, rq_states)
                    if status == b"queued" and queue and (why or routing.is_hub_queue(queue))]
        return repaired + self.leave_own_queues(waiting) + self.follow_workers(unserved)

    def leave_own_queues(self, waiting: list[tuple[str, str, str]]) -> list[str]:
        """Jobs waiting on a worker's own queue (warm-model preference) while that worker is
        gone or busy with another job go to the shared queue (routed again)."""
        if not waiting:
            return []
        live = {w["name"]: w for w in workers.live_workers(self.r)}
        moved = []
        for job_id, rq_id, queue in waiting:
            owner = routing.queue_owner(queue)
            current = live.get(owner, {}).get("current_job")
            if owner not in live:
                reason = f"worker {owner} is gone"
            elif current not in (None, job_id) and self.r.hget(job_key(current), "status") == b"running":
                reason = f"worker {owner} is busy with job {current}"
            else:
                continue
            if reroute(self.r, job_id, rq_id, reason):
                moved.append(job_id)
        return moved

    def follow_workers(self, unserved: list[tuple[str, str]]) -> list[str]:
        """When what the live workers offer (models, memory, lanes, hub access) has changed
        since the last scan: jobs on the hub queue or waiting for a worker are routed again
        (refresh_route), so a job for a Hugging Face id leaves the hub queue once a worker
        with the model joins, and waiting_for_worker says what is missing now. With nothing
        waiting there is nothing to read (a job queued later is routed against the workers of then)."""
        if not unserved:
            return []
        live = workers.live_workers(self.r)
        offered = tuple(sorted((w["name"], tuple(sorted(routing.served_models(w))), w.get("memory_gb"),
                                tuple(w.get("lanes", [])), bool(w.get("hub"))) for w in live))
        if offered == self.workers_seen:
            return []
        self.workers_seen = offered
        moved = []
        for job_id, rq_id in unserved:
            try:
                if refresh_route(self.r, job_id, rq_id, live) == "moved":
                    moved.append(job_id)
            except ValueError:  # a record this version cannot read (listed as unreadable): it stays
                continue
        return moved
