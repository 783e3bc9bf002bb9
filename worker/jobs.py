"""The function rq calls for every job: `worker.jobs.run_job(job_id)`.

It runs in the supervisor process (worker/supervisor.py), which must never import MLX: the
supervisor takes the job's lease and hands the job to its training process.
"""

from worker import supervisor


def run_job(job_id: str) -> str:
    return supervisor.current().run(job_id)
