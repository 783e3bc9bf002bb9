"""The Tinker API's sampling routes (docs/sessions.md):

    POST /api/v1/create_sampling_session   a sampler on a base model or a saved checkpoint -> {sampling_session_id}
    GET  /api/v1/samplers/{id}             {sampler_id, base_model, model_path}
    POST /api/v1/asample                   num_samples completions of a prompt (a future: protobuf SampleResponse),
                                           {request_id, sample_sequence_ids}

A sampler samples on the session's job for its base model, with the batched decoder GRPO
samples with (worker/kinds/session_job.py); `save_weights_for_sampler` without a name makes one
on a training client's weights as they are (api/routes/tinker_training.py).
"""

from typing import Any

from fastapi import APIRouter, HTTPException, status
from pydantic import Field, model_validator

from api.deps import RedisDep, SettingsDep
from api.tinker_compat.jobs import checkpoint_or_404, job_for, live_job, not_found, session_or_404
from api.tinker_compat.protocol import ERRORS, Body, KeyDep, KeyWriterDep, TinkerRoute
from shared import jobstore, sessions
from shared.session_specs import SESSION_ID_PATTERN

router = APIRouter(prefix="/api/v1", tags=["Tinker: sampling"], route_class=TinkerRoute, responses=ERRORS)

MAX_SAMPLES = 256  # of one asample call
MAX_NEW_TOKENS = 32_768
DEFAULT_NEW_TOKENS = 1024  # when sampling_params.max_tokens is not given (and the session's max_seq_len allows)


class CreateSampler(Body):
    session_id: str = Field(pattern=SESSION_ID_PATTERN)
    sampling_session_seq_id: int = Field(ge=0, le=10**12)
    base_model: str | None = Field(None, min_length=1, max_length=512)
    model_path: str | None = Field(None, max_length=1024)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.base_model is None) == (self.model_path is None):
            raise ValueError("give base_model or model_path")
        return self


class Chunk(Body):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class ModelInput(Body):
    chunks: list[Chunk] = Field(min_length=1)

    @model_validator(mode="after")
    def _text_only(self):
        if any(c.type != "encoded_text" for c in self.chunks):
            raise ValueError("only encoded_text chunks: images are not supported by this server")
        if any(t < 0 for c in self.chunks for t in c.tokens) or not any(c.tokens for c in self.chunks):
            raise ValueError("a prompt is one or more token ids, none negative")
        return self


class SamplingParams(Body):
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1, le=1_000_000)
    top_p: float = Field(1.0, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _bounded_stops(self):
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 16 or any(isinstance(s, str) and not 1 <= len(s) <= 256 for s in stops):
            raise ValueError("stop: at most 16 strings of 1-256 characters, or token ids")
        return self


class Sample(Body):
    sampling_session_id: str = Field(max_length=256)
    num_samples: int = Field(1, ge=1, le=MAX_SAMPLES)
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0, le=0, description="Top-k log-probs are not served.")
    topk_sample_logprobs: int = Field(0, ge=0, le=0, description="Top-k log-probs are not served.")
    prompt_alt_tokens_k: int = Field(0, ge=0, le=0, description="Not served.")


def sampler_or_404(r, sampler_id: str, who) -> dict[str, str]:
    found = sessions.get_sampler(r, sampler_id)
    if found is None or not who.sees(found["owner"]):
        raise not_found(f"sampler {sampler_id!r}")
    return found


@router.post("/create_sampling_session", summary="A sampler on a base model or a checkpoint's weights")
def create_sampling_session(body: CreateSampler, r: RedisDep, settings: SettingsDep,
                            who: KeyWriterDep) -> dict[str, str]:
    session_or_404(r, body.session_id, who)
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    if sessions.get_sampler(r, sampler_id) is not None:
        raise HTTPException(status.HTTP_409_CONFLICT, f"sampling_session_seq_id {body.sampling_session_seq_id} is taken")
    adapter, base_model = "", body.base_model
    if body.model_path is not None:
        run, model_id, checkpoint_id = checkpoint_or_404(r, body.model_path, who)
        adapter, base_model = f"{model_id}/{checkpoint_id}", run["base_model"]
    job_id = job_for(r, body.session_id, base_model, who, settings)
    sessions.create_sampler(r, sampler_id, who.name, body.session_id, job_id, base_model, body.model_path or "", adapter)
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}", summary="A sampler's base model and weights")
def get_sampler(sampler_id: str, r: RedisDep, who: KeyDep) -> dict[str, Any]:
    found = sampler_or_404(r, sampler_id, who)
    return {"sampler_id": sampler_id, "base_model": found["base_model"], "model_path": found["model_path"] or None}


@router.post("/asample", summary="Completions of a prompt (a future: protobuf SampleResponse)")
def asample(body: Sample, r: RedisDep, who: KeyWriterDep) -> dict[str, Any]:
    sampler = sampler_or_404(r, body.sampling_session_id, who)
    job_id = live_job(r, sampler["job_id"])
    tokens = [t for c in body.prompt.chunks for t in c.tokens]
    spec = jobstore.get_spec(r, job_id)
    limit = spec.config.max_seq_len if spec is not None else MAX_NEW_TOKENS
    params = body.sampling_params.model_dump()
    params["max_tokens"] = params["max_tokens"] or min(DEFAULT_NEW_TOKENS, limit - len(tokens))
    if len(tokens) + params["max_tokens"] > limit:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"the prompt's {len(tokens)} tokens and max_tokens "
                            f"{params['max_tokens']} exceed the session's max_seq_len ({limit})")
    sessions.seen(r, sampler["session_id"])
    call = {"type": "sample", "sampler_id": body.sampling_session_id, "tokens": tokens, "num_samples": body.num_samples,
            "params": params, "prompt_logprobs": body.prompt_logprobs}
    request_id = sessions.submit_call(r, job_id, who.name, call)
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(body.num_samples)]}
