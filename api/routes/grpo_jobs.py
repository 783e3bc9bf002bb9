"""GRPO fine-tuning jobs: /admin/api/fine-tune/grpo/jobs (paths and job object as in the seed server).

Routes are plain `def`s: redis-py is blocking, and FastAPI runs sync routes in a thread pool.
The event stream is the exception: an `async def` on redis.asyncio (api/sse.py), so that
open streams hold no threads.

Who may do what (api/auth.py): every route needs a token; a viewer's token only reads
(403 on changes); a trainer's token sees only the jobs it created (others' are 404).
"""

import re
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, Header, HTTPException, Query, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError, model_validator

from api import sse
from api.auth import Principal
from api.deps import PrincipalDep, RedisDep, SettingsDep, WriterDep, get_async_redis, get_settings, require_token
from api.json_body import JSONBodyRoute
from api.submission import check_spec
from shared import jobstore, lifecycle
from shared.schemas import ErrorBody, Job, JobCreate, JobList, JobStatus, UnreadableJob, check_json_values

router = APIRouter(
    prefix="/admin/api/fine-tune/grpo/jobs",
    tags=["GRPO jobs"],
    dependencies=[Depends(require_token)],
    route_class=JSONBodyRoute,
    responses={
        400: {"model": ErrorBody, "description": "Malformed or over-deep JSON body."},
        401: {"model": ErrorBody, "description": "Missing or wrong bearer token."},
        413: {"model": ErrorBody, "description": "Body larger than MTQ_MAX_BODY_BYTES."},
        503: {"model": ErrorBody, "description": "Redis is unavailable."},
    },
)

NOT_FOUND = {404: {"model": ErrorBody, "description": "No job with this id (or not one of this trainer token's)."}}
CONFLICT = {409: {"model": ErrorBody, "description": "Not possible in the job's current status."}}
FORBIDDEN = {403: {"model": ErrorBody, "description": "A viewer token cannot change anything."}}
# Job ids are uuid4 hex; anything with a ':' would name another of the job's keys (mtq:job:<id>:events).
JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class JobDeleted(BaseModel):
    job_id: str
    deleted: bool = True


def _not_found(job_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"job not found: {job_id[:100]}")


def _entry_or_404(r: redis.Redis, job_id: str, who: Principal) -> Job | UnreadableJob:
    entry = jobstore.get_job_entry(r, job_id) if JOB_ID.match(job_id) else None
    if entry is None or not who.sees(entry.owner):
        raise _not_found(job_id)
    return entry


def _job_or_404(r: redis.Redis, job_id: str, who: Principal) -> Job:
    """A job this principal may see, readable (409 for a stored record that cannot be loaded)."""
    entry = _entry_or_404(r, job_id, who)
    if isinstance(entry, UnreadableJob):
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id}: {entry.error}; it can only be deleted")
    return entry


@router.post("", response_model=Job, responses=FORBIDDEN, summary="Create a GRPO job (queued)")
def create_job(spec: JobCreate, r: RedisDep, settings: SettingsDep, who: WriterDep) -> Job:
    check_spec(spec, settings)
    return jobstore.create_job(r, spec, owner=who.name)


@router.get("", response_model=JobList, summary="List jobs, newest first (a trainer token: its own)")
def list_jobs(
    r: RedisDep,
    who: PrincipalDep,
    status_: Annotated[JobStatus | None, Query(alias="status", description="Only jobs in this status.")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
    after: Annotated[str | None, Query(max_length=64, description="`next_after` of the previous page.")] = None,
) -> JobList:
    owner = who.name if who.role == "trainer" else None
    try:
        jobs, has_more = jobstore.list_jobs(r, status=status_, limit=limit, after=after, owner=owner)
    except KeyError:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"unknown job id in 'after': {after}") from None
    return JobList(data=jobs, has_more=has_more, next_after=jobs[-1].job_id if has_more else None)


@router.get("/{job_id}", response_model=Job | UnreadableJob, responses=NOT_FOUND, summary="Get one job")
def get_job(job_id: str, r: RedisDep, who: PrincipalDep) -> Job | UnreadableJob:
    return _entry_or_404(r, job_id, who)


@router.delete("/{job_id}", response_model=JobDeleted, responses={**NOT_FOUND, **CONFLICT, **FORBIDDEN},
               summary="Delete a finished (or unreadable) job's record and events")
