"""Batched sampling for GRPO: every row of a step (batch_size prompts x group_size) decodes together.

Why not mlx_lm's generate/batch_generate: we need each sampled token's log-prob under the
distribution it was drawn from (logits / temperature) and its entropy, and we want no
host sync per token. So the KV cache is a fixed-size buffer (`StaticKVCache`): shapes never
change while decoding, and the whole decode step (model forward, filtering, sampling,
EOS bookkeeping) is one `mx.compile`d function. The host looks at the rows only once per
chunk of tokens (all finished? cancelled?).

On a GPU a decode step costs about its number of MLX primitives (host work per primitive,
not arithmetic), so the step keeps that number down: what all layers share (positions,
mask, write slot) is computed once (`Slots`), and on CUDA each layer's attention and KV write
is one kernel (worker/decode/attention_kernel.py; a Qwen3 layer's q/k norms and RoPE too; else the
attention sees each row's query twice so that MLX fuses it, `fused_queries`), each projection
group's LoRA product two (worker/decode/lora_kernel.py), a quantized matmul of few rows one
(worker/decode/quantized_kernel.py), and a Qwen3 block's residual adds and the norms after them one
each (worker/decode/norm_kernel.py), its MLP activation one (worker/decode/swiglu_kernel.py), its rows 2-D
(`decode_blocks`); those two also run the LoRA kernels next to them (`Handoff`).
bench/decode.py counts them.

The prompt of each group is prefilled once and its cache repeated group_size times.
"""

import contextlib
import copy
import itertools
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from mlx_lm.models.activations import swiglu
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.tuner.lora import LoRALinear

from worker.decode import attention_kernel, lora_kernel, norm_kernel, quantized_kernel, swiglu_kernel

CHUNK = 16  # decode steps between host checks (early stop when all rows ended, cancel)


class Slots:
    """Where one forward pass of n new tokens goes in the fixed-size KV buffers, computed once
    for every layer: RoPE offsets, the attention mask, and (for one token) the slot it is
    written to. The graph of a decode step then holds these once, not once per layer."""

    def __init__(self, capacity: int, write_pos: mx.array, left_pad: mx.array, n: int, kernel: bool = False):
        self.write_pos = write_pos  # () int32: buffer slot of the first new token (same for all rows)
        self.left_pad = left_pad  # (rows,) int32
        self.offset = write_pos - left_pad  # (rows,) RoPE position of the first new token
        self.mask = attention_mask(write_pos + mx.arange(n), mx.arange(capacity), left_pad)
        self.one = (mx.arange(capacity) == write_pos)[None, None, :, None] if n == 1 else None
        # kernel: one token's key and value are written by the attention (attention_kernel.attend),
        # which takes them from `pending` (a layer's cache and its new key and value).
        self.kernel, self.pending, self.attended = kernel and n == 1, None, 0


class Handoff:
    """What one traced decode step's kernels leave to the next (decode_blocks, grouped_projections).
    A projection group's output is made by its base matmul, then lora_kernel.up (with LoRA), then
    split; the kernel that reads it (norm_kernel's residual add, swiglu_kernel's activation)
    can take the base output and make the rest itself, and make the first LoRA kernel
    (lora_kernel.down) of the group reading its own output: each saves a kernel or a split."""

    def __init__(self):
        self.parts = {}  # id(a group's output) -> (it, the group's base output y, up's (t, B, scale) or None, its first column)
        self.downs = {}  # id(an output x a kernel made) -> (x, A, x @ A)
        self.lora_a = {}  # id(a projection) -> its group's A, where lora_kernel runs that group

    def part(self, out: mx.array) -> tuple | None:
        """(y, up, first column) if out is a part of a group's output, made from its base output y."""
        entry = self.parts.get(id(out))
        return entry[1:] if entry is not None and entry[0] is out else None

    def whole(self, r: mx.array) -> tuple[mx.array, tuple | None]:
        """r as a kernel that adds it may take it: (y, up) if r is a LoRA group's whole output."""
        part = self.part(r)
        return part[:2] if part is not None and part[1] is not None and part[0].shape == r.shape else (r, None)

    def halves(self, gate: mx.array, up: mx.array) -> tuple | None:
        """(y, up's (t, B, scale) or None) if gate and up are the two halves of one group's output."""
        g, u = self.part(gate), self.part(up)
        if g is None or u is None or g[0] is not u[0] or g[1] is not u[1]:
            return None
        f = gate.shape[-1]
        return g[:2] if (g[2], u[2], up.shape[-1], g[0].shape[-1]) == (0, f, f, 2 * f) else None

    def down(self, x: mx.array, a: mx.array) -> mx.array | None:
        """x @ a if the kernel that made x made it."""
        entry = self.downs.get(id(x))
        return entry[2] if entry is not None and entry[0] is x and entry[1] is a else None


