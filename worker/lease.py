"""A worker's hold on a running job: a lease with a fencing token.

Starting a job bumps the job's `lease_epoch` and sets a lease key with a short TTL that
the worker's heartbeat thread renews. Every write the worker makes for the job (progress,
events, checkpoints, the final status) runs as a Lua script that first checks that
`lease_epoch` is still the worker's own. When a worker dies, its lease expires, the
reaper (worker/reaper.py) re-queues the job and bumps the epoch: from then on a worker
that was only paused (SIGSTOP, a laptop asleep) can no longer write anything; it notices
at its next write or heartbeat and drops the job. A worker asked to shut down (SIGTERM)
checkpoints and hands its job back to the queue instead of finishing it first.

Redis being restarted must not fail a job, so every call here retries connection errors
with backoff for up to MTQ_REDIS_RETRY_S seconds.
"""

import json
import logging
import os
import threading
import time
from typing import Any, Callable, TypeVar

import redis

from shared import jobstore
from shared.jobstore import EVENTS_MAXLEN, field_args
from shared.keys import RUNNING_JOBS, adapter_key, checkpoint_key, events_key, job_key, lease_key

log = logging.getLogger(__name__)
T = TypeVar("T")


def lease_ttl_s() -> float:
    return float(os.environ.get("MTQ_LEASE_TTL", "20"))


def redis_retry_s() -> float:
    return float(os.environ.get("MTQ_REDIS_RETRY_S", "600"))


def retention_s() -> int:
    """How long finished jobs' records, events and checkpoints are kept."""
    return int(float(os.environ.get("MTQ_JOB_RETENTION_S", str(30 * 86400))))


class LeaseLost(Exception):
    """Another worker owns the job now; this one must stop touching it."""


def retrying(fn: Callable[[], T], what: str) -> T:
    deadline = time.monotonic() + redis_retry_s()
    delay = 0.25
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError) as e:
            if time.monotonic() > deadline:
                raise
            log.warning("redis unavailable during %s (%s); retrying in %.1fs", what, e, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


_ACQUIRE = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' then return -1 end
local epoch = redis.call('HINCRBY', KEYS[1], 'lease_epoch', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1])
if not redis.call('HGET', KEYS[1], 'started_at') then redis.call('HSET', KEYS[1], 'started_at', ARGV[3]) end
redis.call('HDEL', KEYS[1], 'error', 'finished_at')
redis.call('SET', KEYS[2], ARGV[1] .. ':' .. epoch, 'PX', ARGV[2])
redis.call('SADD', KEYS[3], ARGV[4])
return epoch
"""

# KEYS: job, events, lease. ARGV: epoch, ttl_ms (0: leave lease), event json ('' none), maxlen, then field/value pairs.
_FENCED_WRITE = """
if redis.call('HGET', KEYS[1], 'lease_epoch') ~= ARGV[1] then return 0 end
for i = 5, #ARGV, 2 do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i]) else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
if ARGV[3] ~= '' then redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'data', ARGV[3]) end
if ARGV[2] ~= '0' then redis.call('SET', KEYS[3], redis.call('HGET', KEYS[1], 'worker') .. ':' .. ARGV[1], 'PX', ARGV[2]) end
return 1
"""

# KEYS: job, blob hash. ARGV: epoch, marker field, marker value, then name/blob pairs.
_FENCED_BLOBS = """
if redis.call('HGET', KEYS[1], 'lease_epoch') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""

# KEYS: job, events, lease, running, checkpoint, adapter. ARGV: epoch, job_id, retention_s, drop_checkpoint, event, maxlen, fields...
_FENCED_FINISH = """
if redis.call('HGET', KEYS[1], 'lease_epoch') ~= ARGV[1] then return 0 end
for i = 7, #ARGV, 2 do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i]) else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'data', ARGV[5])
redis.call('DEL', KEYS[3])
redis.call('SREM', KEYS[4], ARGV[2])
if ARGV[4] == '1' then redis.call('DEL', KEYS[5]) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[5], ARGV[3])
redis.call('EXPIRE', KEYS[6], ARGV[3])
return 1
"""


# KEYS: job, events, lease, running. ARGV: epoch, job_id, event json, maxlen.
# Returns the attempt number to enqueue, or 0 if the lease was not current.
_FENCED_HAND_BACK = """
if redis.call('HGET', KEYS[1], 'lease_epoch') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('DEL', KEYS[3])
redis.call('SREM', KEYS[4], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'data', ARGV[3])
return redis.call('HINCRBY', KEYS[1], 'attempts', 1)
"""


