"""Adapter layers on a loaded model: attach a job's, take them out, switch them off, swap in
another's, and write them as mlx_lm writes and loads them (adapters.safetensors +
adapter_config.json). Where adapters live on disk and in Redis: shared/adapters.py.

The training process keeps its models loaded between jobs, so a job attaches fresh layers to
the shared model and takes them out again at its end (its worker module's `load`). A block's
layers that read one input run as one (SharedInput); under AdamW, Adam or SGD their LoRA pair is
itself the trainable weights (pair_inputs), while the adapter keeps mlx_lm's per-layer names
(adapter_weights, set_adapter_weights).
"""

import contextlib
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters

from shared.adapters import CONFIG_FILE, WEIGHTS_FILE
from worker.runtime.projection_groups import PAIR, block_pair, lora_pair, shared_input_groups
from worker.runtime.scalars import as_input


ADAPTER_LAYERS = (LoRALinear, DoRALinear, LoRASwitchLinear)  # mlx_lm's adapter layers, each around its `linear`
# Optimizers whose update of a weight reads only that weight's own entries: under them a group's
# pair can be its trainable weights (pair_inputs) with each layer's training math unchanged. Muon
# and Adafactor update by whole matrices (an orthogonalisation, factored moments).
ELEMENTWISE = ("adamw", "adam", "sgd")


class InputDtypeLoRALinear(LoRALinear):
    """mlx_lm's LoRA layer with its product in the input's dtype, as mixed-precision training
    runs it: on a bfloat16 model x @ A @ B in bfloat16 (float32 accumulation inside each matmul),
    where mlx_lm's promotes it to float32. The weights stay float32, so the optimizer's small
    updates are not rounded away; on a float32 model nothing changes. On MLX CUDA the float32
    product made a LoRA step of a bfloat16 model 1.7x slower (docs/performance.md). A job's
    layers are these (attach_adapter); the decoder runs its own LoRA products. shared_input:
    the SharedInput it belongs to, whose one computation gives each of its layers its output.
    _scale: `scale` as an array (attach_adapter sets it; the underscore keeps it out of the
    parameters), so that a compiled step takes it as an input (in the module's state) rather than
    compiling it into its kernels (worker/runtime/scalars.py); in the layer's compute dtype, so
    that the product multiplies by it without a cast (a primitive per layer in an eager forward).
    `scale` stays the number (0: lora_disabled)."""

    shared_input = None

    def __call__(self, x):
        if self.shared_input is not None:
            return self.shared_input.output(self, x)
        if self.scale == 0:  # lora_disabled (a reference policy): the base alone, two matmuls fewer
            return self.linear(x)
        h = x.reshape(-1, x.shape[-1])  # 2-D rows: each 3-D matmul would add a flatten and an unflatten
        z = (self.dropout(h) @ self.lora_a.astype(x.dtype)) @ self.lora_b.astype(x.dtype)
        return (self.linear(h) + self._scale.astype(z.dtype) * z).reshape(*x.shape[:-1], -1)


class InputScaleDoRALinear(DoRALinear):
    """mlx_lm's DoRA layer with its scale an input of a compiled step (`_scale`, as
    InputDtypeLoRALinear's), not a constant compiled into its kernels: a DoRA job of another
    lora_alpha compiled 4 kernels of its own (tests/test_scalars.py). The math is mlx_lm's
    DoRALinear.__call__'s; `scale` 0 (lora_disabled) stays the number."""

    def __call__(self, x):
        scale = self._scale if self.scale else self.scale
        w = self._dequantized_weight()
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        out = x @ w.T + (scale * z).astype(x.dtype)
        adapted = w + (scale * self.lora_b.T) @ self.lora_a.T  # the norm of the adapted weights
        out = (self.m / mx.stop_gradient(mx.linalg.norm(adapted, axis=1))).astype(x.dtype) * out
        if "bias" in self.linear:
            out = out + self.linear.bias
        return out


