"""One Tinker training client (one model_id): a LoRA adapter of its own on a shared base model,
trained by forward_backward and optim_step, and saved and loaded as bytes. It runs in the
training process's main thread; the session loop hands it plain numpy values.

Several clients share one base model (worker/runtime/models.py get_model: loaded once, its q/k/v
and gate/up fused). A client's LoRA layers are modules of its own, in the model only while one
of its calls runs (`attached`: the model's own adapter layers, if any, out; the base's weights
frozen, as every adapter job leaves them; the client's layers in; on exit the model's own layers
back), so the base computes after a call exactly what it computed before.

The adapter, as Tinker's LoraConfig asks:
    rank r; seed: the draw of the A matrices (B starts at 0: a new adapter is the base model).
    train_attn: every linear layer of a block's attention; train_mlp: of its MLP (a mixture of
    experts' experts included, its router not); train_unembed: lm_head. A model with tied
    embeddings has no lm_head of its own, so its unembedding is not trained (info() says
    train_unembed False); LoRA on the tied matrix would change the input embeddings too.
    scale = alpha / r with alpha = 32: Tinker's lora_alpha (tinker_cookbook hyperparam_utils),
    and alpha / r is the scale of the PEFT adapters Tinker exports (the cookbook's merge code).

forward_backward: the datums right-padded into micro-batches of similar lengths (as many rows as
worker/runtime/memory_plan.py loss_rows fits; gradient checkpointing only where not even one row
fits without it), each target's log-prob from the output head a chunk of positions at a time
(worker/runtime/logprobs.py head_logprobs), the loss of worker/sessions/losses.py summed. Without
forward_only the gradients are summed into the client's until optim_step (Tinker accumulates).

optim_step: AdamW as PyTorch's (decoupled weight decay, bias-corrected: mlx's AdamW with
bias_correction), on the gradients clipped to a global norm of grad_clip_norm (0: not clipped):
    g *= min(1, c / (|g| + 1e-6));  theta *= 1 - lr wd
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    theta -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
then the gradients are zeroed; the optimizer's state persists across steps. With no gradient
(no forward_backward since the last step) it changes nothing, as PyTorch's optimizer skips a
parameter without a gradient, and says so (metric skipped 1). A gradient that is not finite is
an error: the step is not taken and the gradients are dropped.

state / load_state: the adapter's weights, the optimizer's state and the counters as bytes
(worker/runtime/checkpoints.py, the jobs' checkpoints) plus the LoraConfig (saved_lora_config).
adapter_files: adapters.safetensors + adapter_config.json as mlx_lm writes and loads them.
"""

import contextlib
import json
import math
import secrets
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.tuner.utils import linear_to_lora_layers

from worker.runtime.adapter_layers import adapter_config, adapter_layers, save_adapter, without_adapters
from worker.runtime.checkpoints import CheckpointMismatch, restore, snapshot, to_blobs
from worker.runtime.logprobs import head_logprobs
from worker.runtime.memory_plan import logits_chunk_tokens, loss_rows, weights_bytes
from worker.runtime.models import gradient_checkpointing
from worker.runtime.train_core import TrainState, clipped
from worker.sessions.losses import check_call, loss_config, token_losses

LORA_ALPHA = 32.0
MAX_LORA_RANK = 512
CONFIG_BLOB = "lora_config"  # state()'s LoraConfig, beside the checkpoint's blobs
LINEAR = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear)
MLP_BLOCKS = ("mlp", "feed_forward", "block_sparse_moe")
ROUTERS = ("gate", "router", "shared_expert_gate")  # a mixture of experts' routing layers: no LoRA


class BadRequest(ValueError):
    """A call the client cannot run as asked; the message says why (a failed future of category user)."""


@dataclass(frozen=True)
class LoraConfig:
    """Tinker's LoraConfig (create_model's lora_config)."""

    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


