"""GRPO fine-tuning jobs: /admin/api/fine-tune/grpo/jobs (paths and job object as in the seed server).

Routes are plain `def`s: redis-py is blocking, and FastAPI runs sync routes in a thread pool.
The event stream is the exception: an `async def` on redis.asyncio (api/sse.py), so that
open streams hold no threads.

Who may do what (api/auth.py): every route needs a token; a viewer's token only reads
(403 on changes); a trainer's token sees only the jobs it created (others' are 404).
"""

import re
from typing import Annotated, Any, Literal

import redis
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError, model_validator

from api import sse
from api.auth import Principal
from api.deps import ADMIN_ERRORS, PrincipalDep, RedisDep, SettingsDep, WriterDep, get_async_redis, get_settings, require_token
from api.json_body import JSONBodyRoute
from api.routes.adapters import archive_response
from api.submission import check_spec
from shared import adapters, jobstore, lifecycle
from shared.schemas import ErrorBody, Job, JobCreate, JobStatus, UnreadableJob, check_json_values

router = APIRouter(
    prefix="/admin/api/fine-tune/grpo/jobs",
    tags=["GRPO jobs"],
    dependencies=[Depends(require_token)],
    route_class=JSONBodyRoute,
    responses={
        400: {"model": ErrorBody, "description": "Invalid request: malformed or over-deep JSON, or a field that is "
              "missing or wrong (`detail` says which, in words; `errors` lists them)."},
        413: {"model": ErrorBody, "description": "Body larger than MTQ_MAX_BODY_BYTES."},
        **ADMIN_ERRORS,
    },
)

NOT_FOUND = {404: {"model": ErrorBody, "description": "No job with this id (or not one of this trainer token's)."}}
CONFLICT = {409: {"model": ErrorBody, "description": "Not possible in the job's current status."}}
FORBIDDEN = {403: {"model": ErrorBody, "description": "A viewer token cannot change anything."}}
# Job ids are uuid4 hex; anything with a ':' would name another of the job's keys (mtq:job:<id>:events).
JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class Deleted(BaseModel):
    status: Literal["deleted"] = "deleted"


def _not_found(job_id: str, what: str = "Job not found") -> HTTPException:
    # The seed server's messages: "Job not found: <id>", "Job not found or not cancellable: <id>", ...
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what}: {job_id[:100]}")


def _entry(r: redis.Redis, job_id: str, who: Principal) -> Job | UnreadableJob | None:
    """The job, if it exists and this principal may see it."""
    entry = jobstore.get_job_entry(r, job_id) if JOB_ID.match(job_id) else None
    return entry if entry is not None and who.sees(entry.owner) else None


def _entry_or_404(r: redis.Redis, job_id: str, who: Principal) -> Job | UnreadableJob:
    entry = _entry(r, job_id, who)
    if entry is None:
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


@router.get("", response_model=list[Job | UnreadableJob],
            summary="List jobs, newest first (a trainer token: its own): a plain array, as the seed server",
            responses={200: {"headers": {
                "X-Has-More": {"description": "`true` if more jobs follow this page.", "schema": {"type": "string"}},
                "X-Next-After": {"description": "Pass as `after` to get the next page (only when X-Has-More is true).",
                                 "schema": {"type": "string"}}}}})
def list_jobs(
    r: RedisDep,
    who: PrincipalDep,
    response: Response,
    status_: Annotated[JobStatus | None, Query(alias="status", description="Only jobs in this status.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[str | None, Query(max_length=64, description="X-Next-After of the previous page.")] = None,
) -> list[Job | UnreadableJob]:
    owner = who.name if who.role == "trainer" else None
    try:
        jobs, has_more = jobstore.list_jobs(r, status=status_, limit=limit, after=after, owner=owner)
    except KeyError:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"unknown job id in 'after': {after}") from None
    response.headers["X-Has-More"] = "true" if has_more else "false"
    if has_more:
        response.headers["X-Next-After"] = jobs[-1].job_id
    return jobs


@router.get("/{job_id}", response_model=Job | UnreadableJob, responses=NOT_FOUND, summary="Get one job")
def get_job(job_id: str, r: RedisDep, who: PrincipalDep) -> Job | UnreadableJob:
    return _entry_or_404(r, job_id, who)


@router.delete("/{job_id}", response_model=Deleted,
               responses={404: {"model": ErrorBody, "description": "Unknown (or another trainer's) or running job."}, **FORBIDDEN},
               summary="Delete a queued, finished or unreadable job with everything it stored")
def delete_job(job_id: str, r: RedisDep, who: WriterDep) -> Deleted:
    # lifecycle.delete refuses a running job (and removes a queued one's rq job).
    if _entry(r, job_id, who) is None or not lifecycle.delete(r, job_id):
        raise _not_found(job_id, "Job not found or currently running")
    return Deleted()


@router.post("/{job_id}/cancel", response_model=Job,
             responses={404: {"model": ErrorBody, "description": "Unknown (or another trainer's) or finished job."}, **FORBIDDEN},
             summary="Cancel a queued or running job: answered with the job already cancelled")
def cancel_job(job_id: str, r: RedisDep, who: WriterDep) -> Job:
    # A running job's worker is fenced out at once and stops at its next check.
    entry = _entry(r, job_id, who)
    if not isinstance(entry, Job) or not lifecycle.cancel(r, job_id):
        raise _not_found(job_id, "Job not found or not cancellable")
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


@router.get("/{job_id}/adapter", response_class=Response,
            responses={200: {"content": {"application/gzip": {}},
                             "description": "A .tar.gz of adapters.safetensors + adapter_config.json (mlx_lm's format), "
                             "from the copy in Redis: extract it into a directory and pass that as adapter_path."},
                       404: {"model": ErrorBody, "description": "Unknown job, or it has no stored adapter (not completed, or deleted)."}},
            summary="Download a completed job's adapter")
def download_job_adapter(job_id: str, r: RedisDep, who: PrincipalDep) -> Response:
    job = _job_or_404(r, job_id, who)
    stored = adapters.files(r, job_id)
    if not stored:
        raise _not_found(job_id, "Adapter not found for job")
    return archive_response(stored, job.adapter_name)


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
