"""Batched sampling for GRPO: every row of a step (batch_size prompts x group_size) decodes together.

Why not mlx_lm's generate/batch_generate: we need each sampled token's log-prob under the
distribution it was drawn from (logits / temperature) and its entropy, and we want no
host sync per token. So the KV cache is a fixed-size buffer (`StaticKVCache`): shapes never
change while decoding, and the whole decode step (model forward, filtering, sampling,
EOS bookkeeping) is one `mx.compile`d function. The host looks at the rows only once per
chunk of tokens (all finished? cancelled?).

On a GPU a decode step costs about its number of MLX primitives (host work per primitive,
not arithmetic), so the step keeps that number down: what all layers share (positions,
mask, write slot) is computed once (`Slots`), and on CUDA the attention sees each row's
query twice so that MLX fuses it (`fused_queries`). bench/decode.py counts them.

The prompt of each group is prefilled once and its cache repeated group_size times.
"""

import contextlib
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.tuner.lora import LoRALinear

CHUNK = 16  # decode steps between host checks (early stop when all rows ended, cancel)


class Slots:
    """Where one forward pass of n new tokens goes in the fixed-size KV buffers, computed once
    for every layer: RoPE offsets, the attention mask, and (for one token) the slot it is
    written to. The graph of a decode step then holds these once, not once per layer."""

    def __init__(self, capacity: int, write_pos: mx.array, left_pad: mx.array, n: int):
        self.write_pos = write_pos  # () int32: buffer slot of the first new token (same for all rows)
        self.offset = write_pos - left_pad  # (rows,) RoPE position of the first new token
        self.mask = attention_mask(write_pos + mx.arange(n), mx.arange(capacity), left_pad)
        self.one = (mx.arange(capacity) == write_pos)[None, None, :, None] if n == 1 else None


class StaticKVCache:
    """One layer's KV cache in a fixed-size buffer shared by left-padded rows.

    Implements what mlx_lm's models ask of a cache: `offset` (RoPE position of the next
    token, per row), `update_and_fetch`, `make_mask`.
    """

    def __init__(self, capacity: int, slots: Slots, keys=None, values=None):
        self.capacity, self.slots = capacity, slots
        self.keys, self.values = keys, values  # (rows, kv_heads, capacity, head_dim); made on first write

    @property
    def offset(self) -> mx.array:
        return self.slots.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            rows, heads, _, _ = keys.shape
            self.keys = mx.zeros((rows, heads, self.capacity, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((rows, heads, self.capacity, values.shape[3]), values.dtype)
        if self.slots.one is not None:
            # A select, not slice_update: one kernel, a pure op inside mx.compile (slice_update
            # copies the buffer unless it can donate it, then computes the offset, then writes).
            self.keys = mx.where(self.slots.one, keys.astype(self.keys.dtype), self.keys)
            self.values = mx.where(self.slots.one, values.astype(self.values.dtype), self.values)
        else:
            start = self.slots.write_pos.reshape(1)
            self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), start, axes=(2,))
            self.values = mx.slice_update(self.values, values.astype(self.values.dtype), start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size=None) -> mx.array:
        return self.slots.mask


class PaddingMaskCache:
    """A 'cache' for one full forward pass over left-padded rows (the loss): it stores
    nothing and only supplies the causal + padding mask, so that any mlx_lm model works."""

    def __init__(self, left_pad: mx.array):
        self.left_pad = left_pad
        self.offset = 0

    def update_and_fetch(self, keys, values):
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size=None) -> mx.array:
        pos = mx.arange(n)
        return attention_mask(pos, pos, self.left_pad)


def lm_head(model: nn.Module) -> Callable[[mx.array], mx.array]:
    """The output projection of an mlx_lm model whose logits are head(model.model(x)):
    its lm_head, or the tied embedding."""
    return model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens.as_linear


