"""Memory of a GRPO step, estimated before the job runs, and the loss step's micro-batch.

A step has two phases that never overlap (the sampling KV cache is gone before the loss):

  sampling   the KV cache of all B*G rows, P + L positions each (P: longest prompt,
             L: max_completion_len), and the decode's transient copies of it:
                 S = copies * rows * layers * 2 * kv_heads * head_dim * (P + L) * bytes
  loss       m rows at a time (the micro-batch), gradients accumulated over the step:
                 no checkpointing:   m * (P + L) * layers * act
                 checkpointing:      m * (P + L) * (layers * hidden * bytes + 2 * act)
             plus the chunk of full-vocabulary float32 logits being turned into log-probs.
             act = the activations one layer keeps per token for its backward pass
             (inputs of every projection, attention, MLP, LoRA's float32 inputs; written
             out in `activation_bytes`).

Peak = weights + max(S, loss). The formulas were calibrated against measured peaks
(bench/grpo_step.py --sweep prints estimate beside measurement). The trainer makes the
estimate MLX's memory limit, so a GPU that would queue work far ahead keeps to it.

The micro-batch (when the job does not set it) is the largest divisor m of B*G such that
  - the loss step needs no more than sampling does (the peak stays the sampling peak),
    or m * (P + L) <= MIN_MICRO_BATCH_TOKENS (smaller would be mostly per-call overhead),
  - m * (P + L) <= MAX_MICRO_BATCH_TOKENS (on the CPU larger forward passes are no faster;
    on a GPU they are, at a cost in memory: docs/performance.md, the loss-phase table), and
  - weights + loss(m) fits max_memory_gb.
Gradient checkpointing (unless the job sets it) is used where it allows a larger micro-batch.

That is the memory-first default, what a 16 GB Mac needs, whose memory the system and its apps
share. A CUDA GPU's memory is the worker's alone: there a job without max_memory_gb gets a budget
of CUDA_BUDGET_SHARE of the memory MLX does not already hold for other models (memory first only
where that budget does not fit the job). A job's explicit max_memory_gb is a budget spent on speed
instead: the first rule goes (the loss step may need more than
sampling, up to the budget), on a GPU the token cap too, checkpointing stays off unless
without it the micro-batch would fall under MIN_MICRO_BATCH_TOKENS where with it it would not,
and MLX's memory limit is the budget rather than the estimate. The plan says which rules chose
it (`reason`); the job record shows it (GET on the job: memory_plan).
If even m = 1 (or sampling) does not fit max_memory_gb, the job fails at start with
MemoryEstimateError, which says how much it needs.

Rows of varying lengths (the Tinker training client's datums) have no sampling phase: a
micro-batch takes as many rows of its longest row's width as `loss_rows` says fit beside the
weights, at most MAX_MICRO_BATCH_TOKENS tokens.
"""

import dataclasses
import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from shared.memory_estimate import GB, ModelShape, logits_chunk_tokens, loss_bytes, need_bytes, sampling_bytes  # noqa: F401 (re-exported)
from shared.settings import load_settings
from worker.runtime.backend import cuda
from worker.runtime.projection_groups import decode_groups, decode_projections

MAX_MICRO_BATCH_TOKENS = 8192
DENSE_DECODE_ROWS = 8  # the H100 decoded 8 rows dense in 0.83x the quantized step's time (docs/performance.md)
MIN_MICRO_BATCH_TOKENS = 1024  # below this a micro-batch is mostly per-call overhead: allowed whenever it fits
# A job's default budget on CUDA, of the GPU's free memory: the estimates have come out under the
# measured peaks (10% at G8 B4 L128 on an H100, bench/grpo_step.py --sweep), and MLX's allocator keeps a cache.
CUDA_BUDGET_SHARE = 0.75


class MemoryEstimateError(Exception):
    """The job cannot fit max_memory_gb even one row at a time; the message gives the estimate."""


def model_shape(model: nn.Module) -> ModelShape:
    a = model.args
    heads = a.num_attention_heads
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // heads
    embed = model.model.embed_tokens
    dtype = embed.scales.dtype if hasattr(embed, "scales") else embed.weight.dtype
    return ModelShape(
        layers=len(model.layers), hidden=a.hidden_size, intermediate=a.intermediate_size, heads=heads,
        kv_heads=getattr(a, "num_key_value_heads", None) or heads, head_dim=head_dim, vocab=a.vocab_size,
        act_bytes=dtype.size,
    )


