"""The session kind (shared/session_specs.py): a Tinker session's job on one base model, which
serves the session's calls (shared/sessions.py) on a warm worker until the session ends.

    load the base model (the worker's shared copy, kept loaded between jobs)
    until the client finishes the session, stops heartbeating for idle_timeout_s, or the job is cancelled:
        take the next call, in the order the calls came, and answer its future:
            create_model          a training client: a LoRA of its own (worker/sessions/training_client.py)
            forward_backward      losses, per-datum log-probs, gradients summed until optim_step (protobuf)
            optim_step            AdamW on the summed gradients; a session_step event with its metrics
            save_weights          weights (+ optimizer state) into Redis, under tinker://<model>/<checkpoint id>
            load_weights          a checkpoint into a new client or an existing one
            snapshot_for_sampler  a sampler on a client's weights as they are now (in this job's memory)
            sample                num_samples completions with GRPO's batched decoder (protobuf)
        while no call waits: log-prob requests for this model (worker/runtime/score_requests.py)
    fail the calls still queued (the session ended); completed

A call that cannot be done (bad inputs, an unknown model id) fails its future with Tinker's
category `user` and the reason; the session goes on. A client's state lives here alone: a lost
worker fails the job (shared/session_specs.py), and the API fails its pending futures.
"""

import json
import logging
import math
import os
import shutil
from contextlib import ExitStack
from pathlib import Path

import mlx.core as mx
import numpy as np

from shared import sessions
from shared.adapters import CONFIG_FILE, WEIGHTS_FILE
from shared.session_specs import SessionJobCreate
from shared.settings import load_settings
from shared.tinker_wire import Sequence, decode_forward_backward, encode_forward_backward_output, encode_sample_response
from worker.decode.draw import SamplingParams
from worker.decode.sampling import make_decode_step, sample
from worker.runtime.adapter_layers import adapter_swapped
from worker.runtime.logprobs import completion_logprobs, eos_token_ids, left_pad
from worker.runtime.models import get_model
from worker.runtime.train_core import Cancelled
from worker.sessions.training_client import BadRequest, LoraConfig, TrainingClient
from worker.supervisor.lease import retrying

log = logging.getLogger(__name__)

WAIT_S = 0.5  # one wait for a call; between waits: the session's end, a cancel, scoring requests
JSON = "application/json"
# The job's phase while it answers a call (worker/supervisor/marks.py PHASES); "serving" otherwise.
PHASES = {"forward_backward": "updating", "optim_step": "updating", "sample": "sampling", "save_weights": "saving",
          "load_weights": "loading_model"}
PROTOBUF = "application/x-protobuf"


class CallError(Exception):
    """A call that cannot be done as asked: its future fails with category `user`."""


def run(job, spec: SessionJobCreate) -> dict:
    """Serve the session's calls until it ends; the completed record's fields."""
    settings = load_settings()
    job.mark("loading_model")
    model, tokenizer, cached = get_model(spec.model_id, settings)
    if not cached:
        job.publish_loaded()
    job.write(event={"type": "model_ready", "cached": cached})
    served = Session(job, spec, model, tokenizer, settings.home / "sessions" / job.job_id)
    try:
        why = served.serve()
    finally:
        shutil.rmtree(served.scratch, ignore_errors=True)
        retrying(lambda: sessions.fail_waiting(job.lease.r, job.job_id, f"the session's job ended before this call"),
                 "fail waiting calls")
    log.info("job %s: session %s ended: %s", job.job_id, spec.session_id, why)
    return {"history": [], "events": [{"type": "session_ended", "reason": why}], "adapter": None}


