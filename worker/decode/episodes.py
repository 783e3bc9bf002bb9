"""The multi-turn decode (docs/agentic.md): every row of a GRPO step is an episode of up to
max_turns model turns, each answered by its tools or environment (`answer`, run on a thread
pool while the other rows go on decoding), the answer's tokens appended to the row's KV cache.

Rows decode together in one compiled step, as in worker/decode/sampling.py, over KV buffers in
which a row's tokens need not be contiguous (EpisodeSlots' `valid`): a row whose turn ended waits,
its slots masked, while the others decode. No row waits for another's turn: at each look (every
CHUNK decode steps, sooner while answers are on their way) the rows whose answers are in get
their last token and the appended tokens in one prefill pass of those rows only (left-padded
within it), which also gives the first token of their next turn; the other rows skip its slots.
When the buffers fill, each row's valid slots are packed to their end (a gather: no token is
recomputed).

A row ends at an EOS that nothing answers, when its answer does not fit the episode's tokens,
at max_turns, or when its model tokens reach max_tokens (max_completion_len) or its episode's
tokens (model and appended) reach episode_len. `ended` is false where a bound cut it.
"""

import math
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from worker.decode import attention_kernel
from worker.decode.draw import Samples, SamplingParams, draw
from worker.decode.graph_patches import lora_args
from worker.decode.kv_cache import EpisodeSlots, StaticKVCache
from worker.decode.sampling import CHUNK, draw_keys, is_eos, make_decode_forward
from worker.runtime.logprobs import left_pad, lm_head

CAPACITY_BUCKET = 256  # KV buffers grow by this many slots, so that the step compiles for few shapes
KEYS_BLOCK = 256  # random keys split off at a time (_Keys)

# answer(row, its turn's tokens, EOS included unless a bound cut the turn) -> tokens to append,
# or None: the episode is done.
Answer = Callable[[int, list[int]], list[int] | None]


@dataclass(frozen=True)
class Limits:
    max_turns: int
    episode_len: int  # tokens after the prompt, the model's and the appended ones


@dataclass
class Episodes:
    samples: Samples  # the tokens after each prompt: mask marks the model's (only they have log-probs)
    turns: list[list[tuple[int, int]]]  # each row's model turns as [start, end) of samples' columns
    appended_tokens: int  # prefilled after the prompts (the last token of a turn included)
    decode_steps: int  # compiled decode steps run (each forwards one token of every row)


def make_episode_step(model: nn.Module, params: SamplingParams, eos_ids: list[int], pad_id: int,
                      dense: bool = False) -> Callable:
    """One compiled decode step of a multi-turn decode: each live row forwards its last token,
    which becomes a valid slot of its own, and draws the next. Returns
    step(tokens, keys, values, write_pos, positions, valid, live, remaining, key, lora, rows) ->
    (next tokens, their log-probs, entropies, which rows drew (`live` before the step), live
    after it, remaining, valid, positions, keys, values); remaining: tokens each row may still
    draw in its turn."""
    forward, constant = make_decode_forward(model, dense, attention_kernel.cuda())
    numbers = params.inputs()  # inputs, not numbers compiled into the kernels (worker/runtime/scalars.py)

    def step(tokens, keys, values, write_pos, positions, valid, live, remaining, key, lora, rows):
        capacity = keys[0].shape[2]
        slots = EpisodeSlots(capacity, write_pos, positions, valid, 1)
        caches = [StaticKVCache(capacity, slots, k, v) for k, v in zip(keys, values)]
        logits = forward(tokens, caches, slots, lora, None)
        nxt, logp, ent = draw(logits, key, params, rows, numbers)
        nxt = mx.where(live, nxt, pad_id)
        valid = valid | ((mx.arange(capacity) == write_pos)[None, :] & live[:, None])
        positions = positions + live
        remaining = remaining - live
        drew = live
        live = live & ~is_eos(nxt, eos_ids) & (remaining > 0)
        return nxt, logp, ent, drew, live, remaining, valid, positions, [c.keys for c in caches], [c.values for c in caches]

    return mx.compile(step, inputs=[numbers]) if constant else mx.compile(step, inputs=[model.state, numbers])


