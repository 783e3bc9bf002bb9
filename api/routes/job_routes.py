"""The routes of every job kind (shared/kinds.py), one router per kind: create, list, get,
cancel, delete, stream, resume, history and the job's adapter, with the seed server's shapes
and messages:

    POST   {prefix}                   the job (status "queued"); 400 with a readable `detail`
    GET    {prefix}                   a plain JSON array, newest first; headers X-Has-More, X-Next-After (the next page's `after`);
                                      ?view=summary: without prompts and datasets
    GET    {prefix}/{id}              404 "Job not found: <id>"
    POST   {prefix}/{id}/cancel       the job, already "cancelled"; 404 "Job not found or not cancellable: <id>"
    DELETE {prefix}/{id}              {"status": "deleted"} (queued or finished); 404 "Job not found or currently running: <id>"
    GET    {prefix}/{id}/stream       server-sent events (api/sse.py)
    POST   {prefix}/{id}/resume       re-queue a failed or cancelled job, optional {"config": {...}} overrides
    GET    {prefix}/{id}/history      a completed job's per-step metrics
    GET    {prefix}/{id}/adapter      a completed job's adapter (or full model) as .tar.gz
    GET    {prefix}/{id}/trackers     its experiment trackers' states (docs/trackers.md)
    GET    {prefix}/{id}/tensorboard  its TensorBoard event files as .tar.gz

Jobs of other kinds are 404 here, except that the DPO routes read ORPO jobs too (as the seed
server's do: shared/kinds.py route_kinds). Jobs of any kind, read-only, by their id alone (how
the client commands and the web page find a job's kind, and so its routes):

    GET    /admin/api/jobs            every kind's jobs, newest first, paged as above
    GET    /admin/api/jobs/{id}       the job (its `kind` says which); 404 "Job not found: <id>"
    GET    /admin/api/kinds           the kinds (shared/kinds.py): routes, step events, curves

Routes are plain `def`s (redis-py is blocking; FastAPI runs
them in a thread pool), except the event stream: an `async def` on redis.asyncio, so that open
streams hold no threads. Who may do what (api/auth.py): a viewer's token only reads (403 on
changes); a trainer's token sees only the jobs it created (others' are 404).
"""

from typing import Annotated, Any, Callable, Literal, Union

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError, model_validator

from api import sse
from api.auth import Principal
from api.deps import (ADMIN_ERRORS, PrincipalDep, RedisDep, SettingsDep, WriterDep, get_async_redis, get_settings,
                      get_stream_redis, require_token)
from api.json_body import JSONBodyRoute
from api.routes.adapters import archive_response
from api.submission import check_datasets, check_export, check_spec, prepared, refuse_resume
from shared import adapters, jobstore, lifecycle, trackers
from shared.keys import JOB_ID, job_key
from shared.kinds import KINDS, Kind
from shared.schemas import Deleted, ErrorBody, JobStatus, JobSummary, UnreadableJob, check_json_values

ERRORS = {
    400: {"model": ErrorBody, "description": "Invalid request: malformed or over-deep JSON, or a field that is "
          "missing or wrong (`detail` says which, in words)."},
    403: {"model": ErrorBody, "description": "A viewer token cannot change anything."},
    404: {"model": ErrorBody, "description": "No job of this kind with this id (or not one of this trainer token's)."},
    409: {"model": ErrorBody, "description": "Not possible in the job's current status (or its stored record cannot be "
          "loaded); on create: another owner's job uses the adapter name."},
    413: {"model": ErrorBody, "description": "Body larger than MTQ_MAX_BODY_BYTES."},
    429: {"model": ErrorBody, "description": "This token has MTQ_MAX_STREAMS_PER_TOKEN streams open already."},
    **ADMIN_ERRORS,
}


# How a family's routes (shared/kinds.py) check a spec beyond its schema. Invalid input is the
# app's 400 with the seed server's messages (api/main.py `readable`).
FAMILIES: dict[str, Callable[..., None]] = {"grpo": check_spec, "supervised": check_datasets, "session": refuse_resume,
                                            "export": check_export}


class ResumeRequest(BaseModel):
    config: dict[str, Any] = Field(default_factory=dict, description="Config fields to change, e.g. {\"learning_rate\": 1e-5}.")

    _json_values = model_validator(mode="before")(check_json_values)


class ChartInfo(BaseModel):
    title: str
    metrics: list[str] = Field(description="Metric names; one with `*` stands for every metric it matches.")


