"""What every kind's trainer shares: its counters, how a step stops or fails, its batches of
rows, its optimizer, and `Run`, the face a kind shows the job loop (worker/runtime/job_loop.py).

Every step's randomness (sampling, LoRA dropout) is drawn from `step_seed(seed, step)`, and
every step's rows from `batch_indices`, a pure function of (step, seed): a job resumed from a
checkpoint continues as it would have, without any RNG state in the checkpoint.

Rows of token ids are right-padded (`pad_rows`): attention is causal, so padding after a
row's last token changes nothing before it, and the loss masks it out.

Imports MLX and nothing of the worker's queue side (no Redis): the trainers run without a
worker (bench/train_step.py, tests/test_supervised_trainer.py).
"""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.tuner.utils import build_schedule

from worker.runtime.scalars import as_inputs

PAD_TO = 32  # padded widths are multiples of this: few distinct shapes to compile


@dataclass
class TrainState:
    step: int = 0  # completed optimizer steps
    num_tokens: int = 0
    history: list[dict] = field(default_factory=list)


class Cancelled(Exception):
    """The job was cancelled or handed back (its should_stop said so) during a step."""


class NonFiniteLoss(Exception):
    pass


def check_finite(loss: float, grad_norm: float, step: int) -> None:
    """Raise NonFiniteLoss for step `step` (1-based) unless its loss and gradient norm are finite."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteLoss(f"non-finite loss or gradient at step {step} (loss={loss}, grad_norm={grad_norm})")


def step_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s random numbers: a function of (job seed, step)."""
    return seed * 1_000_003 + step


# --------------------------------------------------------------------------- which rows a step takes


