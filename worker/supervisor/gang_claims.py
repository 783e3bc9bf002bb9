"""Gangs: one job trained by several workers at once, data-parallel (docs/distributed.md). This
module is the queue's side of it (no MLX); worker/runtime/gang_group.py is the training process's.

A job whose config says `workers: N` (N > 1) is a gang job. Its rq job is routed and taken as
any job's, by one worker: the leader, its rank 0 (worker/supervisor/admission.py form_gang, push_ranks).

    pick      the leader and N-1 other workers that are free, can run the job or receive its model
              (shared/routing.py Route.free) and advertise a gang address on the same device and
              backend (MTQ_GANG_BACKEND; jaccl: cabled to each other); fewer: the job goes
              back on its queue, not started, waiting_for_worker saying how many it has of N
    claim     all N at once, in one step that first checks each is idle (a Lua script over
              their claim keys): a worker that takes any job holds its own key for that job
              (`hold`, renewed while the job runs), so a member that took another job just
              before refuses the claim, named at once, and the leader puts the job back on its
              queue, not started (no attempt); a claimed worker takes no other job. The members'
              claims expire after MTQ_GANG_JOIN_S unless their rank jobs start and hold them
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
SHUTTING_DOWN = "(shutting down)"  # what holds a worker in a warm shutdown (`retire`), in place of a job id
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


# Set every key of KEYS to ARGV[2] (for ARGV[3] ms) if none is held by another job than the one
# ARGV[1] prefixes; else set none and return the index (from 1) of the first that is.
_CLAIM = """
for i, key in ipairs(KEYS) do
  local held = redis.call('get', key)
  if held and string.sub(held, 1, string.len(ARGV[1])) ~= ARGV[1] then return i end
end
for _, key in ipairs(KEYS) do redis.call('set', key, ARGV[2], 'px', ARGV[3]) end
return 0
"""
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def claim(r: redis.Redis, names: list[str], job_id: str, ttl_s: float) -> tuple[str | None, str | None]:
    """Claim every worker of `names` for the job, or none: (the claim's token, None), or (None,
    the first worker held by another job). A worker already held for this same job is claimed
    again (the leader's own hold, a new attempt's gang)."""
    token = f"{job_id}:{secrets.token_hex(4)}"
    refused = r.eval(_CLAIM, len(names), *map(claim_key, names), f"{job_id}:", token, max(int(ttl_s * 1000), 1000))
    return (token, None) if refused == 0 else (None, names[refused - 1])


def hold(r: redis.Redis, worker: str, job_id: str, ttl_s: float) -> str | None:
    """This worker takes the job (alone, as a gang's leader or as its rank): hold its claim key
    for it, unless another job holds it; the token (renewed by `renew` while the job runs)."""
    return claim(r, [worker], job_id, ttl_s)[0]


def retire(r: redis.Redis, worker: str, ttl_s: float) -> str:
    """This worker is shutting down (warm): hold it for no job, whatever held it, so that no
    gang claims it, not even its own job's next gang (rank 0 hands the job back meanwhile); the
    token, renewed until the worker is gone."""
    token = f"{SHUTTING_DOWN}:{secrets.token_hex(4)}"
    r.set(claim_key(worker), token, px=max(int(ttl_s * 1000), 1000))
    return token


def renew(r: redis.Redis, worker: str, token: str, ttl_s: float) -> bool:
    """Keep this worker's hold for another ttl_s; False when it is no longer this token's."""
    return bool(r.eval(_RENEW, 1, claim_key(worker), token, max(int(ttl_s * 1000), 1000)))


def claimed_by(r: redis.Redis, worker: str) -> str | None:
    """The job that holds this worker (its own job, or the gang that claimed it), if any."""
    token = r.get(claim_key(worker))
    return None if token is None else token.decode().rsplit(":", 1)[0]


def release(r: redis.Redis, names: list[str], token: str) -> None:
    """Drop these workers' claims, where they are still this token's."""
    for n in names:
        r.eval(_RELEASE, 1, claim_key(n), token)


def members_of(rec: dict[str, str]) -> list[str]:
    """The workers of a running gang job's attempt, by rank (a job record's decoded fields)."""
    return json.loads(rec.get("gang") or "[]")
