"""The decode's KV cache: fixed-size buffers shared by left-padded rows, so that the shapes of a
decode step never change while it decodes and the whole step is one `mx.compile`d function.

Slots is what one forward pass shares across layers (RoPE offsets, the mask, the write slot);
StaticKVCache is one layer's buffers, in the form mlx_lm's models ask of a cache; KernelMisfit
is raised where a model does not hand its cache to the attention as attention_kernel.attend needs.
"""

import mlx.core as mx

from worker.runtime.logprobs import attention_mask


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


class KernelMisfit(Exception):
    """The model does not attend as attention_kernel.attend needs (sampling.kernel_fits)."""


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


class EpisodeSlots:
    """Slots of a multi-turn decode (worker/decode/episodes.py): a row's tokens need not be one
    run of slots after its left padding, since rows wait while others decode and turns are
    appended at the same slot for all rows. `valid` (rows, capacity) marks the slots before
    write_pos holding a token of the row; the n new tokens of a row are the last n - chunk_pad
    of the pass (left-padded within it); positions (rows,) is the RoPE position of each row's
    first new token. No attention kernel: the mask is an array like any other."""

    kernel, pending, attended = False, None, 0

    def __init__(self, capacity: int, write_pos: mx.array, positions: mx.array, valid: mx.array, n: int,
                 chunk_pad: mx.array | None = None):
        self.write_pos = write_pos
        chunk_pad = mx.zeros_like(positions) if chunk_pad is None else chunk_pad
        self.offset = positions - chunk_pad  # the padding before a row's new tokens takes the positions before them
        s = mx.arange(capacity)[None, None, :]
        q = (write_pos + mx.arange(n))[None, :, None]
        before = valid[:, None, :] & (s < write_pos)
        new = (s >= write_pos + chunk_pad[:, None, None]) & (s <= q)  # causal within the pass, after its padding
        self.mask = (before | new | (s == q))[:, None]  # a padding query sees itself: no NaN (attention_mask)
        self.one = (mx.arange(capacity) == write_pos)[None, None, :, None] if n == 1 else None
