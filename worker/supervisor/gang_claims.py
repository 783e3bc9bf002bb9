"""Gangs: one job trained by several workers at once, data-parallel (docs/distributed.md). This
module is the queue's side of it (no MLX); worker/runtime/gang_group.py is the training process's.

A job whose config says `workers: N` (N > 1) is a gang job. Its rq job is routed and taken as
any job's, by one worker: the leader, its rank 0 (worker/supervisor/admission.py form_gang, push_ranks).

    pick      the leader and N-1 other workers that are free, can run the job or receive its model
              (shared/routing.py Route.free) and advertise a gang address on the same device and
              backend (MTQ_GANG_BACKEND; jaccl: cabled to each other); fewer: the job goes
              back on its queue, not started, waiting_for_worker saying how many it has of N
    claim     all N at once (MSETNX of their claim keys, which expire after MTQ_GANG_JOIN_S):
              two leaders never share a worker, and a claimed worker takes no other job
    start     lifecycle.start: the job is running under the leader's lease epoch E; `gang` in
              its record names the members by rank
    ranks     a rank job (worker.jobs.run_rank: job, E, rank, hostfile) on each member's own
              queue, which it serves first; it runs its part under epoch E, watched by its own
              supervisor as any job (death, stall, lease)
    stage     a member without the job's model receives it from rank 0 over Redis
              (worker/runtime/model_staging.py)
    join      every rank's training process (one that never joined a group: MLX forms one per
              process, so it is replaced after the attempt) joins the group of the hostfile (the members' advertised addresses, by
              rank) within MTQ_GANG_JOIN_S

Any rank's death or stall ends the attempt for all: its supervisor loses the job (epoch E + 1,
an attempt counted), the other ranks' collectives fail at once (a killed peer) or their
supervisors see the lease gone, and every rank's training process is killed and restarted.
The job is queued again and a new gang resumes it from rank 0's last checkpoint.
"""

import json
import secrets
from typing import Any

import redis

CLAIM_PREFIX = "mtq:gang-claim:"
RANK_JOB_FUNC = "worker.jobs.run_rank"
GANG_LOST = "gang attempt lost: "  # a rank's training process: its gang's attempt cannot go on (a peer is gone)


def claim_key(worker: str) -> str:
    return CLAIM_PREFIX + worker


def pick(leader: str, free: list[dict[str, Any]], size: int) -> list[dict[str, Any]] | None:
    """The gang's members by rank: the leader first, then free workers on the leader's device
    and gang backend, in the order given (shared/routing.py: those that have the model first);
    None when there are not `size` of them, or a jaccl gang's cabling does not join them."""
    me = next((w for w in free if w["name"] == leader), None)
    if me is None:
        return None
    others = [w for w in free if w["name"] != leader and w.get("device") == me.get("device")
              and w.get("gang_backend") == me.get("gang_backend")]
    members = [me, *others[: size - 1]]
    if len(members) != size or any(None in entry for entry in hostfile(members)):
        return None
    return members


def hostfile(members: list[dict[str, Any]]) -> list[list[str]]:
    """Each rank's entry, by rank: its "host:port" address (MLX's ring hostfile); a jaccl gang's
    then names its RDMA device to each rank: "" to itself (and to a jaccl-ring's non-neighbours),
    None where it advertises none (worker/runtime/gang_group.py backend_env)."""
    backend = members[0].get("gang_backend") or "ring"
    if not backend.startswith("jaccl"):
        return [[w["gang_address"]] for w in members]
    n = len(members)
    return [[w["gang_address"], *(
        "" if j == i or (backend == "jaccl-ring" and j not in ((i - 1) % n, (i + 1) % n))
        else (w.get("gang_rdma") or {}).get(peer["name"]) for j, peer in enumerate(members))]
        for i, w in enumerate(members)]


def claim(r: redis.Redis, names: list[str], job_id: str, ttl_s: float) -> str | None:
    """Claim every worker of `names` for the job's gang, or none; the claim's token."""
    token = f"{job_id}:{secrets.token_hex(4)}"
    with r.pipeline() as p:
        p.msetnx({claim_key(n): token for n in names})
        for n in names:
            p.pexpire(claim_key(n), max(int(ttl_s * 1000), 1000))
        claimed = p.execute()[0]
    return token if claimed else None


def claimed_by(r: redis.Redis, worker: str) -> str | None:
    """The job whose gang has claimed this worker, if any."""
    token = r.get(claim_key(worker))
    return None if token is None else token.decode().rsplit(":", 1)[0]


def release(r: redis.Redis, names: list[str], token: str) -> None:
    """Drop these workers' claims, where they are still this token's."""
    for n in names:
        r.eval("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0",
               1, claim_key(n), token)


def members_of(rec: dict[str, str]) -> list[str]:
    """The workers of a running gang job's attempt, by rank (a job record's decoded fields)."""
    return json.loads(rec.get("gang") or "[]")
