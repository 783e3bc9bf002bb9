"""GRPO fine-tuning jobs: /admin/api/fine-tune/grpo/jobs (paths and job object as in the seed server).

Routes are plain `def`s: redis-py is blocking, and FastAPI runs sync routes in a thread pool.
"""

import re
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, Header, HTTPException, Query, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from api import sse
from api.deps import RedisDep, SettingsDep, require_token
from shared import jobstore, lifecycle
from shared.reward_specs import disallowed_endpoint_hosts, endpoint_urls
from shared.schemas import ErrorBody, Job, JobCreate, JobList, JobStatus

router = APIRouter(
    prefix="/admin/api/fine-tune/grpo/jobs",
    tags=["GRPO jobs"],
    dependencies=[Depends(require_token)],
    responses={
        401: {"model": ErrorBody, "description": "Missing or wrong bearer token."},
        503: {"model": ErrorBody, "description": "Redis is unavailable."},
    },
)

NOT_FOUND = {404: {"model": ErrorBody, "description": "No job with this id."}}
CONFLICT = {409: {"model": ErrorBody, "description": "Not possible in the job's current status."}}
STREAM_ID = re.compile(r"^\d+(-\d+)?$")


class JobDeleted(BaseModel):
    job_id: str
    deleted: bool = True


def _job_or_404(r: redis.Redis, job_id: str) -> Job:
    job = jobstore.get_job(r, job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job not found: {job_id}")
    return job


def _check_reward_hosts(spec: JobCreate, allowed_hosts: tuple[str, ...]) -> None:
    """Reward URLs must point at allowed hosts (MTQ_REWARD_HOSTS): the worker would POST
    completions to them. Reported like pydantic's own field errors."""
    errors = disallowed_endpoint_hosts(endpoint_urls(spec.reward, spec.config.reward_endpoint), allowed_hosts)
    if errors:
        raise RequestValidationError([{"loc": ("body",), "msg": msg, "type": "value_error"} for msg in errors])


@router.post("", response_model=Job, summary="Create a GRPO job (queued)")
def create_job(spec: JobCreate, r: RedisDep, settings: SettingsDep) -> Job:
    _check_reward_hosts(spec, settings.reward_hosts)
    return jobstore.create_job(r, spec)


@router.get("", response_model=JobList, summary="List jobs, newest first")
def list_jobs(
    r: RedisDep,
    status_: Annotated[JobStatus | None, Query(alias="status", description="Only jobs in this status.")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
    after: Annotated[str | None, Query(description="`next_after` of the previous page.")] = None,
) -> JobList:
    try:
        jobs, has_more = jobstore.list_jobs(r, status=status_, limit=limit, after=after)
    except KeyError:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"unknown job id in 'after': {after}") from None
    return JobList(data=jobs, has_more=has_more, next_after=jobs[-1].job_id if has_more else None)


@router.get("/{job_id}", response_model=Job, responses=NOT_FOUND, summary="Get one job")
def get_job(job_id: str, r: RedisDep) -> Job:
    return _job_or_404(r, job_id)


@router.delete("/{job_id}", response_model=JobDeleted, responses={**NOT_FOUND, **CONFLICT},
               summary="Delete a finished job's record and events")
def delete_job(job_id: str, r: RedisDep) -> JobDeleted:
    job = _job_or_404(r, job_id)
    if not jobstore.is_finished(job.status):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"job {job_id} is {job.status}; cancel it first (POST {router.prefix}/{job_id}/cancel)",
        )
    if not lifecycle.delete(r, job_id):  # it was resumed meanwhile
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {jobstore.get_status(r, job_id)}")
    return JobDeleted(job_id=job_id)


@router.post("/{job_id}/cancel", response_model=Job, responses={**NOT_FOUND, **CONFLICT},
             summary="Cancel a job (a queued one at once, a running one at its next step)")
def cancel_job(job_id: str, r: RedisDep) -> Job:
    job = _job_or_404(r, job_id)
    if jobstore.is_finished(job.status):
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is already {job.status}")
    new_status = lifecycle.cancel(r, job_id)
    if new_status in ("completed", "failed"):  # it finished between our read and the request
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is already {new_status}")
    return _job_or_404(r, job_id)


class JobHistory(BaseModel):
    job_id: str
    history: list[dict[str, Any]] = Field(description="One entry per step (the last 1000), each step once, "
                                          "also across resumes: {step, loss, reward, ...}.")


@router.get("/{job_id}/history", response_model=JobHistory, responses=NOT_FOUND,
            summary="A completed job's per-step metrics")
def job_history(job_id: str, r: RedisDep) -> JobHistory:
    _job_or_404(r, job_id)
    return JobHistory(job_id=job_id, history=jobstore.get_history(r, job_id))


class ResumeRequest(BaseModel):
    config: dict[str, Any] = Field(default_factory=dict, description="Config fields to change, e.g. {\"learning_rate\": 1e-5}.")


@router.post("/{job_id}/resume", response_model=Job, responses={**NOT_FOUND, **CONFLICT},
             summary="Re-queue a failed or cancelled job; it continues from its last checkpoint")
def resume_job(job_id: str, r: RedisDep, body: ResumeRequest | None = None) -> Job:
    job = _job_or_404(r, job_id)
    if job.status not in jobstore.RESUMABLE_STATUSES:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {job.status}; only failed or cancelled jobs resume")
    try:
        resumed = jobstore.resume_job(r, job_id, (body or ResumeRequest()).config)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", "config", *err["loc"])} for err in e.errors()]) from None
    except ValueError as e:  # a change that does not fit the checkpoint
        raise RequestValidationError([{"loc": ("body", "config"), "msg": str(e), "type": "value_error"}]) from None
    if not resumed:  # its status changed between our read and the request
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {jobstore.get_status(r, job_id)}")
    return _job_or_404(r, job_id)


@router.get(
    "/{job_id}/stream",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "`id: <stream id>` + `data: <event JSON>` per event; ends after "
            "the terminal event (`done`, `failed` or `cancelled`).",
        },
        400: {"model": ErrorBody, "description": "Malformed Last-Event-ID."},
        **NOT_FOUND,
    },
    summary="Follow a job's progress as server-sent events",
)
def stream_job(
    job_id: str,
    r: RedisDep,
    settings: SettingsDep,
    last_event_id: Annotated[str | None, Header(description="Resume after this event id.")] = None,
) -> StreamingResponse:
    _job_or_404(r, job_id)  # before the stream starts: afterwards no 404 can be sent
    if last_event_id is not None and not STREAM_ID.match(last_event_id):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"malformed Last-Event-ID: {last_event_id!r}")
    return StreamingResponse(
        sse.job_events(settings.redis_url, job_id, after=last_event_id or "0-0"),
        media_type="text/event-stream",
        # no-cache / no buffering: proxies (nginx) must pass each event on at once.
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
