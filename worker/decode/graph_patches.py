"""What a decode step changes in mlx / mlx_lm while it is traced: context managers that swap
process-global functions for the decode's own, and the inputs they take.

Which functions, and why. mlx_lm's models run their forward pass by calling these; swapping them
changes how a decode step computes without a copy of each model's code:

  decode_attention      mx.fast.scaled_dot_product_attention and mlx_lm's qwen3.Attention.__call__:
                        on CUDA the attention and the KV write as one attention_kernel.attend (a
                        Qwen3 layer's q/k norms and RoPE too), else each row's query given
                        `queries` times so that MLX fuses the masked attention (fused_queries)
  decode_blocks         qwen3.Qwen3Model.__call__: a Qwen3 model's residual adds and the norms after
                        them as norm_kernel.add_norm, its MLP activation as swiglu_kernel.swiglu, a
                        quantized embedding's lookup as embed_kernel.lookup, its rows 2-D where the
                        attention kernel runs whole
  grouped_projections   __call__ of the classes of the grouped projections (nn.Linear,
                        nn.QuantizedLinear, mlx_lm's LoRALinear) and nn.QuantizedEmbedding.as_linear
                        (a tied output projection): each projection group (decode_groups of
                        worker/runtime/projection_groups.py) as one matmul and one pair of LoRA
                        matmuls (lora_args), with lora_kernel's and quantized_kernel's kernels, or
                        dense copies of quantized weights (dequantized)

Handoff is what these leave each other within one step: a kernel that takes a LoRA group's base
output makes the group's LoRA product itself (the kernels are worker/decode/*_kernel.py).

Why it is safe. Each context manager restores what it swapped in its `finally`, also when the
trace raises (KernelMisfit). They are entered only around tracing: the compiled decode step's
Python function (sampling.make_decode_step) runs only while mx.compile traces it (later calls
replay the graph), and sampling.kernel_fits traces one step that is never evaluated. Only the training process's main thread
traces, one job at a time, and no other thread of it runs a model, so nothing else calls the
swapped functions meanwhile.
"""

import contextlib
import itertools

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3
from mlx_lm.models.activations import swiglu

from worker.decode import attention_kernel, embed_kernel, lora_kernel, norm_kernel, quantized_kernel, swiglu_kernel
from worker.decode.kv_cache import KernelMisfit, Slots, StaticKVCache
from worker.runtime.projection_groups import Group, base_projection, decode_groups, lora_pair


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
        self.made = {}  # id(t) -> (t, x, A): t = lora_kernel.down(x, A), which a kernel taking t may make itself

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

    def made_from(self, up: tuple | None) -> tuple | None:
        """(x, A) if up's t is lora_kernel.down(x, A): a kernel taking up may make t itself."""
        entry = self.made.get(id(up[0])) if up is not None else None
        return entry[1:] if entry is not None and entry[0] is up[0] else None

    def down(self, x: mx.array, a: mx.array) -> mx.array | None:
        """x @ a if the kernel that made x made it."""
        entry = self.downs.get(id(x))
        return entry[2] if entry is not None and entry[0] is x and entry[1] is a else None


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
    reading it, where grouped_projections hands them over (handoff). A quantized embedding
    looks its rows up by embed_kernel where kernel and it fits. When the
    attention kernel runs every block's attention whole (kernel_norms_and_rope), the rows go
    through the blocks 2-D, (rows, hidden): MLX 0.32's CUDA quantized matmul runs a (rows, 1, K)
    input as `rows` products of one row, each reading all the weights, and a (rows, K) one as
    one product (mlx/backend/cuda/quantized/quantized.cpp, its batch count)."""
    qwen3_model = qwen3.Qwen3Model.__call__

    def add_norm(h, r, norm, reader=None):
        """h + r and its norm, the norm's output read by the projection `reader`."""
        y, up = handoff.whole(r)
        a = handoff.lora_a.get(id(reader))
        made = handoff.made_from(up)
        if kernel and not norm_kernel.available(h, y, norm, up, a, made):
            made = None  # up's t as lora_kernel.down made it
        if kernel and not norm_kernel.available(h, y, norm, up, a):
            y, up, a, made = r, None, None, None  # what is handed over does not fit: the add and norm alone
        if kernel and norm_kernel.available(h, y, norm, up, a, made):
            h, x, t = norm_kernel.add_norm(h, y, norm, up, a, made)
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
        flat = slots.kernel and inputs.shape[1] == 1 and all(kernel_norms_and_rope(b.self_attn) for b in self.layers)
        if kernel and embed_kernel.available(inputs, self.embed_tokens):
            h = embed_kernel.lookup(inputs, self.embed_tokens, flat)
        else:
            h = self.embed_tokens(inputs)
            h = h.reshape(h.shape[0], h.shape[2]) if flat else h
        mask = None if flat else qwen3.create_attention_mask(h, cache[0])  # whole_attention takes no mask
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


def lora_args(model: nn.Module) -> list[tuple[mx.array, mx.array, mx.array]]:
    """The LoRA matrices of each decode_groups group with LoRA, as one pair (lora_pair: A side by
    side, B block-diagonal), and its scale as a (1,) float32 array (as the kernels read it: an
    input of the step, not a number compiled into its kernels, worker/runtime/scalars.py). Taken at
    each sample() (the job's LoRA weights change between steps): a paired group's trainable pair
    itself, another's built (small, rank x outputs)."""
    return [(*lora_pair(group.modules), mx.array([group.modules[0].scale], mx.float32))
            for group in decode_groups(model) if group.lora]


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
    classes = {type(m) for group in groups for m in group.modules} | {type(base_projection(m)) for group in groups
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
        sizes = [base_projection(m)["weight"].shape[0] for m in mods]
        bases = [group.fused] if group.fused is not None else [base_projection(m) for m in mods]
        if pair is not None and kernel and lora_kernel.available(x, *pair[:2]):
            a, b, scale = pair
            t = handoff.down(x, a)
            if t is None:
                t = lora_kernel.down(x, a)
                handoff.made[id(t)] = (t, x, a)
            ys = [project(base, x) for base in bases]
            bs = [b] if len(ys) == 1 else _split(b, sizes)
            outs = [lora_kernel.up(y, t, b_i, scale) for y, b_i in zip(ys, bs)]
            return handed(outs, ys, (t, b, scale), sizes)
        flat = x.ndim > 2 and (pair is not None or any(id(b) in dense for b in bases))
        h = x.reshape(-1, x.shape[-1]) if flat else x
        ys = [project(b, h) for b in bases]
        if pair is not None:
            a, b, scale = pair
            p = (h @ a) @ b
            z = (scale.astype(p.dtype) * p).astype(x.dtype)  # fused with the add below
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
    MLX 0.32's quantized one (docs/performance.md, "H200: projections and norms as kernels",
    dense decode weights). Memory: memory_plan.dense_decode_bytes (a job's budget pays for it:
    worker/runtime/memory_plan.py)."""
    copies = {}
    for m in modules:
        w = mx.dequantize(m["weight"], m["scales"], m.get("biases"), m.group_size, m.bits, mode=m.mode)
        copies[id(m)] = (mx.contiguous(w.T), m.get("bias"))
        mx.eval(copies[id(m)][0])
    return copies


def _split(x: mx.array, sizes: list[int]) -> list[mx.array]:
    return mx.split(x, list(itertools.accumulate(sizes))[:-1], axis=-1) if len(sizes) > 1 else [x]