class Session:
    def __init__(self, job, spec: SessionJobCreate, model, tokenizer, scratch: Path):
        self.job, self.spec, self.model, self.tokenizer, self.scratch = job, spec, model, tokenizer, scratch
        self.r = job.lease.r
        self.clients: dict[str, TrainingClient] = {}
        self.snapshots: dict[str, dict[str, bytes]] = {}  # sampler id -> adapter files of a client's weights then
        self.steps = 0  # optim_steps of every client: the job's step events
        self.eos_ids = eos_token_ids(tokenizer)

    def serve(self) -> str:
        while True:
            if self.job.should_stop():
                raise Cancelled()
            why = retrying(lambda: sessions.session_ended(self.r, self.spec.session_id, self.spec.config.idle_timeout_s),
                           "session check")
            if why is not None:
                return why
            self.job.mark("serving")
            item = retrying(lambda: sessions.next_call(self.r, self.job.job_id, WAIT_S), "next call")
            if item is None:
                self.job.between_steps(self.spec.model_id)
                continue
            request_id, call, body = item
            self.job.mark(PHASES.get(call["type"], "serving"))
            try:
                result, content_type = self.answer(call, body)
            except (CallError, BadRequest) as e:
                retrying(lambda: sessions.fail(self.r, request_id, str(e), "user"), "call failed")
            except (Cancelled, MemoryError):
                raise
            except Exception as e:  # a bug, or MLX's own error: the call's, not the session's
                log.exception("job %s: call %s (%s) failed", self.job.job_id, request_id, call["type"])
                retrying(lambda: sessions.fail(self.r, request_id, f"{type(e).__name__}: {e}", "server"), "call failed")
            else:
                retrying(lambda: sessions.answer(self.r, request_id, result, content_type), "call answered")

    # ------------------------------------------------------------------ the calls

    def answer(self, call: dict, body: bytes) -> tuple[bytes, str]:
        kind = call["type"]
        if kind == "create_model":
            return self.create_model(call)
        if kind == "sample":
            return self.sample(call)
        # load_weights with a LoRA config: create_training_client_from_state's new client
        client = self.create(call["model_id"]) if "lora" in call else self.client(call["model_id"])
        if kind == "forward_backward":
            return self.forward_backward(client, body)
        if kind == "optim_step":
            return self.optim_step(client, call)
        if kind == "save_weights":
            return self.save_weights(client, call)
        if kind == "load_weights":
            return self.load_weights(client, call)
        if kind == "snapshot_for_sampler":
            self.snapshots[call["sampler_id"]] = client.adapter_files()
            return as_json({"sampling_session_id": call["sampler_id"]})
        raise CallError(f"unknown call {kind!r}")

    def client(self, model_id: str) -> TrainingClient:
        if model_id not in self.clients:
            raise CallError(f"model {model_id} is not on this session's worker (its state is gone with an earlier "
                            "run of the job: load its last save_state into a new training client)")
        return self.clients[model_id]

    def create(self, model_id: str) -> TrainingClient:
        run = sessions.get_run(self.r, model_id)
        if run is None:
            raise CallError(f"model {model_id} not found")
        self.clients[model_id] = TrainingClient(self.model, LoraConfig(**run["lora"]))
        return self.clients[model_id]

    def create_model(self, call: dict) -> tuple[bytes, str]:
        self.create(call["model_id"])
        return as_json({"model_id": call["model_id"]})

    def forward_backward(self, client: TrainingClient, body: bytes) -> tuple[bytes, str]:
        wire = decode_forward_backward(body, max_datums=1 << 20, max_tokens=1 << 30)  # the API bounded it
        outputs, metrics = client.forward_backward([(d.tokens, d.inputs) for d in wire.data], wire.loss_fn,
                                                   wire.config, wire.forward_only)
        return encode_forward_backward_output(outputs, metrics), PROTOBUF

    def optim_step(self, client: TrainingClient, call: dict) -> tuple[bytes, str]:
        a = call["adam"]
        metrics = client.optim_step(a["learning_rate"], a["beta1"], a["beta2"], a["eps"], a["weight_decay"],
                                    a["grad_clip_norm"])
        self.steps += 1
        shown = {k.split(":")[0]: v for k, v in metrics.items()}  # Tinker's name:reduction, as the job's metrics
        self.job.write(event={"type": "session_step", "iter": self.steps, "model_id": call["model_id"], **shown},
                       progress={"iter": self.steps, **shown})
        return as_json({"metrics": metrics})

    def save_weights(self, client: TrainingClient, call: dict) -> tuple[bytes, str]:
        checkpoint_id = call["checkpoint_id"]
        files = client.state() if checkpoint_id.startswith("weights/") else client.adapter_files()
        sessions.save_checkpoint(self.r, call["model_id"], checkpoint_id, files, call.get("ttl_seconds"),
                                 call.get("user_metadata"))
        path = sessions.tinker_path(call["model_id"], checkpoint_id)
        return as_json({"path": path})

    def load_weights(self, client: TrainingClient, call: dict) -> tuple[bytes, str]:
        source_model, checkpoint_id = call["source"]
        files = sessions.checkpoint_files(self.r, source_model, checkpoint_id)
        if not files:
            raise CallError(f"checkpoint {sessions.tinker_path(source_model, checkpoint_id)} is gone")
        client.load_state(files, with_optimizer=call["optimizer"])
        return as_json({"model_id": call["model_id"], "path": sessions.tinker_path(source_model, checkpoint_id)})

    def sample(self, call: dict) -> tuple[bytes, str]:
        sampler = sessions.get_sampler(self.r, call["sampler_id"])
        if sampler is None:
            raise CallError(f"sampler {call['sampler_id']} not found")
        p = call["params"]
        stops = [p["stop"]] if isinstance(p["stop"], str) else p["stop"]
        stop_tokens = [s for s in stops or [] if isinstance(s, int)]
        stop_texts = [s for s in stops or [] if isinstance(s, str)]
        # No stop given: the model's EOS; an empty list: nothing stops it but max_tokens.
        eos_ids = self.eos_ids if stops is None or stop_texts else stop_tokens
        params = SamplingParams(p["max_tokens"], p["temperature"], p["top_p"], max(p["top_k"], 0))
        seed = p["seed"] % 2**32 if p["seed"] is not None else int.from_bytes(os.urandom(4), "little")
        prompt = call["tokens"]
        with ExitStack() as stack:
            model = stack.enter_context(adapter_swapped(self.model, self.sampler_dir(call["sampler_id"], sampler)))
            step = make_decode_step(model, params, eos_ids, self.eos_ids[0])
            samples = sample(model, step, [prompt], call["num_samples"], params, eos_ids, mx.random.key(seed),
                             self.job.should_stop)
            if samples is None:
                raise Cancelled()
            prompt_logprobs = self.prompt_logprobs(model, prompt) if call["prompt_logprobs"] else None
        tokens, logprobs, mask, ended = (np.array(a) for a in (samples.tokens, samples.logprobs, samples.mask, samples.ended))
        sequences = []
        for row in range(len(tokens)):
            n = int(mask[row].sum())
            seq = Sequence(tokens[row, :n].tolist(), logprobs[row, :n].tolist(), "stop" if ended[row] else "length")
            sequences.append(cut_at_stop_text(self.tokenizer, seq, stop_texts))
        return encode_sample_response(sequences, prompt_logprobs), PROTOBUF

    def prompt_logprobs(self, model, prompt: list[int]) -> list[float]:
        """log p(prompt[i] | prompt[:i]) at temperature 1; NaN for the first token (nothing before it)."""
        inputs, pad = left_pad([prompt[:1]], pad_id=0)
        rest = mx.array([prompt[1:]])
        logp = completion_logprobs(model, mx.concatenate([inputs, rest], axis=1), pad, rest, 1.0, 4096)
        return [math.nan, *np.array(logp[0]).tolist()]

    def sampler_dir(self, sampler_id: str, sampler: dict[str, str]) -> Path | None:
        """The sampler's adapter files on disk (mlx_lm loads them from there), or None: the base model."""
        if sampler_id in self.snapshots:
            files = self.snapshots[sampler_id]
        elif sampler["adapter"]:
            model_id, _, checkpoint_id = sampler["adapter"].partition("/")
            files = sessions.checkpoint_files(self.r, model_id, checkpoint_id)
            if not files:
                raise CallError(f"the checkpoint of sampler {sampler_id} ({sampler['model_path']}) is gone")
        else:
            return None
        where = self.scratch / sampler_id.replace(":", "_")
        if not (where / WEIGHTS_FILE).exists():
            where.mkdir(parents=True, exist_ok=True)
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                (where / name).write_bytes(files[name])
        return where


def cut_at_stop_text(tokenizer, seq: Sequence, stops: list[str]) -> Sequence:
    """The sequence up to the token that completes the first stop string (kept: Tinker returns the
    stop sequence), stop_reason "stop"; as it is where none occurs."""
    if not stops:
        return seq
    for n in range(1, len(seq.tokens) + 1):
        text = tokenizer.decode(seq.tokens[:n])
        if any(s in text for s in stops):
            return Sequence(seq.tokens[:n], seq.logprobs[:n], "stop")
    return seq


def as_json(value: dict) -> tuple[bytes, str]:
    return json.dumps(value).encode(), JSON