def attention_mask(q_pos: mx.array, k_pos: mx.array, left_pad: mx.array) -> mx.array:
    """(rows, 1, queries, keys): causal, padding hidden. A padding query sees only itself:
    a row with every key masked gives NaN in attention (on CUDA), which would reach the
    gradients even though padding positions are never used."""
    causal = k_pos[None, :] <= q_pos[:, None]  # also hides buffer slots not written yet
    not_pad = k_pos[None, :] >= left_pad[:, None]
    itself = k_pos[None, :] == q_pos[:, None]
    return ((causal[None] & not_pad[:, None, :]) | itself[None])[:, None]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # A gang's rank (worker/gang.py) samples some rows of a step's batch: which rows of the whole
    # batch they are, and its height. Each row then draws the random numbers it would draw in the
    # whole batch on one worker (Gumbel noise of the whole batch's shape; categorical's own way).
    batch_rows: tuple[int, ...] | None = None
    batch_height: int = 0


@dataclass
class Samples:
    tokens: mx.array  # (rows, max_tokens) int32, pad after the end
    logprobs: mx.array  # (rows, max_tokens) float32: log pi_old(token), logits / temperature
    entropy: mx.array  # (rows, max_tokens) float32: entropy of the sampling distribution
    mask: mx.array  # (rows, max_tokens) bool: token belongs to the completion (EOS included)
    ended: mx.array  # (rows,) bool: the row emitted EOS (not truncated)
    steps: int  # decode steps actually run


def log_softmax(logits: mx.array, temperature: float) -> mx.array:
    """log softmax(logits / temperature) in float32 (temperature 0, greedy, counts as 1)."""
    logits = logits.astype(mx.float32) / (temperature if temperature > 0 else 1.0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def pick(logp_all: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
    """log p(token) and the entropy of the distribution, from log_softmax's output."""
    logp = mx.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]
    return logp, -(mx.exp(logp_all) * logp_all).sum(-1)


def token_logprobs(logits: mx.array, tokens: mx.array, temperature: float) -> tuple[mx.array, mx.array]:
    """log p(token) and entropy of softmax(logits / temperature), in float32.

    Shared by sampling (pi_old) and the loss (pi_theta) so both see the same distribution.
    """
    return pick(log_softmax(logits, temperature), tokens)


def draw(logits: mx.array, key: mx.array, p: SamplingParams) -> tuple[mx.array, mx.array, mx.array]:
    """The next token of every row, its log-prob and the entropy (one log-softmax for all three)."""
    logp_all = log_softmax(logits, p.temperature)
    if p.temperature == 0:
        tokens = mx.argmax(logits, axis=-1)
    else:
        filtered = logp_all
        if p.top_k > 0:
            filtered = apply_top_k(filtered, p.top_k)
        if p.top_p < 1.0:
            filtered = apply_top_p(filtered, p.top_p)
        if p.min_p > 0.0:
            filtered = apply_min_p(filtered, p.min_p)
        if p.batch_rows is None:
            tokens = mx.random.categorical(filtered, key=key)
        else:
            noise = mx.random.gumbel(shape=(p.batch_height, filtered.shape[-1]), key=key)
            tokens = mx.argmax(filtered + noise[mx.array(p.batch_rows)], axis=-1)
    tokens = tokens.astype(mx.int32)
    return (tokens, *pick(logp_all, tokens))


def fused_queries(keys: mx.array) -> int:
    """Queries per row that let MLX fuse a decode step's masked attention (MLX 0.32): its CUDA
    backend runs attention with an array mask as five unfused kernels for one query (the
    vector kernel takes no mask) but hands it to cuDNN from two queries on (half precision,
    head dim a multiple of 8 up to 128). Metal's vector kernel takes the mask for one query;
    the CPU has no fused attention."""
    cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    d = keys.shape[-1]
    return 2 if cuda and keys.dtype in (mx.float16, mx.bfloat16) and d % 8 == 0 and d <= 128 else 1


@contextlib.contextmanager
def attention_queries(queries: int):
    """While a decode step is traced: mx.fast.scaled_dot_product_attention, given one query
    per row and an array mask, attends with that query repeated `queries` times and keeps
    the first output. The copies see the same keys under the same mask, so the result is
    that of one query; they are there only for MLX to fuse the attention (fused_queries).
    Only the attention sees them: projections, norms and RoPE run on one token per row."""
    sdpa = mx.fast.scaled_dot_product_attention

    def repeated(q, k, v, *, scale, mask=None, sinks=None):
        if q.shape[2] == 1 and isinstance(mask, mx.array):
            q = mx.concatenate([q] * queries, axis=2)
            return sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)[:, :, :1]
        return sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)

    mx.fast.scaled_dot_product_attention = repeated if queries > 1 else sdpa
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = sdpa


