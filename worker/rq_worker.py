"""The rq worker process.

SimpleWorker runs each job in the worker's own process and main thread: no fork (unsafe
once MLX/Metal is initialised) and no thread pool (MLX streams are per thread — the seed
bug). So the thread that loads a model is the one that samples and trains with it, and
models stay loaded between jobs (worker/models.py).
"""

import logging

from rq import SimpleWorker

from shared.jobstore import connect
from shared.settings import QUEUE_NAME, load_settings
from worker.openblas import reexec_with_openblas


class GRPOWorker(SimpleWorker):
    pass


def run_worker(queues: list[str] | None = None, name: str | None = None) -> None:
    reexec_with_openblas()  # before mlx is imported (by the first job)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import worker.jobs  # noqa: F401  load mlx and the trainer now, not inside the first job

    settings = load_settings()
    worker = GRPOWorker(queues or [QUEUE_NAME], connection=connect(settings.redis_url), name=name)
    worker.work(with_scheduler=False, logging_level="INFO")