@dataclass(eq=False, repr=False)
class SharedInput:
    """A block's LoRA layers that read one input (a SHARED_INPUT group: q/k/v, gate/up), computed
    together at the first one's call on an input: one matmul of the base weights where the worker
    fused them, x @ A and @ B of one LoRA pair (lora_pair), then split; each layer gets what its
    own __call__ gives. On the H200 a step's time followed its matmul count (docs/performance.md):
    a q/k/v group's forward and backward are 8 matmuls where its layers alone are 24. Only for
    layers without dropout (one mask would serve them all)."""
    # Weak: each layer holds its group, and a cycle would keep a finished job's weights until
    # Python's cycle collector ran. The layers live as long as the model holds them.
    refs: list[weakref.ref]
    fused: nn.Module | None  # their base weights side by side (fuse_shared_inputs); None: each its own
    x: mx.array | None = None  # the input of the outputs below, until every layer has taken its own
    outputs: list[mx.array] = field(default_factory=list)
    taken: int = 0

    def output(self, layer: InputDtypeLoRALinear, x: mx.array) -> mx.array:
        if self.x is not x:
            self.x, self.outputs, self.taken = x, self.project(x), 0
        y = self.outputs[next(i for i, ref in enumerate(self.refs) if ref() is layer)]
        self.taken += 1
        if self.taken == len(self.refs):  # this step's arrays are not kept past it
            self.x, self.outputs = None, []
        return y

    def project(self, x: mx.array) -> list[mx.array]:
        layers = [ref() for ref in self.refs]
        sizes = [m.lora_b.shape[1] for m in layers]
        splits = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
        scale = layers[0].scale
        if scale == 0:  # lora_disabled (a reference policy): the base alone
            if self.fused is not None:
                return mx.split(self.fused(x), splits, axis=-1)
            return [m.linear(x) for m in layers]
        a, b = self.pair(layers)
        h, rows = x.reshape(-1, x.shape[-1]), x.shape[:-1]  # 2-D rows, as InputDtypeLoRALinear's
        p = (h @ a.astype(x.dtype)) @ b.astype(x.dtype)
        z = layers[0]._scale.astype(p.dtype) * p
        if self.fused is not None:
            return mx.split((self.fused(h) + z).reshape(*rows, -1), splits, axis=-1)
        return [(m.linear(h) + z_i).reshape(*rows, -1) for m, z_i in zip(layers, mx.split(z, splits, axis=-1))]

    def pair(self, layers: list[InputDtypeLoRALinear]) -> tuple[mx.array, mx.array]:
        """The group's LoRA pair: its trainable pair (pair_inputs), B's off-diagonal blocks masked
        (their gradient is then zero), else built from its layers' matrices (lora_pair)."""
        a, b = lora_pair(layers)
        return (a, mx.where(layers[0]._pair_mask, b, 0.0)) if PAIR[0] in layers[0] else (a, b)


class PairedLoRALinear(InputDtypeLoRALinear):
    """A layer of a SharedInput whose pair is the trainable weights (pair_inputs): `lora_a` and
    `lora_b` read and write its blocks of the pair (held by the group's first layer, PAIR),
    `blocks` (row, rank, column, outputs) says where. A compiled step then neither builds the pair
    nor splits its gradient: on an H100 an SFT step took 0.83x the one that builds its pairs, 1.10x
    the full step (docs/performance.md, sixteenth sitting)."""

    def _pair(self) -> InputDtypeLoRALinear:
        return self.shared_input.refs[0]()

    def block(self, a: mx.array, b: mx.array) -> tuple[mx.array, mx.array]:
        """Its (A, B) of a pair of its group's shape: the weights, or their gradients (by_layer)."""
        row, r, col, c = self.blocks
        return a[:, row:row + r], b[row:row + r, col:col + c]

    @property
    def lora_a(self) -> mx.array:
        return self.block(*(self._pair()[k] for k in PAIR))[0]

    @property
    def lora_b(self) -> mx.array:
        return self.block(*(self._pair()[k] for k in PAIR))[1]

    def __setattr__(self, key, value):
        if key not in ("lora_a", "lora_b"):
            return super().__setattr__(key, value)
        first, (row, r, col, c) = self._pair(), self.blocks
        if key == "lora_a":
            a = first[PAIR[0]]
            first[PAIR[0]] = mx.concatenate([a[:, :row], value.astype(a.dtype), a[:, row + r:]], axis=1)
        else:  # its rows of B: zeros but for its block
            b = first[PAIR[1]]
            rows = mx.concatenate([mx.zeros((r, col), b.dtype), value.astype(b.dtype),
                                   mx.zeros((r, b.shape[1] - col - c), b.dtype)], axis=1)
            first[PAIR[1]] = mx.concatenate([b[:row], rows, b[row + r:]], axis=0)


