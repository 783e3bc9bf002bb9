"""The supervisor's adapter to rq's worker: every use of rq's worker internals, in one place.

`RQWorker` is an rq SimpleWorker (jobs run in the worker's own process, the supervisor, which
hands them to its training process) with what the supervisor needs rq to do otherwise: queues
that change while it runs, heartbeats kept by another thread, a warm shutdown that the job's
watch sees, and a work loop that outlives Redis trouble.

Checked against rq 3.0.0 (pinned in pyproject.toml): each rq name overridden or used here
(`dequeue_timeout`, `get_heartbeat_ttl`, `execute_job`, `prepare_execution`, `perform_job`,
`set_state`, `maintain_heartbeats`, `handle_warm_shutdown_request`, `_stop_requested`,
`_ordered_queues`, `birth_date`, `unsubscribe`, `work`) exists in rq/worker/base.py or
rq/worker/worker_classes.py of that version; check them again when rq is upgraded.
"""

import logging
import time

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.worker import WorkerStatus

from shared.settings import load_settings

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0  # between two tries of rq's work loop while Redis is in trouble


class RQWorker(SimpleWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.running = None  # (rq job, execution) while a job runs, for the heartbeat thread
        self.stopping = False  # a warm shutdown was requested

    @property
    def dequeue_timeout(self) -> int:
        # rq blocks this long at a dequeue: queues set by `listen` count from the next one.
        return max(1, int(load_settings().lease_ttl_s / 4))

    def get_heartbeat_ttl(self, job, working_time: float = 0.0) -> int:
        # rq's registry entries live as long as our lease: a dead worker is noticed quickly,
        # and the heartbeat thread keeps a live one's entries fresh.
        return max(int(load_settings().lease_ttl_s), 1) + 5

    def execute_job(self, job, queue):
        # SimpleWorker's, keeping the job and its execution for `renew_rq_heartbeats`.
        execution = self.prepare_execution(job)
        self.running = (job, execution)
        try:
            self.perform_job(job, queue, execution)
        finally:
            self.running = None
        self.set_state(WorkerStatus.IDLE)

    def handle_warm_shutdown_request(self):
        # rq's hook on SIGTERM / Ctrl-C; an idle rq worker then leaves its loop by an exception
        # without setting _stop_requested, so `work` needs its own word for it.
        self.stopping = True
        super().handle_warm_shutdown_request()

    @property
    def stop_requested(self) -> bool:
        """A warm shutdown was requested while a job runs (rq then sets _stop_requested)."""
        return self._stop_requested

    @property
    def running_rq_job_id(self) -> str:
        """The id of the rq job this worker is running."""
        return self.running[0].id

    def renew_rq_heartbeats(self) -> None:
        """rq's heartbeats of the running job (its registry entry, execution and job), which rq
        renews only between jobs."""
        running = self.running
        if running is not None:
            self.maintain_heartbeats(*running)

    def listen(self, names: list[str]) -> None:
        """Listen to these queues from the next dequeue on (rq's worker reads `_ordered_queues`
        there), and show them in rq's worker record (rq-dashboard's workers view)."""
        if names == self.queue_names():
            return
        self.queues = [Queue(n, connection=self.connection) for n in names]
        self._ordered_queues = self.queues[:]
        if self.birth_date is not None:  # before its birth, rq writes the record itself
            self.connection.hset(self.key, "queues", ",".join(names))
        log.info("listening to %d queues: %s", len(names), ", ".join(names))

    def work(self, *args, **kwargs) -> bool:
        """rq's work loop, again after a pause when it ends on a Redis error (out of memory, or a
        timeout: rq then quits) rather than on a stop: the worker backs off instead of exiting
        (and being restarted at once, over and over, by `mtq up` or a service manager)."""
        delay = 1.0
        while True:
            try:
                worked = super().work(*args, **kwargs)
            except redis.RedisError as e:  # raised where rq registers or retires the worker
                log.warning("worker loop: redis error %s", e)
                worked = False
            if self.stopping:
                return worked
            self._forget_registration()
            log.warning("worker loop ended on Redis trouble; again in %.0f s", delay)
            try:
                time.sleep(delay)  # rq's signal handlers stay installed: a SIGTERM here ends the wait
            except StopRequested:
                return worked
            delay = min(delay * 2, MAX_BACKOFF_S)

    def _forget_registration(self) -> None:
        """What rq's loop may leave when a Redis error ends it: its pubsub thread, and its worker
        key without a death date (rq would refuse to register the name again)."""
        try:
            self.unsubscribe()
            self.connection.delete(self.key)  # allowed at maxmemory
        except redis.RedisError as e:
            log.warning("worker loop: redis error %s", e)
