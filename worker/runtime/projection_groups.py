"""The projections of a model's blocks that read one input (q/k/v, gate/up), fused and grouped.

A worker fuses them when it loads a shared model (fuse_shared_inputs, worker/runtime/models.py),
so that a decode step runs each group as one matmul of its base weights and one pair of LoRA
matmuls (decode_groups; worker/decode/graph_patches.py grouped_projections runs them), and a
training step likewise (worker/runtime/adapter_layers.py SharedInput; both take the pair from
lora_pair). The memory
plan counts the dense copies of the quantized weights a decode step multiplies by
(decode_projections, worker/runtime/memory_plan.py). They live here, not in worker/decode/, so
that loading a model and planning its memory load no part of the decoder (an SFT, DPO or KTO
job never decodes).
"""

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tuner.lora import LoRALinear

# Projections of one block that read the same input: a decode step runs each such group as one
# matmul of its base weights (fuse_shared_inputs) and one pair of LoRA matmuls (decode_groups).
SHARED_INPUT = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
_ARRAYS = ("weight", "scales", "biases", "bias")  # what nn.Linear / nn.QuantizedLinear hold
# Where a group's LoRA pair is its trainable weights: their names on its first projection.
PAIR = ("pair_a", "pair_b")


def shared_input_groups(model: nn.Module) -> Iterator[tuple[nn.Module, list[nn.Module]]]:
    """Each SHARED_INPUT group of the model's blocks that has all its projections: (the module
    holding them, the projections), block by block."""
    for layer in model.layers:
        for parent_name, names in SHARED_INPUT:
            parent = getattr(layer, parent_name, None)
            mods = [getattr(parent, name, None) for name in names]
            if parent is not None and all(m is not None for m in mods):
                yield parent, mods


@dataclass(eq=False)
class FusedInputs:
    """One block's projections that read the same input (q/k/v, gate/up) as one module: their
    weights side by side along the outputs (fuse_shared_inputs)."""
    fused: nn.Module


def fuse_shared_inputs(model: nn.Module) -> int:
    """Fuse every SHARED_INPUT group of plain projections of one type and quantization (a
    model's base, before LoRA is attached): the decode step then runs one matmul per group.
    Memory stays what it was (the projections' weights become views of the fused ones). Only
    for a model whose base weights never change: the worker's shared models and a qlora job's
    private copy once quantized (worker/runtime/models.py; full fine-tuning trains its copy's).
    Returns the groups fused."""
    count = 0
    for parent, mods in shared_input_groups(model):
        if getattr(parent, "fused_inputs", None) is not None or not _fusable(mods):
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
    """The model's Groups, in a fixed order (worker/decode/graph_patches.py lora_args follows it)."""
    groups, grouped = [], set()
    for parent, mods in shared_input_groups(model):
        lora = all(isinstance(m, LoRALinear) for m in mods) and len({m.scale for m in mods}) == 1
        plain = all(type(m) in (nn.Linear, nn.QuantizedLinear) for m in mods)
        info = getattr(parent, "fused_inputs", None)
        fused = info.fused if info is not None and (lora or plain) else None
        if lora or fused is not None:
            groups.append(Group(mods, lora, fused))
            grouped.update(id(m) for m in mods)
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear) and id(m) not in grouped:
            groups.append(Group([m], True, None))
    return groups


def lora_pair(mods: list[LoRALinear]) -> tuple[mx.array, mx.array]:
    """The LoRA matrices of projections that read one input as one pair: A side by side, B
    block-diagonal, so that x @ A @ B holds each projection's x @ A_i @ B_i side by side (the
    zeros add nothing). A group whose pair is its trainable weights (PAIR, set by
    worker/runtime/adapter_layers.py pair_inputs) gives that pair; otherwise block_pair builds it."""
    if PAIR[0] in mods[0]:
        return mods[0][PAIR[0]], mods[0][PAIR[1]]
    return block_pair([(m.lora_a, m.lora_b) for m in mods])


def block_pair(matrices: list[tuple[mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
    """(A_i, B_i) as one pair (lora_pair). Each B_i is added into its block of a B of zeros: in a
    compiled step's backward its gradient is then one slice of B's (a padded B_i concatenated: two
    slices, and the pad's and concatenation's primitives in the forward). Gradients reach each A_i
    through the concatenation."""
    if len(matrices) == 1:
        return matrices[0]
    rows, cols = (sum(b.shape[i] for _, b in matrices) for i in (0, 1))
    pair_b, row, col = mx.zeros((rows, cols), matrices[0][1].dtype), 0, 0
    for _, b in matrices:
        r, c = b.shape
        pair_b = pair_b.at[row:row + r, col:col + c].add(b)
        row, col = row + r, col + c
    return mx.concatenate([a for a, _ in matrices], axis=1), pair_b


def lora_arrays(mods: list[LoRALinear]) -> list[mx.array]:
    """The arrays that hold a group's LoRA weights: its pair where that is its trainable weights
    (lora_pair), otherwise each projection's A and B."""
    if PAIR[0] in mods[0]:
        return list(lora_pair(mods))
    return [a for m in mods for a in (m.lora_a, m.lora_b)]


def base_projection(m: nn.Module) -> nn.Module:
    """The projection under mlx_lm's LoRA (m itself if it has none)."""
    return m.linear if isinstance(m, LoRALinear) else m


def decode_projections(model: nn.Module, groups: list[Group]) -> list[nn.Module]:
    """The quantized modules whose weights a decode step multiplies by: each fused group's module,
    every other projection of the blocks, and the output projection (a tied embedding's)."""
    in_fused = {id(base_projection(m)) for g in groups if g.fused is not None for m in g.modules}
    mods = [g.fused for g in groups if g.fused is not None]
    mods += [m for layer in model.layers for _, m in layer.named_modules() if id(m) not in in_fused]
    mods.append(getattr(model, "lm_head", model.model.embed_tokens))
    return [m for m in mods if type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding)]
