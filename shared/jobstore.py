"""Job records in Redis, of every kind: creating, reading, listing and resuming them.

A job is a hash (shared.keys.job_key) plus an event stream (shared.keys.events_key). Every
status change goes through shared/lifecycle.py; this module reads records and turns API
requests into lifecycle calls. What differs by kind (its spec and job models, the config
fields a resume cannot change) is the kind's entry in shared/kinds.py.
"""

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import AliasChoices, BaseModel

from shared import adapters, kinds, lifecycle, routing
from shared.adapters import adapter_dir
from shared.keys import JOBS_INDEX, job_key
from shared.schemas import JobStatus, JobSummary, UnreadableJob
from shared.settings import load_settings


class AdapterNameTaken(ValueError):
    """Another owner's job uses the adapter name (of that model): the API answers 409."""


def connect(url: str, socket_timeout: float = 30.0) -> redis.Redis:
    # Bytes in and out: rq needs a connection without decode_responses.
    return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=min(5.0, socket_timeout),
                                health_check_interval=30)


def max_attempts(config) -> int:
    return min(config.max_attempts, load_settings().max_attempts_cap)


def create_job(r: redis.Redis, spec, owner: str | None = None, tenant: str | None = None, **fields: str) -> BaseModel:
    """Store a new job of the spec's kind as queued and put it on its rq queue (one atomic
    step); the job as created (a worker may have started it already: that is the next GET's
    news). owner: the name of the token that created it (api/auth.py); tenant: set for a
    trainer's job, which may use only that tenant's adapters and files (the worker checks).
    AdapterNameTaken if another owner's job uses its adapter name. fields: more record fields
    (the OpenAI API's, api/openai_compat/jobs.py)."""
    kind = kinds.KINDS[spec.kind]
    job_id = uuid.uuid4().hex
    spec = spec.model_copy(update={"adapter_name": spec.adapter_name or f"{kind.name}-{job_id[:8]}"})
    if not adapters.claim_name(r, spec.model_id, spec.adapter_name, job_id, owner):
        raise AdapterNameTaken(f"adapter_name {spec.adapter_name!r} of model {spec.model_id!r} is used by another "
                               "owner's job; choose another name")
    # As the seed server: the adapter's path is known from the start; progress is the kind's until a step.
    path = adapter_dir(load_settings(), spec.model_id, spec.adapter_name)
    who = {k: v for k, v in (("owner", owner), ("tenant", tenant)) if v}
    record = lifecycle.create(r, job_id, kind.name, spec, progress=json.dumps(kind.initial_progress), adapter_path=str(path),
                              adapter_ref=adapters.adapter_ref(spec.model_id, spec.adapter_name),
                              max_attempts=max_attempts(spec.config), **who, **fields)
    return job_from_record(job_id, spec, record)


@dataclass(frozen=True)
class StoredJob:
    """A job as its training process runs it."""

    kind: kinds.Kind
    spec: BaseModel  # its kind's spec model
    tenant: str | None  # a trainer's job uses only that trainer's adapters and files (None: anyone's)


def load_job(r: redis.Redis, job_id: str) -> StoredJob | None:
    """The job's kind, spec and tenant, the spec decoded once, here; None if there is no such
    job. ValueError if this version cannot read its spec."""
    kind, raw, tenant = r.hmget(job_key(job_id), "kind", "spec", "tenant")
    if raw is None:
        return None
    spec = lifecycle.read_spec({"kind": kind and kind.decode(), "spec": raw})
    return StoredJob(kinds.of_record(kind), spec, None if tenant is None else tenant.decode())


def get_spec(r: redis.Redis, job_id: str):
    """The job's spec, as its kind's model; None if there is no such job."""
    job = load_job(r, job_id)
    return None if job is None else job.spec


def load_summary(r: redis.Redis, job_id: str) -> tuple[kinds.Kind, dict[str, Any]] | None:
    """What a worker's supervisor reads of a job: its kind and its summary (model,
    config and the step the memory estimate reads: shared/routing.py spec_summary), never its
    spec, except for a record written before summaries held the step. None if there is no
    such job; ValueError if this version cannot read it."""
    kind, summary = r.hmget(job_key(job_id), "kind", "summary")
    rec = {"kind": None if kind is None else kind.decode(), "summary": None if summary is None else summary.decode()}
    current = lifecycle.current_summary(rec)
    if current is not None:
        return kinds.of_record(kind), current
    job = load_job(r, job_id)
    return None if job is None else (job.kind, routing.spec_summary(job.spec))