def lora_keys(model: nn.Module, lora: LoraConfig) -> list[str]:
    """The projections that get LoRA (mlx_lm's `keys`): names inside a block, and lm_head."""
    keys = set()
    for layer in model.layers:
        for name, m in layer.named_modules():
            part, last = name.split(".")[0], name.rsplit(".", 1)[-1]
            if not isinstance(m, LINEAR) or last in ROUTERS:
                continue
            if (lora.train_attn and ("attn" in part or "attention" in part)) or (lora.train_mlp and part in MLP_BLOCKS):
                keys.add(name)
    if lora.train_unembed and isinstance(getattr(model, "lm_head", None), LINEAR):
        keys.add("lm_head")
    return sorted(keys)


def new_layers(model: nn.Module, keys: list[str], rank: int, seed: int) -> list[tuple[str, nn.Module]]:
    """Fresh mlx_lm LoRA layers on the model's projections `keys`, by their names in the model;
    the model keeps its own layers. Their A matrices are drawn from `seed` (MLX's generator is
    seeded for the draw, then from its own next number, so its later draws still follow from
    whatever seeded it before)."""
    carry = int(mx.random.randint(0, 2**31 - 1, ()).item())
    mx.random.seed(seed)
    try:
        with without_adapters(model):
            model.freeze()
            linear_to_lora_layers(model, len(model.layers),
                                  {"rank": rank, "scale": LORA_ALPHA / rank, "dropout": 0.0, "keys": keys})
            layers = adapter_layers(model)
    finally:
        mx.random.seed(carry)
    mx.eval([m.parameters() for _, m in layers])
    return layers


def saved_lora_config(blobs: dict) -> LoraConfig:
    """The LoraConfig of a state() (for a client created from it)."""
    return LoraConfig(**json.loads(_by_bytes(blobs)[CONFIG_BLOB.encode()]))


def _by_bytes(blobs: dict) -> dict[bytes, bytes]:
    """Blobs keyed by bytes (as Redis gives them back), whichever way they came."""
    return {k.encode() if isinstance(k, str) else k: v for k, v in blobs.items()}


