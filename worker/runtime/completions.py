"""Chat and text completions, answered by the training process from the scoring queues
(shared/scoring.py; the API's side: api/routes/openai_chat.py). A request is

    {type: "generate", model_id, adapter_name?, tenant?, messages + tools? | prompt,
     max_tokens?, temperature, top_p, n, stop, seed?, stream, logprobs}

and its answer {choices: [{text, finish_reason, tool_calls?, logprobs?}], prompt_tokens,
completion_tokens, model_id, adapter_name}.

Batched across requests: the process takes the request at the head of the queue's turn (owners
in turn, as scoring), then the next ones in turn while they can share its decode (same adapter
and sampling, up to MAX_BATCH_ROWS rows and MAX_BATCH_POSITIONS positions), and decodes their
rows together (worker/decode/serving.py). It decodes until the time it was given ends (a busy
worker: its budget between two optimizer steps); the requests not finished then keep their
tokens (their parts) and go back to the head of their owners' lists, to go on at a later turn
from their prompt and those tokens. A stream gets each choice's new text after every chunk: what
is sure to stay (no half of a multi-byte character, nothing that may be the start of a stop string
or of a tool call). Tool calls are read at the end with the tokenizer's own syntax (as tool
episodes read them: worker/agentic/tools.py).

The requested adapter goes in with adapter_swapped, as for scoring, and each choice draws with
keys of its own (from the request's seed, or a fresh one; a key per token), so a seed gives the same
choices in any batch and across turns, and a busy worker's job keeps its weights, optimizer state
and random state.
"""

import json
import logging
import os
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from jinja2 import TemplateError

from shared import scoring
from shared.metrics import recorder
from shared.settings import Settings
from worker.agentic.conversation import Conversation
from worker.agentic.episode import EpisodeFailed
from worker.agentic.tools import call_syntax, find_blocks
from worker.decode.draw import SamplingParams
from worker.decode.sampling import draw_keys, make_decode_step
from worker.decode.serving import decode
from worker.runtime.adapter_layers import adapter_swapped
from worker.runtime.logprobs import eos_token_ids
from worker.runtime.models import ModelNotFound, get_model
from worker.runtime.score_requests import AdapterNotFound, Refused, adapter_files

log = logging.getLogger(__name__)
MAX_BATCH_ROWS = 16  # rows (choices) decoded together
MAX_BATCH_POSITIONS = 65_536  # the batch's KV positions (rows x their prompt and limit): its memory
MAX_TOOL_CALLS = 16  # read from one answer


@dataclass
class Choice:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    sent: int = 0  # characters of its text streamed so far


@dataclass
class Pending:
    """A claimed request: its id, body, prompt tokens, each choice's state, token limit."""

    request_id: str
    request: dict
    prompt: list[int]
    choices: list[Choice]
    limit: int
    cancelled: bool = False

    def open_rows(self) -> list[int]:
        return [i for i, c in enumerate(self.choices) if c.finish is None]


def batch_key(request: dict) -> tuple:
    """Requests that can share a decode: same adapter (an adapter is read as its owner's) and sampling."""
    adapter = (request.get("adapter_name"), request.get("tenant")) if request.get("adapter_name") else None
    return adapter, request.get("temperature", 1.0), request.get("top_p", 1.0)


def prompt_tokens(tokenizer, request: dict) -> list[int]:
    """The request's prompt: chat messages as the chat template renders them for a reply (the
    tokens a multi-turn GRPO episode starts from), or text as `tokenizer.encode` gives it (as
    mlx_lm.generate takes a text prompt). Refused (400) when the template cannot render them."""
    if "messages" not in request:
        return list(tokenizer.encode(request["prompt"]))
    try:
        return Conversation(tokenizer, request["messages"], request.get("tools")).prompt_tokens()
    except (EpisodeFailed, TemplateError) as e:
        raise Refused(f"messages: {e}", 400) from None


def pending(tokenizer, settings: Settings, context: int | None, request_id: str, request: dict,
            parts: list[dict]) -> Pending:
    """The claimed request with the tokens its earlier turns drew (its parts). Its limit: its
    max_tokens (else MTQ_MAX_COMPLETION_TOKENS), within the model's context."""
    prompt = prompt_tokens(tokenizer, request)
    if context and len(prompt) >= context:
        raise Refused(f"the prompt is {len(prompt)} tokens; the model's context is {context} tokens", 400)
    limit = request.get("max_tokens") or settings.max_completion_tokens
    if context:
        limit = min(limit, context - len(prompt))
    choices = [Choice() for _ in range(request.get("n", 1))]
    if parts:  # each part holds the choices as they were at the end of a turn
        last = parts[-1]
        choices = [Choice(list(t), list(lp), f) for t, lp, f in zip(last["tokens"], last["logprobs"], last["finish"])]
    return Pending(request_id, request, prompt, choices, limit)


