"""Checkpoints as bytes, so they can live in Redis where any worker can resume from them.

A checkpoint holds the LoRA weights, the optimizer state, the trainer's counters and metric
history, and the log-probs a kind keeps (DPO's reference log-probs: `reference`, an object with
arrays() and restore(arrays), worker/kinds/supervised_trainer.py ReferenceLogps). No RNG state:
the trainer draws every step's randomness (sampling, LoRA dropout) from (seed, step), so a
resumed job samples what the original would have.
"""

import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map_with_path

from worker.runtime.adapter_layers import adapter_weights, set_adapter_weights
from worker.runtime.train_core import TrainState

HISTORY_KEPT = 1000  # metric history entries carried in a checkpoint


class CheckpointMismatch(Exception):
    """The checkpoint's LoRA tensors do not fit the job's model and LoRA settings."""


def _to_bytes(arrays: dict[str, mx.array]) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "a.safetensors"
        mx.save_safetensors(str(path), arrays)
        return path.read_bytes()


def _from_bytes(blob: bytes) -> dict[str, mx.array]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "a.safetensors"
        path.write_bytes(blob)
        return mx.load(str(path))


def snapshot(model: nn.Module, optimizer: optim.Optimizer, state: TrainState, reference=None) -> dict:
    """Cheap: MLX arrays are immutable, so holding references freezes this moment."""
    return {
        "lora": adapter_weights(model),
        "optimizer": dict(tree_flatten(optimizer.state)),
        "state": TrainState(state.step, state.num_tokens, state.history[-HISTORY_KEPT:]),
        "reference": reference.arrays() if reference is not None else None,
    }


def all_finite(snap: dict) -> bool:
    arrays = [*snap["lora"].values(), *(v for v in snap["optimizer"].values() if mx.issubdtype(v.dtype, mx.floating))]
    return all(bool(mx.isfinite(a).all()) for a in arrays)


def to_blobs(snap: dict) -> dict[str, bytes]:
    return {
        "lora": _to_bytes(snap["lora"]),
        "optimizer": _to_bytes(snap["optimizer"]),
        "state": json.dumps(asdict(snap["state"])).encode(),
        **({"reference": _to_bytes(snap["reference"])} if snap["reference"] else {}),
    }


def restore(model: nn.Module, optimizer: optim.Optimizer | None, blobs: dict[bytes, bytes], reference=None) -> TrainState:
    """The checkpoint's weights into the model's trainable parameters, and its optimizer state
    into the optimizer's (None: the weights alone; an initialised optimizer's state takes the
    saved values by name); its counters returned."""
    saved_lora = _from_bytes(blobs[b"lora"])
    expected = {name: p.shape for name, p in adapter_weights(model).items()}
    got = {name: a.shape for name, a in saved_lora.items()}
    if got != expected:
        diff = sorted(n for n in expected.keys() | got.keys() if expected.get(n) != got.get(n))
        raise CheckpointMismatch(
            f"the checkpoint does not fit this job's LoRA ({len(diff)} tensors differ, e.g. {diff[0]}: "
            f"checkpoint {got.get(diff[0])}, job {expected.get(diff[0])})")
    set_adapter_weights(model, saved_lora)
    if optimizer is not None:
        # The learning rate comes from the (possibly overridden) config, not the checkpoint.
        saved = _from_bytes(blobs[b"optimizer"])
        saved.pop("learning_rate", None)
        optimizer.state = tree_map_with_path(lambda path, v: saved.get(path, v), optimizer.state)
        mx.eval(optimizer.state)
    mx.eval(model.parameters())
    if reference is not None and b"reference" in blobs:  # a checkpoint written before there were kept log-probs has none
        reference.restore(_from_bytes(blobs[b"reference"]))
    return TrainState(**json.loads(blobs[b"state"]))


class CheckpointSaver:
    """Writes a checkpoint only once its weights are known to be good.

    A snapshot is taken after a step (every `every` steps, or `interval_s` seconds) but
    written to Redis only when the next step has computed a finite loss and gradient with
    those weights (the trainer's on_finite_loss). So after a non-finite loss the last
    checkpoint is always one that trains, and `resume` continues from it.
    """

    def __init__(self, job, every: int, interval_s: float, start_step: int):
        self.job, self.every, self.interval_s = job, every, interval_s
        self.pending: dict | None = None
        self.last_step = start_step  # of the last snapshot
        self.last_written = start_step  # of the last checkpoint in Redis
        self.last_time = time.monotonic()

    def maybe_snapshot(self, model, optimizer, state: TrainState, reference=None) -> None:
        due = state.step - self.last_step >= self.every or time.monotonic() - self.last_time >= self.interval_s
        if due:
            self.pending = snapshot(model, optimizer, state, reference)
            self.last_step, self.last_time = state.step, time.monotonic()

    def save_now(self, model, optimizer, state: TrainState, reference=None) -> None:
        """Checkpoint the weights as they are (the worker is shutting down), unless they are
        not finite: then the last good checkpoint stays."""
        snap = snapshot(model, optimizer, state, reference)
        if state.step > self.last_written and all_finite(snap):
            self.pending = snap
            self.flush()

    def flush(self) -> None:
        if self.pending is not None:
            step = self.pending["state"].step
            self.job.save_checkpoint(step, to_blobs(self.pending))
            self.last_written = step
            self.pending = None