# Projections of one block that read the same input: with LoRA on all of them, a decode step
# runs their LoRA as one pair of matmuls (grouped_lora).
SHARED_INPUT = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def lora_groups(model: nn.Module) -> list[list[LoRALinear]]:
    """The model's projections that read one input and all carry LoRA (mlx_lm's LoRALinear)."""
    groups = []
    for layer in model.layers:
        for parent, names in SHARED_INPUT:
            mods = [getattr(getattr(layer, parent, None), name, None) for name in names]
            if all(type(m) is LoRALinear for m in mods):
                groups.append(mods)
    return groups


def stacked_lora(model: nn.Module) -> list[tuple[mx.array, mx.array]]:
    """Each lora_groups group's LoRA matrices as one pair: its A side by side, its B
    block-diagonal, so that x @ A @ B holds every projection's LoRA product. Made once per
    sample() (the job's LoRA weights change between steps): small, rank x outputs."""
    stacked = []
    for mods in lora_groups(model):
        ranks, outs = [m.lora_b.shape[0] for m in mods], [m.lora_b.shape[1] for m in mods]
        b = mx.zeros((sum(ranks), sum(outs)), mods[0].lora_b.dtype)
        r0 = n0 = 0
        for m, r, n in zip(mods, ranks, outs):
            b[r0:r0 + r, n0:n0 + n] = m.lora_b
            r0, n0 = r0 + r, n0 + n
        stacked.append((mx.concatenate([m.lora_a for m in mods], axis=1), b))
    return stacked


@contextlib.contextmanager
def grouped_lora(model: nn.Module, stacked: list[tuple[mx.array, mx.array]]):
    """While a decode step is traced: each lora_groups projection takes its LoRA product from
    its group's (x @ A) @ B, made by the group's first call on that input, instead of two
    matmuls of its own; the rest of mlx_lm's LoRALinear as it is (dropout must be off,
    as in sampling). A block then runs 2 LoRA matmuls for q, k, v and 2 for gate, up, not 10."""
    groups = lora_groups(model)
    where = {id(m): (g, i) for g, mods in enumerate(groups) for i, m in enumerate(mods)}
    call = LoRALinear.__call__
    products = {}  # group -> (its input, x @ A @ B)

    def grouped(self, x):
        if id(self) not in where or self.dropout(x) is not x:
            return call(self, x)
        g, i = where[id(self)]
        if g not in products or products[g][0] is not x:
            a, b = stacked[g]
            products[g] = (x, (x @ a) @ b)
        start = sum(m.lora_b.shape[1] for m in groups[g][:i])
        z = products[g][1][..., start:start + self.lora_b.shape[1]]
        return self.linear(x) + (self.scale * z).astype(x.dtype)

    LoRALinear.__call__ = grouped
    try:
        yield
    finally:
        LoRALinear.__call__ = call


def make_decode_step(
    model: nn.Module, params: SamplingParams, eos_ids: list[int], pad_id: int, queries: int | None = None,
) -> Callable:
    """One compiled decode step for all rows: forward one token, pick the next, track EOS.

    queries: how many copies of each row's query the attention gets (attention_queries;
    by default fused_queries'): the results are those of one query."""
    head = lm_head(model)

    def step(tokens, keys, values, write_pos, left_pad, finished, key, lora):
        capacity = keys[0].shape[2]
        slots = Slots(capacity, write_pos, left_pad, 1)
        caches = [StaticKVCache(capacity, slots, k, v) for k, v in zip(keys, values)]
        # The function runs only while traced: what the two contexts change is in the graph.
        with attention_queries(queries or fused_queries(keys[0])), grouped_lora(model, lora):
            logits = head(model.model(tokens[:, None], cache=caches)[:, 0])
        nxt, logp, ent = draw(logits, key, params)
        nxt = mx.where(finished, pad_id, nxt)
        valid = ~finished
        finished = finished | is_eos(nxt, eos_ids)
        return nxt, logp, ent, valid, finished, [c.keys for c in caches], [c.values for c in caches]

    return mx.compile(step, inputs=[model.state])