def admitted(r, items: list[Pending]) -> list[Pending]:
    """The requests whose rows fit the batch's positions (the first always does); the others go
    back to their owners' lists for the next turn."""
    kept, positions = [], 0
    for p in items:
        size = sum(len(p.prompt) + p.limit for _ in p.open_rows())
        if kept and positions + size > MAX_BATCH_POSITIONS:
            scoring.put_back(r, p.request_id)
            continue
        kept.append(p)
        positions += size
    return kept


class Batch:
    """The requests decoded together, the rows of their open choices, and what becomes of each
    chunk: text deltas pushed to streams, rows ended at a stop string or their limit."""

    def __init__(self, r, tokenizer, eos_ids: list[int], items: list[Pending], until: float):
        self.r, self.tokenizer, self.eos_ids, self.items, self.until = r, tokenizer, set(eos_ids), items, until
        self.rows = [(p, i) for p in items for i in p.open_rows()]
        self.syntax = call_syntax(tokenizer)
        for p in items:  # what earlier turns streamed: the same function of the same tokens
            for c in p.choices:
                c.sent = len(self.sendable(p, c))

    def detokenized(self, tokens: list[int]) -> str:
        """The tokens' text as mlx_lm's generate and server give it (its streaming detokenizer)."""
        d = self.tokenizer.detokenizer
        d.reset()
        for t in tokens:
            if t not in self.eos_ids:
                d.add_token(t)
        d.finalize()
        return d.text

    def text(self, p: Pending, c: Choice) -> str:
        return self.detokenized(c.tokens)

    def on_chunk(self, tokens: list[list[int]], logprobs: list[list[float]]) -> np.ndarray | None:
        ended = np.zeros(len(self.rows), dtype=bool)
        self.look_for_cancels()
        for row, ((p, i), new, logps) in enumerate(zip(self.rows, tokens, logprobs)):
            c = p.choices[i]
            if c.finish is not None or p.cancelled:
                ended[row] = True
                continue
            room = p.limit - len(c.tokens)
            c.tokens += new[:room]
            c.logprobs += logps[:room]
            if any(t in self.eos_ids for t in new[:room]):
                c.finish = "stop"
            elif len(c.tokens) >= p.limit:
                c.finish = "length"
            self.cut_at_stop(p, c)
            ended[row] = c.finish is not None
        self.stream()
        return None if time.monotonic() >= self.until else ended

    def cut_at_stop(self, p: Pending, c: Choice) -> None:
        """End the choice at the first stop string in its text (its tokens up to the one that
        completes it; the text is cut before it when answered)."""
        stops = p.request.get("stop") or []
        if not stops or not any(s in self.text(p, c) for s in stops):
            return
        n = next(n for n in range(1, len(c.tokens) + 1)
                 if any(s in self.detokenized(c.tokens[:n]) for s in stops))
        del c.tokens[n:], c.logprobs[n:]
        c.finish = "stop"

    def final_text(self, p: Pending, c: Choice) -> str:
        text = self.text(p, c)
        cuts = [text.find(s) for s in p.request.get("stop") or [] if s in text]
        return text[:min(cuts)] if cuts else text

    def sendable(self, p: Pending, c: Choice) -> str:
        """The part of the choice's text a stream may have now: all of it once it finished
        (before its stop string, tool calls aside); before that, without a trailing partial
        character, nor a tail that may be the start of a stop string or of a tool call."""
        text = self.final_text(p, c)
        markers = list(p.request.get("stop") or [])
        if p.request.get("tools"):
            start = text.find(self.syntax.start)
            text = text if start < 0 else text[:start]
            markers.append(self.syntax.start)
        if c.finish is not None:
            return text
        text = text.rstrip("\ufffd")
        return text[:len(text) - unsure_tail(text, markers)]

    def stream(self) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            for p in self.items:
                if not p.request.get("stream"):
                    continue
                for i, c in enumerate(p.choices):
                    text = self.sendable(p, c)
                    if len(text) > c.sent:
                        pipe.rpush(scoring.stream_key(p.request_id), json.dumps({"index": i, "text": text[c.sent:]}))
                        c.sent = len(text)
                pipe.expire(scoring.stream_key(p.request_id), scoring.SCORE_TTL_S)
            pipe.execute()

    def look_for_cancels(self) -> None:
        """A stream whose client went away is ended (the API marks it cancelled)."""
        with self.r.pipeline(transaction=False) as pipe:
            for p in self.items:
                pipe.hget(scoring.score_key(p.request_id), "cancelled")
            for p, flag in zip(self.items, pipe.execute()):
                p.cancelled = p.cancelled or flag is not None

    def answer(self, p: Pending) -> dict:
        choices = []
        for c in p.choices:
            text, calls = self.final_text(p, c), []
            if p.request.get("tools") and self.syntax.start in text:
                text, calls = self.tool_calls(p, text)
            choice = {"text": text, "finish_reason": "tool_calls" if calls else c.finish}
            if calls:
                choice["tool_calls"] = calls
            if p.request.get("logprobs"):
                choice["logprobs"] = [{"token": self.tokenizer.decode([t]), "logprob": lp}
                                      for t, lp in zip(c.tokens, c.logprobs)]
            choices.append(choice)
        return {"choices": choices, "prompt_tokens": len(p.prompt),
                "completion_tokens": sum(len(c.tokens) for c in p.choices),
                "model_id": p.request["model_id"], "adapter_name": p.request.get("adapter_name")}

    def tool_calls(self, p: Pending, text: str) -> tuple[str, list[dict]]:
        """The text before the first call, and the calls that parse (those that do not stay text)."""
        blocks, _ = find_blocks(text, self.syntax, MAX_TOOL_CALLS)
        calls = []
        for block in blocks:
            try:
                parsed = self.syntax.parse(block, p.request["tools"]) if block is not None else None
            except Exception:  # the model's text, not ours: what does not parse is no call
                parsed = None
            for call in parsed if isinstance(parsed, list) else [parsed] if parsed else []:
                if isinstance(call, dict) and isinstance(call.get("name"), str):
                    arguments = call.get("arguments", {})
                    calls.append({"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                                  else json.dumps(arguments)})
        return (text[:text.find(self.syntax.start)] if calls else text), calls


def unsure_tail(text: str, markers: list[str]) -> int:
    """The length of the longest end of `text` that is the start of one of the markers."""
    return max((k for m in markers for k in range(1, min(len(m), len(text) + 1)) if text.endswith(m[:k])), default=0)


def choice_keys(p: Pending) -> list[np.ndarray]:
    """Each choice's random keys, one per token up to its limit: from the request's seed (or a
    fresh one) alone, so that a seed gives the same choices whatever the request is batched with
    and at whichever turn it goes on."""
    seed = p.request.get("seed")
    key = mx.random.key(seed % 2**32 if seed is not None else int.from_bytes(os.urandom(4), "little"))
    return [draw_keys(k, p.limit) for k in mx.random.split(key, len(p.choices))]


def claim_batch(r, queue: str, first: tuple[str, dict, list]) -> list[tuple[str, dict, list]]:
    """The first request and the next ones in turn that can share its decode."""
    claimed = [first]
    rows = first[1].get("n", 1)
    while rows < MAX_BATCH_ROWS:
        nxt = scoring.claim(r, queue)
        if nxt is None:
            break
        if nxt[1].get("type") != "generate" or batch_key(nxt[1]) != batch_key(first[1]) \
                or rows + nxt[1].get("n", 1) > MAX_BATCH_ROWS:
            scoring.put_back(r, nxt[0])
            break
        claimed.append(nxt)
        rows += nxt[1].get("n", 1)
    return claimed


def serve(r, settings: Settings, queue: str, first: tuple[str, dict, list], until: float) -> None:
    """Decode the batch that starts with `first` until its requests are answered or `until`
    passes (the rest go back, with their parts)."""
    request = first[1]
    claimed = claim_batch(r, queue, first)
    try:
        model, tokenizer, _ = get_model(request["model_id"], settings)
        name = request.get("adapter_name")
        adapter = adapter_files(r, settings, request["model_id"], name, request.get("tenant")) if name else None
    except (ModelNotFound, AdapterNotFound) as e:
        error = f"Model not found: {request['model_id']}" if isinstance(e, ModelNotFound) else str(e)
        for request_id, *_ in claimed:
            scoring.answer(r, request_id, error=error, error_status=404)
        return
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    items = []
    for request_id, req, parts in claimed:
        try:
            items.append(pending(tokenizer, settings, context, request_id, req, parts))
        except Refused as e:
            scoring.answer(r, request_id, error=str(e), error_status=e.status)
    items = admitted(r, items)
    eos_ids = eos_token_ids(tokenizer)
    batch = Batch(r, tokenizer, eos_ids, items, until)
    if not batch.rows:
        return
    recorder.observe("mtq_completion_batch_rows", len(batch.rows))
    recorder.flush(r)
    try:
        params = SamplingParams(max_tokens=max(p.limit for p in items), temperature=request.get("temperature", 1.0),
                                top_p=request.get("top_p", 1.0))
        keys = {p.request_id: choice_keys(p) for p in items}
        with adapter_swapped(model, adapter):
            step = make_decode_step(model, params, eos_ids, eos_ids[0])
            decode(model, step, [p.prompt + p.choices[i].tokens for p, i in batch.rows],
                   [keys[p.request_id][i][len(p.choices[i].tokens):] for p, i in batch.rows], params, eos_ids,
                   batch.on_chunk)
    except Exception as e:
        log.exception("completion batch failed")
        for p in items:
            scoring.answer(r, p.request_id, error=f"Completion failed: {type(e).__name__}: {e}", error_status=500)
        return
    for p in items:
        if p.cancelled or not p.open_rows():
            scoring.answer(r, p.request_id, result=batch.answer(p))
        else:
            scoring.add_part(r, p.request_id, [{"tokens": [c.tokens for c in p.choices], "logprobs": [
                c.logprobs for c in p.choices], "finish": [c.finish for c in p.choices]}])
            scoring.put_back(r, p.request_id)
