"""A worker's hold on a running job: its lease epoch (fencing token), and Redis retries.

The supervisor (worker/supervisor/supervisor.py) takes a job with `Lease.start`, renews it from its
heartbeat thread, and hands its epoch to the training process, which makes every write for
the job through the same kind of handle. Every write is fenced by the epoch in
shared/lifecycle.py, so a worker that lost the job (paused past its lease, then resumed)
writes nothing more: it gets LeaseLost and drops the job.

Redis being restarted, or out of memory for a while, must not fail a job, so every call here
retries connection errors, timeouts and out-of-memory refusals with backoff for up to
MTQ_REDIS_RETRY_S seconds.
"""

import logging
import threading
import time
from typing import Any, Callable, TypeVar

import redis

from shared import fenced_writes, jobstore, lifecycle
from shared.fenced_writes import LeaseLost
from shared.keys import checkpoint_key
from shared.settings import load_settings

log = logging.getLogger(__name__)
T = TypeVar("T")


def retrying(fn: Callable[[], T], what: str) -> T:
    deadline = time.monotonic() + load_settings().redis_retry_s
    delay = 0.25
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError,
                redis.exceptions.OutOfMemoryError) as e:
            if time.monotonic() > deadline:
                raise
            log.warning("redis unavailable during %s (%s); retrying in %.1fs", what, e, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


class Lease:
    def __init__(self, r: redis.Redis, job_id: str, worker: str, epoch: int):
        self.r, self.job_id, self.worker, self.epoch = r, job_id, worker, epoch
        self.lost = threading.Event()

    @classmethod
    def start(cls, r: redis.Redis, job_id: str, worker: str, gang: list[str] | None = None) -> "Lease | None":
        """Take a queued job (gang: as the leader of these workers, worker/supervisor/gang_claims.py); None if it
        is not queued (cancelled, deleted, taken)."""
        ttl = load_settings().lease_ttl_s
        epoch = retrying(lambda: lifecycle.start(r, job_id, worker, ttl, gang), "lease start")
        return None if epoch is None else cls(r, job_id, worker, epoch)

    def _fenced(self, fn: Callable[[], T], what: str) -> T:
        try:
            return retrying(fn, what)
        except LeaseLost:
            self.lost.set()
            raise

    def write(self, event: dict | None = None, **fields: Any) -> str | None:
        """Set job fields and append an event, only while this worker holds the job; the
        event's stream id."""
        return self._fenced(lambda: fenced_writes.write(self.r, self.job_id, self.epoch, event, **fields), "job write")

    def save_blobs(self, key: str, blobs: dict[str, bytes], event: dict | None = None, **fields: Any) -> None:
        """Replace the hash `key` with `blobs` and set job fields, in one fenced write."""
        self._fenced(lambda: fenced_writes.write(self.r, self.job_id, self.epoch, event, blobs_key=key, blobs=blobs,
                                             **fields), f"write {key}")

    def renew(self) -> bool:
        """Heartbeat: extend the lease. False once the job belongs to someone else."""
        ttl = load_settings().lease_ttl_s
        if retrying(lambda: fenced_writes.renew(self.r, self.job_id, self.epoch, ttl), "lease renew"):
            return True
        self.lost.set()
        return False

    def finish(self, status: str, event: dict | list[dict], **fields: Any) -> None:
        """The job's last write: final status, terminal event (after the others given), lease released, retention set."""
        self._fenced(lambda: lifecycle.finish(self.r, self.job_id, self.epoch, status, event, **fields), "job finish")

    def hand_back(self, reason: str) -> None:
        """Back on the queue without counting an attempt; another worker resumes from the checkpoint."""
        self._fenced(lambda: lifecycle.hand_back(self.r, self.job_id, self.epoch, reason), "hand back")

    def lose(self, reason: str) -> str | None:
        """This worker's run of the job died or stalled: re-queue it (or fail it when out of attempts)."""
        self.lost.set()
        return retrying(lambda: lifecycle.lose(self.r, self.job_id, reason, epoch=self.epoch), "job lost")

    def cancel_requested(self) -> bool:
        return retrying(lambda: jobstore.cancel_requested(self.r, self.job_id), "cancel check")

    def load_checkpoint(self) -> dict[bytes, bytes]:
        return retrying(lambda: self.r.hgetall(checkpoint_key(self.job_id)), "checkpoint load")