class Lease:
    def __init__(self, r: redis.Redis, job_id: str, worker: str, epoch: int):
        self.r, self.job_id, self.worker, self.epoch = r, job_id, worker, epoch
        self.lost = threading.Event()
        self.hand_back_requested = threading.Event()  # the worker is shutting down

    @classmethod
    def acquire(cls, r: redis.Redis, job_id: str, worker: str) -> "Lease | None":
        """Take a queued job; None if it is not queued (cancelled, deleted, taken)."""
        epoch = retrying(lambda: r.eval(
            _ACQUIRE, 3, job_key(job_id), lease_key(job_id), RUNNING_JOBS,
            worker, int(lease_ttl_s() * 1000), repr(time.time()), job_id,
        ), "lease acquire")
        return None if epoch == -1 else cls(r, job_id, worker, int(epoch))

    def _check(self, ok: int) -> None:
        if ok != 1:
            self.lost.set()
            raise LeaseLost(f"job {self.job_id}: lease epoch {self.epoch} is no longer current")

    def write(self, event: dict | None = None, renew: bool = False, **fields: Any) -> None:
        """Set job fields and append an event, only while this worker holds the job."""
        ttl_ms = int(lease_ttl_s() * 1000) if renew else 0
        args = [self.epoch, ttl_ms, json.dumps(event) if event else "", EVENTS_MAXLEN, *field_args(fields)]
        keys = (job_key(self.job_id), events_key(self.job_id), lease_key(self.job_id))
        self._check(retrying(lambda: self.r.eval(_FENCED_WRITE, 3, *keys, *args), "job write"))

    def renew(self) -> bool:
        """Heartbeat: extend the lease. False once the job belongs to someone else."""
        try:
            self.write(renew=True)
            return True
        except LeaseLost:
            return False

    def save_blobs(self, key: str, marker: str, marker_value: Any, blobs: dict[str, bytes]) -> None:
        """Replace the hash `key` with `blobs` and set job field `marker` (fenced, atomic)."""
        args: list = [self.epoch, marker, marker_value]
        for name, blob in blobs.items():
            args += [name, blob]
        self._check(retrying(lambda: self.r.eval(_FENCED_BLOBS, 2, job_key(self.job_id), key, *args), f"write {key}"))

    def save_checkpoint(self, step: int, blobs: dict[str, bytes]) -> None:
        self.save_blobs(checkpoint_key(self.job_id), "checkpoint_step", step, blobs)

    def save_adapter(self, blobs: dict[str, bytes]) -> None:
        self.save_blobs(adapter_key(self.job_id), "adapter_stored", 1, blobs)

    def finish(self, status: str, event: dict, **fields: Any) -> None:
        """The job's last write: final status, terminal event, lease released, retention set."""
        fields = {"status": status, "finished_at": time.time(), **fields}
        keys = (job_key(self.job_id), events_key(self.job_id), lease_key(self.job_id), RUNNING_JOBS,
                checkpoint_key(self.job_id), adapter_key(self.job_id))
        args = [self.epoch, self.job_id, retention_s(), "1" if status == "completed" else "0",
                json.dumps(event), EVENTS_MAXLEN, *field_args(fields)]
        self._check(retrying(lambda: self.r.eval(_FENCED_FINISH, len(keys), *keys, *args), "job finish"))

    def hand_back(self) -> None:
        """Put the job back on the queue (the worker is shutting down); another worker
        resumes it from its last checkpoint."""
        keys = (job_key(self.job_id), events_key(self.job_id), lease_key(self.job_id), RUNNING_JOBS)
        event = {"type": "requeued", "reason": "worker shutting down", "lost_worker": self.worker}
        attempt = retrying(lambda: self.r.eval(
            _FENCED_HAND_BACK, len(keys), *keys, self.epoch, self.job_id, json.dumps(event), EVENTS_MAXLEN), "hand back")
        self._check(1 if attempt else 0)
        jobstore.enqueue(self.r, self.job_id, attempt=int(attempt))

    def should_stop(self) -> bool:
        """Checked between decode chunks and steps: a cancel, or this worker shutting down."""
        if self.lost.is_set():
            raise LeaseLost(f"job {self.job_id}: lease lost")
        if self.hand_back_requested.is_set():
            return True
        return retrying(lambda: jobstore.cancel_requested(self.r, self.job_id), "cancel check")

    def load_checkpoint(self) -> dict[bytes, bytes]:
        return retrying(lambda: self.r.hgetall(checkpoint_key(self.job_id)), "checkpoint load")


# The lease of the job this worker process is running, for the heartbeat thread.
_current: Lease | None = None


def set_current(lease: Lease | None) -> None:
    global _current
    _current = lease


def current() -> Lease | None:
    return _current