class TrainingClient:
    """One model_id's adapter on a shared base model, its optimizer and its summed gradients
    (module docstring). Every method runs on the training process's main thread; a bad call
    raises BadRequest before it changes anything."""

    def __init__(self, model: nn.Module, lora: LoraConfig):
        if isinstance(lora.rank, bool) or not isinstance(lora.rank, int) or not 1 <= lora.rank <= MAX_LORA_RANK:
            raise BadRequest(f"lora_config.rank must be an integer from 1 to {MAX_LORA_RANK}, got {lora.rank!r}")
        if lora.seed is not None and (isinstance(lora.seed, bool) or not isinstance(lora.seed, int)
                                      or not 0 <= lora.seed < 2**63):
            raise BadRequest(f"lora_config.seed must be an integer from 0 to 2**63 - 1, got {lora.seed!r}")
        self.model, self.lora = model, lora
        self.keys = lora_keys(model, lora)
        if not self.keys:
            tied = " (this model's embeddings are tied: it has no lm_head of its own to train)" if lora.train_unembed else ""
            raise BadRequest(f"lora_config trains nothing: train_attn, train_mlp and train_unembed leave no layer{tied}")
        self.seed = lora.seed if lora.seed is not None else secrets.randbelow(2**31)
        self.layers = new_layers(model, self.keys, lora.rank, self.seed)
        args = model.args
        self.vocab_size = args.vocab_size
        self.max_tokens = getattr(args, "max_position_embeddings", None) or 2**20
        self.chunk_tokens = logits_chunk_tokens(self.vocab_size)
        self.weights = weights_bytes(model)
        self.fits: dict[int, tuple[int, bool]] = {}  # width -> (rows a micro-batch fits, checkpointing)
        self.grads = None  # the gradients summed since the last optim_step (None: none)
        self.train_state = TrainState()  # step: optimizer steps taken; num_tokens: datum tokens trained on
        with self.attached() as m:
            self.optimizer = self.fresh_optimizer(m)

    def info(self) -> dict:
        """What get_info says of this client: the adapter's settings, as they are in effect."""
        return {"is_lora": True, "lora_rank": self.lora.rank, "lora_alpha": LORA_ALPHA, "seed": self.seed,
                "train_attn": self.lora.train_attn, "train_mlp": self.lora.train_mlp,
                "train_unembed": "lm_head" in self.keys, "tied_embeddings": not hasattr(self.model, "lm_head")}

    @contextlib.contextmanager
    def attached(self):
        """The base model with this client's LoRA layers (and no other), base weights frozen."""
        with without_adapters(self.model) as model:
            model.freeze()
            model.update_modules(tree_unflatten(self.layers))
            yield model

    def fresh_optimizer(self, model: nn.Module) -> optim.Optimizer:
        """AdamW with zero moments (its hyperparameters are each optim_step's); model: attached."""
        optimizer = optim.AdamW(learning_rate=0.0, bias_correction=True)
        optimizer.init(model.trainable_parameters())
        return optimizer

    # ----------------------------------------------------------------------- forward_backward

    def forward_backward(self, data: list[tuple[np.ndarray, dict[str, np.ndarray]]], loss_fn: str, config: dict,
                         forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per datum its outputs (`logprobs`, and for cross_entropy `elementwise_loss`), and the
        call's metrics (`loss:sum`). Not forward_only: the gradients add to the client's."""
        error = self.check(data, loss_fn, config)
        if error:
            raise BadRequest(error)
        cfg = loss_config(loss_fn, config)
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total, summed = 0.0, None  # the call's gradients, added to the client's only once all went well
        with self.attached() as model:
            for rows, checkpointing in self.micro_batches([len(tokens) for tokens, _ in data]):
                batch = [data[i] for i in rows]
                arrays = pad_batch(batch, cfg)

                def loss_of(*args):
                    return batch_loss(model, *args, loss_fn, cfg, self.chunk_tokens, checkpointing)

                if forward_only:
                    loss, lp = loss_of(*arrays)
                else:
                    (loss, lp), grads = nn.value_and_grad(model, loss_of)(*arrays)
                    summed = grads if summed is None else tree_map(mx.add, summed, grads)
                mx.eval(loss, lp, summed)
                total += loss.item()
                for i, out in zip(rows, datum_outputs(batch, np.array(lp), loss_fn)):
                    outputs[i] = out
        if not forward_only:
            self.grads = summed if self.grads is None else tree_map(mx.add, self.grads, summed)
            mx.eval(self.grads)
            self.train_state.num_tokens += sum(len(tokens) for tokens, _ in data)
        return outputs, {"loss:sum": total}

    def check(self, data: list, loss_fn: str, config: dict) -> str | None:
        """What is wrong with a forward_backward call (losses.check_call), naming the field; None if nothing."""
        return check_call(loss_fn, config, data, self.vocab_size, self.max_tokens)

    def micro_batches(self, lengths: list[int]) -> list[tuple[list[int], bool]]:
        """Datum indices in micro-batches, longest first, each as many rows of its longest
        datum's width as fit (memory_plan.loss_rows), with whether it needs checkpointing."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        out, k = [], 0
        while k < len(order):
            rows, checkpointing = self.fitting(lengths[order[k]], order[k])
            out.append((order[k:k + rows], checkpointing))
            k += rows
        return out

    def fitting(self, width: int, datum: int) -> tuple[int, bool]:
        """(rows, checkpointing) of a micro-batch `width` tokens wide: checkpointing (a forward
        pass more) only where not even one row fits without it."""
        if width not in self.fits:
            rows = loss_rows(self.model, width, False, self.weights)
            checkpointing = rows == 0
            if checkpointing:
                rows = loss_rows(self.model, width, True, self.weights)
            if rows == 0:
                raise BadRequest(f"data[{datum}] has {width} tokens: a forward and backward pass of it needs more "
                                 "memory than this worker has")
            self.fits[width] = rows, checkpointing
        return self.fits[width]

    # ----------------------------------------------------------------------- optim_step

    def optim_step(self, learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step on the summed gradients (module docstring), which are then zeroed."""
        error = adam_error(learning_rate=learning_rate, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                           grad_clip_norm=grad_clip_norm)
        if error:
            raise BadRequest(error)
        if self.grads is None:
            return {"skipped": 1.0, "step": float(self.train_state.step)}
        grads, norm = clipped(self.grads, grad_clip_norm if grad_clip_norm > 0 else None)
        self.grads = None
        norm = norm.item()
        if not math.isfinite(norm):
            raise BadRequest(f"the summed gradient is not finite (norm {norm}): the step was not taken and the "
                             "gradients were dropped")
        opt = self.optimizer
        opt.learning_rate, opt.betas, opt.eps, opt.weight_decay = learning_rate, [beta1, beta2], eps, weight_decay
        with self.attached() as model:
            opt.update(model, grads)
            mx.eval(model.trainable_parameters(), opt.state)
        self.train_state.step += 1
        return {"skipped": 0.0, "step": float(self.train_state.step), "grad_norm": norm,
                "learning_rate": float(learning_rate)}

    # ----------------------------------------------------------------------- weights as bytes

    def state(self) -> dict[str, bytes]:
        """The adapter's weights, the optimizer's state, the counters and the LoraConfig."""
        with self.attached() as model:
            blobs = to_blobs(snapshot(model, self.optimizer, self.train_state))
        return {**blobs, CONFIG_BLOB: json.dumps({**asdict(self.lora), "seed": self.seed}).encode()}

    def load_state(self, blobs: dict, with_optimizer: bool) -> None:
        """A state()'s weights (and, with_optimizer, its optimizer state and counters; without,
        the optimizer starts afresh) in place of the client's; pending gradients are dropped."""
        blobs = _by_bytes(blobs)
        needed = [b"lora", b"state"] + ([b"optimizer"] if with_optimizer else [])
        if any(k not in blobs for k in needed):
            raise BadRequest(f"the checkpoint lacks {', '.join(k.decode() for k in needed if k not in blobs)}")
        if CONFIG_BLOB.encode() in blobs:
            saved = saved_lora_config(blobs)
            theirs = (saved.rank, lora_keys(self.model, saved))
            if theirs != (self.lora.rank, self.keys):
                raise BadRequest(f"the checkpoint's LoRA (rank {saved.rank}, {len(theirs[1])} projections) does not "
                                 f"fit this client's (rank {self.lora.rank}, {len(self.keys)} projections)")
        with self.attached() as model:
            try:
                state = restore(model, self.optimizer if with_optimizer else None, blobs)
            except CheckpointMismatch as e:
                raise BadRequest(str(e)) from None
            if not with_optimizer:
                self.optimizer = self.fresh_optimizer(model)
        self.train_state = state if with_optimizer else TrainState(num_tokens=state.num_tokens)
        self.grads = None

    def adapter_files(self) -> dict[str, bytes]:
        """adapters.safetensors + adapter_config.json, which mlx_lm.load(..., adapter_path=) loads."""
        settings = SimpleNamespace(lora_layers=len(self.model.layers), lora_rank=self.lora.rank,
                                   lora_alpha=LORA_ALPHA / self.lora.rank, lora_dropout=0.0)
        with self.attached() as model, tempfile.TemporaryDirectory() as d:
            save_adapter(model, Path(d), adapter_config(settings, keys=self.keys))
            return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


# --------------------------------------------------------------------------- a micro-batch


def pad_batch(batch: list[tuple[np.ndarray, dict[str, np.ndarray]]], cfg: dict[str, float]):
    """(inputs (B, W) int32, targets (B, W, K) int32, mask (B, W) float32, loss inputs) of the
    datums right-padded to the longest: padding predicts token 0 with every loss input 0 (a
    missing clip threshold: the config's) and is masked out. K: the most target tokens per
    position (cross_entropy's top-K; 1 otherwise); the loss inputs are (B, W), weights (B, W, K)."""
    lengths = [len(tokens) for tokens, _ in batch]
    B, W = len(batch), max(lengths)
    K = max(inputs["target_tokens"].reshape(n, -1).shape[1] for (_, inputs), n in zip(batch, lengths))
    tokens = np.zeros((B, W), np.int32)
    targets = np.zeros((B, W, K), np.int32)
    mask = np.zeros((B, W), np.float32)
    names = sorted({name for _, inputs in batch for name in inputs} - {"target_tokens"})
    x = {name: np.full((B, W, K) if name == "weights" else (B, W), cfg.get(name, 0.0), np.float32) for name in names}
    for r, ((ids, inputs), n) in enumerate(zip(batch, lengths)):
        tokens[r, :n] = ids
        mask[r, :n] = 1.0
        t = inputs["target_tokens"].reshape(n, -1)
        targets[r, :n, :t.shape[1]] = t
        for name in names:
            if name in inputs:
                value = inputs[name].reshape(n, -1)
                if name == "weights":
                    x[name][r, :n, :value.shape[1]] = value
                else:
                    x[name][r, :n] = value[:, 0]
    return mx.array(tokens), mx.array(targets), mx.array(mask), {k: mx.array(v) for k, v in x.items()}


def batch_loss(model: nn.Module, inputs: mx.array, targets: mx.array, mask: mx.array, x: dict[str, mx.array],
               loss_fn: str, cfg: dict[str, float], chunk_tokens: int, checkpointing: bool) -> tuple[mx.array, mx.array]:
    """The micro-batch's summed loss, and the targets' log-probs: (B, W, K) for cross_entropy,
    (B, W) for the others."""
    B, W, K = targets.shape
    with gradient_checkpointing(model, checkpointing):
        hidden = model.model(inputs)
    lp = head_logprobs(model, hidden.reshape(B * W, -1), targets.reshape(B * W, K), 1.0, chunk_tokens).reshape(B, W, K)
    if loss_fn == "cross_entropy":
        mask = mask[..., None]
    else:
        lp = lp[..., 0]
    return (token_losses(loss_fn, lp, x, cfg) * mask).sum(), lp


def datum_outputs(batch: list, lp: np.ndarray, loss_fn: str) -> list[dict[str, np.ndarray]]:
    """Each datum's outputs, cut from the micro-batch's log-probs: logprobs the shape of its
    target_tokens; for cross_entropy also elementwise_loss = -weights * logprobs."""
    outs = []
    for r, (ids, inputs) in enumerate(batch):
        n, shape = len(ids), inputs["target_tokens"].shape
        logprobs = lp[r, :n] if lp.ndim == 2 else lp[r, :n, :(shape[1] if len(shape) == 2 else 1)].reshape(shape)
        out = {"logprobs": logprobs.astype(np.float32)}
        if loss_fn == "cross_entropy":
            with np.errstate(over="ignore"):  # an infinite loss is an answer here, not a warning
                out["elementwise_loss"] = -inputs["weights"].astype(np.float32) * out["logprobs"]
        outs.append(out)
    return outs


def adam_error(**params: float) -> str | None:
    """What is wrong with optim_step's adam_params, naming the field; None if nothing."""
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"adam_params.{name} must be a finite number, got {str(value)[:100]!r}"
    for name in ("beta1", "beta2"):
        if not 0 <= params[name] < 1:
            return f"adam_params.{name} must be in [0, 1), got {params[name]}"
    if params["eps"] <= 0:
        return f"adam_params.eps must be positive (where a gradient is 0, eps 0 divides 0 by 0), got {params['eps']}"
    for name in ("learning_rate", "weight_decay", "grad_clip_norm"):
        if params[name] < 0:
            return f"adam_params.{name} must not be negative, got {params[name]}"
    return None
