"""OpenAI's fine-tuning jobs as this project's jobs: a mapping layer, not a lifecycle of its own.

An OpenAI job IS an SFT (`supervised`), DPO (`dpo`) or GRPO (`reinforcement`) job, created
through the kinds' own spec models and jobstore.create_job; its record keeps the OpenAI
request (field `openai`: files, resolved hyperparameters, suffix, metadata) and its id is
`ftjob-<job id>`. What the SDK reads is computed from the record:

    lifecycle status               OpenAI status
    queued                         queued
    running                        running
    completed                      succeeded
    failed                         failed
    cancelled                      cancelled (paused, when the cancel was a pause: lifecycle.cancel(paused=True))

    event                          FineTuningJobEvent
    <kind>_step                    info, metrics: {step, train_loss, train_mean_token_accuracy, ...}; a
                                   reinforcement job's also OpenAI's RFT reward fields (_rft_scores)
    requeued, rerouted, truncated  warn, message
    waiting                        warn, message (no live worker can run it: a gang short of workers, or
                                   at create, a model no live worker has)
    failed                         error, message
    anything else                  info, message

Checkpoints are the job's `checkpoint` events (one per epoch: steps_per_save), and the last step
of a succeeded job. Hyperparameters: `"auto"` resolves to AUTO, the learning rate is the
multiplier times BASE_LEARNING_RATE, and steps = ceil(rows x n_epochs / batch_size).
"""

import csv
import io
import json
import math
import secrets
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.openai_compat.files import check_file, to_rows
from shared import jobstore
from shared.datasets import DatasetError, file_content, visible_file
from shared.events import decode_events
from shared.graders import Grader
from shared.keys import events_key, job_key
from shared.lifecycle import read_spec
from shared.model_ids import OPENAI_JOB_PREFIX, job_id_of
from shared.reward_specs import GraderReward
from shared.schemas import MAX_EVAL_SAMPLES, MAX_VALIDATION_PROMPTS, SEED_MAX, GRPOConfig, JobCreate
from shared.train_specs import DPOConfig, DPOJobCreate, SFTConfig, SFTJobCreate

KIND_OF_METHOD = {"supervised": "sft", "dpo": "dpo", "reinforcement": "grpo"}
METHOD_OF_KIND = {v: k for k, v in KIND_OF_METHOD.items()}
BASE_LEARNING_RATE = {"supervised": 1e-5, "dpo": 1e-5, "reinforcement": 1e-5}  # times learning_rate_multiplier
AUTO = {"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 1.0, "beta": 0.1, "compute_multiplier": 1.0,
        "eval_samples": 1, "max_completion_tokens": GRPOConfig.model_fields["max_completion_len"].default,
        "temperature": GRPOConfig.model_fields["temperature"].default}
GROUP_SIZE = 4  # completions per prompt of a reinforcement job at compute_multiplier 1
MAX_SUFFIX = 64

