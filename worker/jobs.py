"""The function rq calls for every job: `worker.jobs.run_job(job_id)`.

It runs in the supervisor process (worker/supervisor/supervisor.py), which must never import MLX: the
supervisor takes the job's lease and hands the job to its training process.
"""

from worker.supervisor import supervisor


def run_job(job_id: str) -> str:
    return supervisor.current().run(job_id)


def run_rank(job_id: str, epoch: int, rank: int, hosts: list[list[str]], token: str) -> str:
    """A gang job's rank other than 0, pushed by its leader on this worker's own queue (worker/supervisor/gang_claims.py)."""
    return supervisor.current().run_rank(job_id, epoch, rank, hosts, token)
