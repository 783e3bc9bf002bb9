"""OpenAI's fine-tuning jobs under /v1 (the official SDK's `client.fine_tuning.jobs`):

    POST /v1/fine_tuning/jobs                      create (supervised, dpo, reinforcement) -> FineTuningJob
    GET  /v1/fine_tuning/jobs                      ?after=&limit=&metadata[k]=v, newest first
    GET  /v1/fine_tuning/jobs/{id}                 FineTuningJob
    POST /v1/fine_tuning/jobs/{id}/cancel          cancelled (a paused job too)
    POST /v1/fine_tuning/jobs/{id}/pause           paused: cancelled, marked so; its checkpoint kept
    POST /v1/fine_tuning/jobs/{id}/resume          a paused job, queued again: it continues from its checkpoint
    GET  /v1/fine_tuning/jobs/{id}/events          newest first, ?after=<event id>&limit=
    GET  /v1/fine_tuning/jobs/{id}/checkpoints     newest first, ?after=<checkpoint id>&limit=

A job here is an SFT, DPO or GRPO job of this project (api/openai_compat/jobs.py maps it): created
through its kind's spec model, its family's checks (api/submission.py) and jobstore.create_job,
run by the same workers, and visible on the kinds' own routes too. Same tokens and roles as
every route (api/deps.py); errors in OpenAI's envelope (api/openai_errors.py).
"""

import json
import re
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from pydantic import ValidationError

from api.auth import Principal
from api.deps import PrincipalDep, RedisDep, SettingsDep, WriterDep, require_token
from api.openai_compat import jobs as openai_jobs
from api.openai_compat.jobs import CheckpointPage, FineTuningJob, JobCreateRequest, Page
from api.openai_errors import ERRORS, OpenAIError, OpenAIRoute
from api.routes.job_routes import FAMILIES
from shared import graders, jobstore, lifecycle
from shared.events import append_event
from shared.keys import JOBS_INDEX, job_key
from shared.kinds import KINDS, of_record
from shared.model_ids import OPENAI_JOB_PREFIX, job_id_of

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["OpenAI: fine-tuning jobs"],
                   dependencies=[Depends(require_token)], route_class=OpenAIRoute, responses=ERRORS)

LimitQuery = Annotated[int, Query(ge=1, le=1000)]
AfterQuery = Annotated[str | None, Query(max_length=128)]


def _found(r, openai_id: str, who: Principal) -> tuple[str, dict, dict]:
    job_id = job_id_of(openai_id)
    found = None if job_id is None else openai_jobs.openai_record(r, job_id)
    if found is None or not who.sees(found[0].get("owner")):
        raise OpenAIError(404, f"No such fine-tuning job: {openai_id[:100]}", "fine_tuning_job_id")
    return job_id, *found


def _job(job_id: str, rec: dict, ft: dict) -> FineTuningJob:
    try:
        return openai_jobs.to_job(job_id, rec, ft)
    except (ValueError, KeyError) as e:  # a record this version cannot read (another version's)
        raise OpenAIError(409, f"job {OPENAI_JOB_PREFIX}{job_id}: stored record cannot be loaded: {type(e).__name__}",
                          "fine_tuning_job_id") from None


def _answer(r, job_id: str) -> FineTuningJob:
    rec, ft = openai_jobs.openai_record(r, job_id)  # type: ignore[misc]
    return _job(job_id, rec, ft)


@router.post("", response_model=FineTuningJob, summary="Create a fine-tuning job (supervised, dpo or reinforcement)")
def create(body: JobCreateRequest, r: RedisDep, settings: SettingsDep, who: WriterDep) -> FineTuningJob:
    method = body.resolved_method()
    grader = method.reinforcement.grader if method.reinforcement is not None else None
    if grader is not None and graders.uses_python(grader) and not settings.python_graders:
        raise OpenAIError(400, "python graders are off on this server (the operator sets MTQ_PYTHON_GRADERS=1)",
                          "method.reinforcement.grader")
    try:
        created = openai_jobs.build(r, body, who)
    except openai_jobs.ParamError as e:
        raise OpenAIError(400, str(e), e.param) from None
    except ValidationError as e:  # the kind's spec refuses a value (the model's name, a row)
        first = e.errors()[0]
        raise OpenAIError(400, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}",
                          "model" if first["loc"][:1] == ("model_id",) else "training_file") from None
    check = FAMILIES[KINDS[created.spec.kind].family]
    check(r, created.spec, settings, who, ("body", "training_file"))
    try:
        job = jobstore.create_job(r, created.spec, owner=who.name, tenant=who.tenant, openai=json.dumps(created.record))
    except jobstore.AdapterNameTaken as e:
        raise OpenAIError(409, str(e), "suffix") from None
    if job.waiting_for_worker:  # e.g. an OpenAI model name that no worker has: it waits, as any job does
        append_event(r, job.job_id, {"type": "waiting", "waiting_for_worker": job.waiting_for_worker})
    return _answer(r, job.job_id)