def batch_indices(n_rows: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Rows for step `step`: walk a seeded shuffle of all rows, a new shuffle per epoch."""
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(k, n_rows)
        out.append(int(np.random.RandomState((seed + 7919 * epoch) % 2**32).permutation(n_rows)[pos]))  # RandomState takes < 2**32
    return out


def batch_rows(n_rows: int, batch_size: int, step: int, accumulation: int, seed: int) -> list[list[int]]:
    """Row indices of each micro-batch of optimizer step `step` (gradient accumulation)."""
    size = min(batch_size, n_rows)
    flat = batch_indices(n_rows, size, step, seed) if accumulation == 1 else [
        i for k in range(step * accumulation, (step + 1) * accumulation) for i in batch_indices(n_rows, size, k, seed)]
    return [flat[k * size:(k + 1) * size] for k in range(accumulation)]


def eval_batches(n_rows: int, batch_size: int, val_batches: int) -> list[list[int]]:
    """The valid rows in order, batch by batch: the first val_batches batches (-1: all)."""
    chunks = [list(range(i, min(i + batch_size, n_rows))) for i in range(0, n_rows, batch_size)]
    return chunks if val_batches < 0 else chunks[:val_batches]


# --------------------------------------------------------------------------- rows of tokens


@dataclass
class Rows:
    """Token rows and where the trained part of each starts (prompt tokens before it); masks,
    when a row's trained tokens are not all of those after its start (SFT's assistant messages):
    per token, 1 where it is trained."""

    tokens: list[list[int]]
    starts: list[int]
    masks: list[list[int]] | None = None


@dataclass
class PaddedBatch:
    inputs: mx.array  # (N, W) int32: the rows without their last token
    targets: mx.array  # (N, W) int32: each position's next token
    mask: mx.array  # (N, W) float32: 1 where the target is a trained token
    lengths: mx.array  # (N,) int32: tokens per row (its last token is at lengths - 1)


def pad_rows(rows: Rows) -> PaddedBatch:
    """Right-pad rows (already cut to max_seq_length) to a width multiple of PAD_TO."""
    longest = max(len(t) for t in rows.tokens)
    width = min(PAD_TO * math.ceil(longest / PAD_TO), longest + PAD_TO) + 1
    grid = [t + [0] * (width - len(t)) for t in rows.tokens]
    tokens = mx.array(grid, dtype=mx.int32)
    pos = mx.arange(1, width)[None, :]  # position of each target in its row
    lengths = mx.array([len(t) for t in rows.tokens], dtype=mx.int32)
    starts = mx.array(rows.starts, dtype=mx.int32)
    mask = (pos >= starts[:, None]) & (pos < lengths[:, None])
    if rows.masks is not None:
        mask = mask & mx.array([m + [0] * (width - len(m)) for m in rows.masks], dtype=mx.bool_)[:, 1:]
    return PaddedBatch(tokens[:, :-1], tokens[:, 1:], mask.astype(mx.float32), lengths)


def cut(rows: Rows, max_len: int) -> tuple[Rows, int]:
    """Rows cut to max_len tokens, and how many were cut."""
    n_cut = sum(len(t) > max_len for t in rows.tokens)
    masks = None if rows.masks is None else [m[:max_len] for m in rows.masks]
    return Rows([t[:max_len] for t in rows.tokens], [min(s, max_len) for s in rows.starts], masks), n_cut


# --------------------------------------------------------------------------- the optimizer


def learning_rate_schedule(cfg, total_updates: int) -> Callable | float:
    """TRL's (transformers') schedules: linear warmup from 0 over warmup_steps, then constant,
    or linear or cosine decay to 0 at update total_updates."""
    warm = min(cfg.warmup_steps, total_updates)
    if cfg.lr_scheduler == "constant":
        if not warm:
            return cfg.learning_rate
        main = optim.linear_schedule(cfg.learning_rate, cfg.learning_rate, 1)
    elif cfg.lr_scheduler == "cosine":
        main = optim.cosine_decay(cfg.learning_rate, max(total_updates - warm, 1))
    else:
        main = optim.linear_schedule(cfg.learning_rate, 0.0, max(total_updates - warm, 1))
    if not warm:
        return main
    return optim.join_schedules([optim.linear_schedule(0.0, cfg.learning_rate, warm), main], [warm])


def make_optimizer(cfg, total_updates: int, name: str = "adamw", mlx_schedule: dict | None = None,
                   momentum: float | None = None) -> optim.Optimizer:
    """mlx.optimizers' optimizer `name` (mlx_lm's choices) of a config's optimizer fields
    (shared/schemas.py OptimizerConfig) over total_updates updates. mlx_schedule: mlx_lm's
    lr_schedule ({name, arguments, warmup}) in place of lr_scheduler and warmup_steps.

    adamw (adam: no weight decay), bias-corrected as PyTorch's and so TRL's unless bias_correction
    is off (MLX's default, and mlx_lm's trainer):

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  theta *= 1 - lr * weight_decay
        theta -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)     (bias_correction off: no 1 - b^t)

    sgd and muon: MLX's with `momentum` (None: theirs, 0 and 0.95) and weight_decay. adafactor:
    the learning rate as given, not Adafactor's relative step nor scaled by each weight's size
    (transformers' advice for fine-tuning: a LoRA B of zeros would otherwise hardly move).
    """
    lr = build_schedule(mlx_schedule) if mlx_schedule else learning_rate_schedule(cfg, total_updates)
    betas, eps = [cfg.adam_beta1, cfg.adam_beta2], cfg.adam_epsilon
    if name == "adam":
        return AdamW(learning_rate=lr, betas=betas, eps=eps, weight_decay=0.0, bias_correction=cfg.bias_correction)
    if name == "sgd":
        return optim.SGD(learning_rate=lr, momentum=momentum or 0.0, weight_decay=cfg.weight_decay)
    if name == "muon":
        return optim.Muon(learning_rate=lr, momentum=0.95 if momentum is None else momentum,
                          weight_decay=cfg.weight_decay)
    if name == "adafactor":
        return optim.Adafactor(learning_rate=lr, relative_step=False, scale_parameter=False,
                               weight_decay=cfg.weight_decay)
    return AdamW(learning_rate=lr, betas=betas, eps=eps, weight_decay=cfg.weight_decay,
                 bias_correction=cfg.bias_correction)


class AdamW(optim.AdamW):
    """mlx's AdamW (weight_decay 0: its Adam) with betas, eps and weight decay in its state, so
    inputs of a compiled step (worker/runtime/scalars.py): as Python numbers mlx's compiled them
    into the update's kernels, which a job of another weight decay compiled again (3 kernels, 1.8
    s on an H100). Each number is cast to the dtype mlx's Python number takes in that product,
    and 1 - beta is the Python number's, so the update is mlx's to the bit (tests/test_scalars.py)."""

    def __init__(self, learning_rate, betas: list[float], eps: float, weight_decay: float, bias_correction: bool):
        super().__init__(learning_rate=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction)
        b1, b2 = betas
        self.state["numbers"] = as_inputs(beta1=b1, beta2=b2, rest1=1 - b1, rest2=1 - b2, eps=eps,
                                          weight_decay=weight_decay)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        n, dtype = self.state["numbers"], gradient.dtype
        lr = self.learning_rate.astype(dtype)
        parameter = parameter * (1 - lr * n["weight_decay"].astype(dtype))
        m = n["beta1"].astype(dtype) * state["m"] + n["rest1"].astype(dtype) * gradient
        v = n["beta2"].astype(dtype) * state["v"] + n["rest2"].astype(dtype) * mx.square(gradient)
        state["m"], state["v"] = m, v
        eps = n["eps"].astype(dtype)
        if not self.bias_correction:
            return parameter - lr * m / (mx.sqrt(v) + eps)
        c1 = (lr / (1 - n["beta1"] ** self.step)).astype(dtype)
        c2 = mx.rsqrt(1 - n["beta2"] ** self.step).astype(dtype)
        return parameter - c1 * m / (mx.sqrt(v) * c2 + eps)


def clipped(grads, max_grad_norm: float | mx.array | None):
    """(grads clipped to a global norm of max_grad_norm (None: as they are; an array: a compiled
    step's input, worker/runtime/scalars.py), their norm before),
    as mlx's clip_grad_norm clips them. Each array's sum of squares (a float16 array's in float32)
    is kept (1, 1), and the sums are concatenated and summed in float32: a square and a sum an
    array (a 2-D array's sum is (1, 1) as it is, another's is reshaped), where sums to scalars
    stacked add a squeeze and an expansion to each. Not added one by one: a compiled chain of
    additions is a kernel of as many inputs as there are trainable arrays, compiled again for every
    other layer count (docs/performance.md)."""
    sums = [(g.astype(mx.float32) if g.dtype == mx.float16 else g).square().sum(keepdims=True).astype(mx.float32)
            for _, g in tree_flatten(grads)]
    norm = mx.sqrt(mx.concatenate([s if s.ndim == 2 else s.reshape(1, 1) for s in sums]).sum())
    if max_grad_norm is None:
        return grads, norm
    normalizer = mx.minimum(max_grad_norm / (norm + 1e-6), 1.0)  # clip_grad_norm's, as it scales
    return tree_map(lambda g: (g * normalizer).astype(g.dtype), grads), norm


# --------------------------------------------------------------------------- what the job loop drives


Step = Callable[["TrainState", Callable[[], bool], Callable[[], None]], tuple[dict, list[dict]]]


@dataclass
class Run:
    """A kind's job, ready to train: what its worker module's `load` yields to the job loop
    (worker/runtime/job_loop.py). The step intervals are named as in mlx_lm's TrainingArgs."""

    module: nn.Module  # its trainable parameters, with the optimizer's state, are the checkpoint
    optimizer: optim.Optimizer
    # step(state, should_stop, on_finite_loss): one optimizer step; state.step counts it. Returns the
    # step's metrics and events to keep (the stream keeps the last MTQ_SAMPLES_EVENTS_KEPT of each type).
    # on_finite_loss() is called once the weights before the update gave a finite loss and gradient.
    step: Step
    save: Callable[[Path], None]  # the artefact's files (adapter or model directory), into a directory
    phase: str  # the phase a step starts in (worker/supervisor/marks.py PHASES)
    history_metrics: tuple[str, ...]  # the metrics of every step kept in the job's history
    steps_per_save: int  # a checkpoint every N steps (and every checkpoint_interval_s)
    steps_per_report: int = 1  # a step event every N steps (and at the last); progress every step
    evaluate: Callable[[int], dict] | None = None  # val_* metrics after this many steps (None: no validation data)
    steps_per_eval: int = 0
    serves_scoring: bool = True  # answer log-prob requests between steps (False: a private copy of the model)
    # Log-probs kept with the checkpoint (worker/kinds/supervised_trainer.py ReferenceLogps: DPO's reference): arrays() and restore().
    reference: object | None = None
