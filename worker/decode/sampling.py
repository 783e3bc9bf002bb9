"""The sample loop: make_decode_step, one compiled decode step for all rows of a GRPO step
(batch_size prompts x group_size), and sample, which prefills each prompt once, repeats its cache
group_size times and runs the step to the end.

The step (model forward, filtering, sampling, EOS bookkeeping) is one `mx.compile`d function over
fixed-size KV buffers (worker/decode/kv_cache.py), traced with the decode's own attention, blocks
and projections (worker/decode/graph_patches.py); the tokens are drawn by worker/decode/draw.py.
The host looks at the rows only once per CHUNK tokens (all finished? cancelled?), and once half
of them have finished goes on with the others only (compacted).
"""

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from worker.decode import attention_kernel
from worker.decode.draw import Samples, SamplingParams, draw
from worker.decode.graph_patches import (
    Handoff,
    decode_attention,
    decode_blocks,
    dequantized,
    fused_queries,
    grouped_projections,
    lora_args,
)
from worker.decode.kv_cache import KernelMisfit, Slots, StaticKVCache
from worker.runtime.logprobs import left_pad, lm_head
from worker.runtime.projection_groups import decode_groups, decode_projections, lora_arrays

CHUNK = 16  # decode steps between host checks (early stop when all rows ended, cancel)
EOS_CHAIN = 16  # is_eos: more ids are one compare, not as many ops in one fused kernel (a session's stops: 16)


def make_decode_step(
    model: nn.Module, params: SamplingParams, eos_ids: list[int], pad_id: int, queries: int | None = None,
    dense: bool = False, kernel: bool | None = None,
) -> Callable:
    """One compiled decode step for all rows: forward one token, pick the next, track EOS.

    kernel: the step runs the CUDA kernels where they fit (None, the default: on CUDA): the
    attention is attention_kernel's (where kernel_fits), LoRA products lora_kernel's, quantized
    matmuls quantized_kernel's, a Qwen3 block's residual adds and norms norm_kernel's and its MLP
    activation swiglu_kernel's (those two also make the LoRA kernels beside them).
    queries: where the attention is not attention_kernel's, how many copies of each row's query
    it gets (decode_attention; None: fused_queries' choice); the results are those of one query.
    dense: the quantized projections multiply by dequantized copies of their weights
    (dequantized; the log-probs then agree with the quantized model's to float rounding, not
    exactly).

    The model's weights are constants of the compiled step, except the LoRA weights, which it
    takes as its argument `lora` (lora_args): MLX checks every input of a compiled function
    at every call, and a model has hundreds. A model with other trainable weights (DoRA, full
    fine-tuning) gives the compiled step all its weights as inputs instead.

    Returns step(tokens, keys, values, write_pos, left_pad, finished, key, lora, rows), as
    sample() calls it: each row's last token, the layers' KV buffers, the buffer slot it is
    written to, each row's left padding, the rows that have finished, this position's random
    key, lora_args(model), and draw's rows (None: the rows are the whole batch). It gives the
    next tokens, their log-probs and entropies, whether each token belongs to its completion
    (its row had not finished), the rows finished after it, and the new KV buffers."""
    kernels = attention_kernel.cuda() if kernel is None else kernel
    kernel = kernel_fits(model) if kernel is None else kernel
    forward, constant = make_decode_forward(model, dense, kernels)
    numbers = params.inputs()  # inputs, not numbers compiled into the kernels (worker/runtime/scalars.py)

    def step(tokens, keys, values, write_pos, left_pad, finished, key, lora, rows):
        capacity = keys[0].shape[2]
        slots = Slots(capacity, write_pos, left_pad, 1, kernel)
        caches = [StaticKVCache(capacity, slots, k, v) for k, v in zip(keys, values)]
        logits = forward(tokens, caches, slots, lora, queries)
        nxt, logp, ent = draw(logits, key, params, rows, numbers)
        nxt = mx.where(finished, pad_id, nxt)
        valid = ~finished
        finished = finished | is_eos(nxt, eos_ids)
        return nxt, logp, ent, valid, finished, [c.keys for c in caches], [c.values for c in caches]

    return mx.compile(step, inputs=[numbers]) if constant else mx.compile(step, inputs=[model.state, numbers])


def make_decode_forward(model: nn.Module, dense: bool, kernels: bool) -> tuple[Callable, bool]:
    """The traced part of a decode step that every decode shares (make_decode_step's and
    worker/decode/episodes.py's): forward(tokens, caches, slots, lora, queries) -> the logits of
    each row's one new token, under the decode's attention, blocks and projections. Also
    whether the model's weights can be constants of the compiled step (all its trainable
    weights are LoRA weights passed as `lora`)."""
    groups = decode_groups(model)
    copies = dequantized(decode_projections(model, groups)) if dense else {}
    embed = model.model.embed_tokens
    dense_head = None
    if id(embed) in copies:  # a tied output projection: embed_tokens.as_linear, not a QuantizedLinear call
        w = copies[id(embed)][0]
        dense_head = lambda h: h @ w  # noqa: E731
    passed = {id(a) for g in groups if g.lora for a in lora_arrays(g.modules)}
    constant = all(id(a) in passed for _, a in tree_flatten(model.trainable_parameters()))

    def forward(tokens, caches, slots, lora, queries):
        # The function runs only while traced: what the contexts change is in the graph.
        handoff = Handoff()
        with (decode_attention(slots, queries or fused_queries(caches[0].keys)), decode_blocks(slots, kernels, handoff),
              grouped_projections(groups, lora, copies, kernels, handoff)):
            hidden = model.model(tokens[:, None], cache=caches)
            head = dense_head or lm_head(model)  # looked up while traced: grouped_projections' as_linear
            return head(hidden if hidden.ndim == 2 else hidden[:, 0])  # decode_blocks' rows may be 2-D

    return forward, constant


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
    """Whether each token is one of eos_ids. Up to EOS_CHAIN ids, element-wise compares only,
    which a compiled step fuses with the ops around them (a (rows, ids) compare and its any()
    are five primitives)."""
    if len(eos_ids) > EOS_CHAIN:
        return (tokens[:, None] == mx.array(eos_ids, dtype=mx.int32)[None, :]).any(axis=1)
    hit = tokens == (eos_ids[0] if eos_ids else -1)
    for e in eos_ids[1:]:
        hit = hit | (tokens == e)
    return hit


def draw_keys(key: mx.array, draws: int) -> np.ndarray:
    """Each draw's random key, mx.random.split(key, draws), on the host: a decode step takes
    mx.array(keys[i]) and its KV slot as mx.array(slot), made on the host, where indexing the
    split keys and adding one to the slot were three primitives a step (two views and an add)."""
    return np.array(mx.random.split(key, draws))


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
    # Each row's row of the whole batch (a gang's rank has some of its rows) and the batch's height.
    index = np.array(params.batch_rows if params.batch_rows is not None else range(rows), dtype=np.int32)
    height = params.batch_height or rows
    draw_rows = None if params.batch_rows is None else (height, mx.array(index))

    lora = lora_args(model)  # the LoRA weights of this step
    step_keys = draw_keys(key, params.max_tokens + 1)
    first, first_logp, first_ent = draw(logits, mx.array(step_keys[0]), params, draw_rows)

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
                tokens, keys, values, mx.array(width + steps + i - 1, dtype=mx.int32), pad, finished,
                mx.array(step_keys[steps + i]), lora, draw_rows
            )
            for out, a in zip(outputs, (tokens, logp, ent, valid)):
                out.append(a)
            finished = finished_next
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
