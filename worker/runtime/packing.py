"""Packing (SFT's `packing`, TRL's name and its default strategy, best-fit-decreasing): a micro-batch's
token rows laid end to end in fewer, denser sequences (as wide as its longest row: SFTTrainer.pack_to
says why), each row attending only to its own tokens and numbered from position 0, so that every
row gets the logits it gets alone and the loss and gradients are those of the padded batch.

How a packed forward pass reaches mlx_lm's models without a copy of their code: they take a
`cache` per layer, and from it their attention mask (`create_attention_mask` asks the cache's
`make_mask`), RoPE's offset (`self.rope(x, offset=cache.offset)`) and the keys and values
attended to (`cache.update_and_fetch`). `PackedCache` answers these with the block-diagonal
causal mask of the rows' segments, the tokens' positions and the keys and values as they are;
while the forward pass is traced, `per_token_rope` gives mx.fast.rope, called with those
positions as its offset, one offset per token: each token is a batch entry of its own, which
mx.fast.rope takes with a vector of offsets (the same kernel, so the same numbers as unpacked).
"""

import contextlib
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from worker.runtime.models import UnsupportedBase
from worker.runtime.train_core import PAD_TO, Rows, pad_rows


def best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Item indices per bin: the largest item first, each into the bin it fills most (the one with
    the least room that holds it), a new bin when none does. Items of size 0 go nowhere."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if sizes[i] == 0:
            continue
        fits = [b for b in range(len(bins)) if room[b] >= sizes[i]]
        if fits:
            b = min(fits, key=lambda b: room[b])
        else:
            b = len(bins)
            bins.append([])
            room.append(capacity)
        bins[b].append(i)
        room[b] -= sizes[i]
    return bins


@dataclass
class PackedBatch:
    inputs: mx.array  # (B, W) int32: the rows' inputs, end to end, B bins of W positions
    targets: mx.array  # (B, W) int32
    mask: mx.array  # (B, W) float32: 1 where the target is a trained token (as pad_rows's)
    positions: mx.array  # (B, W) int32: each token's position in its row
    segments: mx.array  # (B, W) int32: which row of its bin a token is (1, 2, ...; padding 0)


def pack_rows(rows: Rows, capacity: int) -> PackedBatch:
    """Rows (cut to max_seq_length) packed into bins of `capacity` positions: each row's inputs,
    targets and mask as pad_rows makes them (len(row) - 1 positions), its positions from 0."""
    padded = pad_rows(rows)
    arrays = [np.array(a) for a in (padded.inputs, padded.targets, padded.mask)]
    sizes = [len(t) - 1 for t in rows.tokens]
    bins = best_fit_decreasing(sizes, capacity) or [[]]
    fill = max(sum(sizes[i] for i in b) for b in bins)
    width = max(PAD_TO * math.ceil(fill / PAD_TO), PAD_TO)
    out = [np.zeros((len(bins), width), a.dtype) for a in arrays]
    positions = np.zeros((len(bins), width), np.int32)
    segments = np.zeros((len(bins), width), np.int32)
    for b, items in enumerate(bins):
        col = 0
        for s, i in enumerate(items, 1):
            n = sizes[i]
            for packed, a in zip(out, arrays):
                packed[b, col:col + n] = a[i, :n]
            positions[b, col:col + n] = np.arange(n)
            segments[b, col:col + n] = s
            col += n
    return PackedBatch(*(mx.array(a) for a in out), mx.array(positions), mx.array(segments))


class PackedCache:
    """Each attention layer's `cache` in a packed forward pass: nothing kept between calls."""

    def __init__(self, positions: mx.array, segments: mx.array):
        self.offset = positions  # RoPE's offset: per_token_rope knows it by identity
        self.segments = segments

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """(B, 1, n, n): a token sees the tokens of its own segment up to itself (and, for a
        sliding-window layer, within window_size of it); a padding token sees the padding."""
        idx = mx.arange(n)
        mask = (self.segments[:, :, None] == self.segments[:, None, :]) & (idx[:, None] >= idx[None])
        if window_size is not None:
            mask = mask & (idx[:, None] < idx[None] + window_size)
        return mask[:, None]


@contextlib.contextmanager
def per_token_rope(positions: mx.array, calls: list[int]):
    """While a packed forward pass is traced: mx.fast.rope with `positions` (B, T) as its offset
    rotates each token of its input (B, ..., T, D) by its own position; calls[0] counts them."""
    rope = mx.fast.rope

    def patched(a, dims, *, offset, **kwargs):
        if offset is not positions:
            return rope(a, dims, offset=offset, **kwargs)
        calls[0] += 1
        tokens = mx.moveaxis(a, -2, 1)  # (B, T, ..., D)
        shape = tokens.shape
        single = tokens.reshape(shape[0] * shape[1], *shape[2:-1], 1, shape[-1])
        out = rope(single, dims, offset=positions.reshape(-1), **kwargs)
        return mx.moveaxis(out.reshape(shape), 1, -2)

    mx.fast.rope = patched
    try:
        yield
    finally:
        mx.fast.rope = rope


def packed_logits(model: nn.Module, inputs: mx.array, positions: mx.array, segments: mx.array,
                  hidden: bool = False) -> mx.array:
    """The model's logits of a packed batch (hidden: its last hidden states, before the output
    head, for chunked_nll): each row's as if it were alone."""
    cache = PackedCache(positions, segments)
    calls = [0]
    with per_token_rope(positions, calls):
        logits = (model.model if hidden else model)(inputs, cache=[cache] * len(model.layers))
    if not calls[0]:  # a model that positions tokens otherwise would see the bins' positions
        raise UnsupportedBase(f"packing: the {type(model).__module__} model does not apply RoPE through mx.fast.rope")
    return logits


def check_packable(model: nn.Module) -> None:
    """UnsupportedBase unless every layer of the model is attention with a key-value cache (no
    recurrent state, which would carry from one row into the next)."""
    kinds = {type(c).__name__ for c in make_prompt_cache(model) if type(c) not in (KVCache, RotatingKVCache)}
    if kinds:
        raise UnsupportedBase(f"packing needs a model whose every layer is attention; this one keeps "
                              f"{', '.join(sorted(kinds))} state: set packing false")