Auto = Literal["auto"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SupervisedHyperparameters(_Strict):
    batch_size: Auto | int | None = Field(None)
    learning_rate_multiplier: Auto | float | None = None
    n_epochs: Auto | int | None = None


class DpoHyperparameters(SupervisedHyperparameters):
    beta: Auto | float | None = None


class ReinforcementHyperparameters(SupervisedHyperparameters):
    compute_multiplier: Auto | float | None = None
    # With a validation_file: evaluate every eval_interval steps, eval_samples completions per row.
    eval_interval: Auto | Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    eval_samples: Auto | Annotated[int, Field(ge=1, le=MAX_EVAL_SAMPLES)] | None = None
    reasoning_effort: Literal["default", "low", "medium", "high"] | None = None
    # Local extensions (not OpenAI's): the completions' length in tokens and the sampling
    # temperature (GRPOConfig.max_completion_len, temperature).
    max_completion_tokens: Auto | Annotated[int, Field(ge=1, le=32768)] | None = None
    temperature: Auto | Annotated[float, Field(ge=0.0, le=100.0)] | None = None


class SupervisedMethod(_Strict):
    hyperparameters: SupervisedHyperparameters | None = None


class DpoMethod(_Strict):
    hyperparameters: DpoHyperparameters | None = None


class ReinforcementMethod(_Strict):
    grader: Grader
    hyperparameters: ReinforcementHyperparameters | None = None
    response_format: dict[str, Any] | None = None


class Method(_Strict):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reinforcement: ReinforcementMethod | None = None

    @model_validator(mode="after")
    def _reinforcement_has_grader(self):
        if self.type == "reinforcement" and self.reinforcement is None:
            raise ValueError("method.reinforcement (with its grader) is required for a reinforcement job")
        return self

    def hyperparameters(self) -> SupervisedHyperparameters:
        config = getattr(self, self.type)
        hp = config.hyperparameters if config is not None else None
        default = {"supervised": SupervisedHyperparameters, "dpo": DpoHyperparameters,
                   "reinforcement": ReinforcementHyperparameters}[self.type]
        return hp or default()


class WandbIntegration(_Strict):
    project: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    name: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[^\x00-\x1f]+$")
    entity: str | None = Field(None, max_length=128)
    tags: list[Annotated[str, Field(max_length=64)]] | None = Field(None, max_length=16)


class Integration(_Strict):
    """OpenAI's Weights & Biases integration: the job reports to wandb (docs/trackers.md), in the
    project and under the name given; online with the worker's WANDB_API_KEY, else offline."""

    type: Literal["wandb"]
    wandb: WandbIntegration


class JobCreateRequest(_Strict):
    """POST /v1/fine_tuning/jobs (the SDK's JobCreateParams)."""

    model: str = Field(..., min_length=1, max_length=512)
    training_file: str = Field(..., max_length=64)
    validation_file: str | None = Field(None, max_length=64)
    method: Method | None = None
    hyperparameters: SupervisedHyperparameters | None = Field(None, description="Deprecated: method.supervised's.")
    suffix: str | None = Field(None, max_length=MAX_SUFFIX, pattern=r"^[A-Za-z0-9._-]*$")
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    integrations: list[Integration] | None = Field(None, max_length=1)

    @model_validator(mode="after")
    def _checks(self):
        if self.method is not None and self.hyperparameters is not None:
            raise ValueError("give hyperparameters under method (the top-level field is deprecated)")
        for k, v in (self.metadata or {}).items():
            if len(k) > 64 or len(v) > 512:
                raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return self

    def resolved_method(self) -> Method:
        if self.method is not None:
            return self.method
        return Method(type="supervised", supervised=SupervisedMethod(hyperparameters=self.hyperparameters))


# --------------------------------------------------------------------------- the SDK's objects


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJob(BaseModel):
    id: str
    created_at: int
    error: JobError | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: dict[str, Any]
    model: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    organization_id: str
    result_files: list[str]
    seed: int
    status: Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    method: dict[str, Any]


class FineTuningJobEvent(BaseModel):
    id: str
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"]


class CheckpointMetrics(BaseModel):
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None
    step: float | None = None
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None


class FineTuningJobCheckpoint(BaseModel):
    id: str
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    step_number: int


class Page(BaseModel):
    object: Literal["list"] = "list"
    data: list[Any]
    has_more: bool


class CheckpointPage(Page):
    first_id: str | None = None
    last_id: str | None = None


# --------------------------------------------------------------------------- creating


def _resolve(hp: SupervisedHyperparameters, rows: int) -> dict[str, Any]:
    """Every hyperparameter the method has, "auto" (or unset) replaced by the value used."""
    out: dict[str, Any] = {}
    for name, value in hp.model_dump().items():
        if name == "reasoning_effort":
            out[name] = value or "default"
        elif value is None or value == "auto":
            out[name] = min(AUTO["batch_size"], rows) if name == "batch_size" else AUTO.get(name)
        else:
            out[name] = value
    if "eval_interval" in out and out["eval_interval"] is None:
        out["eval_interval"] = steps_per_epoch(rows, out["batch_size"])
    return out


def steps_per_epoch(rows: int, batch_size: int) -> int:
    return max(1, math.ceil(rows / batch_size))


@dataclass
class Created:
    spec: Any
    record: dict[str, Any]  # the record's `openai` field


def _file_rows(r, file_id: str, who, param: str) -> list[dict]:
    meta = visible_file(r, file_id, who)
    if meta is None:
        raise DatasetError(f"{param}: file {file_id[:64]} not found")
    rows, _ = check_file(file_content(r, file_id) or b"", meta["filename"])
    return rows


def build(r, request: JobCreateRequest, who) -> Created:
    """The kind's spec for the request (DatasetError with `.param` for a file that does not fit)."""
    method = request.resolved_method()
    try:
        train = _file_rows(r, request.training_file, who, "training_file")
        rows = to_rows(method.type, train, "training_file")
    except DatasetError as e:
        raise ParamError(str(e), "training_file") from None
    valid = None
    if request.validation_file:
        try:
            valid = to_rows(method.type, _file_rows(r, request.validation_file, who, "validation_file"), "validation_file")
        except DatasetError as e:
            raise ParamError(str(e), "validation_file") from None
        if method.type == "reinforcement" and len(valid) > MAX_VALIDATION_PROMPTS:
            raise ParamError(f"validation_file has {len(valid)} rows; a reinforcement job's limit is "
                             f"{MAX_VALIDATION_PROMPTS} (each evaluation samples them all)", "validation_file")
    hp = _resolve(method.hyperparameters(), len(rows))
    wandb = request.integrations[0].wandb if request.integrations else None
    report = {} if wandb is None else {"report_to": ["wandb"], "run_name": wandb.name, "wandb_project": wandb.project}
    seed = request.seed if request.seed is not None else secrets.randbelow(2**31)
    per_epoch = steps_per_epoch(len(rows), hp["batch_size"])
    iters = per_epoch * hp["n_epochs"]
    lr = BASE_LEARNING_RATE[method.type] * hp["learning_rate_multiplier"]
    adapter_name = f"{request.suffix}-{secrets.token_hex(4)}" if request.suffix else None
    if method.type == "reinforcement":
        group = max(2, round(GROUP_SIZE * hp["compute_multiplier"]))
        config = GRPOConfig(batch_size=hp["batch_size"], group_size=group, iters=iters, learning_rate=lr, seed=seed,
                            checkpoint_every=per_epoch, max_completion_len=hp["max_completion_tokens"],
                            temperature=hp["temperature"], eval_interval=hp["eval_interval"],
                            eval_samples=hp["eval_samples"], **report)
        spec = JobCreate(model_id=request.model, adapter_name=adapter_name, prompts=rows, validation_prompts=valid,
                         config=config, reward=[GraderReward(grader=method.reinforcement.grader)])  # type: ignore[union-attr]
    elif method.type == "dpo":
        config = DPOConfig(batch_size=hp["batch_size"], iters=iters, learning_rate=lr, seed=seed, beta=hp["beta"],
                           steps_per_report=1, steps_per_save=per_epoch, steps_per_eval=per_epoch, **report)
        spec = DPOJobCreate(model_id=request.model, adapter_name=adapter_name, dataset=rows, valid_dataset=valid,
                            config=config)
    else:
        config = SFTConfig(batch_size=hp["batch_size"], iters=iters, learning_rate=lr, seed=seed, mask_prompt=True,
                           steps_per_report=1, steps_per_save=per_epoch, steps_per_eval=per_epoch, **report)
        spec = SFTJobCreate(model_id=request.model, adapter_name=adapter_name, dataset=rows, valid_dataset=valid,
                            config=config)
    echoed = method.model_dump(exclude_none=True)
    echoed.setdefault(method.type, {})["hyperparameters"] = hp
    record = {"training_file": request.training_file, "validation_file": request.validation_file, "method": echoed,
              "hyperparameters": hp, "suffix": request.suffix or "", "metadata": request.metadata, "seed": seed,
              "integrations": [i.model_dump(exclude_none=True) for i in request.integrations or []]}
    return Created(spec, record)


class ParamError(ValueError):
    """A request that cannot become a job; `param` names the field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


# --------------------------------------------------------------------------- reading


def fine_tuned_model(job_id: str, rec: dict[bytes, bytes | None]) -> tuple[str, str, str] | None:
    """(name, model_id, adapter_name) of a succeeded OpenAI job's fine-tuned model, given its
    record fields `summary`, `owner`, `openai` and `status` (as HMGET returns them); None for
    any other job."""
    if rec.get(b"openai") is None or rec.get(b"status") != b"completed":
        return None
    summary, ft = json.loads(rec[b"summary"] or "{}"), json.loads(rec[b"openai"])  # type: ignore[arg-type]
    owner = rec.get(b"owner")
    name = model_name({"owner": owner.decode() if owner else None}, job_id, ft["suffix"], summary.get("model_id", ""))
    return name, summary["model_id"], summary["adapter_name"]


def adapter_of(name: str, rec: dict[bytes, bytes | None]) -> tuple[str, str] | None:
    """(model_id, adapter_name) of a fine-tuned model's name, given its job's record fields
    (fine_tuned_model); None unless the name is exactly that succeeded job's fine_tuned_model."""
    job_id = job_id_of(name) if name.startswith("ft:") else None
    found = None if job_id is None else fine_tuned_model(job_id, rec)
    return found[1:] if found is not None and found[0] == name else None


NAME_FIELDS = ("summary", "owner", "openai", "status")  # what fine_tuned_model reads


def fine_tuned_adapter(r, name: str) -> tuple[str, str] | None:
    """(model_id, adapter_name) of a fine-tuned model's name (ft:...); None if it names none."""
    job_id = job_id_of(name) if name.startswith("ft:") else None
    if job_id is None or not job_id.isalnum():
        return None
    return adapter_of(name, dict(zip((f.encode() for f in NAME_FIELDS), r.hmget(job_key(job_id), NAME_FIELDS))))


def organization(owner: str | None) -> str:
    return f"org-{owner or 'local'}"


def model_name(rec: dict, job_id: str, suffix: str, model_id: str) -> str:
    """The fine-tuned model's name: ft:<model>:<organization>:<suffix>:<job id> (`mtq download` takes it)."""
    return f"ft:{model_id}:{organization(rec.get('owner'))}:{suffix}:{job_id}"


def status_of(rec: dict) -> str:
    status = rec["status"]
    if status == "cancelled" and rec.get("paused") == "1":
        return "paused"
    return {"completed": "succeeded"}.get(status, status)


def openai_record(r, job_id: str) -> tuple[dict, dict] | None:
    """(the record's fields decoded, its `openai` field) of an OpenAI job; None for any other."""
    h = r.hgetall(job_key(job_id)) if job_id.isalnum() and len(job_id) <= 64 else {}
    if b"openai" not in h:
        return None
    rec = {k.decode(): v.decode() for k, v in h.items() if k != b"history"}
    rec["_history"] = h.get(b"history")
    return rec, json.loads(rec["openai"])


def to_job(job_id: str, rec: dict, ft: dict) -> FineTuningJob:
    job = jobstore.job_from_record(job_id, read_spec(rec), rec)
    status = status_of(rec)
    progress = job.progress or {}
    estimated = None
    if status == "running" and job.started_at and progress.get("iter"):
        elapsed = max(0.0, time.time() - job.started_at)
        estimated = int(job.started_at + elapsed / progress["iter"] * progress.get("total_iters", progress["iter"]))
    return FineTuningJob(
        id=OPENAI_JOB_PREFIX + job_id, created_at=int(job.created_at),
        error=JobError(code="job_failed", message=job.error) if status == "failed" else None,
        fine_tuned_model=model_name(rec, job_id, ft["suffix"], job.model_id) if status == "succeeded" else None,
        finished_at=int(job.finished_at) if job.finished_at and status in ("succeeded", "failed", "cancelled") else None,
        hyperparameters={k: ft["hyperparameters"].get(k) for k in ("batch_size", "learning_rate_multiplier", "n_epochs")},
        model=job.model_id, organization_id=organization(rec.get("owner")),
        result_files=[f"file-{job_id}"] if status == "succeeded" else [], seed=ft["seed"], status=status,
        trained_tokens=int(progress.get("num_tokens", 0)) if status == "succeeded" else None,
        training_file=ft["training_file"], validation_file=ft.get("validation_file"), estimated_finish=estimated,
        integrations=ft.get("integrations") or [], metadata=ft.get("metadata"), method=ft["method"],
    )


WARN_EVENTS = ("requeued", "rerouted", "truncated", "waiting")
METRIC_NAMES = {"loss": "train_loss", "mean_token_accuracy": "train_mean_token_accuracy", "val_loss": "valid_loss",
                "val_mean_token_accuracy": "valid_mean_token_accuracy"}


def _metrics(event: dict) -> dict[str, Any]:
    out = {"step": event.get("iter"), "total_steps": event.get("total_iters")}
    for k, v in event.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("iter", "total_iters"):
            out[METRIC_NAMES.get(k, k)] = v
    return out


def _rft_scores(data: dict) -> dict[str, Any]:
    """A reinforcement step's rewards as OpenAI's RFT metrics events also carry them:
    train_mean_reward, full_valid_mean_reward (a step with an evaluation), and `scores` with
    train_reward_mean / valid_reward_mean overall and per grader (reward source)."""
    sources = dict.fromkeys(k.split("/")[1] for k in data
                            if k.startswith(("rewards/", "val_rewards/")) and k.endswith("/mean"))
    graders = [{"name": name, "train_reward_mean": data.get(f"rewards/{name}/mean"),
                "valid_reward_mean": data.get(f"val_rewards/{name}/mean")} for name in sources]
    scores = {"train_reward_mean": data["reward"], "valid_reward_mean": data.get("val_reward"), "graders": graders}
    out = {"train_mean_reward": data["reward"], "scores": scores}
    if "val_reward" in data:
        out["full_valid_mean_reward"] = data["val_reward"]
    return out


def to_event(stream_id: str, event: dict, kind_step: str, first_step: int) -> FineTuningJobEvent:
    created = int(stream_id.split("-")[0]) // 1000
    kind = event.get("type", "")
    if kind == kind_step:
        data = _metrics({**event, "iter": event["iter"] + 1 - first_step})
        if "reward" in data:  # a reinforcement job's
            data.update(_rft_scores(data))
        parts = ", ".join(f"{k}={v:.4g}" for k, v in data.items()
                          if k in ("train_loss", "reward", "full_valid_mean_reward") and v is not None)
        return FineTuningJobEvent(id=f"ftevent-{stream_id}", created_at=created, level="info", type="metrics",
                                  message=f"Step {data['step']}/{data['total_steps']}: {parts}", data=data)
    level = "error" if kind == "failed" else "warn" if kind in WARN_EVENTS else "info"
    detail = event.get("error") or event.get("reason") or event.get("waiting_for_worker") or ""
    message = {"cancelled": "Job paused" if event.get("paused") else "Job cancelled",
               "done": "The job has successfully completed", "started": "Fine-tuning job started",
               "checkpoint": f"Checkpoint created at step {event.get('step')}",
               "resumed": f"Resumed from the checkpoint of step {event.get('from_step')}"}.get(kind, kind.replace("_", " "))
    data = {k: v for k, v in event.items() if k != "type" and isinstance(v, (str, int, float, bool, type(None)))}
    return FineTuningJobEvent(id=f"ftevent-{stream_id}", created_at=created, level=level, type="message",
                              message=f"{message}: {detail}" if detail else message, data=data)


def events(r, job_id: str, after: str | None, limit: int, kind_step: str, first_step: int) -> Page:
    """Newest first; `after` an event id, exclusive."""
    high = "+" if after is None else "(" + after.removeprefix("ftevent-")
    entries = r.xrevrange(events_key(job_id), high, "-", count=limit + 1)
    decoded = decode_events([(events_key(job_id), entries)]) if entries else []
    data = [to_event(i, e, kind_step, first_step) for i, e in decoded[:limit]]
    return Page(data=data, has_more=len(decoded) > limit)


def _all_events(r, job_id: str) -> list[tuple[str, dict]]:
    return decode_events([(events_key(job_id), r.xrange(events_key(job_id)))] if r.exists(events_key(job_id)) else [])


def checkpoints(r, job_id: str, rec: dict, ft: dict, kind_step: str, first_step: int, after: str | None,
                limit: int) -> CheckpointPage:
    """The job's checkpoint events (and a succeeded job's last step), newest first, each with
    the metrics of its step's event (an evaluation's val_* among them: steps_per_eval is an epoch)."""
    steps: dict[int, dict] = {}
    made: dict[int, int] = {}
    for stream_id, e in _all_events(r, job_id):
        if e.get("type") == kind_step:
            steps[e["iter"] + 1 - first_step] = _metrics({**e, "iter": e["iter"] + 1 - first_step})
        elif e.get("type") == "checkpoint":
            made[e["step"]] = int(stream_id.split("-")[0]) // 1000
        elif e.get("type") == "done":
            made[int(json.loads(rec.get("progress") or "{}").get("iter", 0))] = int(stream_id.split("-")[0]) // 1000
    model = json.loads(rec["summary"])["model_id"]
    items = []
    for step in sorted(made, reverse=True):
        known = {k: v for k, v in steps.get(step, {}).items() if k in CheckpointMetrics.model_fields}
        items.append(FineTuningJobCheckpoint(
            id=f"ftckpt-{job_id}-{step}", created_at=made[step], fine_tuning_job_id=OPENAI_JOB_PREFIX + job_id, step_number=step,
            fine_tuned_model_checkpoint=f"{model_name(rec, job_id, ft['suffix'], model)}:ckpt-step-{step}",
            metrics=CheckpointMetrics(**{**known, "step": float(step)})))
    if after is not None:
        ids = [c.id for c in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return CheckpointPage(data=page, has_more=len(items) > limit, first_id=page[0].id if page else None,
                          last_id=page[-1].id if page else None)


@dataclass
class ResultsFile:
    filename: str
    content: bytes
    created_at: int


def results_file(r, file_id: str, tenant: str | None) -> ResultsFile | None:
    """A succeeded OpenAI job's results file (`file-<job id>`): its steps' metrics as CSV."""
    found = openai_record(r, file_id.removeprefix("file-")) if file_id.startswith("file-") else None
    if found is None:
        return None
    rec, _ = found
    if rec["status"] != "completed" or (tenant is not None and rec.get("owner") != tenant):
        return None
    history = json.loads(rec["_history"] or "[]")
    names = list(dict.fromkeys(METRIC_NAMES.get(k, k) for h in history for k in h if k != "step"))
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["step", *names])
    for h in history:
        renamed = {METRIC_NAMES.get(k, k): v for k, v in h.items()}
        writer.writerow([h.get("step"), *(renamed.get(n, "") for n in names)])
    return ResultsFile("step_metrics.csv", out.getvalue().encode(), int(float(rec.get("finished_at") or 0)))
