"""Scoring requests, answered by the training process (queues and records: shared/scoring.py):
log-probs, and rewards from a reward job's model.

    logprob(completion | prompt) = sum_t log softmax(logits_t / T)[c_t]

over the completion tokens c_t, each predicted from the prompt and the completion tokens
before it (teacher forcing), with raw logits (T = 1) unless the batch form names a
temperature. The prompt is tokenised exactly as the GRPO trainer tokenises it
(worker/runtime/logprobs.py prompt_token_ids: raw text by default, the chat template on request), the
completion with `tokenizer.encode` without special tokens, and rows are scored in padded
batches with the trainer's own forward (worker/runtime/logprobs.py completion_logprobs). A row longer
than the model's context is refused (400) before anything is scored.

A conversation item ({messages, tools?}) is the whole conversation as the chat template renders
it with tools=, scored at the tokens an SFT job with assistant_only_loss trains (its assistant
messages of weight 1: worker/kinds/sft_job.py assistant_tokens, the one function for that mask);
as a row, its prompt is the tokens before the first of them.

A worker busy with a training job answers between optimizer steps, on the model it holds, for
at most a budget, and any one request for a slice of it a turn (worker/runtime/request_loop.py):
rows are scored CHUNK_TOKENS at a time, and a request with rows left keeps what it has (its parts) and
goes back to the head of its owner's list, to continue at a later turn, after a step. So a
large batch is spread over steps, and other owners' requests go in between. `adapter_swapped`
(worker/runtime/adapter_layers.py) takes the job's LoRA layers out, puts the requested adapter (or none:
the base model) in, and puts the job's very LoRA modules back afterwards, so the job's weights,
optimizer state, compiled functions and random state are untouched (scoring draws no random
numbers and runs in eval mode).
"""

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from jinja2 import TemplateError

from shared import scoring
from shared.adapters import HEAD_FILE, WEIGHTS_FILE, adapter_ref, cached_copy
from shared.datasets import DatasetError
from shared.jobstore import connect
from shared.keys import ADAPTERS_INDEX, adapter_key, job_key
from shared.metrics import recorder
from shared.settings import Settings
from worker.kinds.reward_head import load_head, score_completions
from worker.kinds.sft_job import assistant_tokens
from worker.rewards.batch import RewardError
from worker.runtime.adapter_layers import adapter_swapped
from worker.runtime.logprobs import as_item, completion_logprobs, completion_token_ids, left_pad, pair_tokens, prompt_token_ids
from worker.runtime.memory_plan import logits_chunk_tokens, model_shape
from worker.runtime.models import ModelNotFound, get_model

log = logging.getLogger(__name__)
ROWS_PER_BATCH = 16  # rows scored in one padded forward pass
CHUNK_TOKENS = 512  # tokens scored between two looks at the clock (one row at least)


class AdapterNotFound(Exception):
    pass


class Refused(Exception):
    """A request that cannot be answered as asked: the API answers it with `status`."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def adapter_files(r, settings: Settings, model_id: str, adapter_name: str, tenant: str | None = None) -> Path:
    """The adapter of the newest completed job for (model_id, adapter_name), from its copy in
    Redis into this worker's cache (any worker can score with any adapter, no shared disk).
    tenant: only an adapter of that owner's jobs (another's reads as missing)."""
    job_id = r.hget(ADAPTERS_INDEX, adapter_ref(model_id, adapter_name))
    if job_id is not None and tenant is not None and r.hget(job_key(job_id.decode()), "owner") != tenant.encode():
        job_id = None  # another owner's: as if there were none
    blobs = {} if job_id is None else r.hgetall(adapter_key(job_id.decode()))
    if not blobs:
        raise AdapterNotFound(f"Adapter not found: {model_id}/{adapter_name}")
    if WEIGHTS_FILE.encode() not in blobs:
        raise AdapterNotFound(f"Adapter not found: {model_id}/{adapter_name} (a full fine-tune's model directory, not an adapter)")
    return cached_copy(settings, f"adapters/{job_id.decode()}", {k.decode(): v for k, v in blobs.items()})


Row = tuple[list[int], list[int], list[int]]  # prompt ids, completion ids, 1 where a completion token is scored


def score_rows(model: nn.Module, tokenizer, rows: list[Row], temperature: float) -> list[dict]:
    """{logprob, token_count, per_token} for each row, over its scored completion tokens."""
    results: list[dict | None] = [None] * len(rows)
    vocab = model_shape(model).vocab
    todo = [i for i, (_, c, _) in enumerate(rows) if c]
    for i, (_, c, _) in enumerate(rows):
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
            per_token = [x for x, scored in zip(logp[k, : len(rows[i][1])].tolist(), rows[i][2]) if scored]
            results[i] = {"logprob": float(sum(per_token)), "token_count": len(per_token), "per_token": per_token}
    return results  # type: ignore[return-value]


def tokenize(tokenizer, item: dict, use_chat_template: bool) -> Row:
    if "messages" in item:
        return conversation_row(tokenizer, item)
    completion = completion_token_ids(tokenizer, item["completion"])
    return prompt_token_ids(tokenizer, as_item(item["prompt"]), use_chat_template), completion, [1] * len(completion)


def conversation_row(tokenizer, item: dict) -> Row:
    """A conversation's tokens as a row: the prompt up to its first scored token. Refused (400)
    when the tokenizer has no chat template (as multi-turn GRPO jobs fail then:
    worker/agentic/conversation.py), or its template does not render the conversation turn by
    turn or refuses the messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise Refused("conversations are rendered with the tokenizer's chat template, and this model's tokenizer "
                      "has none", 400)
    try:
        tokens, mask = assistant_tokens(tokenizer, item)
    except (DatasetError, TemplateError) as e:  # TemplateError: the template refused the messages (raise_exception)
        raise Refused(f"conversation: {e}", 400) from None
    start = next((t for t, on in enumerate(mask) if on), len(mask))
    return tokens[:start], tokens[start:], mask[start:]