class KindInfo(BaseModel):
    name: str = Field(description="The jobs' `kind`.")
    prefix: str = Field(description="Its routes: POST to create, GET {prefix}/{id}/stream, .../cancel, ...")
    step_event: str = Field(description="The `type` of its per-step events.")
    first_step: int = Field(description="The `iter` of its first step event (0: the step's index; 1: completed steps).")
    headline: str = Field(description="The metric a job list shows.")
    charts: list[ChartInfo] = Field(description="Its curves against step, from its step events and `eval` events.")


StatusQuery = Annotated[JobStatus | None, Query(alias="status", description="Only jobs in this status.")]
LimitQuery = Annotated[int, Query(ge=1, le=1000)]
AfterQuery = Annotated[str | None, Query(max_length=64, description="X-Next-After of the previous page.")]
ViewQuery = Annotated[Literal["full", "summary"], Query(description="summary: each job without its prompts, datasets "
                                                        "and reward sources (the web page's and `mtq jobs`' form).")]
PAGED = {200: {"headers": {
    "X-Has-More": {"description": "`true` if more jobs follow this page.", "schema": {"type": "string"}},
    "X-Next-After": {"description": "Pass as `after` to get the next page (only when X-Has-More is true).",
                     "schema": {"type": "string"}}}}}


def only(*codes: int) -> dict:
    return {code: ERRORS[code] for code in codes}


def visible(r, job_id: str, who: Principal, kind: Kind | None = None):
    """The job (or its unreadable record), if `kind`'s routes read it (None: any kind) and this principal may see it."""
    h = r.hgetall(job_key(job_id)) if JOB_ID.fullmatch(job_id) else {}
    if not h or (kind is not None and jobstore.of_kind(h.get(b"kind")) not in kind.route_kinds):
        return None
    found = jobstore.job_or_unreadable(job_id, h)
    return found if who.sees(found.owner) else None


def not_found(job_id: str, what: str = "Job not found") -> HTTPException:
    # The seed server's messages: "Job not found: <id>", "Job not found or not cancellable: <id>", ...
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what}: {job_id[:100]}")


def page(r, who: Principal, response: Response, status_: JobStatus | None, limit: int, after: str | None,
         kind: Kind | None, view: str) -> list:
    """A page of jobs, newest first (a trainer: its own), of `kind` (None: every kind), with the paging headers.
    A full page also ends where its jobs' specs reach MTQ_MAX_LIST_BYTES (X-Has-More says so)."""
    try:
        jobs, has_more = jobstore.list_jobs(r, status=status_, limit=limit, after=after, owner=who.tenant, kind=kind,
                                            summary=view == "summary", max_bytes=get_settings().max_list_bytes)
    except KeyError:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"unknown job id in 'after': {after}") from None
    response.headers["X-Has-More"] = "true" if has_more else "false"
    if has_more:
        response.headers["X-Next-After"] = jobs[-1].job_id
    return jobs


class JobHistory(BaseModel):
    job_id: str
    history: list[dict[str, Any]] = Field(description="One entry per step (the last 1000), each step once, "
                                          "also across resumes: {step, loss, ...}.")


class TrackerState(BaseModel):
    status: Literal["running", "finished", "failed", "killed"] = Field(description="running: following the job's "
        "events; finished: all logged, its run closed; failed: `error` says why; killed: still running "
        "MTQ_TRACKER_GRACE_S after the job's run ended.")
    step: int | None = Field(None, description="The last global step it logged.")
    error: str | None = None
    run_id: str | None = Field(None, description="MLflow's run id.")


