"""Log-prob scoring, answered by the training process (queue and records: shared/scoring.py).

    logprob(completion | prompt) = sum_t log softmax(logits_t / T)[c_t]

over the completion tokens c_t, each predicted from the prompt and the completion tokens
before it (teacher forcing), with raw logits (T = 1) unless the batch form names a
temperature. The prompt is tokenised exactly as the GRPO trainer tokenises it
(worker/logprobs.py prompt_token_ids: raw text by default, the chat template on request), the
completion with `tokenizer.encode` without special tokens, and rows are scored in padded
batches with the trainer's own forward (worker/logprobs.py completion_logprobs).

A worker busy with a training job answers between optimizer steps, on the model it holds:
`adapter_swapped` (worker/adapters.py) takes the job's LoRA layers out, puts the requested adapter (or none: the
base model) in, and puts the job's very LoRA modules back afterwards, so the job's weights,
optimizer state, compiled functions and random state are untouched (scoring draws no
random numbers and runs in eval mode).
"""

import functools
import logging
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from shared import scoring
from shared.adapters import HEAD_FILE, WEIGHTS_FILE, cached_copy
from shared.jobstore import connect
from shared.keys import ADAPTERS_INDEX, adapter_key
from shared.lifecycle import adapter_ref
from shared.metrics import recorder
from shared.settings import Settings
from worker.adapters import adapter_swapped
from worker.logprobs import as_item, completion_logprobs, completion_token_ids, prompt_token_ids
from worker.memory import logits_chunk_tokens, model_shape
from worker.models import ModelNotFound, get_model
from worker.reward_head import load_head, score_completions
from worker.rewards.batch import RewardError
from worker.sampling import left_pad

log = logging.getLogger(__name__)
ROWS_PER_BATCH = 16  # rows scored in one padded forward pass
BUDGET_BETWEEN_STEPS_S = 2.0  # a busy worker answers for at most this long between two steps


class AdapterNotFound(Exception):
    pass


def adapter_files(r, settings: Settings, model_id: str, adapter_name: str) -> Path:
    """The adapter of the newest completed job for (model_id, adapter_name), from its copy in
    Redis into this worker's cache (any worker can score with any adapter, no shared disk)."""
    job_id = r.hget(ADAPTERS_INDEX, adapter_ref(model_id, adapter_name))
    blobs = {} if job_id is None else r.hgetall(adapter_key(job_id.decode()))
    if not blobs:
        raise AdapterNotFound(f"Adapter not found: {model_id}/{adapter_name}")
    if WEIGHTS_FILE.encode() not in blobs:
        raise AdapterNotFound(f"Adapter not found: {model_id}/{adapter_name} (a full fine-tune's model directory, not an adapter)")
    return cached_copy(settings, f"adapters/{job_id.decode()}", {k.decode(): v for k, v in blobs.items()})


def score_rows(model: nn.Module, tokenizer, rows: list[tuple[list[int], list[int]]], temperature: float) -> list[dict]:
    """{logprob, token_count, per_token} for each (prompt ids, completion ids) row."""
    results: list[dict | None] = [None] * len(rows)
    vocab = model_shape(model).vocab
    todo = [i for i, (_, c) in enumerate(rows) if c]
    for i, (_, c) in enumerate(rows):
        if not c:  # an empty completion has nothing to score
            results[i] = {"logprob": 0.0, "token_count": 0, "per_token": []}
    for start in range(0, len(todo), ROWS_PER_BATCH):
        chunk = todo[start:start + ROWS_PER_BATCH]
        prompts, pad = left_pad([rows[i][0] for i in chunk], pad_id=0)
        width = max(len(rows[i][1]) for i in chunk)
        completion = mx.array([rows[i][1] + [0] * (width - len(rows[i][1])) for i in chunk], dtype=mx.int32)
        inputs = mx.concatenate([prompts, completion], axis=1)
        logp = completion_logprobs(model, inputs, pad, completion, temperature, logits_chunk_tokens(vocab))
        logp = np.array(logp.astype(mx.float32))
        for k, i in enumerate(chunk):
            per_token = logp[k, : len(rows[i][1])].tolist()
            results[i] = {"logprob": float(sum(per_token)), "token_count": len(per_token), "per_token": per_token}
    return results  # type: ignore[return-value]