class _Buffers:
    """The KV buffers of all rows, which slots of them are whose (valid), and each row's next
    RoPE position."""

    def __init__(self, rows: int, layers: int, capacity: int):
        self.capacity, self.write_pos = capacity, 0
        self.keys: list = [None] * layers
        self.values: list = [None] * layers
        self.valid = mx.zeros((rows, capacity), dtype=mx.bool_)
        self.positions = mx.zeros((rows,), dtype=mx.int32)

    def grow(self, need: int) -> None:
        """At least `need` slots (in buckets)."""
        if need <= self.capacity:
            return
        extra = math.ceil((need - self.capacity) / CAPACITY_BUCKET) * CAPACITY_BUCKET
        widen = [(0, 0), (0, 0), (0, extra), (0, 0)]
        self.keys = [None if k is None else mx.pad(k, widen) for k in self.keys]
        self.values = [None if v is None else mx.pad(v, widen) for v in self.values]
        self.valid = mx.pad(self.valid, [(0, 0), (0, extra)])
        self.capacity += extra

    def pack(self) -> None:
        """Each row's valid slots, in order, moved to end at the same slot: the gaps of the
        rows that waited are dropped, so the buffers need no more slots than the longest row."""
        valid = np.array(self.valid)
        counts = valid.sum(axis=1)
        width = int(counts.max())
        index = np.zeros(valid.shape, dtype=np.int32)
        for r, n in enumerate(counts):
            index[r, width - n:width] = np.flatnonzero(valid[r])
        index = mx.array(index)[:, None, :, None]
        self.keys = [mx.take_along_axis(k, index, axis=2) for k in self.keys]
        self.values = [mx.take_along_axis(v, index, axis=2) for v in self.values]
        s = np.arange(self.capacity)[None, :]
        self.valid = mx.array((s >= width - counts[:, None]) & (s < width))
        self.write_pos = width

    def make_room(self, n: int) -> None:
        """Room for n more slots: the rows packed, if that is not enough, more slots."""
        if self.write_pos + n > self.capacity:
            self.pack()
            self.grow(self.write_pos + n)

    def prefill(self, model: nn.Module, tokens: mx.array, chunk_pad: mx.array, rows: mx.array | None = None) -> mx.array:
        """Forward new tokens (n a row, left-padded by chunk_pad) at the write slot: of every
        row, or of the rows `rows` only (the others' slots of the pass stay invalid: a gap the
        next pack drops). Returns the last position's logits of the rows forwarded."""
        n = tokens.shape[1]
        self.grow(self.write_pos + n)
        part = (lambda a: a) if rows is None else (lambda a: a[rows])
        valid, positions = part(self.valid), part(self.positions)
        slots = EpisodeSlots(self.capacity, mx.array(self.write_pos, dtype=mx.int32), positions, valid, n, chunk_pad)
        caches = [StaticKVCache(self.capacity, slots, part(k) if k is not None else None, part(v) if v is not None else None)
                  for k, v in zip(self.keys, self.values)]
        logits = lm_head(model)(model.model(tokens, cache=caches)[:, -1, :])
        s = mx.arange(self.capacity)[None, :]
        valid = valid | ((s >= self.write_pos + chunk_pad[:, None]) & (s < self.write_pos + n))
        positions = positions + (n - chunk_pad)
        if rows is None:
            self.keys, self.values = [c.keys for c in caches], [c.values for c in caches]
            self.valid, self.positions = valid, positions
        else:
            for layer, c in enumerate(caches):
                self.keys[layer][rows], self.values[layer][rows] = c.keys, c.values
            self.valid[rows], self.positions[rows] = valid, positions
        self.write_pos += n
        return logits


