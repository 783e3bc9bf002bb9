"""The routes of one job kind, built from its spec model: create, list, get, cancel, delete,
stream, resume and history, with the seed server's shapes and messages:

    POST   {prefix}                   the job (status "queued"); 400 "Invalid request: <where>: <why>"
    GET    {prefix}                   a plain JSON array, newest first; header X-Next-After: the next page's `after`
    GET    {prefix}/{id}              404 "Job not found: <id>"
    POST   {prefix}/{id}/cancel       the job, already "cancelled"; 404 "Job not found or not cancellable: <id>"
    DELETE {prefix}/{id}              {"status": "deleted"} (queued or finished); 404 "Job not found or currently running: <id>"
    GET    {prefix}/{id}/stream       server-sent events (api/sse.py)
    POST   {prefix}/{id}/resume       re-queue a failed or cancelled job, optional {"config": {...}} overrides
    GET    {prefix}/{id}/history      a completed job's per-step metrics

Invalid input of any kind (body, query) is a 400 with a readable string, as the seed's.
Jobs of other kinds are 404 here. Who may do what: api/auth.py (a trainer token sees its own jobs).
"""

import re
from typing import Annotated, Any, Callable

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError, model_validator

from api import sse
from api.deps import ADMIN_ERRORS, PrincipalDep, RedisDep, SettingsDep, WriterDep, get_async_redis, get_settings, require_token
from api.json_body import JSONBodyRoute
from shared import jobstore, lifecycle, train_jobs
from shared.datasets import FileRef, file_meta, load_rows, path_error
from shared.keys import job_key
from shared.model_ids import model_id_error
from shared.schemas import ErrorBody, check_json_values
from shared.train_specs import TrainJob

JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ERRORS = {
    400: {"model": ErrorBody, "description": "Invalid request: a readable reason."},
    403: {"model": ErrorBody, "description": "A viewer token cannot change anything."},
    404: {"model": ErrorBody, "description": "Job not found (or not one of this trainer token's)."},
    409: {"model": ErrorBody, "description": "Not possible in the job's current status."},
    413: {"model": ErrorBody, "description": "Body larger than MTQ_MAX_BODY_BYTES."},
    429: {"model": ErrorBody, "description": "Too many open event streams for this token."},
    **ADMIN_ERRORS,
}


def readable(errors: list[dict]) -> str:
    """pydantic's errors as one line: 'Invalid request: config.beta: Input should be greater than 0'."""
    parts = []
    for e in errors[:3]:
        loc = [str(p) for p in e["loc"] if p not in ("body", "query", "path", "header")]
        msg = e["msg"].encode("utf-8", "backslashreplace").decode()
        parts.append(f"{'.'.join(loc) or 'body'}: {msg}" if loc else msg)
    return "Invalid request: " + "; ".join(parts)


