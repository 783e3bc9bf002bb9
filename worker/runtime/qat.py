"""Quantization-aware training, as mlx-lm-lora's `--qat-*` flags define it: in the forward of a QAT
step every unquantized linear and embedding layer computes with its weight as quantization rounds
it, with a straight-through gradient (w + stop_gradient(round(w) - w): the forward sees the
rounded weight, the gradient reaches w as if unrounded). The trained weights stay full precision;
the model learns to work through the rounding it will have once quantized (mtq export's `quantize`).

With full fine-tuning the trained weights themselves are rounded. Under a LoRA layer the fused
weight W + scale * (a b)^T is, as the export fuses and quantizes it (mlx-lm-lora rounds the base
alone, whose small LoRA deltas the export's rounding of the fused weight then mostly loses); a
DoRA layer's base is rounded alone. The rounding is MLX's quantize / dequantize with the job's
bits, group size and mode (mlx-lm-lora's is a symmetric one of its own): the grid mlx_lm's
quantize_model gives the exported model, embeddings included.
"""

import contextlib
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tuner.lora import LoRALinear

from worker.runtime.models import UnsupportedBase


def rounded(w: mx.array, quantization: dict) -> mx.array:
    """w as mx.quantize rounds it (then dequantized)."""
    return mx.dequantize(*mx.quantize(w, **quantization), **quantization).astype(w.dtype)


def qat_layers(module: nn.Module, quantization: dict) -> list[tuple[nn.Module, LoRALinear | None]]:
    """The unquantized layers quantize_model would quantize (linear and embedding layers whose
    input dim is a multiple of the group), each with the LoRA layer around it, if any."""
    lora = {id(m.linear): m for _, m in module.named_modules() if isinstance(m, LoRALinear)}
    return [(m, lora.get(id(m))) for _, m in module.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % quantization["group_size"] == 0]


def fake_quantized(layer: nn.Module, lora: LoRALinear | None, quantization: dict) -> mx.array:
    """The weight that makes the layer compute with its rounded weight, the gradient straight
    through. Under a LoRA layer the rounded weight is the fused one, W + scale * (a b)^T, and the
    base takes the rounding's difference, so that base plus LoRA give the fused model's rounding."""
    w = layer.weight
    fused = w if lora is None else w + lora._scale.astype(w.dtype) * (lora.lora_a @ lora.lora_b).T.astype(w.dtype)
    return w + mx.stop_gradient(rounded(fused, quantization) - fused)


@contextlib.contextmanager
def fake_quantize(module: nn.Module, quantization: dict):
    """The module's linear layers with fake-quantized weights inside the block, their own after it."""
    layers = qat_layers(module, quantization)
    weights = [m.weight for m, _ in layers]
    for m, lora in layers:
        m.weight = fake_quantized(m, lora, quantization)
    try:
        yield
    finally:
        for (m, _), w in zip(layers, weights):
            m.weight = w


def qat_loss(loss: Callable, quantization: dict) -> Callable:
    """loss(module, *arrays) computed through fake-quantized weights."""
    def fake_quantized_loss(module, *arrays):
        with fake_quantize(module, quantization):
            return loss(module, *arrays)
    return fake_quantized_loss


def qat_step(cfg, step: int) -> bool:
    """Whether optimizer step `step` (0-based: the steps done before it) trains through fake
    quantization: after qat_start_step steps, then every qat_interval-th step."""
    return cfg.qat_enable and step >= cfg.qat_start_step and (step - cfg.qat_start_step) % cfg.qat_interval == 0


def check_qat(module: nn.Module, cfg) -> None:
    """UnsupportedBase when QAT is asked of a model with no linear layer to round (a quantized base)."""
    if cfg.qat_enable and not qat_layers(module, cfg.qat):
        raise UnsupportedBase("qat_enable: the model has no unquantized linear layer to train through fake "
                              "quantization (a quantized base: QAT needs an unquantized model)")