def pair_inputs(model: nn.Module) -> int:
    """Make each SharedInput group's LoRA pair (lora_pair, from its layers' weights) its trainable
    weights, held by its first layer (PAIR), in place of its layers' lora_a and lora_b, which
    become views of it (PairedLoRALinear). The mask keeps B's off-diagonal blocks at zero: their
    gradient is masked out, and an ELEMENTWISE optimizer moves no weight whose gradients have all
    been zero (weight decay scales zero to zero), so each layer trains as it would alone. B's
    gradient and optimizer state are then the whole pair's (a q/k/v group's 3x its layers';
    docs/performance.md counts what that costs). Returns the groups paired."""
    groups = {id(m.shared_input): m.shared_input for _, m in model.named_modules()
              if type(m) is InputDtypeLoRALinear and m.shared_input is not None}
    for group in groups.values():
        layers = [ref() for ref in group.refs]
        a, b = lora_pair(layers)
        mask = block_pair([(m.lora_a, mx.ones_like(m.lora_b)) for m in layers])[1].astype(mx.bool_)  # 1 byte a weight
        row = col = 0
        for m in layers:
            (_, r), (_, c) = m.lora_a.shape, m.lora_b.shape
            del m["lora_a"], m["lora_b"]
            m.__class__ = PairedLoRALinear
            object.__setattr__(m, "blocks", (row, r, col, c))  # a plain attribute: Module's would keep a tuple as state
            row, col = row + r, col + c
        layers[0][PAIR[0]], layers[0][PAIR[1]], layers[0]["_pair_mask"] = a, b, mask
    return len(groups)