def job_from_record(job_id: str, spec, rec: dict[str, str]) -> BaseModel:
    """The job object (its kind's job model): the spec and the record's lifecycle fields."""
    spec_fields = {name: getattr(spec, name) for name in type(spec).model_fields
                   if name not in ("config", "adapter_name", "model_id")}
    return kinds.of_record(rec.get("kind")).job_model(
        **_record_fields(job_id, rec, spec.model_id, spec.adapter_name or ""), **spec_fields,
        config=spec.config.model_dump())


def summary_from_hash(job_id: str, h: dict[bytes, bytes]) -> JobSummary:
    """The job's summary: its record's fields, model, adapter name and config, without its
    prompts or datasets (from the record's `summary`; a record written before there was one:
    its spec)."""
    rec = {k.decode(): v.decode() for k, v in h.items() if k != b"history"}
    summary = json.loads(rec["summary"]) if rec.get("summary") else routing.spec_summary(lifecycle.read_spec(rec))
    return JobSummary(**_record_fields(job_id, rec, summary["model_id"], summary["adapter_name"] or ""),
                      config=summary["config"])


def _record_fields(job_id: str, rec: dict[str, str], model_id: str, adapter_name: str) -> dict[str, Any]:
    """Every kind's job object's fields that are not its spec's (shared/schemas.py JobRecord)."""
    kind = kinds.of_record(rec.get("kind"))

    def num(name: str, cast=float, default=None):
        return cast(rec[name]) if rec.get(name) else default

    phase, phase_note, phase_s = _phase(rec)
    return dict(
        job_id=job_id, kind=kind.name, model_id=model_id, adapter_name=adapter_name,
        adapter_path=rec.get("adapter_path") or str(adapter_dir(load_settings(), model_id, adapter_name)),
        status=rec["status"], created_at=float(rec["created_at"]), started_at=num("started_at", default=kind.unset_time),
        finished_at=num("finished_at", default=kind.unset_time), error=rec.get("error") or "",
        progress=json.loads(rec.get("progress") or "null") or kind.initial_progress, phase=phase, phase_note=phase_note,
        phase_s=phase_s, memory_plan=json.loads(rec["memory_plan"]) if rec.get("memory_plan") else None,
        waiting_for_worker=rec.get("waiting_for_worker"), worker=rec.get("worker"),
        checkpoint_step=num("checkpoint_step", int), attempts=num("attempts", int, 0),
        failed_attempts=num("failed_attempts", int, 0), max_attempts=num("max_attempts", int, 3),
        resumed_from=num("resumed_from", int), owner=rec.get("owner"),
    )


def job_from_hash(job_id: str, h: dict[bytes, bytes]) -> BaseModel:
    """The job object of a record as Redis returns it. ValueError / KeyError for a record this
    version cannot read (another version's, say)."""
    rec = {k.decode(): v.decode() for k, v in h.items() if k != b"history"}
    return job_from_record(job_id, lifecycle.read_spec(rec), rec)


def _phase(rec: dict[str, str]) -> tuple[str | None, str | None, float | None]:
    """(phase, note, seconds in it so far): a queued job waits for a worker (the note says why
    none could run it, if so); a running one is in the phase its training process last wrote
    (record fields of their own: not rewritten per step), since the time it wrote with it
    (`compiling`'s note says how long so far); a finished one is in none."""
    if rec["status"] == "queued":
        return "waiting_for_worker", rec.get("waiting_for_worker"), None
    if rec["status"] != "running":
        return None, None, None
    phase, note = rec.get("phase") or "starting", rec.get("phase_note")
    seconds = max(0.0, time.time() - float(rec["phase_since"])) if rec.get("phase_since") else None
    if phase == "compiling" and note and seconds is not None:
        note = f"{note}; compiling for {seconds:.0f} s so far"
    return phase, note, seconds


def job_or_unreadable(job_id: str, h: dict[bytes, bytes], build=job_from_hash) -> BaseModel:
    """The job (build: job_from_hash or summary_from_hash), or an entry saying its stored record
    cannot be loaded (written by another version, say): one bad record must not break listing
    the others."""
    try:
        return build(job_id, h)
    except (ValueError, KeyError) as e:  # pydantic's ValidationError is a ValueError
        owner = h.get(b"owner")
        return UnreadableJob(job_id=job_id, error=f"stored record cannot be loaded: {type(e).__name__}: {e}"[:500],
                             owner=None if owner is None else owner.decode())


def get_status(r: redis.Redis, job_id: str) -> JobStatus | None:
    status = r.hget(job_key(job_id), "status")
    return None if status is None else status.decode()  # type: ignore[return-value]


# The record's fields a summary shows (the spec, of any size, only when a record has no summary).
SUMMARY_FIELDS = ("kind", "status", "owner", "created_at", "started_at", "finished_at", "error", "progress", "phase",
                  "phase_note", "phase_since", "waiting_for_worker", "worker", "checkpoint_step", "attempts", "failed_attempts",
                  "max_attempts", "resumed_from", "adapter_path", "summary")