def delete_job(job_id: str, r: RedisDep, who: WriterDep) -> JobDeleted:
    entry = _entry_or_404(r, job_id, who)
    if isinstance(entry, Job) and not jobstore.is_finished(entry.status):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"job {job_id} is {entry.status}; cancel it first (POST {router.prefix}/{job_id}/cancel)",
        )
    if not lifecycle.delete(r, job_id):  # it was resumed meanwhile
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {jobstore.get_status(r, job_id)}")
    return JobDeleted(job_id=job_id)


@router.post("/{job_id}/cancel", response_model=Job, responses={**NOT_FOUND, **CONFLICT, **FORBIDDEN},
             summary="Cancel a job (a queued one at once, a running one at its next step)")
def cancel_job(job_id: str, r: RedisDep, who: WriterDep) -> Job:
    job = _job_or_404(r, job_id, who)
    if jobstore.is_finished(job.status):
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is already {job.status}")
    if not lifecycle.cancel(r, job_id):  # it finished between our read and the request
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is already {jobstore.get_status(r, job_id)}")
    return _job_or_404(r, job_id, who)


class JobHistory(BaseModel):
    job_id: str
    history: list[dict[str, Any]] = Field(description="One entry per step (the last 1000), each step once, "
                                          "also across resumes: {step, loss, reward, ...}.")


@router.get("/{job_id}/history", response_model=JobHistory, responses=NOT_FOUND,
            summary="A completed job's per-step metrics")
def job_history(job_id: str, r: RedisDep, who: PrincipalDep) -> JobHistory:
    _job_or_404(r, job_id, who)
    return JobHistory(job_id=job_id, history=jobstore.get_history(r, job_id))


class ResumeRequest(BaseModel):
    config: dict[str, Any] = Field(default_factory=dict, description="Config fields to change, e.g. {\"learning_rate\": 1e-5}.")

    _json_values = model_validator(mode="before")(check_json_values)


@router.post("/{job_id}/resume", response_model=Job, responses={**NOT_FOUND, **CONFLICT, **FORBIDDEN},
             summary="Re-queue a failed or cancelled job; it continues from its last checkpoint")
def resume_job(job_id: str, r: RedisDep, settings: SettingsDep, who: WriterDep, body: ResumeRequest | None = None) -> Job:
    job = _job_or_404(r, job_id, who)
    if job.status not in jobstore.RESUMABLE_STATUSES:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {job.status}; only failed or cancelled jobs resume")
    overrides = (body or ResumeRequest()).config
    try:
        check_spec(jobstore.with_config_overrides(jobstore.get_spec(r, job_id), overrides), settings, loc=("body", "config"))
        resumed = jobstore.resume_job(r, job_id, overrides)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", "config", *err["loc"])} for err in e.errors()]) from None
    except ValueError as e:  # a change that does not fit the checkpoint
        raise RequestValidationError([{"loc": ("body", "config"), "msg": str(e), "type": "value_error"}]) from None
    if not resumed:  # its status changed between our read and the request
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {jobstore.get_status(r, job_id)}")
    return _job_or_404(r, job_id, who)


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
        429: {"model": ErrorBody, "description": "This token has MTQ_MAX_STREAMS_PER_TOKEN streams open already."},
        **NOT_FOUND,
    },
    summary="Follow a job's progress as server-sent events",
)
async def stream_job(
    job_id: str,
    who: PrincipalDep,
    last_event_id: Annotated[str | None, Header(description="Resume after this event id.")] = None,
) -> sse.CountedStream:
    # Everything here runs on the event loop (no sync dependency: those take a pool thread).
    r, settings = get_async_redis(), get_settings()
    job_status, owner = await sse.status_and_owner(r, job_id) if JOB_ID.match(job_id) else (None, None)
    if job_status is None or not who.sees(owner):  # before the stream starts: afterwards no 404 can be sent
        raise _not_found(job_id)
    if last_event_id is not None and not sse.valid_stream_id(last_event_id):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"malformed Last-Event-ID: {last_event_id[:50]!r}")
    if sse.open_streams[who.name] >= settings.max_streams_per_token:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            f"token {who.name!r} has {settings.max_streams_per_token} event streams open (MTQ_MAX_STREAMS_PER_TOKEN)",
        )
    return sse.CountedStream(sse.job_events(r, job_id, after=last_event_id or "0-0"), who.name)
