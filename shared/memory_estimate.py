"""The memory formulas of a training step, on plain numbers: no MLX, so the API can route a
job by its estimated need (shared/routing.py), the worker that dequeues it can check it
against its own device (worker/supervisor/admission.py), and GRPO's trainer can plan its
micro-batch (worker/runtime/memory_plan.py, which explains each term and how they were
calibrated). All three ask `need_bytes`, the one estimate of what a step needs.

A model's shape comes from its config.json (`shape_from_config`), its weights' size from its
safetensors files, both advertised by the workers that hold it (shared/workers.py).
"""

from dataclasses import asdict, dataclass
from typing import Any

GB = 1e9
# The decode's peak over its KV cache: ~4.7 measured on CPU (attention copies K/V for
# grouped-query heads, old and new buffers). On CUDA (fused attention) the H100 peaked at 1.84
# copies (G16 B4 L256 within 5 GB); 1.85 leaves room for dense decode copies at that budget.
SAMPLING_KV_COPIES = {"cpu": 5, "gpu": 1.85}
LOGITS_CHUNK_BYTES = 16 * 2**20  # float32 logits of one chunk of completion positions
MIN_LOGITS_CHUNK_TOKENS = 64
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# The arrays mlx.optimizers keep per trained weight, each of its shape and dtype: AdamW's and
# Adam's m and v, SGD's and Muon's v; Adafactor's factored moments are a row and a column.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "muon": 1, "adafactor": 0}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    act_bytes: int  # bytes per activation value (2 for bf16/fp16 models, 4 for fp32)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def shape_from_config(config: dict[str, Any]) -> ModelShape | None:
    """The shape from a Hugging Face / mlx_lm config.json (None if it lacks a field)."""
    config = config.get("text_config", config) if "vision_config" in config else config
    try:
        heads = int(config["num_attention_heads"])
        return ModelShape(
            layers=int(config["num_hidden_layers"]), hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]), heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            vocab=int(config["vocab_size"]), act_bytes=DTYPE_BYTES.get(config.get("torch_dtype"), 2),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def logits_chunk_tokens(vocab: int) -> int:
    return max(MIN_LOGITS_CHUNK_TOKENS, LOGITS_CHUNK_BYTES // (4 * vocab))


def activation_bytes(s: ModelShape, width: int) -> int:
    """Bytes one transformer layer keeps per token for its backward pass."""
    q, kv, d, f = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.intermediate
    stored = 6 * d + 4 * q + 6 * kv + 4 * f  # norms, q/k/v (+ norms, rope), attention out, MLP
    lora_inputs = 5 * d + q + f  # LoRA's float32 copies of each projection's input
    attention = s.heads * width  # attention probabilities, float32
    return s.act_bytes * stored + 4 * lora_inputs + 4 * attention


def sampling_bytes(s: ModelShape, rows: int, width: int, device: str) -> int:
    """The KV cache of `rows` rows of `width` positions, times the decode's copies of it."""
    return int(SAMPLING_KV_COPIES[device] * rows * s.layers * 2 * s.kv_heads * s.head_dim * width * s.act_bytes)


def loss_bytes(s: ModelShape, rows: int, width: int, checkpointing: bool) -> int:
    act = activation_bytes(s, width)
    # checkpointing: each layer's input, plus the layer being recomputed and its neighbour's gradient
    per_token = s.layers * s.hidden * s.act_bytes + 2 * act if checkpointing else s.layers * act
    logits = 4 * min(logits_chunk_tokens(s.vocab), rows * width) * s.vocab * 4  # logits, softmax, their gradients
    return rows * width * per_token + logits


def block_bytes(s: ModelShape) -> int:
    """One block's projections unquantized (act_bytes each)."""
    q, kv, d = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    return (d * (2 * q + 2 * kv) + 3 * d * s.intermediate) * s.act_bytes


def dense_bytes(s: ModelShape) -> int:
    """The model's weights unquantized (act_bytes each): its blocks' projections and one
    embedding matrix (a model with an untied output layer has a second: the estimate is low by it)."""
    return s.layers * block_bytes(s) + s.vocab * s.hidden * s.act_bytes


def trained_bytes(s: ModelShape, full_layers: int, optimizer_states: int) -> int:
    """What full fine-tuning holds beyond the weights: each trained block's gradient and the
    optimizer's state of it (optimizer_states arrays, OPTIMIZER_STATES), in the weights' dtype as
    mlx.optimizers keep them. full_layers: the blocks trained, from the top; -1 all, 0 none (LoRA,
    whose adapter's gradients and state are small beside its activations, is left out)."""
    blocks = s.layers if full_layers < 0 else min(full_layers, s.layers)
    return blocks * block_bytes(s) * (1 + optimizer_states)


def need_bytes(family: str, s: ModelShape, weights: int, rows: int, width: int, checkpointing: bool | None, device: str,
               dequantize: bool = False, qat: bool = False, full_layers: int = 0, optimizer_states: int = 2) -> int:
    """The least memory a step of a job of this family (shared/kinds.py) runs in, with `rows`
    rows of `width` tokens. GRPO: the weights plus the larger of sampling every row and a loss
    step of one row (the micro-batch then grows into whatever room is left). Supervised kinds:
    the weights plus a loss step of all the rows (a batch is one forward and backward pass).
    An export (no step): the base and its fused copy, which is written while the base is
    still held; with dequantize, a copy at least as large as the unquantized model. QAT
    (worker/runtime/qat.py) adds the rounded copy of every weight, which the backward keeps; full
    fine-tuning (full_layers blocks) the trained blocks' gradients and optimizer state (`trained_bytes`).
    checkpointing None: the worker plans it (supervised_checkpointing): the lower need."""
    if checkpointing is None:
        return min(need_bytes(family, s, weights, rows, width, c, device, dequantize, qat, full_layers,
                              optimizer_states) for c in (False, True))
    if family == "export":
        return weights + (max(weights, dense_bytes(s)) if dequantize else weights)
    if family == "grpo":
        return weights + max(sampling_bytes(s, rows, width, device), loss_bytes(s, 1, width, checkpointing))
    return (weights + loss_bytes(s, rows, width, checkpointing) + (dense_bytes(s) if qat else 0)
            + trained_bytes(s, full_layers, optimizer_states))


def supervised_checkpointing(s: ModelShape, weights: int, rows: int, width: int, device: str,
                             memory: float, qat: bool = False, full_layers: int = 0,
                             optimizer_states: int = 2) -> tuple[bool, str]:
    """Gradient checkpointing for a supervised job that does not ask for it: on where its step
    (rows of width tokens, as the routing counts them) needs more than `memory` without it and
    less with it; why, when it is not simply off."""
    trained = {"qat": qat, "full_layers": full_layers, "optimizer_states": optimizer_states}
    without = need_bytes("supervised", s, weights, rows, width, False, device, **trained)
    if without <= memory:
        return False, ""
    with_it = need_bytes("supervised", s, weights, rows, width, True, device, **trained)
    if with_it >= without:
        return False, (f"the step needs about {without / GB:.2f} GB of the worker's {memory / GB:.2f} GB, and "
                       "gradient checkpointing would not lower it")
    return True, (f"gradient checkpointing on: the step needs about {without / GB:.2f} GB without it, "
                  f"{with_it / GB:.2f} GB with it, of the worker's {memory / GB:.2f} GB")