class KernelMisfit(Exception):
    """The model does not attend as attention_kernel.attend needs (kernel_fits)."""


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

    def allocate(self, rows: int, heads: int, key_dim: int, value_dim: int, dtype: mx.Dtype):
        """The buffers, if not made yet (zeros: a slot not written yet is masked, never read)."""
        if self.keys is None:
            self.keys = mx.zeros((rows, heads, self.capacity, key_dim), dtype)
            self.values = mx.zeros((rows, heads, self.capacity, value_dim), dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.allocate(*keys.shape[:2], keys.shape[3], values.shape[3], keys.dtype)
        if self.slots.kernel:
            if self.slots.pending is not None:  # the last layer's attention did not take its token
                raise KernelMisfit
            self.slots.pending = (self, keys.astype(self.keys.dtype), values.astype(self.values.dtype))
        elif self.slots.one is not None:
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
    # A gang's rank (worker/runtime/gang_group.py) samples some rows of a step's batch: which rows of the whole
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


def draw(logits: mx.array, key: mx.array, p: SamplingParams,
         rows: tuple[int, mx.array] | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """The next token of every row, its log-prob and the entropy (one log-softmax for all three).
    rows (height, index): the rows are these rows of a batch of `height` (a gang's share, or
    the rows left once finished ones are dropped), and each draws the Gumbel noise it would
    draw in the whole batch (mx.random.categorical's own way), so the same token."""
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
        if rows is None:
            tokens = mx.random.categorical(filtered, key=key)
        else:
            height, index = rows
            noise = mx.random.gumbel(shape=(height, filtered.shape[-1]), key=key)
            tokens = mx.argmax(filtered + noise[index], axis=-1)
    tokens = tokens.astype(mx.int32)
    return (tokens, *pick(logp_all, tokens))


def fused_queries(keys: mx.array) -> int:
    """Queries per row that let MLX fuse a decode step's masked attention (MLX 0.32): its CUDA
    backend runs attention with an array mask as five unfused kernels for one query (the
    vector kernel takes no mask) but hands it to cuDNN from two queries on (half precision,
    head dim a multiple of 8 up to 128). Metal's vector kernel takes the mask for one query;
    the CPU has no fused attention."""
    d = keys.shape[-1]
    return 2 if attention_kernel.cuda() and keys.dtype in (mx.float16, mx.bfloat16) and d % 8 == 0 and d <= 128 else 1


def kernel_norms_and_rope(attention: nn.Module) -> bool:
    """Whether attention_kernel.attend applies this attention module's q/k RMSNorms and RoPE
    itself (its rope= and norms=): mlx_lm's Qwen3 attention with a plain RoPE on every dimension
    of a head. Its decode step then runs the projections, the kernel and the output projection,
    without four norm and RoPE kernels, the reshapes and transposes around them."""
    if type(attention) is not qwen3.Attention:
        return False
    rope, q_norm, k_norm = attention.rope, attention.q_norm, attention.k_norm
    d = q_norm.weight.shape[0]
    return (type(rope) is nn.RoPE and not rope.traditional and rope.dims == d and d % 2 == 0
            and type(q_norm) is nn.RMSNorm and type(k_norm) is nn.RMSNorm and k_norm.weight.shape == (d,))


@contextlib.contextmanager
def decode_attention(slots: Slots, queries: int):
    """While a decode step is traced: what mx.fast.scaled_dot_product_attention does with one
    query per row. With slots.kernel, attention_kernel.attend (which also writes the layer's
    new key and value), and for a Qwen3 attention the whole attention between its projections
    (kernel_norms_and_rope). Else, given an array mask, it attends with each query repeated
    `queries` times and keeps the first output: the copies see the same keys under the same
    mask, so the result is that of one query; they are there only for MLX to fuse the
    attention (fused_queries). Only the attention sees them: projections, norms and RoPE run
    on one token per row."""
    sdpa = mx.fast.scaled_dot_product_attention
    qwen3_attention = qwen3.Attention.__call__

    def attention(q, k, v, *, scale, mask=None, sinks=None):
        pending, slots.pending = slots.pending, None
        if pending is not None:
            cache, k_new, v_new = pending
            if k is not cache.keys or v is not cache.values or sinks is not None or not attention_kernel.available(q, k):
                raise KernelMisfit
            slots.attended += 1
            return attention_kernel.attend(q, k_new, v_new, k, v, slots.write_pos, slots.left_pad, scale)
        if queries > 1 and q.shape[2] == 1 and isinstance(mask, mx.array):
            q = mx.concatenate([q] * queries, axis=2)
            return sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)[:, :, :1]
        return sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)

    def whole_attention(self, x, mask=None, cache=None):
        if not (slots.kernel and isinstance(cache, StaticKVCache) and kernel_norms_and_rope(self)):
            return qwen3_attention(self, x, mask, cache)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        d = self.q_norm.weight.shape[0]
        cache.allocate(x.shape[0], k.shape[-1] // d, d, d, k.dtype)
        same = (k.dtype, v.dtype) == (cache.keys.dtype, cache.values.dtype)
        if not same or not attention_kernel.available(q, cache.keys):
            raise KernelMisfit
        slots.attended += 1
        out = attention_kernel.attend(q, k, v, cache.keys, cache.values, slots.write_pos, slots.left_pad, self.scale,
                                      rope=self.rope, norms=(self.q_norm, self.k_norm))
        return self.o_proj(out)

    mx.fast.scaled_dot_product_attention = attention
    qwen3.Attention.__call__ = whole_attention
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = sdpa
        qwen3.Attention.__call__ = qwen3_attention


@contextlib.contextmanager
def decode_blocks(slots: Slots, kernel: bool, handoff: Handoff):
    """While a decode step is traced: a Qwen3 model's blocks, each residual add and the RMSNorm
    after it (the block's second norm, the next block's first, the model's last) as one
    norm_kernel.add_norm where kernel and it fits, else as mlx_lm's blocks run them; the add
    also makes a LoRA output projection's last product and the norm the first one of the group
    reading it, where grouped_projections hands them over (handoff). When the
    attention kernel runs every block's attention whole (kernel_norms_and_rope), the rows go
    through the blocks 2-D, (rows, hidden): MLX 0.32's CUDA quantized matmul runs a (rows, 1, K)
    input as `rows` products of one row, each reading all the weights, and a (rows, K) one as
    one product (mlx/backend/cuda/quantized/quantized.cpp, its batch count)."""
    qwen3_model = qwen3.Qwen3Model.__call__

    def add_norm(h, r, norm, reader=None):
        """h + r and its norm, the norm's output read by the projection `reader`."""
        y, up = handoff.whole(r)
        a = handoff.lora_a.get(id(reader))
        if kernel and not norm_kernel.available(h, y, norm, up, a):
            y, up, a = r, None, None  # what is handed over does not fit: the add and norm alone
        if kernel and norm_kernel.available(h, y, norm, up, a):
            h, x, t = norm_kernel.add_norm(h, y, norm, up, a)
            if t is not None:
                handoff.downs[id(x)] = (x, a, t)
            return h, x
        h = h + r
        return h, norm(h)

    def mlp(m, x):
        """mlx_lm's Qwen3 MLP, down(swiglu(gate(x), up(x))), its activation by swiglu_kernel where
        kernel and it fits (which also makes what handoff leaves it)."""
        gate, up = m.gate_proj(x), m.up_proj(x)
        halves = handoff.halves(gate, up) if kernel else None
        a = handoff.lora_a.get(id(m.down_proj))
        if halves is not None and swiglu_kernel.available(*halves, a):
            out, t = swiglu_kernel.swiglu(*halves, a)
            if t is not None:
                handoff.downs[id(out)] = (out, a, t)
        else:
            out = swiglu(gate, up)
        return m.down_proj(out)

    def blocks(self, inputs, cache=None, input_embeddings=None):
        if cache is None or input_embeddings is not None or any(type(b) is not qwen3.TransformerBlock
                                                                for b in self.layers):
            return qwen3_model(self, inputs, cache, input_embeddings)
        h = self.embed_tokens(inputs)
        if slots.kernel and inputs.shape[1] == 1 and all(kernel_norms_and_rope(b.self_attn) for b in self.layers):
            h, mask = h.reshape(h.shape[0], h.shape[2]), None  # whole_attention takes no mask
        else:
            mask = qwen3.create_attention_mask(h, cache[0])
        x = self.layers[0].input_layernorm(h)
        for i, (block, c) in enumerate(zip(self.layers, cache)):
            h, x = add_norm(h, block.self_attn(x, mask, c), block.post_attention_layernorm, block.mlp.gate_proj)
            if i + 1 < len(self.layers):
                after = self.layers[i + 1]
                h, x = add_norm(h, mlp(block.mlp, x), after.input_layernorm, after.self_attn.q_proj)
            else:
                h, x = add_norm(h, mlp(block.mlp, x), self.norm)
        return x

    qwen3.Qwen3Model.__call__ = blocks
    try:
        yield
    finally:
        qwen3.Qwen3Model.__call__ = qwen3_model


# Projections of one block that read the same input: a decode step runs each such group as one
# matmul of its base weights (fuse_shared_inputs) and one pair of LoRA matmuls (decode_groups).
SHARED_INPUT = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
_ARRAYS = ("weight", "scales", "biases", "bias")  # what nn.Linear / nn.QuantizedLinear hold


@dataclass(eq=False)
class FusedInputs:
    """One block's projections that read the same input (q/k/v, gate/up) as one module: their
    weights side by side along the outputs (fuse_shared_inputs)."""
    fused: nn.Module


def fuse_shared_inputs(model: nn.Module) -> int:
    """Fuse every SHARED_INPUT group of plain projections of one type and quantization (a
    model's base, before LoRA is attached): the decode step then runs one matmul per group.
    Memory stays what it was (the projections' weights become views of the fused ones). Only
    for a model whose base weights never change: the worker's shared models (worker/runtime/models.py;
    full fine-tuning and QLoRA change theirs, on a private copy). Returns the groups fused."""
    count = 0
    for layer in model.layers:
        for parent_name, names in SHARED_INPUT:
            parent = getattr(layer, parent_name, None)
            mods = [getattr(parent, name, None) for name in names]
            if parent is None or getattr(parent, "fused_inputs", None) is not None or not _fusable(mods):
                continue
            keys = [k for k in _ARRAYS if k in mods[0]]
            fused = copy.copy(mods[0])  # its class and quantization; its arrays replaced below
            for k in keys:
                fused[k] = mx.concatenate([m[k] for m in mods], axis=0)
            mx.eval(fused.parameters())
            start = 0
            for m in mods:
                n = m["weight"].shape[0]
                for k in keys:
                    m[k] = fused[k][start:start + n]
                start += n
            mx.eval([m.parameters() for m in mods])
            parent.fused_inputs = FusedInputs(fused)
            count += 1
    return count


def _fusable(mods: list) -> bool:
    if any(type(m) not in (nn.Linear, nn.QuantizedLinear) for m in mods) or len({type(m) for m in mods}) > 1:
        return False
    first = mods[0]
    same = lambda f: len({f(m) for m in mods}) == 1  # noqa: E731
    quantized = type(first) is nn.QuantizedLinear
    return (same(lambda m: tuple(k for k in _ARRAYS if k in m)) and same(lambda m: m["weight"].shape[1:])
            and same(lambda m: tuple(m[k].dtype for k in _ARRAYS if k in m))
            and (not quantized or same(lambda m: (m.group_size, m.bits, m.mode))))


@dataclass(eq=False)
class Group:
    """Projections a decode step runs together: a SHARED_INPUT group (one input), or one LoRA
    projection alone. lora: all carry mlx_lm's LoRA, with one scale (their LoRA products are
    one pair of matmuls); fused: their base weights are one module (fuse_shared_inputs)."""
    modules: list[nn.Module]
    lora: bool
    fused: nn.Module | None


def decode_groups(model: nn.Module) -> list[Group]:
    """The model's Groups, in a fixed order (lora_args follows it)."""
    groups, grouped = [], set()
    for layer in model.layers:
        for parent_name, names in SHARED_INPUT:
            parent = getattr(layer, parent_name, None)
            mods = [getattr(parent, name, None) for name in names]
            if any(m is None for m in mods):
                continue
            lora = all(type(m) is LoRALinear for m in mods) and len({m.scale for m in mods}) == 1
            plain = all(type(m) in (nn.Linear, nn.QuantizedLinear) for m in mods)
            info = getattr(parent, "fused_inputs", None)
            fused = info.fused if info is not None and (lora or plain) else None
            if lora or fused is not None:
                groups.append(Group(mods, lora, fused))
                grouped.update(id(m) for m in mods)
    for _, m in model.named_modules():
        if type(m) is LoRALinear and id(m) not in grouped:
            groups.append(Group([m], True, None))
    return groups


def lora_args(model: nn.Module) -> list[tuple[mx.array, mx.array]]:
    """The LoRA matrices of each decode_groups group with LoRA, as one pair: A side by side,
    B block-diagonal, so that x @ A @ B holds every projection's LoRA product. Made at each
    sample() (the job's LoRA weights change between steps): small, rank x outputs."""
    pairs = []
    for group in decode_groups(model):
        mods = group.modules
        if not group.lora:
            continue
        if len(mods) == 1:
            pairs.append((mods[0].lora_a, mods[0].lora_b))
        else:
            ranks, outs = [m.lora_b.shape[0] for m in mods], [m.lora_b.shape[1] for m in mods]
            b = mx.zeros((sum(ranks), sum(outs)), mods[0].lora_b.dtype)
            r0 = n0 = 0
            for m, r, n in zip(mods, ranks, outs):
                b[r0:r0 + r, n0:n0 + n] = m.lora_b
                r0, n0 = r0 + r, n0 + n
            pairs.append((mx.concatenate([m.lora_a for m in mods], axis=1), b))
    return pairs


def _base(m: nn.Module) -> nn.Module:
    return m.linear if type(m) is LoRALinear else m


@contextlib.contextmanager
def grouped_projections(groups: list[Group], lora: list, dense: dict, kernel: bool, handoff: Handoff):
    """While a decode step is traced: a projection of a Group takes its output from the group's,
    made at the group's first call on that input: one matmul of the fused base weights (else
    each projection's own), plus scale * (x @ A) @ B of its LoRA pair (lora_args), on 2-D rows
    (a 3-D matmul adds two reshapes), then split. With kernel, where they fit, the LoRA product
    is lora_kernel's down and up, on the rows as they come, and a quantized matmul (a tied
    output projection's too) quantized_kernel's; handoff gets each output's base output and
    up's inputs, and gives a down the kernel making x made (decode_blocks). What each projection gives is what mlx_lm's
    LoRALinear gives, without dropout (sampling never drops out). dense: dequantized weights
    (dequantized) that quantized projections use instead of their own."""
    where = {id(m): (g, i) for g, group in enumerate(groups) for i, m in enumerate(group.modules)}
    pair = dict(zip([g for g, group in enumerate(groups) if group.lora], lora))  # group -> its LoRA pair
    classes = {type(m) for group in groups for m in group.modules} | {type(_base(m)) for group in groups
                                                                         for m in group.modules}
    classes |= {nn.QuantizedLinear} if dense or kernel else set()
    calls = {cls: cls.__call__ for cls in classes}
    outputs = {}  # group -> (its input, the outputs of its projections)
    if kernel:
        handoff.lora_a.update((id(m), pair[g][0]) for g, group in enumerate(groups) if g in pair
                              for m in group.modules)

    def project(m: nn.Module, x: mx.array) -> mx.array:
        """m(x): with kernel, a quantized module's by quantized_kernel where it fits; on 2-D rows
        where that is faster: a dense copy's matmul (a 3-D one adds two reshapes), and on CUDA
        MLX's quantized one (decode_blocks says why)."""
        if kernel and id(m) not in dense and quantized_kernel.available(x, m):
            y = quantized_kernel.matmul(x, m)
            return y + m["bias"] if "bias" in m else y
        if x.ndim > 2 and (id(m) in dense or (kernel and type(m) is nn.QuantizedLinear)):
            return project(m, x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        if id(m) not in dense:
            return calls[type(m)](m, x)
        w, bias = dense[id(m)]
        return x @ w if bias is None else x @ w + bias

    def run(group: Group, pair, x: mx.array) -> list[mx.array]:
        mods = group.modules
        sizes = [_base(m)["weight"].shape[0] for m in mods]
        bases = [group.fused] if group.fused is not None else [_base(m) for m in mods]
        if pair is not None and kernel and lora_kernel.available(x, *pair):
            a, b = pair
            t = handoff.down(x, a)
            t = lora_kernel.down(x, a) if t is None else t
            ys = [project(base, x) for base in bases]
            bs = [b] if len(ys) == 1 else _split(b, sizes)
            outs = [lora_kernel.up(y, t, b_i, mods[0].scale) for y, b_i in zip(ys, bs)]
            return handed(outs, ys, (t, b, mods[0].scale), sizes)
        flat = x.ndim > 2 and (pair is not None or any(id(b) in dense for b in bases))
        h = x.reshape(-1, x.shape[-1]) if flat else x
        ys = [project(b, h) for b in bases]
        if pair is not None:
            a, b = pair
            z = (mods[0].scale * ((h @ a) @ b)).astype(x.dtype)  # fused with the add below
            zs = [z] if len(ys) == 1 else _split(z, sizes)
            ys = [y + z for y, z in zip(ys, zs)]
        if flat:
            ys = [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]
        return handed(ys, ys if pair is None else [], None, sizes)  # with LoRA by MLX's ops: nothing to hand over

    def handed(outs: list, ys: list, up: tuple | None, sizes: list[int]) -> list[mx.array]:
        """The group's outputs, each made from one base output (ys) and lora_kernel.up's inputs
        up, told to handoff (with kernel): what a kernel reading them makes itself is then left
        out of the graph."""
        parts = _split(outs[0], sizes) if len(outs) < len(sizes) else outs
        if kernel and len(ys) == 1:
            for part, start in zip(parts, itertools.accumulate([0, *sizes[:-1]])):
                handoff.parts[id(part)] = (part, ys[0], up, start)
        return parts

    def grouped(self, x):
        if id(self) not in where:
            return project(self, x)
        g, i = where[id(self)]
        if g not in outputs or outputs[g][0] is not x:
            outputs[g] = (x, run(groups[g], pair.get(g), x))
        return outputs[g][1][i]

    for cls in classes:
        cls.__call__ = grouped
    as_linear = nn.QuantizedEmbedding.as_linear  # a tied output projection
    if kernel:
        nn.QuantizedEmbedding.as_linear = lambda self, x: (quantized_kernel.matmul(x, self)
                                                           if quantized_kernel.available(x, self) else as_linear(self, x))
    try:
        yield
    finally:
        for cls, call in calls.items():
            cls.__call__ = call
        nn.QuantizedEmbedding.as_linear = as_linear


def dequantized(modules: list[nn.Module]) -> dict[int, tuple[mx.array, mx.array | None]]:
    """Dense copies of quantized modules' weights (the scales' dtype, transposed to inputs x
    outputs) and their biases, by module id: on CUDA a dense matmul of 32 rows is faster than
    MLX 0.32's quantized one (a whole decode step of the qwen3-0.6b shape at 4 bits without
    LoRA: 5.07 ms against 5.81 on an H200; docs/performance.md). Memory:
    memory.dense_decode_bytes (a job's budget pays for it: worker/runtime/memory_plan.py)."""
    copies = {}
    for m in modules:
        w = mx.dequantize(m["weight"], m["scales"], m.get("biases"), m.group_size, m.bits, mode=m.mode)
        copies[id(m)] = (mx.contiguous(w.T), m.get("bias"))
        mx.eval(copies[id(m)][0])
    return copies


def decode_projections(model: nn.Module, groups: list[Group]) -> list[nn.Module]:
    """The quantized modules whose weights a decode step multiplies by: each fused group's module,
    every other projection of the blocks, and the output projection (a tied embedding's)."""
    in_fused = {id(_base(m)) for g in groups if g.fused is not None for m in g.modules}
    mods = [g.fused for g in groups if g.fused is not None]
    mods += [m for layer in model.layers for _, m in layer.named_modules() if id(m) not in in_fused]
    mods.append(getattr(model, "lm_head", model.model.embed_tokens))
    return [m for m in mods if type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding)]


def _split(x: mx.array, sizes: list[int]) -> list[mx.array]:
    return mx.split(x, list(itertools.accumulate(sizes))[:-1], axis=-1) if len(sizes) > 1 else [x]


def make_decode_step(
    model: nn.Module, params: SamplingParams, eos_ids: list[int], pad_id: int, queries: int | None = None,
    dense: bool = False, kernel: bool | None = None,
) -> Callable:
    """One compiled decode step for all rows: forward one token, pick the next, track EOS.

    kernel: the step runs the CUDA kernels where they fit (by default on CUDA): the attention
    is attention_kernel's (where kernel_fits), LoRA products lora_kernel's, quantized matmuls
    quantized_kernel's, a Qwen3 block's residual adds and norms norm_kernel's and its MLP
    activation swiglu_kernel's (those two also make the LoRA kernels beside them). Else the
    attention's queries:
    how many copies of each row's query the attention gets (decode_attention; by default
    fused_queries'): the results are those of one query. dense: the quantized
    projections multiply by dequantized copies of their weights (dequantized; the log-probs
    then agree with the quantized model's to float rounding, not exactly).

    The model's weights are constants of the compiled step, except the LoRA weights, which it
    takes as its argument `lora` (lora_args): MLX checks every input of a compiled function
    at every call, and a model has hundreds. A model with other trainable weights (DoRA, full
    fine-tuning) gives the compiled step all its weights as inputs instead. `rows`: draw's
    (None: the rows are the whole batch)."""
    groups = decode_groups(model)
    copies = dequantized(decode_projections(model, groups)) if dense else {}
    embed = model.model.embed_tokens
    dense_head = None
    if id(embed) in copies:  # a tied output projection: embed_tokens.as_linear, not a QuantizedLinear call
        w = copies[id(embed)][0]
        dense_head = lambda h: h @ w  # noqa: E731
    passed = {id(a) for g in groups if g.lora for m in g.modules for a in (m.lora_a, m.lora_b)}
    constant = all(id(a) in passed for _, a in tree_flatten(model.trainable_parameters()))
    kernels = attention_kernel.cuda() if kernel is None else kernel
    kernel = kernel_fits(model) if kernel is None else kernel

    def step(tokens, keys, values, write_pos, left_pad, finished, key, lora, rows):
        capacity = keys[0].shape[2]
        slots = Slots(capacity, write_pos, left_pad, 1, kernel)
        caches = [StaticKVCache(capacity, slots, k, v) for k, v in zip(keys, values)]
        # The function runs only while traced: what the contexts change is in the graph.
        handoff = Handoff()
        with (decode_attention(slots, queries or fused_queries(keys[0])), decode_blocks(slots, kernels, handoff),
              grouped_projections(groups, lora, copies, kernels, handoff)):
            hidden = model.model(tokens[:, None], cache=caches)
            head = dense_head or lm_head(model)  # looked up while traced: grouped_projections' as_linear
            logits = head(hidden if hidden.ndim == 2 else hidden[:, 0])  # decode_blocks' rows may be 2-D
        nxt, logp, ent = draw(logits, key, params, rows)
        nxt = mx.where(finished, pad_id, nxt)
        valid = ~finished
        finished = finished | is_eos(nxt, eos_ids)
        return nxt, logp, ent, valid, finished, [c.keys for c in caches], [c.values for c in caches]

    return mx.compile(step) if constant else mx.compile(step, inputs=[model.state])


def kernel_fits(model: nn.Module) -> bool:
    """Whether a decode step of the model can attend with attention_kernel: on MLX's CUDA
    backend, when every layer hands its cache's own buffers and no attention sinks to
    mx.fast.scaled_dot_product_attention right after update_and_fetch (mlx_lm's models do), or
    is a Qwen3 attention the kernel runs whole (kernel_norms_and_rope), and every layer attends
    so. Found by tracing one step of one row, never evaluated."""
    if not attention_kernel.cuda():
        return False
    slots = Slots(2, mx.array(1, mx.int32), mx.array([0], mx.int32), 1, kernel=True)
    caches = [StaticKVCache(2, slots) for _ in model.layers]
    try:
        with decode_attention(slots, 1):
            model.model(mx.zeros((1, 1), mx.int32), cache=caches)
    except KernelMisfit:
        return False
    return slots.pending is None and slots.attended == len(model.layers)


def is_eos(tokens: mx.array, eos_ids: list[int]) -> mx.array:
    eos = mx.array(eos_ids or [-1], dtype=mx.int32)
    return (tokens[:, None] == eos[None, :]).any(axis=1)


def left_pad(prompts: list[list[int]], pad_id: int, width: int | None = None) -> tuple[mx.array, mx.array]:
    """Prompts left-padded to one width (the longest's, or `width`: a gang's rank pads its share as
    the whole batch would be, so that its positions are the same)."""
    width = max(max(len(p) for p in prompts), width or 0)
    rows = [[pad_id] * (width - len(p)) + p for p in prompts]
    return mx.array(rows, dtype=mx.int32), mx.array([width - len(p) for p in prompts], dtype=mx.int32)


def compacted(finished: np.ndarray) -> np.ndarray | None:
    """Which rows a decode keeps once at least half of them have finished (else None): the
    unfinished ones, plus finished ones up to a power of two, so that a job's decode step is
    compiled for a few row counts only. Their work is saved where the step's cost grows with
    its rows (a CPU; a GPU's matmuls of many rows)."""
    live = np.flatnonzero(~finished)
    if len(finished) < 2 or len(live) > len(finished) // 2:
        return None
    size = 1 << max(len(live) - 1, 0).bit_length()
    return np.sort(np.concatenate([live, np.flatnonzero(finished)[:size - len(live)]]))


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
    the prompts to at least this (left_pad). Between chunks, once half the rows have finished,
    the decode goes on with the others only (compacted); every row makes the draws it would
    make in the whole batch (draw's rows), so the samples are the same.

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
    # Buffers of this decode's own, each row its own memory (one prompt's cache repeated is a
    # broadcast of one row): attention_kernel writes into them in place.
    keys = [mx.contiguous(mx.repeat(c.keys, group_size, axis=0)) for c in caches]
    values = [mx.contiguous(mx.repeat(c.values, group_size, axis=0)) for c in caches]
    logits = mx.repeat(logits, group_size, axis=0)
    pad = mx.repeat(pad, group_size, axis=0)
    write_pos = mx.array(width, dtype=mx.int32)
    # Each row's row of the whole batch (a gang's rank has some of its rows) and the batch's height.
    index = np.array(params.batch_rows if params.batch_rows is not None else range(rows), dtype=np.int32)
    height = params.batch_height or rows
    draw_rows = None if params.batch_rows is None else (height, mx.array(index))

    lora = lora_args(model)  # the LoRA weights of this step
    step_keys = mx.random.split(key, params.max_tokens + 1)
    first, first_logp, first_ent = draw(logits, step_keys[0], params, draw_rows)

    live = np.arange(rows)  # the rows still decoded (all, until compacted)
    outputs = [first], [first_logp], [first_ent], [mx.ones((rows,), dtype=mx.bool_)]
    segments = []  # (live, outputs) of the chunks before each compaction
    finished = is_eos(first, eos_ids)
    tokens = first
    steps = 1
    while steps < params.max_tokens:
        n = min(CHUNK, params.max_tokens - steps)
        for i in range(n):
            tokens, logp, ent, valid, finished_next, keys, values = decode_step(
                tokens, keys, values, write_pos, pad, finished, step_keys[steps + i], lora, draw_rows
            )
            for out, a in zip(outputs, (tokens, logp, ent, valid)):
                out.append(a)
            finished = finished_next
            write_pos = write_pos + 1
            # All of it now: a step's log-prob and entropy left lazy would keep its
            # full-vocabulary log-probs alive until the end of sampling.
            mx.async_eval(tokens, logp, ent, valid, finished)
        steps += n
        if should_stop():
            return None
        if steps == params.max_tokens:
            break
        done = np.array(finished)
        if done.all():
            break
        keep = compacted(done)
        if keep is not None:
            segments.append((live, outputs))
            outputs, live, sel = ([], [], [], []), live[keep], mx.array(keep)
            tokens, finished, pad = tokens[sel], finished[sel], pad[sel]
            keys, values = [k[sel] for k in keys], [v[sel] for v in values]
            draw_rows = (height, mx.array(index[live]))

    segments.append((live, outputs))
    tokens, logp, ent, mask = (
        mx.concatenate([_rows_of(rows, live, mx.stack(out[j], axis=1), fill) for live, out in segments if out[j]], axis=1)
        for j, fill in enumerate((0, 0.0, 0.0, False)))
    ended = _rows_of(rows, live, finished, True)  # a row not decoded to the end had finished
    pad_cols = params.max_tokens - tokens.shape[1]
    if pad_cols:
        tokens, logp, ent, mask = (mx.pad(a, [(0, 0), (0, pad_cols)]) for a in (tokens, logp, ent, mask))
    samples = Samples(tokens=tokens, logprobs=logp * mask, entropy=ent * mask, mask=mask, ended=ended, steps=steps)
    mx.eval(samples.tokens, samples.logprobs, samples.entropy, samples.mask, samples.ended)
    return samples


def _rows_of(rows: int, live: np.ndarray, a: mx.array, fill) -> mx.array:
    """a's rows (those of `live`) in a (rows, ...) array, `fill` in the others."""
    if len(live) == rows:
        return a
    out = mx.full((rows, *a.shape[1:]), fill, dtype=a.dtype)
    out[mx.array(live)] = a
    return out