def reward_model_rewards(settings: Settings, model_id: str, adapter_name: str, prompts: list[str],
                         completions: list[str], r=None, tenant: str | None = None) -> list[float]:
    """Rewards from a reward job's adapter and value head (worker/kinds/reward_head.py), on the
    model this process keeps loaded (tenant: only that owner's reward models). Raises
    RewardError when the reward model is unusable."""
    r = r or _redis(settings)
    try:
        model, tokenizer, _ = get_model(model_id, settings)
        adapter = reward_adapter(r, settings, model_id, adapter_name, tenant)
    except (ModelNotFound, AdapterNotFound) as e:
        raise RewardError(f"reward model: {e}") from None
    with adapter_swapped(model, adapter):
        return score_completions(model, tokenizer, load_head(adapter), prompts, completions)


def reward_adapter(r, settings: Settings, model_id: str, adapter_name: str, tenant: str | None) -> Path:
    """A reward job's adapter (adapter_files), with its value head."""
    adapter = adapter_files(r, settings, model_id, adapter_name, tenant)
    if not (adapter / HEAD_FILE).is_file():
        raise AdapterNotFound(f"Adapter not found: {model_id}/{adapter_name} (no value head: not a reward job's)")
    return adapter


@functools.lru_cache
def _redis(settings: Settings):
    return connect(settings.redis_url)


# --------------------------------------------------------------------------- one request, in parts


@dataclass
class Work:
    """A request ready to score: its model and adapter, each row's tokens, how to score rows
    [start, end), and its answer from every row's result."""

    model: nn.Module
    adapter: Path | None
    lengths: list[int]
    score: Callable[[int, int], list]
    answer: Callable[[list], dict]


def prepare(r, settings: Settings, request: dict) -> Work:
    """The request's Work. Refused (400) when a row does not fit the model's context; ModelNotFound,
    AdapterNotFound otherwise."""
    model_id, name = request["model_id"], request.get("adapter_name")
    model, tokenizer, _ = get_model(model_id, settings)
    if request.get("type") == "reward":
        adapter = reward_adapter(r, settings, model_id, name, request.get("tenant"))
        head, prompt, completions = load_head(adapter), request["prompt"], request["completions"]
        lengths = [len(pair_tokens(tokenizer, prompt, c)[0]) for c in completions]
        work = Work(model, adapter, lengths,
                    lambda a, b: score_completions(model, tokenizer, head, [prompt] * (b - a), completions[a:b]),
                    lambda rewards: {"rewards": rewards, "model_id": model_id, "adapter_name": name})
        what = "completions"
    else:
        adapter = adapter_files(r, settings, model_id, name, request.get("tenant")) if name else None
        rows = [tokenize(tokenizer, it, request.get("use_chat_template", False)) for it in request["items"]]
        temperature = request.get("temperature") or 1.0
        work = Work(model, adapter, [len(p) + len(c) for p, c, _ in rows],
                    lambda a, b: score_rows(model, tokenizer, rows[a:b], temperature),
                    lambda results: {"results": results, "model_id": model_id, "adapter_name": name})
        what = "items"
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    too_long = [i for i, n in enumerate(work.lengths) if context and n > context]
    if too_long:
        raise Refused(f"{what}[{too_long[0]}] is {work.lengths[too_long[0]]} tokens (prompt and completion); that "
                      f"exceeds the model's context of {context} tokens", 400)
    return work


def chunk_end(lengths: list[int], start: int, tokens: int = CHUNK_TOKENS) -> int:
    """The end of the run of rows from `start` that holds about `tokens` tokens (one row at least)."""
    end, total = start + 1, lengths[start]
    while end < len(lengths) and total + lengths[end] <= tokens:
        total += lengths[end]
        end += 1
    return end


def serve_one(r, settings: Settings, request_id: str, request: dict, done: list, until: float) -> bool:
    """Score the request's rows after the `done` ones until they are all done (then record the
    answer, errors included: the API reports them) or the clock passes `until` (then keep the
    new part and put the request back). True once answered. Its time reaches /metrics before
    the answer does, so a client that got the answer finds it counted."""
    t0 = time.perf_counter()
    try:
        work = prepare(r, settings, request)
        results = list(done)
        with adapter_swapped(work.model, work.adapter):
            while len(results) < len(work.lengths):
                if len(results) > len(done) and time.monotonic() >= until:  # a chunk a turn at least
                    scoring.add_part(r, request_id, results[len(done):])
                    scoring.put_back(r, request_id)
                    return False
                results += work.score(len(results), chunk_end(work.lengths, len(results)))
        answer = {"result": work.answer(results)}
    except Refused as e:
        answer = {"error": str(e), "error_status": e.status}
    except ModelNotFound:
        answer = {"error": f"Model not found: {request['model_id']}", "error_status": 404}
    except AdapterNotFound as e:
        answer = {"error": str(e), "error_status": 404}
    except Exception as e:
        log.exception("scoring request %s failed", request_id)
        answer = {"error": f"Scoring failed: {type(e).__name__}: {e}", "error_status": 500}
    recorder.observe("mtq_score_request_seconds", time.perf_counter() - t0)
    recorder.flush(r)
    scoring.answer(r, request_id, **answer)
    return True
