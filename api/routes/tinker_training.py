"""The Tinker API's training routes (docs/sessions.md). Each queues a call for the session's job
on the model's worker (shared/sessions.py) and answers a future, `{request_id, model_id}`, that
POST /api/v1/retrieve_future resolves (api/routes/tinker_futures.py):

    POST /api/v1/create_model               a training client: a LoRA on a base model -> {model_id}
    POST /api/v1/forward_backward           (protobuf) losses, per-datum log-probs, gradients summed until optim_step
    POST /api/v1/optim_step                 AdamW on the summed gradients -> {metrics}
    POST /api/v1/save_weights               its weights and optimizer state -> {path: tinker://<model>/weights/<name>}
    POST /api/v1/save_weights_for_sampler   its weights (mlx_lm's adapter files) -> {path}, or unnamed: {sampling_session_id}
    POST /api/v1/load_weights               a checkpoint into a new client ({session_id, model_seq_id}) or an existing one

and two answered at once:

    POST /api/v1/get_info                   the model: base, LoRA rank, tokenizer
    POST /api/v1/weights_info               a checkpoint's: base, LoRA rank

A model's calls are taken in the order they arrive, as the SDK sends them (one after another:
api/routes/tinker_sessions.py CLIENT_CONFIG).
"""

import re
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request, status
from pydantic import Field

from api.deps import RedisDep, SettingsDep
from api.tinker_compat.protocol import ERRORS, Body, KeyDep, KeyWriterDep, TinkerRoute
from api.tinker_compat.jobs import checkpoint_or_404, job_for, live_job, run_or_404, session_or_404
from shared import jobstore, routing, sessions, workers
from shared.session_specs import SESSION_ID_PATTERN
from shared.tinker_wire import WireError, decode_forward_backward

router = APIRouter(prefix="/api/v1", tags=["Tinker: training"], route_class=TinkerRoute, responses=ERRORS)

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a checkpoint's name: one segment of its tinker:// path
MAX_DATUMS = 1024  # of one forward_backward request: the SDK's own chunk (fwdbwd_max_chunk_len)


class LoraConfig(Body):
    rank: int = Field(32, ge=1, le=1024)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


class CreateModel(Body):
    session_id: str = Field(pattern=SESSION_ID_PATTERN)
    model_seq_id: int = Field(ge=0, le=10**12)
    base_model: str = Field(min_length=1, max_length=512)
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    user_metadata: dict[str, str] | None = None


class ModelRef(Body):
    model_id: str = Field(min_length=1, max_length=256)


class AdamParams(Body):
    learning_rate: float = Field(1e-4, ge=0.0, le=10.0, allow_inf_nan=False)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-12, gt=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0, le=10.0)
    grad_clip_norm: float = Field(0.0, ge=0.0, allow_inf_nan=False)


class OptimStep(ModelRef):
    adam_params: AdamParams


class SaveWeights(ModelRef):
    path: str | None = Field(None, max_length=128)
    ttl_seconds: int | None = Field(None, ge=1, le=10 * 365 * 86_400)
    user_metadata: dict[str, str] | None = None
    sampling_session_seq_id: int | None = Field(None, ge=0, le=10**12)
    kind: Literal["snapshot", "inflight"] = "snapshot"


class LoadWeights(Body):
    path: str = Field(max_length=1024)
    optimizer: bool = False
    model_id: str | None = Field(None, max_length=256)  # a client's (the deprecated load_state)
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN)  # a new client's (create_training_client_from_state)
    model_seq_id: int | None = Field(None, ge=0, le=10**12)
    user_metadata: dict[str, str] | None = None


class WeightsInfo(Body):
    tinker_path: str = Field(max_length=1024)


def model_id_of(sid: str, seq: int) -> str:
    return f"{sid}:train:{seq}"


def queue_call(r, run: dict, model_id: str, who, call: dict[str, Any], body: bytes = b"") -> dict[str, str]:
    """Queue the call for the run's job (a 409 once that ended); the future."""
    job_id = live_job(r, run["job_id"])
    sessions.seen(r, run["session_id"])
    sessions.touch_run(r, model_id)
    return {"request_id": sessions.submit_call(r, job_id, who.name, {**call, "model_id": model_id}, body),
            "model_id": model_id}


def new_run(r, settings, who, sid: str, seq: int, base_model: str, lora: dict, metadata: dict | None) -> tuple[dict, str]:
    model_id = model_id_of(sid, seq)
    if sessions.get_run(r, model_id) is not None:
        raise HTTPException(status.HTTP_409_CONFLICT, f"model_seq_id {seq} of session {sid} is taken ({model_id})")
    job_id = job_for(r, sid, base_model, who, settings)
    sessions.create_run(r, model_id, who.name, sid, job_id, base_model, lora, metadata or {})
    return sessions.get_run(r, model_id), model_id


@router.post("/create_model", summary="A training client: a new LoRA on a base model (a future)")
def create_model(body: CreateModel, r: RedisDep, settings: SettingsDep, who: KeyWriterDep) -> dict[str, str]:
    session_or_404(r, body.session_id, who)
    lora = body.lora_config.model_dump()
    run, model_id = new_run(r, settings, who, body.session_id, body.model_seq_id, body.base_model, lora, body.user_metadata)
    return queue_call(r, run, model_id, who, {"type": "create_model", "lora": lora})


@router.post("/get_info", summary="A training client's model")
def get_info(body: ModelRef, r: RedisDep, who: KeyDep) -> dict[str, Any]:
    run = run_or_404(r, body.model_id, who)
    base = run["base_model"]
    return {"type": "get_info", "model_id": body.model_id, "is_lora": True, "lora_rank": run["lora"]["rank"],
            "model_name": base, "model_data": {"model_name": base, "tokenizer_id": tokenizer_id(r, base),
                                               "arch": "lora"}}