def is_eos(tokens: mx.array, eos_ids: list[int]) -> mx.array:
    eos = mx.array(eos_ids or [-1], dtype=mx.int32)
    return (tokens[:, None] == eos[None, :]).any(axis=1)


def left_pad(prompts: list[list[int]], pad_id: int, width: int | None = None) -> tuple[mx.array, mx.array]:
    """Prompts left-padded to one width (the longest's, or `width`: a gang's rank pads its share as
    the whole batch would be, so that its positions are the same)."""
    width = max(max(len(p) for p in prompts), width or 0)
    rows = [[pad_id] * (width - len(p)) + p for p in prompts]
    return mx.array(rows, dtype=mx.int32), mx.array([width - len(p) for p in prompts], dtype=mx.int32)


def sample(
    model: nn.Module,
    decode_step: Callable,
    prompts: list[list[int]],
    group_size: int,
    params: SamplingParams,
    eos_ids: list[int],
    key: mx.array,
    should_stop: Callable[[], bool] = lambda: False,
    width: int | None = None,
) -> Samples | None:
    """Sample group_size completions for each prompt (rows ordered prompt-major); width: pad
    the prompts to at least this (left_pad).

    Returns None when should_stop() said so between chunks (the job was cancelled).
    """
    prompt_tokens, pad = left_pad(prompts, pad_id=0, width=width)
    width = prompt_tokens.shape[1]

    # Prefill each distinct prompt once, into buffers sized for the whole completion.
    capacity = width + params.max_tokens
    slots = Slots(capacity, mx.array(0, dtype=mx.int32), pad, width)
    caches = [StaticKVCache(capacity, slots) for _ in model.layers]
    logits = lm_head(model)(model.model(prompt_tokens, cache=caches)[:, -1, :])  # last position's logits only

    # Repeat to group_size rows per prompt.
    rows = len(prompts) * group_size
    keys = [mx.repeat(c.keys, group_size, axis=0) for c in caches]
    values = [mx.repeat(c.values, group_size, axis=0) for c in caches]
    logits = mx.repeat(logits, group_size, axis=0)
    pad = mx.repeat(pad, group_size, axis=0)
    write_pos = mx.array(width, dtype=mx.int32)

    lora = stacked_lora(model)  # the LoRA weights of this step
    step_keys = mx.random.split(key, params.max_tokens + 1)
    first, first_logp, first_ent = draw(logits, step_keys[0], params)

    out_tokens, out_logp, out_ent, out_valid = [first], [first_logp], [first_ent], [mx.ones((rows,), dtype=mx.bool_)]
    finished = is_eos(first, eos_ids)
    tokens = first
    steps = 1
    while steps < params.max_tokens:
        n = min(CHUNK, params.max_tokens - steps)
        for i in range(n):
            tokens, logp, ent, valid, finished_next, keys, values = decode_step(
                tokens, keys, values, write_pos, pad, finished, step_keys[steps + i], lora
            )
            out_tokens.append(tokens)
            out_logp.append(logp)
            out_ent.append(ent)
            out_valid.append(valid)
            finished = finished_next
            write_pos = write_pos + 1
            # All of it now: a step's log-prob and entropy left lazy would keep its
            # full-vocabulary log-probs alive until the end of sampling.
            mx.async_eval(tokens, logp, ent, valid, finished)
        steps += n
        if should_stop():
            return None
        if steps < params.max_tokens and finished.all().item():
            break

    tokens = mx.stack(out_tokens, axis=1)
    mask = mx.stack(out_valid, axis=1)
    pad_cols = params.max_tokens - tokens.shape[1]
    if pad_cols:
        tokens = mx.pad(tokens, [(0, 0), (0, pad_cols)])
        mask = mx.pad(mask, [(0, 0), (0, pad_cols)])
    logp = mx.pad(mx.stack(out_logp, axis=1), [(0, 0), (0, pad_cols)])
    ent = mx.pad(mx.stack(out_ent, axis=1), [(0, 0), (0, pad_cols)])
    samples = Samples(tokens=tokens, logprobs=logp * mask, entropy=ent * mask, mask=mask, ended=finished, steps=steps)
    mx.eval(samples.tokens, samples.logprobs, samples.entropy, samples.mask, samples.ended)
    return samples
