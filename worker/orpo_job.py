"""The ORPO job kind: worker/dpo_job.py with method "orpo" (the math is written out there)."""

from worker.dpo_job import USER_ERRORS, Cancelled, run as _run  # noqa: F401  (the kind's interface)
from worker.training_process import JobRun


def run(job: JobRun, spec_json: str) -> dict:
    return _run(job, spec_json, method="orpo")