def job_router(k: Kind) -> APIRouter:
    check = FAMILIES[k.family]
    router = APIRouter(prefix=k.prefix, tags=[k.tag], dependencies=[Depends(require_token)], route_class=JSONBodyRoute,
                       responses={code: ERRORS[code] for code in (400, 401, 413, 503)})

    def entry(r, job_id: str, who: Principal):
        return visible(r, job_id, who, k)

    def entry_or_404(r, job_id: str, who: Principal):
        found = entry(r, job_id, who)
        if found is None:
            raise not_found(job_id)
        return found

    def job_or_404(r, job_id: str, who: Principal):
        """A job this principal may see, readable (409 for a stored record that cannot be loaded)."""
        found = entry_or_404(r, job_id, who)
        if isinstance(found, UnreadableJob):
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id}: {found.error}; it can only be deleted")
        return found

    if k.family != "session":  # the Tinker API makes sessions' jobs (docs/sessions.md)
        @router.post("", response_model=k.job_model, responses=only(403, 409), summary=f"Create {k.what} (queued)")
        def create_job(spec: k.spec_model, request: Request, r: RedisDep, settings: SettingsDep,  # type: ignore[valid-type]
                       who: WriterDep):
            spec = prepared(r, spec, who, request)
            check(r, spec, settings, who, ("body",))
            try:
                return jobstore.create_job(r, spec, owner=who.name, tenant=who.tenant)
            except jobstore.AdapterNameTaken as e:
                raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from None

    @router.get("", response_model=list[k.job_model | JobSummary | UnreadableJob],  # type: ignore[name-defined]
                summary="List jobs, newest first (a trainer token: its own): a plain array, as the seed server",
                responses=PAGED)
    def list_jobs(r: RedisDep, who: PrincipalDep, response: Response, status_: StatusQuery = None,
                  limit: LimitQuery = 100, after: AfterQuery = None, view: ViewQuery = "full") -> list:
        return page(r, who, response, status_, limit, after, k, view)

    @router.get("/{job_id}", response_model=k.job_model | UnreadableJob, responses=only(404), summary="Get one job")
    def get_job(job_id: str, r: RedisDep, who: PrincipalDep):
        return entry_or_404(r, job_id, who)

    @router.delete("/{job_id}", response_model=Deleted, responses=only(403, 404),
                   summary="Delete a queued, finished or unreadable job with everything it stored")
    def delete_job(job_id: str, r: RedisDep, who: WriterDep) -> Deleted:
        # lifecycle.delete refuses a running job (and removes a queued one's rq job).
        if entry(r, job_id, who) is None or not lifecycle.delete(r, job_id):
            raise not_found(job_id, "Job not found or currently running")
        return Deleted()

    @router.post("/{job_id}/cancel", response_model=k.job_model, responses=only(403, 404),
                 summary="Cancel a queued or running job: answered with the job already cancelled")
    def cancel_job(job_id: str, r: RedisDep, who: WriterDep):
        # A running job's worker is fenced out at once and stops at its next check.
        found = entry(r, job_id, who)
        if found is None or isinstance(found, UnreadableJob) or not lifecycle.cancel(r, job_id):
            raise not_found(job_id, "Job not found or not cancellable")
        return job_or_404(r, job_id, who)

    @router.post("/{job_id}/resume", response_model=k.job_model, responses=only(403, 404, 409),
                 summary="Re-queue a failed or cancelled job; it continues from its last checkpoint")
    def resume_job(job_id: str, r: RedisDep, settings: SettingsDep, who: WriterDep, body: ResumeRequest | None = None):
        job = job_or_404(r, job_id, who)
        if job.status not in lifecycle.RESUMABLE:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {job.status}; only failed or cancelled jobs resume")
        overrides = (body or ResumeRequest()).config
        spec = jobstore.get_spec(r, job_id)
        try:
            check(r, jobstore.with_config_overrides(spec, overrides), settings, who, ("body", "config"))
            resumed = jobstore.resume_job(r, job_id, spec, overrides)
        except ValidationError as e:
            raise RequestValidationError([{**err, "loc": ("body", "config", *err["loc"])} for err in e.errors()]) from None
        except ValueError as e:  # a change that does not fit the checkpoint
            raise RequestValidationError([{"loc": ("body", "config"), "msg": str(e), "type": "value_error"}]) from None
        if not resumed:  # its status changed between our read and the request
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {jobstore.get_status(r, job_id)}")
        return job_or_404(r, job_id, who)

    @router.get("/{job_id}/history", response_model=JobHistory, responses=only(404, 409),
                summary="A completed job's per-step metrics")
    def job_history(job_id: str, r: RedisDep, who: PrincipalDep) -> JobHistory:
        job_or_404(r, job_id, who)
        return JobHistory(job_id=job_id, history=jobstore.get_history(r, job_id))

    @router.get("/{job_id}/adapter", response_class=Response,
                responses={200: {"content": {"application/gzip": {}},
                                 "description": "A .tar.gz of the job's files from their copy in Redis: an adapter "
                                 "(adapters.safetensors + adapter_config.json, mlx_lm's format: extract it into a directory "
                                 "and pass that as adapter_path), or a full fine-tune's model directory."},
                           404: {"model": ErrorBody, "description": "Unknown job, or it has no stored adapter (not completed, or deleted)."},
                           409: ERRORS[409]},
                summary="Download a completed job's adapter")
    def download_job_adapter(job_id: str, r: RedisDep, who: PrincipalDep) -> Response:
        job = job_or_404(r, job_id, who)
        stored = adapters.files(r, job_id)
        if not stored:
            raise not_found(job_id, "Adapter not found for job")
        return archive_response(stored, job.adapter_name)

    @router.get("/{job_id}/trackers", response_model=dict[str, TrackerState], responses=only(404),
                summary="Its experiment trackers' states, by tracker (those it reports to that have started)")
    def job_trackers(job_id: str, r: RedisDep, who: PrincipalDep) -> dict[str, TrackerState]:
        entry_or_404(r, job_id, who)
        return {name: TrackerState.model_validate(value) for name, value in trackers.state(r, job_id).items()}

    @router.get("/{job_id}/tensorboard", response_class=Response,
                responses={200: {"content": {"application/gzip": {}},
                                 "description": "A .tar.gz of its event files: extract it into a directory and run "
                                 "`tensorboard --logdir` on it."},
                           404: {"model": ErrorBody, "description": "Unknown job, or no event files (yet)."}},
                summary="Download the TensorBoard event files of a job that reports to tensorboard")
    def download_tensorboard(job_id: str, r: RedisDep, who: PrincipalDep) -> Response:
        entry_or_404(r, job_id, who)
        stored = trackers.tensorboard_files(r, job_id)
        if not stored:
            raise not_found(job_id, "No TensorBoard event files for job")
        return archive_response(stored, f"{job_id}-tensorboard")

    @router.get("/{job_id}/stream", response_class=StreamingResponse, responses={
        200: {"content": {"text/event-stream": {}}, "description": "`id: <stream id>` + `data: <event JSON>` per event; "
              "ends after the terminal event (`done`, `failed` or `cancelled`)."},
        400: {"model": ErrorBody, "description": "Malformed Last-Event-ID."}, **only(404, 429)},
        summary="Follow a job's progress as server-sent events")
    async def stream_job(job_id: str, who: PrincipalDep,
                         last_event_id: Annotated[str | None, Header(description="Resume after this event id.")] = None,
                         ) -> sse.CountedStream:
        # Everything here runs on the event loop (no sync dependency: those take a pool thread).
        r, settings = get_async_redis(), get_settings()
        job_status, owner = None, None
        if JOB_ID.fullmatch(job_id) and jobstore.of_kind(await r.hget(job_key(job_id), "kind")) in k.route_kinds:
            job_status, owner = await sse.status_and_owner(r, job_id)
        if job_status is None or not who.sees(owner):  # before the stream starts: afterwards no 404 can be sent
            raise not_found(job_id)
        if last_event_id is not None and not sse.valid_stream_id(last_event_id):
            raise HTTPException(status.HTTP_400_BAD_REQUEST, f"malformed Last-Event-ID: {last_event_id[:50]!r}")
        if sse.open_streams[who.name] >= settings.max_streams_per_token:
            raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS,
                                f"token {who.name!r} has {settings.max_streams_per_token} event streams open (MTQ_MAX_STREAMS_PER_TOKEN)")
        events = sse.job_events(get_stream_redis(), job_id, after=last_event_id or "0-0", keepalive_s=settings.sse_keepalive_s)
        return sse.CountedStream(events, who.name)

    return router