def tokenize(tokenizer, prompt, completion: str, use_chat_template: bool) -> tuple[list[int], list[int]]:
    return prompt_token_ids(tokenizer, as_item(prompt), use_chat_template), completion_token_ids(tokenizer, completion)


def reward_model_rewards(settings: Settings, model_id: str, adapter_name: str, prompts: list[str],
                         completions: list[str], r=None) -> list[float]:
    """Rewards from a reward job's adapter and value head (worker/reward_head.py), on the
    model this process keeps loaded. Raises RewardError when the reward model is unusable."""
    r = r or _redis(settings)
    try:
        model, tokenizer, _ = get_model(model_id, settings)
        adapter = adapter_files(r, settings, model_id, adapter_name)
    except (ModelNotFound, AdapterNotFound) as e:
        raise RewardError(f"reward model: {e}") from None
    if not (adapter / HEAD_FILE).is_file():
        raise RewardError(f"reward model: adapter {model_id}/{adapter_name} has no value head (not a reward job's)")
    with adapter_swapped(model, adapter):
        return score_completions(model, tokenizer, load_head(adapter), prompts, completions)


@functools.lru_cache
def _redis(settings: Settings):
    return connect(settings.redis_url)


def serve_one(r, settings: Settings, request_id: str, request: dict) -> None:
    """Answer one request, log-probs or (type "reward") rewards, and record the answer
    (errors included: the API reports them). Its time reaches /metrics before the answer
    does, so a client that got the answer finds it counted."""
    t0 = time.perf_counter()
    answer = _compute(r, settings, request_id, request)
    recorder.observe("mtq_score_request_seconds", time.perf_counter() - t0)
    recorder.flush(r)
    scoring.answer(r, request_id, **answer)


def _compute(r, settings: Settings, request_id: str, request: dict) -> dict:
    """scoring.answer's keyword arguments: the result, or the error and its HTTP status."""
    t0 = time.perf_counter()
    try:
        if request.get("type") == "reward":
            rewards = reward_model_rewards(settings, request["model_id"], request["adapter_name"],
                                           [request["prompt"]] * len(request["completions"]), request["completions"], r)
            return {"result": {"rewards": rewards, "model_id": request["model_id"],
                               "adapter_name": request["adapter_name"]}}
        model, tokenizer, _ = get_model(request["model_id"], settings)
        adapter = None
        if request.get("adapter_name"):
            adapter = adapter_files(r, settings, request["model_id"], request["adapter_name"])
        rows = [tokenize(tokenizer, it["prompt"], it["completion"], request.get("use_chat_template", False))
                for it in request["items"]]
        with adapter_swapped(model, adapter):
            results = score_rows(model, tokenizer, rows, request.get("temperature") or 1.0)
    except RewardError as e:  # the reward model: its model or adapter is missing or not one
        return {"error": str(e).removeprefix("reward model: "), "error_status": 404}
    except ModelNotFound:
        return {"error": f"Model not found: {request['model_id']}", "error_status": 404}
    except AdapterNotFound as e:
        return {"error": str(e), "error_status": 404}
    except Exception as e:
        log.exception("scoring request %s failed", request_id)
        return {"error": f"Scoring failed: {type(e).__name__}: {e}", "error_status": 500}
    return {"result": {"results": results, "model_id": request["model_id"],
                       "adapter_name": request.get("adapter_name"), "seconds": time.perf_counter() - t0}}


def serve_waiting(r, settings: Settings, model_id: str | None = None, wait_s: float = 0.0) -> int:
    """Answer waiting requests for `model_id` (None: any model, waiting up to wait_s for the
    first), for at most BUDGET_BETWEEN_STEPS_S. Returns how many were answered."""
    deadline = time.monotonic() + BUDGET_BETWEEN_STEPS_S
    served = 0
    while time.monotonic() < deadline:
        if model_id is None:
            claimed = scoring.claim_any(r, wait_s if served == 0 else 0.0)
        else:
            claimed = scoring.claim_for_model(r, model_id)
        if claimed is None:
            break
        serve_one(r, settings, *claimed)
        served += 1
    return served