def weights_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def device_memory_bytes() -> float:
    """What a job may use at most: what the worker declares (`mtq worker --memory-gb`,
    MTQ_MEMORY_GB), else Metal's recommended working set, else 90% of a GPU's memory, else
    75% of RAM."""
    declared = load_settings().memory_gb
    if declared:
        return declared * GB
    info = mx.device_info()
    if "max_recommended_working_set_size" in info:  # Metal
        return float(info["max_recommended_working_set_size"])
    if "total_memory" in info and mx.default_device() == mx.gpu:  # CUDA
        return 0.9 * info["total_memory"]
    return 0.75 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_kind() -> str:
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def device_description() -> dict:
    """For the worker's advertisement: the MLX device, its memory, and what a job may use."""
    info = mx.device_info()
    total = info.get("memory_size") or info.get("total_memory") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"device": device_kind(), "device_name": str(info.get("device_name") or info.get("architecture") or "cpu"),
            "memory_total_gb": round(total / GB, 2), "memory_gb": round(device_memory_bytes() / GB, 2)}


@dataclass(frozen=True)
class MemoryPlan:
    micro_batch_size: int
    gradient_checkpointing: bool
    weights_gb: float
    sampling_gb: float
    loss_gb: float  # of one micro-batch
    limit_gb: float
    budget: bool = False  # the job's max_memory_gb, spent on speed (above)
    reason: str = ""
    dense_decode_gb: float = 0.0  # dequantized copies the decode step multiplies by (0: none)

    @property
    def peak_gb(self) -> float:
        return self.weights_gb + self.dense_decode_gb + max(self.sampling_gb, self.loss_gb)

    @property
    def memory_limit_gb(self) -> float:
        """MLX's memory limit for the job: the budget, else the estimated peak."""
        return self.limit_gb if self.budget else self.peak_gb

    def as_record(self) -> dict:
        """For the job record (GET on a job: memory_plan)."""
        return {"micro_batch_size": self.micro_batch_size, "gradient_checkpointing": self.gradient_checkpointing,
                "estimated_peak_gb": round(self.peak_gb, 4), "weights_gb": round(self.weights_gb, 4),
                "sampling_gb": round(self.sampling_gb, 4), "loss_gb": round(self.loss_gb, 4),
                "memory_limit_gb": round(self.memory_limit_gb, 4), "budget": self.budget,
                "dense_decode_gb": round(self.dense_decode_gb, 4), "reason": self.reason}


def plan_memory(
    model: nn.Module, rows: int, width: int, checkpointing: bool | None,
    micro_batch_size: int | None, max_memory_gb: float | None,
) -> MemoryPlan:
    """rows = B*G, width = longest prompt + max_completion_len. checkpointing None: only
    where it buys a larger micro-batch (recomputing costs a forward pass); with a budget
    (max_memory_gb) only where without it the micro-batch would be small (module docstring).
    A budget that also fits dense copies of a quantized model's weights on CUDA decodes with
    them (worker/decode/graph_patches.py dequantized), from DENSE_DECODE_ROWS rows on. On CUDA
    a job without max_memory_gb has a budget all the same: cuda_budget_gb."""
    if max_memory_gb is None and cuda():
        budget = cuda_budget_gb(model)
        try:
            return _plan_step(model, rows, width, checkpointing, micro_batch_size, budget,
                              f"{CUDA_BUDGET_SHARE:.0%} of the GPU's free memory ({budget:.1f} GB; the job sets no "
                              "max_memory_gb)")
        except MemoryEstimateError:
            pass  # memory first, within all the device's memory
    return _plan_step(model, rows, width, checkpointing, micro_batch_size, max_memory_gb)


def cuda_budget_gb(model: nn.Module) -> float:
    """A job's default budget on CUDA: CUDA_BUDGET_SHARE of what it may use (device_memory_bytes)
    less what MLX holds beside the job's model (another model the process keeps loaded)."""
    others = max(0, mx.get_active_memory() - weights_bytes(model))
    return CUDA_BUDGET_SHARE * max(0.0, device_memory_bytes() - others) / GB


def _plan_step(model: nn.Module, rows: int, width: int, checkpointing: bool | None, micro_batch_size: int | None,
               max_memory_gb: float | None, budget_name: str | None = None) -> MemoryPlan:
    plan = _plan_loss(model, rows, width, checkpointing, micro_batch_size, max_memory_gb, budget_name)
    dense = dense_decode_bytes(model) / GB
    if not plan.budget or not dense or not cuda() or rows < DENSE_DECODE_ROWS:
        return plan
    if plan.peak_gb + dense > plan.limit_gb:
        return _because(plan, f"quantized weights kept for decoding: dense copies ({dense:.2f} GB) do not fit the budget")
    return _because(dataclasses.replace(plan, dense_decode_gb=dense),
                    f"decoding with dense copies of the quantized weights ({dense:.2f} GB): faster on CUDA from "
                    f"{DENSE_DECODE_ROWS} rows")


def dense_decode_bytes(model: nn.Module) -> int:
    """Dense copies of the quantized weights a decode step multiplies by
    (worker/runtime/projection_groups.py decode_projections), in the scales' dtype."""
    return sum(m["weight"].shape[0] * m["weight"].shape[1] * 32 // m.bits * m["scales"].dtype.size
               for m in decode_projections(model, decode_groups(model)))