ENTRY_BYTES = 4096  # what a job object holds besides its spec, about


def list_jobs(
    r: redis.Redis, status: JobStatus | None = None, limit: int = 20, after: str | None = None,
    owner: str | None = None, kind: kinds.Kind | None = None, summary: bool = False, max_bytes: int | None = None,
) -> tuple[list[BaseModel], bool]:
    """Jobs newest first, each its job object (summary: its JobSummary) or an UnreadableJob.
    `after` is the last job_id of the previous page; `owner`: only the jobs of that token name;
    `kind`: only the jobs its routes read (its route_kinds). max_bytes: the page ends before the
    job whose spec would take its specs past this many bytes (one job at least); the second
    value then says True, more follow, as it does when `limit` ends the page."""
    start = 0
    if after is not None:
        rank = r.zrevrank(JOBS_INDEX, after)
        if rank is None:
            raise KeyError(after)
        start = rank + 1
    jobs: list[BaseModel] = []
    size = 0
    chunk = max(limit * 2, 50)
    while True:
        ids = [i.decode() for i in r.zrevrange(JOBS_INDEX, start, start + chunk - 1)]
        if not ids:
            return jobs, False
        with r.pipeline() as p:  # the small fields only: a spec may be megabytes
            for job_id in ids:
                p.hmget(job_key(job_id), SUMMARY_FIELDS)
                p.hstrlen(job_key(job_id), "spec")
            answers = p.execute()
        fields = [{name.encode(): v for name, v in zip(SUMMARY_FIELDS, values) if v is not None} for values in answers[::2]]
        expired = [job_id for job_id, h in zip(ids, fields) if b"status" not in h]
        if expired:  # records past their retention time: drop them from the index too
            r.zrem(JOBS_INDEX, *expired)
            start -= len(expired)
        for job_id, h, spec_bytes in zip(ids, fields, answers[1::2]):
            if b"status" not in h or (status is not None and h[b"status"] != status.encode()):
                continue
            if owner is not None and h.get(b"owner") != owner.encode():
                continue
            if kind is not None and of_kind(h.get(b"kind")) not in kind.route_kinds:
                continue
            size += ENTRY_BYTES + (0 if summary else spec_bytes)
            if len(jobs) == limit or (jobs and max_bytes is not None and size > max_bytes):
                return jobs, True
            if summary and b"summary" in h:
                jobs.append(job_or_unreadable(job_id, h, summary_from_hash))
            else:  # the whole record (also for a summary of a record written before there were summaries)
                whole = r.hgetall(job_key(job_id))
                jobs.append(job_or_unreadable(job_id, whole, summary_from_hash if summary else job_from_hash))
        start += chunk


def of_kind(raw: bytes | None) -> str:
    """A record's kind's name (a kind this version does not know: as stored)."""
    return kinds.DEFAULT.name if raw is None else raw.decode()


def get_history(r: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    """The per-step metrics a completed job recorded ([] before it completes)."""
    raw = r.hget(job_key(job_id), "history")
    return [] if raw is None else json.loads(raw)


def with_config_overrides(spec, overrides: dict[str, Any]):
    """The spec with some config fields changed, a field's other name (GRPO's `epsilon` for
    clip_ratio) counting as the field. pydantic's ValidationError if invalid; ValueError for a
    change that the checkpoint's adapter cannot take (its kind's shape_fields)."""
    config_model = type(spec.config)
    names = {alias: name for name, info in config_model.model_fields.items()
             if isinstance(info.validation_alias, AliasChoices) for alias in info.validation_alias.choices}
    overrides = {names.get(k, k): v for k, v in overrides.items()}
    new = spec.model_copy(update={"config": config_model.model_validate({**spec.config.model_dump(), **overrides})})
    shape_fields = kinds.KINDS[spec.kind].shape_fields
    changed = [f for f in shape_fields if getattr(new.config, f) != getattr(spec.config, f)]
    if changed:
        raise ValueError(f"cannot change {', '.join(changed)} on resume: the checkpoint's adapter has another "
                         "shape or scale (only optimisation and sampling settings may change)")
    return new


def resume_job(r: redis.Redis, job_id: str, spec, overrides: dict[str, Any]) -> bool:
    """Re-queue a failed or cancelled job, optionally with changed config fields; the worker
    continues from its last checkpoint. Raises as with_config_overrides; False if the job is
    not (or no longer) resumable."""
    new = with_config_overrides(spec, overrides)
    return lifecycle.resume(r, job_id, new, overrides, max_attempts=max_attempts(new.config))


def cancel_requested(r: redis.Redis, job_id: str) -> bool:
    return r.hget(job_key(job_id), "cancel_requested") == b"1"