class SeedErrorsRoute(JSONBodyRoute):
    """Invalid input answers 400 with a readable string (the seed's), not FastAPI's 422 list."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def answer_400(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return JSONResponse(status_code=400, content={"detail": readable(e.errors())})

        return answer_400


class ResumeRequest(BaseModel):
    config: dict[str, Any] = Field(default_factory=dict, description="Config fields to change, e.g. {\"learning_rate\": 1e-5}.")

    _json_values = model_validator(mode="before")(check_json_values)


class Deleted(BaseModel):
    status: str = "deleted"


class JobHistory(BaseModel):
    job_id: str
    history: list[dict[str, Any]]


def check_datasets(r, spec, settings) -> None:
    """What the schema cannot see: the model id's allow-list, paths under MTQ_DATA_ROOTS,
    uploaded files that exist and whose rows fit the kind, row counts (400s)."""
    errors = []
    if error := model_id_error(spec.model_id, settings):
        errors.append(error)
    for name in ("dataset", "valid_dataset"):
        ref = getattr(spec, name)
        if isinstance(ref, str) and (error := path_error(ref, settings)):
            errors.append(error)
        elif isinstance(ref, FileRef):
            if file_meta(r, ref.file_id) is None:
                errors.append(f"{name}: file {ref.file_id} not found")
            else:
                try:
                    rows = load_rows(r, ref, settings, spec.row_format, name)
                    if len(rows) > settings.max_prompts:
                        errors.append(f"{name}: {len(rows)} rows; the limit is {settings.max_prompts} (MTQ_MAX_PROMPTS)")
                except ValueError as e:
                    errors.append(str(e))
        elif isinstance(ref, list) and len(ref) > settings.max_prompts:
            errors.append(f"{name}: {len(ref)} rows; the limit is {settings.max_prompts} (MTQ_MAX_PROMPTS)")
    rows = spec.config.batch_size * (2 if spec.row_format == "preference" else 1)  # chosen + rejected
    if rows * spec.config.max_seq_length > settings.max_step_tokens:
        errors.append(f"a micro-batch could hold {rows * spec.config.max_seq_length} tokens (batch_size x "
                      f"{'2 x ' if rows > spec.config.batch_size else ''}max_seq_length); the limit is "
                      f"{settings.max_step_tokens} (MTQ_MAX_STEP_TOKENS)")
    if len(getattr(spec, "preference_pairs", None) or []) > settings.max_prompts:
        errors.append(f"preference_pairs: {len(spec.preference_pairs)} rows; the limit is {settings.max_prompts} (MTQ_MAX_PROMPTS)")
    if errors:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "; ".join(errors))


def job_router(kind: str, prefix: str, tag: str, spec_model: type[BaseModel], what: str) -> APIRouter:
    router = APIRouter(prefix=prefix, tags=[tag], dependencies=[Depends(require_token)], route_class=SeedErrorsRoute,
                       responses={k: ERRORS[k] for k in (400, 401, 413, 503)})

    def visible(r, job_id: str, who) -> TrainJob | None:
        job = train_jobs.get_job(r, job_id, kind) if JOB_ID.match(job_id) else None
        return job if job is not None and who.sees(job.owner) else None

    def found(r, job_id: str, who, message: str = "Job not found") -> TrainJob:
        job = visible(r, job_id, who)
        if job is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"{message}: {job_id[:100]}")
        return job

    @router.post("", response_model=TrainJob, responses={k: ERRORS[k] for k in (403,)}, summary=f"Create {what} (queued)")
    def create_job(spec: spec_model, r: RedisDep, settings: SettingsDep, who: WriterDep) -> TrainJob:  # type: ignore[valid-type]
        check_datasets(r, spec, settings)
        return train_jobs.create_job(r, spec, owner=who.name)

    @router.get("", response_model=list[TrainJob | jobstore.UnreadableJob],
                summary="List jobs, newest first (a trainer token: its own); X-Next-After: the next page")
    def list_jobs(
        response: Response, r: RedisDep, who: PrincipalDep,
        status_: Annotated[jobstore.JobStatus | None, Query(alias="status")] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 100,
        after: Annotated[str | None, Query(max_length=64, description="X-Next-After of the previous page.")] = None,
    ) -> list:
        owner = who.name if who.role == "trainer" else None
        try:
            jobs, more = train_jobs.list_jobs(r, kind, status_, limit, after, owner)
        except KeyError:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, f"unknown job id in 'after': {after}") from None
        if more:
            response.headers["X-Next-After"] = jobs[-1].job_id
        return jobs

    @router.get("/{job_id}", response_model=TrainJob, responses={404: ERRORS[404]}, summary="Get one job")
    def get_job(job_id: str, r: RedisDep, who: PrincipalDep) -> TrainJob:
        return found(r, job_id, who)

    @router.post("/{job_id}/cancel", response_model=TrainJob, responses={k: ERRORS[k] for k in (403, 404)},
                 summary="Cancel a queued or running job (a running one stops at its next step)")
    def cancel_job(job_id: str, r: RedisDep, who: WriterDep) -> TrainJob:
        if visible(r, job_id, who) is None or not lifecycle.cancel(r, job_id):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"Job not found or not cancellable: {job_id[:100]}")
        return found(r, job_id, who)

    @router.delete("/{job_id}", response_model=Deleted, responses={k: ERRORS[k] for k in (403, 404)},
                   summary="Delete a queued or finished job (its record, events, checkpoint)")
    def delete_job(job_id: str, r: RedisDep, who: WriterDep) -> Deleted:
        if visible(r, job_id, who) is None or not lifecycle.delete(r, job_id):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"Job not found or currently running: {job_id[:100]}")
        return Deleted()

    @router.post("/{job_id}/resume", response_model=TrainJob, responses={k: ERRORS[k] for k in (403, 404, 409)},
                 summary="Re-queue a failed or cancelled job; it continues from its last checkpoint")
    def resume_job(job_id: str, r: RedisDep, who: WriterDep, body: ResumeRequest | None = None) -> TrainJob:
        job = found(r, job_id, who)
        if job.status not in lifecycle.RESUMABLE:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {job.status}; only failed or cancelled jobs resume")
        try:
            resumed = train_jobs.resume_job(r, job_id, jobstore.get_spec(r, job_id), (body or ResumeRequest()).config)
        except ValidationError as e:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, readable([{**err, "loc": ("config", *err["loc"])} for err in e.errors()])) from None
        except ValueError as e:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, f"Invalid request: config: {e}") from None
        if not resumed:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {jobstore.get_status(r, job_id)}")
        return found(r, job_id, who)

    @router.get("/{job_id}/history", response_model=JobHistory, responses={404: ERRORS[404]},
                summary="A completed job's per-step metrics")
    def job_history(job_id: str, r: RedisDep, who: PrincipalDep) -> JobHistory:
        found(r, job_id, who)
        return JobHistory(job_id=job_id, history=jobstore.get_history(r, job_id))

    @router.get("/{job_id}/stream", response_class=StreamingResponse, responses={
        200: {"content": {"text/event-stream": {}}, "description": "`data: <event JSON>` per event; ends after the terminal event."},
        404: ERRORS[404], 429: ERRORS[429]}, summary="Follow a job's progress as server-sent events")
    async def stream_job(job_id: str, who: PrincipalDep,
                         last_event_id: Annotated[str | None, Header()] = None) -> sse.CountedStream:
        r, settings = get_async_redis(), get_settings()
        job_kind = await r.hget(job_key(job_id), "kind") if JOB_ID.match(job_id) else None
        job_status, owner = await sse.status_and_owner(r, job_id) if job_kind == kind.encode() else (None, None)
        if job_status is None or not who.sees(owner):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"Job not found: {job_id[:100]}")
        if last_event_id is not None and not sse.valid_stream_id(last_event_id):
            raise HTTPException(status.HTTP_400_BAD_REQUEST, f"malformed Last-Event-ID: {last_event_id[:50]!r}")
        if sse.open_streams[who.name] >= settings.max_streams_per_token:
            raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS,
                                f"token {who.name!r} has {settings.max_streams_per_token} event streams open (MTQ_MAX_STREAMS_PER_TOKEN)")
        return sse.CountedStream(sse.job_events(r, job_id, after=last_event_id or "0-0"), who.name)

    return router
