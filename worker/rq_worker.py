"""The rq worker process.

SimpleWorker runs each job in the worker's own process and main thread: no fork (unsafe
once MLX/Metal is initialised) and no thread pool (MLX streams are per thread — the seed
bug). So the thread that loads a model is the one that samples and trains with it, and
models stay loaded between jobs (worker/models.py).

SimpleWorker sends no heartbeat while a job runs, so rq would declare a long job
abandoned. A heartbeat thread, which only talks to Redis, keeps rq's registries and the
job's lease (worker/lease.py) alive, and reaps dead workers' jobs (worker/reaper.py).
"""

import logging
import threading

import redis
from rq import SimpleWorker
from rq.worker import WorkerStatus

from shared.jobstore import connect
from shared.settings import QUEUE_NAME, load_settings
from worker import lease
from worker.openblas import reexec_with_openblas
from worker.reaper import Reaper

log = logging.getLogger(__name__)


class GRPOWorker(SimpleWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._running = None  # (rq job, execution) while a job runs

    def get_heartbeat_ttl(self, job, working_time: float = 0.0) -> int:
        # rq's registry entries live as long as our lease: a dead worker is noticed quickly,
        # and the heartbeat thread keeps a live one's entries fresh.
        return max(int(lease.lease_ttl_s()), 1) + 5

    def handle_warm_shutdown_request(self):
        # SIGTERM / Ctrl-C: do not train on until the job ends (hours, maybe). The job
        # checkpoints at its next decode chunk and goes back on the queue for another worker.
        super().handle_warm_shutdown_request()
        current = lease.current()
        if current is not None:
            current.hand_back_requested.set()

    def execute_job(self, job, queue):
        execution = self.prepare_execution(job)
        self._running = (job, execution)
        try:
            self.perform_job(job, queue, execution)
        finally:
            self._running = None
        self.set_state(WorkerStatus.IDLE)

    def work(self, *args, **kwargs):
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat_loop, args=(stop,), name="mtq-heartbeat", daemon=True)
        beat.start()
        try:
            return super().work(*args, **kwargs)
        finally:
            stop.set()

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        ttl = lease.lease_ttl_s()
        reaper = Reaper(self.connection, grace_s=ttl / 2)
        while not stop.wait(ttl / 4):
            try:
                current = lease.current()
                if current is not None and not current.renew():
                    log.warning("job %s: lease lost to another worker; dropping it", current.job_id)
                running = self._running
                if running is not None:
                    self.maintain_heartbeats(*running)
                reaper.scan()
            except redis.RedisError as e:
                log.warning("heartbeat: redis error %s", e)
            except Exception:
                log.exception("heartbeat failed")


def run_worker(queues: list[str] | None = None, name: str | None = None) -> None:
    reexec_with_openblas()  # before mlx is imported (by the first job)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import worker.jobs  # noqa: F401  load mlx and the trainer now, not inside the first job

    settings = load_settings()
    worker = GRPOWorker(queues or [QUEUE_NAME], connection=connect(settings.redis_url), name=name)
    worker.work(with_scheduler=False, logging_level="INFO")