def any_kind_router() -> APIRouter:
    """Jobs of every kind, read-only (the module's docstring)."""
    router = APIRouter(prefix="/admin/api", tags=["Jobs of every kind"], dependencies=[Depends(require_token)],
                       responses={code: ERRORS[code] for code in (400, 401, 503)})
    any_job = Union[tuple(dict.fromkeys(k.job_model for k in KINDS.values())) + (UnreadableJob,)]  # type: ignore[valid-type]

    @router.get("/jobs", response_model=list[any_job | JobSummary], responses=PAGED,  # type: ignore[valid-type]
                summary="List jobs of every kind, newest first (a trainer token: its own)")
    def list_jobs(r: RedisDep, who: PrincipalDep, response: Response, status_: StatusQuery = None,
                  limit: LimitQuery = 100, after: AfterQuery = None, view: ViewQuery = "full") -> list:
        return page(r, who, response, status_, limit, after, None, view)

    @router.get("/jobs/{job_id}", response_model=any_job,
                responses={404: {"model": ErrorBody, "description": "No job with this id (or not one of this trainer token's)."}},
                summary="Get a job of any kind; its `kind` names its routes (GET /admin/api/kinds)")
    def get_job(job_id: str, r: RedisDep, who: PrincipalDep):
        found = visible(r, job_id, who)
        if found is None:
            raise not_found(job_id)
        return found

    @router.get("/kinds", response_model=list[KindInfo], summary="The job kinds: their routes, step events and curves")
    def list_kinds() -> list[KindInfo]:
        return [KindInfo(name=k.name, prefix=k.prefix, step_event=k.step_event, first_step=k.first_step,
                         headline=k.headline, charts=[ChartInfo(title=c.title, metrics=list(c.metrics)) for c in k.charts])
                for k in KINDS.values()]

    return router


ROUTERS = [any_kind_router(), *(job_router(kind) for kind in KINDS.values())]
