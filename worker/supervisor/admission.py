"""Admission: whether this worker takes a job it has dequeued, now, and how.

rq hands the supervisor a job from a queue it listens to (shared/routing.py). Before it takes
the job's lease, the supervisor asks `admit`, which reads of the job only its record's summary
(its model, config and step: shared/jobstore.py load_summary), and acts on the answer:

    NotStarted(reason)    no attempt spent: the job needs more memory than this worker has
                          (routed again with the need measured here: the router's memory class
                          is a lower bound), or this worker is claimed by another job's gang
                          (routed again), or a gang job found too few free workers or one of
                          them refused its claim, having just taken another job (back on its queue)
    Start(token)          the worker runs the job alone
    LeadGang(members)     a gang job (config.workers > 1, worker/supervisor/gang_claims.py):
                          its members are claimed, this worker first, as rank 0; once it holds
                          the lease the leader pushes the other ranks' jobs (`push_ranks`)

A worker that takes a job holds its claim key for it (gang_claims.hold; the supervisor renews
it while the job runs and drops it after): the claim of a gang that wants it then fails, in the
same atomic step that would have claimed it, and this worker refuses a job while a gang holds it.

Every Redis call here is retried through Redis trouble (worker/supervisor/lease.py retrying).
"""

import logging
import time
from dataclasses import dataclass
from typing import Any

from rq import Queue

from shared import lifecycle, routing, workers
from shared.keys import job_key
from shared.settings import load_settings
from worker.supervisor import gang_claims
from worker.supervisor.lease import retrying

log = logging.getLogger(__name__)

GANG_RETRY_S = 1.0  # a job put back by this worker is not taken again before this long


@dataclass(frozen=True)
class Here:
    """What admission reads of this worker."""

    name: str
    memory_gb: float | None  # what jobs may use here (None: not known yet)
    device: str | None  # its training process's device, "cpu" or "gpu" (None: not reported yet)
    models: dict[str, dict[str, Any]]  # model key -> the advertisement of a model it has on disk (shared/workers.py)


@dataclass(frozen=True)
class NotStarted:
    reason: str


@dataclass(frozen=True)
class Start:
    token: str  # this worker's hold for the job (gang_claims.hold)


@dataclass(frozen=True)
class LeadGang:
    members: list[dict[str, Any]]  # the live workers' advertisements, by rank: this worker first
    token: str  # their claim's (gang_claims.claim)

    @property
    def names(self) -> list[str]:
        return [w["name"] for w in self.members]


def admit(r, here: Here, job_id: str, rq_job_id: str, kind: str | None,
          summary: dict[str, Any] | None) -> NotStarted | Start | LeadGang:
    """May this worker take the job of `rq_job_id` now (the table above)? summary None: the
    record cannot be read; only the gang claim is checked (the job fails once started)."""
    reason = None if summary is None else does_not_fit(r, here, job_id, rq_job_id, kind, summary)
    if reason:
        return NotStarted(reason)
    token = retrying(lambda: gang_claims.hold(r, here.name, job_id, load_settings().lease_ttl_s), "hold")
    if token is None:
        return NotStarted(claimed_by_another_gang(r, here.name, job_id, rq_job_id))
    if summary is not None and summary["config"].get("workers", 1) > 1:
        return form_gang(r, here.name, job_id, rq_job_id, kind, summary, token)
    return Start(token)


def does_not_fit(r, here: Here, job_id: str, rq_job_id: str, kind: str, summary: dict[str, Any]) -> str | None:
    """Check the job against this worker's device, model and memory; when it needs more,
    route it again, unstarted, with the need measured here. The reason, or None when it fits
    (or this worker cannot tell yet)."""
    if here.memory_gb is None or here.device is None:
        return None
    model = here.models.get(routing.model_key(summary["model_id"]), {})
    teacher = summary.get("teacher_model_id")  # a GKD job's
    need = routing.job_need_gb(kind, summary, model, here.device,
                               teacher and here.models.get(routing.model_key(teacher), {}))
    if need is None or need <= here.memory_gb:
        return None
    reason = f"worker {here.name} has {here.memory_gb:g} GB; the job needs about {need:.2f} GB there"
    rerouted = retrying(lambda: lifecycle.reroute(r, job_id, rq_job_id, reason, need_gb=need), "reroute")
    log.info("job %s: %s; %s", job_id, reason, "routed again" if rerouted else "already moved on")
    return reason


def claimed_by_another_gang(r, name: str, job_id: str, rq_job_id: str) -> str:
    """This worker is claimed by another job's gang, whose rank job is on its way: route the
    job elsewhere. The reason."""
    claimed = retrying(lambda: gang_claims.claimed_by(r, name), "gang claim")
    reason = f"worker {name} is claimed by the gang of job {claimed}"
    retrying(lambda: lifecycle.reroute(r, job_id, rq_job_id, reason), "reroute")
    time.sleep(GANG_RETRY_S)  # not at once again, should the job come back here
    return reason


def form_gang(r, name: str, job_id: str, rq_job_id: str, kind: str, summary: dict[str, Any],
              held: str) -> LeadGang | NotStarted:
    """Pick the gang's members among the free workers that can run the job, this worker (which
    holds itself for the job: `held`) as rank 0, and claim them all at once; else drop the hold
    and put the job back on its queue, not started."""
    live = retrying(lambda: workers.live_workers(r), "live workers")
    where = routing.route(kind, summary, live, warm=False,
                          finished=lambda j: r.hget(job_key(j), "status") != b"running")
    members = gang_claims.pick(name, list(where.free), summary["config"]["workers"])
    join_s = load_settings().gang_join_s
    token, refused = None, None
    if members:
        token, refused = retrying(lambda: gang_claims.claim(r, [w["name"] for w in members], job_id, join_s), "gang claim")
    if token:
        return LeadGang(members, token)
    retrying(lambda: gang_claims.release(r, [name], held), "gang claim")
    retrying(lambda: lifecycle.wait_for_gang(r, job_id, rq_job_id), "wait for gang")
    reason = where.waiting_for_worker or (f"worker {refused} took another job (or is shutting down) just before its "
                                          "gang's claim")
    log.info("job %s: not started: %s; back on its queue", job_id, reason)
    time.sleep(GANG_RETRY_S)  # the job is back on the queue this worker reads: not at once again
    return NotStarted(reason)


def push_ranks(r, job_id: str, epoch: int, gang: LeadGang, lane: str) -> list[list[str]]:
    """The leader holds the job's lease under `epoch`: push each other member's rank job
    (worker.jobs.run_rank) on that member's own queue, which it serves first (its rank job
    holds it from then on). The gang's hostfile."""
    hosts = gang_claims.hostfile(gang.members)
    size = len(gang.members)
    for rank, member in enumerate(gang.names[1:], 1):
        queue = Queue(routing.own_queue(lane, member), connection=r)
        retrying(lambda: queue.enqueue_call(
            gang_claims.RANK_JOB_FUNC, args=(job_id, epoch, rank, hosts, gang.token), timeout=-1,
            job_id=f"{job_id}-e{epoch}-rank{rank}", result_ttl=3600, failure_ttl=3600,
            description=f"rank {rank} of {size} of job {job_id} (epoch {epoch})"), "rank job")
    log.info("job %s: leading a gang of %d: %s", job_id, size, ", ".join(gang.names))
    return hosts