@router.get("", response_model=Page, summary="List fine-tuning jobs, newest first (a trainer token: its own)")
def list_jobs(request: Request, r: RedisDep, who: PrincipalDep, after: AfterQuery = None,
              limit: LimitQuery = 20) -> Page:
    wanted = {k[len("metadata["):-1]: v for k, v in request.query_params.items()
              if k.startswith("metadata[") and k.endswith("]")}
    ids = [i.decode() for i in r.zrevrange(JOBS_INDEX, 0, -1)]
    if after is not None:
        start = job_id_of(after)
        if start not in ids:
            raise OpenAIError(400, f"unknown fine-tuning job id in 'after': {after[:100]}", "after")
        ids = ids[ids.index(start) + 1:]
    data: list[FineTuningJob] = []
    for start in range(0, len(ids), 200):  # the small fields first: a record's spec may be megabytes
        chunk = ids[start:start + 200]
        with r.pipeline() as p:
            for job_id in chunk:
                p.hmget(job_key(job_id), "owner", "openai")
            heads = p.execute()
        for job_id, (owner, ft) in zip(chunk, heads):
            if ft is None or not who.sees(owner and owner.decode()):
                continue
            metadata = json.loads(ft).get("metadata") or {}
            if any(metadata.get(k) != v for k, v in wanted.items()):
                continue
            if len(data) == limit:
                return Page(data=data, has_more=True)
            found = openai_jobs.openai_record(r, job_id)
            try:
                if found is not None:  # not deleted meanwhile
                    data.append(openai_jobs.to_job(job_id, *found))
            except (ValueError, KeyError):  # a record this version cannot read: one must not break the list
                continue
    return Page(data=data, has_more=False)


@router.get("/{job_id}", response_model=FineTuningJob, summary="Get a fine-tuning job")
def retrieve(job_id: str, r: RedisDep, who: PrincipalDep) -> FineTuningJob:
    return _job(*_found(r, job_id, who))


def _conflict(openai_id: str, rec: dict, what: str) -> OpenAIError:
    return OpenAIError(409, f"Job {openai_id[:100]} is {openai_jobs.status_of(rec)}: it cannot be {what}",
                       "fine_tuning_job_id")


@router.post("/{job_id}/cancel", response_model=FineTuningJob, summary="Cancel a queued, running or paused job")
def cancel(job_id: str, r: RedisDep, who: WriterDep) -> FineTuningJob:
    own_id, rec, _ = _found(r, job_id, who)
    if openai_jobs.status_of(rec) == "paused":
        r.hdel(job_key(own_id), "paused")  # already cancelled by its pause: no longer resumable from here
    elif not lifecycle.cancel(r, own_id):
        raise _conflict(job_id, rec, "cancelled")
    return _answer(r, own_id)


@router.post("/{job_id}/pause", response_model=FineTuningJob, summary="Pause a queued or running job")
def pause(job_id: str, r: RedisDep, who: WriterDep) -> FineTuningJob:
    own_id, rec, _ = _found(r, job_id, who)
    if not lifecycle.cancel(r, own_id, paused=True):
        raise _conflict(job_id, rec, "paused")
    return _answer(r, own_id)


@router.post("/{job_id}/resume", response_model=FineTuningJob, summary="Resume a paused job from its checkpoint")
def resume(job_id: str, r: RedisDep, who: WriterDep) -> FineTuningJob:
    own_id, rec, _ = _found(r, job_id, who)
    if openai_jobs.status_of(rec) != "paused" or not jobstore.resume_job(r, own_id, jobstore.get_spec(r, own_id), {}):
        raise _conflict(job_id, rec, "resumed (only paused jobs resume)")
    return _answer(r, own_id)


@router.get("/{job_id}/events", response_model=Page, summary="A job's events, newest first")
def events(job_id: str, r: RedisDep, who: PrincipalDep, after: AfterQuery = None, limit: LimitQuery = 20) -> Page:
    own_id, rec, _ = _found(r, job_id, who)
    if after is not None and not re.fullmatch(r"ftevent-\d{1,20}-\d{1,20}", after):
        raise OpenAIError(400, f"'after' is not an event id: {after[:100]}", "after")
    kind = of_record(rec.get("kind"))
    return openai_jobs.events(r, own_id, after, limit, kind.step_event, kind.first_step)


@router.get("/{job_id}/checkpoints", response_model=CheckpointPage, summary="A job's checkpoints, newest first")
def checkpoints(job_id: str, r: RedisDep, who: PrincipalDep, after: AfterQuery = None,
                limit: LimitQuery = 10) -> CheckpointPage:
    own_id, rec, ft = _found(r, job_id, who)
    kind = of_record(rec.get("kind"))
    return openai_jobs.checkpoints(r, own_id, rec, ft, kind.step_event, kind.first_step, after, limit)