def _plan_loss(model: nn.Module, rows: int, width: int, checkpointing: bool | None,
               micro_batch_size: int | None, max_memory_gb: float | None, budget_name: str | None) -> MemoryPlan:
    if checkpointing is not None:
        plan = _plan(model, rows, width, checkpointing, micro_batch_size, max_memory_gb, budget_name)
        return _because(plan, f"checkpointing {'on' if checkpointing else 'off'} as the job's config says")
    with_it = _plan(model, rows, width, True, micro_batch_size, max_memory_gb, budget_name)
    try:
        without = _plan(model, rows, width, False, micro_batch_size, max_memory_gb, budget_name)
    except MemoryEstimateError:
        return _because(with_it, "checkpointing on: without it not even one row fits")
    if max_memory_gb is None:
        enough = with_it.micro_batch_size
    else:
        enough = min(with_it.micro_batch_size, max(1, MIN_MICRO_BATCH_TOKENS // width))
    if without.micro_batch_size >= enough:
        return _because(without, "checkpointing off" + (": it allows no larger micro-batch" if max_memory_gb is None
                                                        else ": the budget fits the micro-batch without it"))
    return _because(with_it, f"checkpointing on: it allows a micro-batch of {with_it.micro_batch_size} rows, "
                             f"without it {without.micro_batch_size}")


def _plan(model: nn.Module, rows: int, width: int, checkpointing: bool, micro_batch_size: int | None,
          max_memory_gb: float | None, budget_name: str | None) -> MemoryPlan:
    s = model_shape(model)
    limit = device_memory_bytes() if max_memory_gb is None else min(max_memory_gb * GB, device_memory_bytes())
    weights = weights_bytes(model)
    sampling = sampling_bytes(s, rows, width, device_kind())
    divisors = [m for m in range(1, rows + 1) if rows % m == 0]

    def fits(m: int) -> bool:
        return weights + loss_bytes(s, m, width, checkpointing) <= limit

    need = need_bytes("grpo", s, weights, rows, width, checkpointing, device_kind())
    if need > limit:
        raise MemoryEstimateError(
            f"this job needs about {need / GB:.2f} GB (weights {weights / GB:.2f} GB, sampling {rows} rows of "
            f"{width} tokens {sampling / GB:.2f} GB, loss step for one row "
            f"{loss_bytes(s, 1, width, checkpointing) / GB:.2f} GB) but max_memory_gb is {limit / GB:.2f}; "
            f"lower group_size, batch_size or max_completion_len"
            + ("" if checkpointing else ", or turn gradient_checkpointing on (needs lora_dropout 0)")
        )
    budget = max_memory_gb is not None
    capped = not budget or device_kind() == "cpu"  # larger forward passes are faster on a GPU only
    if micro_batch_size is not None:
        m = max(d for d in divisors if d <= micro_batch_size)
        reason = f"micro_batch_size {micro_batch_size} set by the job" + (f", lowered to {m}, a divisor of {rows}" if m != micro_batch_size else "")
    else:
        m = max(d for d in divisors if d == 1 or (fits(d) and (not capped or d * width <= MAX_MICRO_BATCH_TOKENS) and (
            budget or loss_bytes(s, d, width, checkpointing) <= sampling or d * width <= MIN_MICRO_BATCH_TOKENS)))
        if budget:
            reason = (f"{budget_name or f'max_memory_gb {max_memory_gb:g}'} spent on speed: the largest micro-batch dividing {rows} rows that fits "
                      "it" + (f", at most {MAX_MICRO_BATCH_TOKENS} tokens (a CPU)" if capped else ""))
        else:
            reason = (f"memory first (no max_memory_gb): the largest micro-batch dividing {rows} rows whose loss step needs "
                      f"no more than sampling or is at most {MIN_MICRO_BATCH_TOKENS} tokens, at most {MAX_MICRO_BATCH_TOKENS}")
    return MemoryPlan(m, checkpointing, weights / GB, sampling / GB, loss_bytes(s, m, width, checkpointing) / GB, limit / GB,
                      budget, reason)


def loss_rows(model: nn.Module, width: int, checkpointing: bool, weights: int | None = None) -> int:
    """The most rows of `width` tokens that one loss step (forward and backward, the `loss`
    term above) fits beside the weights in this device's memory, at most MAX_MICRO_BATCH_TOKENS
    tokens together but always one row that fits; 0 when not even one does (rows of varying
    lengths, micro-batched by their longest: the Tinker training client). weights: the
    weights' bytes, if known."""
    s = model_shape(model)
    room = device_memory_bytes() - (weights_bytes(model) if weights is None else weights)
    lo, hi = 0, max(1, MAX_MICRO_BATCH_TOKENS // width)
    while lo < hi:  # loss_bytes grows with the rows: the largest count that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if loss_bytes(s, mid, width, checkpointing) <= room else (lo, mid - 1)
    return lo


def _because(plan: MemoryPlan, why: str) -> MemoryPlan:
    return dataclasses.replace(plan, reason=f"{plan.reason}; {why}")