class _Rows:
    """Host side: each row's tokens after its prompt, their log-probs and entropies, which are
    the model's, and its turns."""

    def __init__(self, rows: int):
        self.tokens = [[] for _ in range(rows)]
        self.logp = [[] for _ in range(rows)]
        self.ent = [[] for _ in range(rows)]
        self.model = [[] for _ in range(rows)]
        self.turns = [[] for _ in range(rows)]
        self.turn_start = [0] * rows

    def add_drawn(self, tokens: np.ndarray, logp: np.ndarray, ent: np.ndarray, drew: np.ndarray) -> None:
        """(rows, n) outputs of n draws; a row's draws count where `drew`."""
        for r in np.flatnonzero(drew.any(axis=1)):
            keep = drew[r]
            self.tokens[r] += tokens[r, keep].tolist()
            self.logp[r] += logp[r, keep].tolist()
            self.ent[r] += ent[r, keep].tolist()
            self.model[r] += [True] * int(keep.sum())

    def end_turn(self, r: int) -> list[int]:
        start = self.turn_start[r]
        self.turns[r].append((start, len(self.tokens[r])))
        return self.tokens[r][start:]

    def add_appended(self, r: int, tokens: list[int]) -> None:
        self.tokens[r] += tokens
        self.logp[r] += [0.0] * len(tokens)
        self.ent[r] += [0.0] * len(tokens)
        self.model[r] += [False] * len(tokens)
        self.turn_start[r] = len(self.tokens[r])

    def samples(self, ended: list[bool]) -> Samples:
        """As Samples: `steps` is the columns that hold tokens."""
        width = max(1, max(len(t) for t in self.tokens))

        def padded(lists, dtype, fill):
            return mx.array(np.array([x + [fill] * (width - len(x)) for x in lists], dtype=dtype))

        mask = padded(self.model, np.bool_, False)
        return Samples(tokens=padded(self.tokens, np.int32, 0), logprobs=padded(self.logp, np.float32, 0.0),
                       entropy=padded(self.ent, np.float32, 0.0), mask=mask, ended=mx.array(ended), steps=width)


class _Keys:
    """The random keys of a decode's draws, one per draw, split off in blocks as they are needed,
    on the host (sampling.draw_keys: a key made there per draw, not a slice of the block)."""

    def __init__(self, key: mx.array):
        self.key, self.block, self.used = key, None, KEYS_BLOCK

    def next(self) -> mx.array:
        if self.used == KEYS_BLOCK:
            self.key, sub = mx.random.split(self.key)
            self.block, self.used = draw_keys(sub, KEYS_BLOCK), 0
        self.used += 1
        return mx.array(self.block[self.used - 1])


