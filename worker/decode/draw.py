"""Drawing each row's next token: what a job asks of sampling (SamplingParams), what sample()
returns (Samples), and draw, which picks the tokens from the logits with their log-probs and
entropies under the distribution they were drawn from (logits / temperature: log_softmax and
pick of worker/runtime/logprobs.py, as the loss computes them)."""

import math
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from worker.runtime.logprobs import divisor, log_softmax, pick
from worker.runtime.scalars import as_inputs


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

    def inputs(self) -> dict[str, mx.array]:
        """The numbers draw computes with, as arrays for a compiled decode step to take as inputs
        (worker/runtime/scalars.py): the logits' divisor, top_p and log(min_p)."""
        return as_inputs(temperature=divisor(self.temperature), top_p=self.top_p,
                         log_min_p=math.log(self.min_p) if self.min_p > 0 else 0.0)


@dataclass
class Samples:
    tokens: mx.array  # (rows, max_tokens) int32, pad after the end
    logprobs: mx.array  # (rows, max_tokens) float32: log pi_old(token), logits / temperature
    entropy: mx.array  # (rows, max_tokens) float32: entropy of the sampling distribution
    mask: mx.array  # (rows, max_tokens) bool: token belongs to the completion (EOS included)
    ended: mx.array  # (rows,) bool: the row emitted EOS (not truncated)
    steps: int  # decode steps actually run


def draw(logits: mx.array, key: mx.array, p: SamplingParams, rows: tuple[int, mx.array] | None = None,
         values: dict[str, mx.array] | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """The next token of every row, its log-prob and the entropy (one log-softmax for all three).
    rows (height, index): the rows are these rows of a batch of `height` (a gang's share, or
    the rows left once finished ones are dropped), and each draws the Gumbel noise it would
    draw in the whole batch (mx.random.categorical's own way), so the same token. key: one
    key, or one per row (rows, 2; chat completions: worker/decode/serving.py). values:
    p.inputs(), which a compiled step takes as its inputs (None: made here; mlx_lm's top_p filter
    is a compiled function of its own). min_p as mlx_lm's apply_min_p filters (it keeps at least
    the likeliest token), with log(min_p) an input where it takes the number."""
    values = p.inputs() if values is None else values
    logp_all = log_softmax(logits, values["temperature"])
    if p.temperature == 0:
        tokens = mx.argmax(logits, axis=-1)
    else:
        filtered = logp_all
        if p.top_k > 0:
            filtered = apply_top_k(filtered, p.top_k)
        if p.top_p < 1.0:
            filtered = apply_top_p(filtered, values["top_p"])
        if p.min_p > 0.0:
            top = filtered.max(axis=-1, keepdims=True)
            filtered = mx.where(filtered < top + values["log_min_p"], -float("inf"), filtered)
        if key.ndim == 2:  # a key per row: each row's draws are its own, whatever it is batched with
            noise = mx.vmap(lambda k: mx.random.gumbel(shape=filtered.shape[-1:], key=k))(key)
            tokens = mx.argmax(filtered + noise, axis=-1)
        elif rows is None:
            tokens = mx.random.categorical(filtered, key=key)
        else:
            height, index = rows
            noise = mx.random.gumbel(shape=(height, filtered.shape[-1]), key=key)
            tokens = mx.argmax(filtered + noise[index], axis=-1)
    picked = pick(logp_all, tokens)  # by argmax's own indices: the cast then fuses with what reads the tokens
    return (tokens.astype(mx.int32), *picked)