def tokenizer_id(r, base_model: str) -> str:
    """What the SDK's get_tokenizer loads: a Hugging Face id as it is; a model a worker has on
    disk by its path there (the client may share that disk: a local stack)."""
    if routing.is_hub_id(base_model):
        return base_model
    served = next((routing.served_models(w).get(routing.model_key(base_model)) for w in workers.live_workers(r)
                   if routing.model_key(base_model) in routing.served_models(w)), None)
    return served["model_path"] if served and served.get("model_path") else base_model


@router.post("/forward_backward", summary="Losses and gradients of a batch of datums (protobuf; a future)")
async def forward_backward(request: Request, r: RedisDep, who: KeyWriterDep) -> dict[str, str]:
    body = await request.body()
    try:
        call = decode_forward_backward(body, max_datums=MAX_DATUMS, max_tokens=1_048_576)
    except WireError as e:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"forward_backward: {e}") from None
    run = run_or_404(r, call.model_id, who)
    spec = jobstore.get_spec(r, run["job_id"])
    longest = max(len(d.tokens) for d in call.data)
    if spec is not None and longest > spec.config.max_seq_len:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"forward_backward: a datum of {longest} tokens; the "
                            f"session's limit is {spec.config.max_seq_len} (max_seq_len)")
    return queue_call(r, run, call.model_id, who, {"type": "forward_backward"}, body)


@router.post("/optim_step", summary="AdamW on the gradients summed since the last step (a future)")
def optim_step(body: OptimStep, r: RedisDep, who: KeyWriterDep) -> dict[str, str]:
    run = run_or_404(r, body.model_id, who)
    return queue_call(r, run, body.model_id, who, {"type": "optim_step", "adam": body.adam_params.model_dump()})


def checkpoint_name(name: str | None) -> str:
    if name is None or not NAME.fullmatch(name):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"path: a checkpoint's name ({name!r}) is 1-128 letters, "
                            "digits, '.', '_' or '-', not starting with '.', '_' or '-'")
    return name


@router.post("/save_weights", summary="Save the client's weights and optimizer state (a future: {path})")
def save_weights(body: SaveWeights, r: RedisDep, who: KeyWriterDep) -> dict[str, str]:
    run = run_or_404(r, body.model_id, who)
    return queue_call(r, run, body.model_id, who, {
        "type": "save_weights", "checkpoint_id": f"weights/{checkpoint_name(body.path)}", "ttl_seconds": body.ttl_seconds,
        "user_metadata": body.user_metadata})


@router.post("/save_weights_for_sampler", summary="Save the client's weights for sampling (a future: {path} or "
             "{sampling_session_id})")
def save_weights_for_sampler(body: SaveWeights, r: RedisDep, who: KeyWriterDep) -> dict[str, str]:
    run = run_or_404(r, body.model_id, who)
    if body.path is None and body.sampling_session_seq_id is None:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "give path (a named checkpoint) or sampling_session_seq_id")
    if body.path is None:  # a sampler on the weights as they are now, in the job's memory
        sampler_id = f"{run['session_id']}:sample:{body.sampling_session_seq_id}"
        sessions.create_sampler(r, sampler_id, who.name, run["session_id"], run["job_id"], run["base_model"])
        return queue_call(r, run, body.model_id, who, {"type": "snapshot_for_sampler", "sampler_id": sampler_id})
    return queue_call(r, run, body.model_id, who, {
        "type": "save_weights", "checkpoint_id": f"sampler_weights/{checkpoint_name(body.path)}",
        "ttl_seconds": body.ttl_seconds, "user_metadata": body.user_metadata})


@router.post("/load_weights", summary="Load a checkpoint into a new client or an existing one (a future)")
def load_weights(body: LoadWeights, r: RedisDep, settings: SettingsDep, who: KeyWriterDep) -> dict[str, str]:
    source, source_model, checkpoint_id = checkpoint_or_404(r, body.path, who)
    if body.optimizer and not checkpoint_id.startswith("weights/"):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"{body.path} holds no optimizer state (save_state's do)")
    call = {"type": "load_weights", "source": [source_model, checkpoint_id], "optimizer": body.optimizer}
    if body.session_id is not None and body.model_seq_id is not None:
        session_or_404(r, body.session_id, who)
        run, model_id = new_run(r, settings, who, body.session_id, body.model_seq_id, source["base_model"],
                                source["lora"], body.user_metadata)
        return queue_call(r, run, model_id, who, {**call, "lora": source["lora"]})
    if body.model_id is None:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "give model_id, or session_id and model_seq_id")
    run = run_or_404(r, body.model_id, who)
    if (run["base_model"], run["lora"]["rank"]) != (source["base_model"], source["lora"]["rank"]):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"{body.path} is a rank-{source['lora']['rank']} LoRA of "
                            f"{source['base_model']}; {body.model_id} is a rank-{run['lora']['rank']} one of {run['base_model']}")
    return queue_call(r, run, body.model_id, who, call)


@router.post("/weights_info", summary="A checkpoint's base model and LoRA")
def weights_info(body: WeightsInfo, r: RedisDep, who: KeyDep) -> dict[str, Any]:
    run, _, _ = checkpoint_or_404(r, body.tinker_path, who)
    lora = run["lora"]
    return {"base_model": run["base_model"], "is_lora": True, "lora_rank": lora["rank"],
            "train_attn": lora["train_attn"], "train_mlp": lora["train_mlp"], "train_unembed": lora["train_unembed"]}
