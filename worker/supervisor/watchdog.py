"""The watchdog: what the supervisor's main thread does while its training process runs a job.

    the child answers                              -> its answer is the job's outcome (a gang's rank
                                                      whose gang's attempt is over: lost, as below)
    the child exits (crash, os._exit, OOM kill)    -> the job is re-queued, an attempt counted; a fresh
                                                      child starts
    no progress mark for stall_timeout_s (the      -> the child is killed, likewise
    first step: MTQ_COMPILE_GRACE_S more), or a
    gang's rank still joining after MTQ_GANG_JOIN_S
    SIGTERM / Ctrl-C (warm shutdown)               -> the child checkpoints and hands the job back (no
                                                      attempt counted), or is killed after
                                                      SHUTDOWN_GRACE_S and the job handed back anyway
    the lease is lost (another worker has the job, -> the child drops it at its next check or write, or
    or it was cancelled)                              is killed after LEASE_LOST_GRACE_S (a gang's rank:
                                                      at once, a collective cannot be left)

It reads the child's progress marks (worker/supervisor/marks.py) and the lease's state, which
the heartbeat thread keeps (worker/supervisor/supervisor.py); it needs no MLX and no Redis
but the lease's own calls.
"""

import logging
import time
from typing import Callable

from shared.settings import load_settings
from worker.supervisor.child import POLL_S, TrainingProcess
from worker.supervisor.gang_claims import GANG_LOST
from worker.supervisor.lease import Lease

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 30.0
LEASE_LOST_GRACE_S = 10.0


def watch(t: TrainingProcess, lease: Lease, stall_timeout_s: float, gang: tuple[int, list[list[str]]] | None,
          stop_requested: Callable[[], bool]) -> str:
    """Hand the job to the child and watch it until it ends (the table above); the outcome."""
    t.hand(lease.job_id, lease.epoch, gang)
    job = _Watch(t, lease, stall_timeout_s, gang, stop_requested)
    while True:
        outcome = job.answered() or job.died()
        if outcome is None:
            outcome = job.lease_gone() if lease.lost.is_set() else job.stalled() or job.shut_down()
        if outcome is not None:
            return outcome


def lose(t: TrainingProcess, lease: Lease, reason: str) -> str:
    """The child's run of the job is over without an outcome: re-queue the job (an attempt
    counted, lifecycle.lose) and start a fresh child for the next job."""
    reason = f"{reason} (phase {t.marks.phase}, {t.marks.steps} steps done in this run)"
    log.error("job %s: %s", lease.job_id, reason)
    t.kill()
    status = lease.lose(reason)
    t.start()
    return f"lost: {reason}; job is now {status}"


class _Watch:
    """One job's watch: each check returns the outcome, or None while the job goes on."""

    def __init__(self, t: TrainingProcess, lease: Lease, stall_timeout_s: float,
                 gang: tuple[int, list[list[str]]] | None, stop_requested: Callable[[], bool]):
        self.t, self.lease, self.stall_timeout_s, self.gang = t, lease, stall_timeout_s, gang
        self.stop_requested = stop_requested
        settings = load_settings()
        self.join_s, self.compile_grace_s = settings.gang_join_s, settings.compile_grace_s
        self.stop_seen: float | None = None  # when the warm shutdown was first seen
        self.lost_seen: float | None = None  # when the lost lease was first seen

    def answered(self) -> str | None:
        """The child's answer, if it has sent one within POLL_S."""
        if not self.t.conn.poll(POLL_S):
            return None
        try:
            result = self.t.conn.recv()
        except EOFError:
            return None  # it died: died() says so
        return lose(self.t, self.lease, result) if result.startswith(GANG_LOST) else result

    def died(self) -> str | None:
        if self.t.alive():
            return None
        self.t.proc.join(5)
        return lose(self.t, self.lease, f"training process {self.t.exit_description()}")

    def lease_gone(self) -> str | None:
        """Cancelled, or another worker has the job: the child stops at its next check, within the grace."""
        now = time.monotonic()
        self.lost_seen = self.lost_seen or now
        if self.gang is None and now - self.lost_seen <= LEASE_LOST_GRACE_S:
            return None
        self.t.kill()
        return "lease lost"

    def stalled(self) -> str | None:
        marks = self.t.marks
        silence = time.monotonic() - marks.last
        if self.gang is not None and marks.phase == "joining" and silence > self.join_s:
            self.t.kill()
            return lose(self.t, self.lease, f"rank {self.gang[0]}: its gang did not form within {self.join_s:g}s "
                                            "(MTQ_GANG_JOIN_S)")
        allowed = self.stall_timeout_s
        if marks.steps == 0 and marks.phase != "scoring":
            allowed += self.compile_grace_s
        if silence <= allowed:
            return None
        self.t.kill()
        return lose(self.t, self.lease, f"stalled: no progress for {silence:.0f}s in phase {marks.phase} "
                                        f"(stall_timeout_s={self.stall_timeout_s:g}); its training process was ended")

    def shut_down(self) -> str | None:
        """A warm shutdown: ask the child to hand the job back; past the grace, hand it back ourselves."""
        if not self.stop_requested():
            return None
        now = time.monotonic()
        if self.stop_seen is None:
            self.stop_seen = now
            self.t.marks.request_hand_back()
            return None
        if now - self.stop_seen <= SHUTDOWN_GRACE_S:
            return None
        self.t.kill()
        self.lease.hand_back(f"worker shutting down (its training process did not stop within {SHUTDOWN_GRACE_S:g}s "
                             "and was ended)")
        return "handed back"