def sample_episodes(
    model: nn.Module, step_fn: Callable, prompts: list[list[int]], params: SamplingParams, limits: Limits,
    eos_ids: list[int], pad_id: int, key: mx.array, answer: Answer, pool: ThreadPoolExecutor,
    should_stop: Callable[[], bool] = lambda: False,
) -> Episodes | None:
    """Decode one episode per prompt (rows: the prompts as given, one row each). Returns None
    when should_stop() said so (the job was cancelled).

    A turn that ends is answered on the pool while the other rows decode; the answered rows'
    tokens are prefilled at a later look (the module docstring)."""
    rows = len(prompts)
    prompt_tokens, pad = left_pad(prompts, pad_id=0)
    buffers = _Buffers(rows, len(model.layers), prompt_tokens.shape[1] + CHUNK + min(params.max_tokens, limits.episode_len))
    logits = buffers.prefill(model, prompt_tokens, pad)
    out, keys, lora = _Rows(rows), _Keys(key), lora_args(model)
    index = np.array(params.batch_rows if params.batch_rows is not None else range(rows), dtype=np.int32)
    draw_rows = None if params.batch_rows is None else (params.batch_height, mx.array(index))

    model_used = np.zeros(rows, dtype=np.int64)  # the model's tokens so far
    episode_used = np.zeros(rows, dtype=np.int64)  # all tokens after the prompt so far
    ended = [False] * rows
    answers: dict[int, Future] = {}
    tokens = mx.full((rows,), pad_id, dtype=mx.int32)  # each decoding row's last token, not yet forwarded
    live = mx.zeros((rows,), dtype=mx.bool_)
    remaining = mx.zeros((rows,), dtype=mx.int32)  # tokens each row may still draw in its turn
    starting = np.ones(rows, dtype=bool)  # rows whose next turn starts at the next draw
    decoding = np.zeros(rows, dtype=bool)  # the host's view of `live`
    steps, appended, pending = 0, 0, []
    while True:
        if starting.any():  # the last pass's logits: the first token of these rows' turns
            budget = np.minimum(params.max_tokens - model_used, limits.episode_len - episode_used)
            sel = np.flatnonzero(starting)
            at = mx.array(sel.astype(np.int32))
            nxt, logp, ent = draw(logits, keys.next(), params, (params.batch_height or rows, mx.array(index[sel])))
            tokens[at] = nxt
            remaining[at] = mx.array(budget[sel].astype(np.int32) - 1)
            live[at] = ~is_eos(nxt, eos_ids) & (remaining[at] > 0)
            drew = mx.array(starting)
            pending.append(tuple(mx.zeros((rows,), a.dtype).at[at].add(a) for a in (nxt, logp, ent)) + (drew,))
            decoding |= starting
            starting[:] = False
        if decoding.any():
            # Answers on their way: look sooner, so the rows they answer wait fewer steps.
            n = CHUNK // 4 if answers else CHUNK
            b = buffers
            b.make_room(n)
            for _ in range(n):
                tokens, logp, ent, drew, live, remaining, b.valid, b.positions, b.keys, b.values = step_fn(
                    tokens, b.keys, b.values, mx.array(b.write_pos, dtype=mx.int32), b.positions, b.valid, live, remaining,
                    keys.next(), lora, draw_rows)
                mx.async_eval(tokens, logp, ent, drew, live)
                pending.append((tokens, logp, ent, drew))
                b.write_pos += 1
                steps += 1

        # The look: what was drawn, the turns that ended, the answers that are in.
        if pending:
            drawn = [np.stack([np.array(a) for a in part], axis=1) for part in zip(*pending)]
            out.add_drawn(drawn[0], drawn[1], drawn[2], drawn[3].astype(bool))
            pending = []
        live_now = np.array(live)
        for r in np.flatnonzero(decoding & ~live_now):
            turn_tokens = out.end_turn(r)
            model_used[r] += len(turn_tokens)
            episode_used[r] += len(turn_tokens)
            # A turn cut by a bound is answered too (an environment scores its action), but ends the episode.
            answers[r] = pool.submit(answer, int(r), turn_tokens)
        decoding = live_now
        if should_stop():
            return None
        while answers and not decoding.any() and not any(f.done() for f in answers.values()):
            wait(list(answers.values()), timeout=1.0, return_when=FIRST_COMPLETED)
            if should_stop():
                return None
        chunks: dict[int, list[int]] = {}
        for r in [r for r, f in answers.items() if f.done()]:
            suffix = answers.pop(r).result()  # EpisodeFailed propagates: the job fails naming it
            if out.tokens[r][-1] not in eos_ids:
                pass  # cut: ended stays False
            elif suffix is None:
                ended[r] = True
            elif len(out.turns[r]) < limits.max_turns and model_used[r] < params.max_tokens and \
                    episode_used[r] + len(suffix) < limits.episode_len:
                chunks[r] = [out.tokens[r][-1], *suffix]
                out.add_appended(r, list(suffix))
                episode_used[r] += len(suffix)
        if not chunks:
            if decoding.any() or answers:
                continue
            break
        # One pass of the answered rows: their last token and their answer.
        sel = [int(r) for r in sorted(chunks)]
        chunk, chunk_pad = left_pad([chunks[r] for r in sel], pad_id=0)
        appended += sum(len(c) for c in chunks.values())
        buffers.make_room(chunk.shape[1])
        logits = buffers.prefill(model, chunk, chunk_pad, mx.array(sel))
        starting[sel] = True

    samples = out.samples(ended)
    mx.eval(samples.tokens, samples.logprobs, samples.entropy, samples.mask, samples.ended)
    return Episodes(samples, out.turns, appended, steps)