def by_layer(module: nn.Module, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """A flat dict of the module's trainable arrays (weights, gradients) with each paired group's
    pair (pair_inputs) given as its layers' lora_a and lora_b, the names mlx_lm gives them."""
    out = dict(arrays)
    names = {id(m): name for name, m in module.named_modules()}
    for name, m in module.named_modules():
        if type(m) is not PairedLoRALinear or f"{name}.{PAIR[0]}" not in out:
            continue
        a, b = out.pop(f"{name}.{PAIR[0]}"), out.pop(f"{name}.{PAIR[1]}")
        for layer in (ref() for ref in m.shared_input.refs):
            out[f"{names[id(layer)]}.lora_a"], out[f"{names[id(layer)]}.lora_b"] = layer.block(a, b)
    return out


def share_inputs(model: nn.Module, fused: bool = True) -> int:
    """Group each of the model's shared_input_groups whose layers are all InputDtypeLoRALinear
    of one scale (SharedInput; layers without dropout), with the worker's fused base weights
    unless not `fused` (QAT swaps each layer's base weight for a fake-quantized one during a step,
    which the fused weights would not see). Returns the groups made."""
    count = 0
    for parent, layers in shared_input_groups(model):
        if any(type(m) is not InputDtypeLoRALinear for m in layers) or len({m.scale for m in layers}) > 1:
            continue
        info = getattr(parent, "fused_inputs", None) if fused else None
        group = SharedInput([weakref.ref(m) for m in layers], info.fused if info is not None else None)
        for m in layers:
            m.shared_input = group
        count += 1
    return count


def compute_dtype(base: nn.Module) -> mx.Dtype:
    """The dtype a LoRA layer's product is in: its base's, the model's (a quantized base's scales'),
    float32 where those are not floating (an MX quantization's scales are uint8 exponents; the
    product's cast then makes the scale its dtype at each call)."""
    dtype = base.scales.dtype if isinstance(base, nn.QuantizedLinear) else base.weight.dtype
    return dtype if mx.issubdtype(dtype, mx.floating) else mx.float32


def adapter_config(cfg, fine_tune_type: str = "lora", quantization: dict | None = None,
                   keys: list[str] | None = None) -> dict:
    """mlx_lm's adapter_config.json for a job's config (any kind's: lora_layers, lora_rank,
    lora_alpha, lora_dropout). lora_alpha is mlx_lm's LoRA `scale` itself, as the seed server
    passes it (so the same request trains the same model). A quantized base (qlora) adds
    `quantization`, the arguments of mlx_lm's quantize_model that rebuild it (the key mlx_lm's
    config.json uses for a quantized model); mlx_lm itself keeps none there. A QAT job adds `qat`,
    the quantization it trained through (worker/runtime/qat.py). keys: the
    projections that carry LoRA (mlx_lm's `keys`: names inside a block, or a model-level name
    such as lm_head); None: mlx_lm's default, every linear layer of the blocks."""
    return {"fine_tune_type": fine_tune_type, "num_layers": cfg.lora_layers,
            "lora_parameters": {"rank": cfg.lora_rank, "scale": cfg.lora_alpha, "dropout": cfg.lora_dropout,
                                **({"keys": keys} if keys is not None else {})},
            **({"quantization": quantization} if quantization else {}),
            **({"qat": cfg.qat} if getattr(cfg, "qat", None) else {})}  # what mtq export --quantize rounds to


def adapter_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's adapter layers, by their names in it."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ADAPTER_LAYERS)]


def remove_adapter_layers(model: nn.Module) -> None:
    """Take every LoRA / DoRA layer out (mlx_lm's remove_lora_layers leaves DoRA in)."""
    layers = [(name, m.linear) for name, m in adapter_layers(model)]
    if layers:
        model.update_modules(tree_unflatten(layers))


class AdapterMismatch(Exception):
    """An init_adapter whose weights are not those of the job's adapter; the message says how."""


def attach_adapter(model: nn.Module, cfg, fine_tune_type: str = "lora", init: Path | None = None) -> None:
    """Make the job's weights the only trainable ones: fresh LoRA / DoRA layers (qlora: LoRA)
    in place of any previous job's, or for `full` the last lora_layers blocks' own weights
    (-1: all), as mlx_lm's trainer does (embeddings and the final norm stay frozen). init: an
    adapter directory whose weights the layers start from (the job's init_adapter)."""
    remove_adapter_layers(model)
    model.freeze()
    if fine_tune_type == "full":
        for layer in model.layers[-max(cfg.lora_layers, 0):]:
            layer.unfreeze()
    else:
        conf = adapter_config(cfg, fine_tune_type)
        linear_to_lora_layers(model, conf["num_layers"], conf["lora_parameters"], use_dora=fine_tune_type == "dora")
        for _, m in model.named_modules():
            if type(m) is LoRALinear:
                m.__class__ = InputDtypeLoRALinear  # the same weights and fields, another __call__
                m._scale = as_input(m.scale, compute_dtype(m.linear))
            elif type(m) is DoRALinear:
                m.__class__ = InputScaleDoRALinear
                m._scale = as_input(m.scale)  # float32: the number's value in DoRA's float32 products
        if not cfg.lora_dropout:
            share_inputs(model, fused=not getattr(cfg, "qat_enable", False))
            if getattr(cfg, "optimizer", "adamw") in ELEMENTWISE:
                pair_inputs(model)
    if init is not None:
        load_adapter_weights(model, init / WEIGHTS_FILE)
    model.eval()
    mx.eval(model.trainable_parameters())


def started_from(spec) -> dict:
    """The model_ready event's word on where the adapter started (nothing: a fresh one)."""
    return {"init_adapter": spec.init_adapter.model_dump(exclude_none=True)} if spec.init_adapter else {}


def load_adapter_weights(module: nn.Module, path: Path) -> None:
    """Set the module's trainable weights from an adapters.safetensors that has exactly those
    (names and shapes: AdapterMismatch otherwise)."""
    weights = mx.load(str(path))
    own = adapter_weights(module)
    missing, extra = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
    shapes = [f"{k} {tuple(weights[k].shape)} there, {tuple(own[k].shape)} here" for k in sorted(own.keys() & weights.keys())
              if weights[k].shape != own[k].shape]
    if missing or extra or shapes:
        parts = [f"{len(missing)} of this job's weights missing (e.g. {missing[0]})" if missing else "",
                 f"{len(extra)} weights this job has not (e.g. {extra[0]})" if extra else "",
                 f"other shapes: {shapes[0]}" if shapes else ""]
        raise AdapterMismatch("init_adapter does not fit this job's adapter: " + "; ".join(p for p in parts if p))
    set_adapter_weights(module, {k: v.astype(own[k].dtype) for k, v in weights.items()})


def adapter_weights(module: nn.Module) -> dict[str, mx.array]:
    """The job's weights by the names mlx_lm gives them: the module's trainable parameters, with
    each paired group's pair as its layers' lora_a and lora_b (by_layer)."""
    return by_layer(module, dict(tree_flatten(module.trainable_parameters())))


def set_adapter_weights(module: nn.Module, weights: dict[str, mx.array]) -> None:
    """Set the module's trainable weights from adapter_weights' names (a paired layer's lora_a
    and lora_b go into its group's pair; module.load_weights would skip them, as not its own)."""
    paired = {name: m for name, m in module.named_modules() if type(m) is PairedLoRALinear}
    rest = []
    for key, value in weights.items():
        name, _, leaf = key.rpartition(".")
        if name in paired and leaf in ("lora_a", "lora_b"):
            setattr(paired[name], leaf, value)
        else:
            rest.append((key, value))
    module.load_weights(rest, strict=False)  # strict=False: the base weights are not in it


def save_adapter(module: nn.Module, out_dir: Path, config: dict) -> None:
    """adapters.safetensors + adapter_config.json, as mlx_lm writes and loads them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / WEIGHTS_FILE), adapter_weights(module))
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))


class lora_disabled:
    """Context: LoRA layers contribute nothing (the base model = the reference policy of GRPO's
    KL term and of DPO: the same weights, no second copy)."""

    def __init__(self, model: nn.Module):
        self.layers = [m for _, m in model.named_modules() if hasattr(m, "lora_a") and hasattr(m, "scale")]

    def __enter__(self):
        self.scales = [m.scale for m in self.layers]
        for m in self.layers:
            m.scale = 0.0

    def __exit__(self, *exc):
        for m, s in zip(self.layers, self.scales):
            m.scale = s


@contextlib.contextmanager
def without_adapters(model: nn.Module):
    """The model without its adapter layers, in eval mode, for other layers to go in; on exit
    whatever adapter layers it then has go out and its own very layers go back, so a job's
    weights, optimizer state and compiled functions are untouched."""
    own = adapter_layers(model)
    training = model.training
    remove_adapter_layers(model)
    try:
        model.eval()
        yield model
    finally:
        remove_adapter_layers(model)
        if own:
            model.update_modules(tree_unflatten(own))
        model.train(training)


@contextlib.contextmanager
def adapter_swapped(model: nn.Module, adapter_dir: Path | None):
    """The model with the given adapter (None: no adapter) in place of its own LoRA layers, in
    eval mode (worker/runtime/score_requests.py answers between a job's steps)."""
    with without_adapters(model):
        if adapter_dir is not None:
            load_adapters(model, str(adapter_dir))
            model.eval()
        yield model
