"""GRPO fine-tuning jobs: /admin/api/fine-tune/grpo/jobs (paths and job object as in the seed
server), built by api/routes/job_routes.py like every kind's. What is GRPO's own: the body
(shared/schemas.py JobCreate), the operator's allow-lists and limits checked on create and on
resume (api/submission.py), and invalid input answered with the seed's GRPO messages
(`model_id is required`, `Invalid config: ...`; api/main.py `readable`, with pydantic's list
under `errors`).
"""

from api.json_body import JSONBodyRoute
from api.routes.job_routes import JobKind, job_router
from api.submission import check_spec
from shared import jobstore
from shared.schemas import Job, JobCreate


def check(r, spec: JobCreate, settings, loc: tuple) -> None:
    check_spec(spec, settings, loc=loc)


def resume(r, job_id: str, spec: JobCreate, overrides: dict) -> bool:
    return jobstore.resume_job(r, job_id, overrides)


router = job_router(JobKind(
    kind="grpo", prefix="/admin/api/fine-tune/grpo/jobs", tag="GRPO jobs", what="a GRPO job",
    spec_model=JobCreate, job_model=Job, create=jobstore.create_job, from_hash=jobstore.job_or_unreadable,
    with_overrides=jobstore.with_config_overrides, resume=resume, check=check,
    route_class=JSONBodyRoute,  # invalid input: the app's handler (the seed's GRPO messages), not SeedErrorsRoute
))
