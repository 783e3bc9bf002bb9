"""What the supervised job kinds (SFT, DPO, ORPO, reward models) share: padded batches of
token rows, per-token log-probs, the adapter, and the job around the training steps.

Each kind module (worker/sft_job.py, worker/dpo_job.py, worker/reward_model_job.py) writes
its math at its top and a Trainer with `step(state)`, `evaluate()`, `optimizer`, `module`
(whose trainable parameters are checkpointed) and `save(dir)`; `run_job` here does the rest
exactly as the GRPO kind does: checkpoints with optimizer state in Redis (any worker
resumes), cancel and hand-back at every step, fenced progress, events and adapter.

Rows are right-padded: attention is causal, so padding after a row's last token changes
nothing before it, and the loss masks it out.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import build_schedule, linear_to_lora_layers
from mlx_lm.utils import quantize_model, save_config, save_model

from shared.adapters import adapter_dir
from shared.datasets import DatasetError, load_rows
from shared.settings import load_settings
from shared.train_specs import TrainConfig
from worker import checkpoints
from worker.grpo import Cancelled, NonFiniteLoss, TrainState, batch_indices
from worker.models import ModelNotFound, get_model, gradient_checkpointing, load_private, loaded_model_ids

if TYPE_CHECKING:  # the job's handle; the trainers run without the worker (bench/train_step.py)
    from worker.training_process import JobRun

log = logging.getLogger(__name__)


class UnsupportedBase(Exception):
    """The model cannot be fine-tuned the way the job asks (already quantized, too large)."""


USER_ERRORS = (ModelNotFound, DatasetError, NonFiniteLoss, checkpoints.CheckpointMismatch, UnsupportedBase)
PAD_TO = 32  # widths are padded to a multiple of this: few distinct shapes


# --------------------------------------------------------------------------- batches


@dataclass
class Rows:
    """Token rows and where the trained part of each starts (prompt tokens before it)."""

    tokens: list[list[int]]
    starts: list[int]


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
    return PaddedBatch(tokens[:, :-1], tokens[:, 1:], mask.astype(mx.float32), lengths)


def token_logps(logits: mx.array, targets: mx.array) -> mx.array:
    """log softmax(logits)[target] at every position, in float32: (N, W)."""
    logits = logits.astype(mx.float32)
    return mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - mx.logsumexp(logits, axis=-1)


def cut(rows: Rows, max_len: int) -> tuple[Rows, int]:
    """Rows cut to max_len tokens, and how many were cut."""
    n_cut = sum(len(t) > max_len for t in rows.tokens)
    return Rows([t[:max_len] for t in rows.tokens], [min(s, max_len) for s in rows.starts]), n_cut


def pair_tokens(tokenizer, prompt: str, completion: str) -> tuple[list[int], int]:
    """A prompt + completion row as the preference kinds and reward scoring tokenise it: the
    prompt as raw text (as log-prob scoring does), the completion without special tokens,
    then EOS. Returns (tokens, where the completion starts)."""
    p = list(tokenizer.encode(prompt))
    c = list(tokenizer.encode(completion, add_special_tokens=False)) + [tokenizer.eos_token_id]
    return p + c, len(p)


def batch_rows(n_rows: int, batch_size: int, step: int, accumulation: int, seed: int) -> list[list[int]]:
    """Row indices of each micro-batch of optimizer step `step`: a seeded shuffle per epoch,
    a pure function of (step, seed), so a resumed job sees the same batches."""
    size = min(batch_size, n_rows)
    flat = batch_indices(n_rows, size, step, seed) if accumulation == 1 else [
        i for k in range(step * accumulation, (step + 1) * accumulation) for i in batch_indices(n_rows, size, k, seed)]
    return [flat[k * size:(k + 1) * size] for k in range(accumulation)]


def eval_batches(n_rows: int, batch_size: int, val_batches: int) -> list[list[int]]:
    """The valid rows in order, batch by batch: the first val_batches batches (-1: all)."""
    chunks = [list(range(i, min(i + batch_size, n_rows))) for i in range(0, n_rows, batch_size)]
    return chunks if val_batches < 0 else chunks[:val_batches]


# --------------------------------------------------------------------------- adapter and optimizer


def adapter_config(cfg: TrainConfig, fine_tune_type: str = "lora", quantization: dict | None = None) -> dict:
    """mlx_lm's adapter_config.json: the seed passes lora_alpha as mlx_lm's scale. A quantized
    base (qlora) adds `quantization`, the arguments of mlx_lm's quantize_model that rebuild it
    (the key mlx_lm's config.json uses for a quantized model); mlx_lm itself keeps none there."""
    return {"fine_tune_type": fine_tune_type, "num_layers": cfg.lora_layers,
            "lora_parameters": {"rank": cfg.lora_rank, "scale": cfg.lora_alpha, "dropout": cfg.lora_dropout},
            **({"quantization": quantization} if quantization else {})}


def remove_adapter_layers(model: nn.Module) -> None:
    """Take every LoRA / DoRA layer out (mlx_lm's remove_lora_layers leaves DoRA in)."""
    layers = [(name, m.linear) for name, m in model.named_modules() if isinstance(m, (LoRALinear, DoRALinear))]
    if layers:
        model.update_modules(tree_unflatten(layers))


def attach_adapter(model: nn.Module, cfg: TrainConfig, fine_tune_type: str = "lora") -> None:
    """Make the job's weights the only trainable ones: fresh LoRA / DoRA layers (qlora: LoRA),
    or for `full` the last lora_layers blocks' own weights (-1: all), as mlx_lm's trainer does
    (embeddings and the final norm stay frozen)."""
    remove_adapter_layers(model)
    model.freeze()
    if fine_tune_type == "full":
        for layer in model.layers[-max(cfg.lora_layers, 0):]:
            layer.unfreeze()
    else:
        conf = adapter_config(cfg, fine_tune_type)
        linear_to_lora_layers(model, conf["num_layers"], conf["lora_parameters"], use_dora=fine_tune_type == "dora")
    model.eval()
    mx.eval(model.trainable_parameters())


def private_base(model_id: str, settings, fine_tune_type: str, quant_bits: int | None):
    """(model, tokenizer, config, quantization) for a job that changes the base weights: its own
    copy (worker/models.py load_private), made ready by prepare_private."""
    model, tokenizer, config = load_private(model_id, settings)
    return (model, tokenizer, *prepare_private(model, config, model_id, fine_tune_type, quant_bits,
                                                settings.full_finetune_max_gb))


def prepare_private(model: nn.Module, config: dict, name: str, fine_tune_type: str, quant_bits: int | None,
                    max_gb: float) -> tuple[dict, dict | None]:
    """Check a lazily loaded private copy and quantize it for qlora, as mlx_lm.convert does
    (affine, group size 64); (its config, the quantization or None). `full` is bounded by
    max_gb (MTQ_FULL_FINETUNE_MAX_GB), checked before any weight is read."""
    if "quantization" in config or "quantization_config" in config:
        raise UnsupportedBase(f"model {name!r} is already quantized: fine_tune_type lora or dora on it is QLoRA "
                              "as it is; full, qlora and quantize_base need an unquantized model")
    size = sum(v.nbytes for _, v in tree_flatten(model.parameters()))  # lazy: nothing read yet
    if fine_tune_type == "full" and size > max_gb * 1e9:
        raise UnsupportedBase(
            f"full fine-tuning of {name!r}: its weights are {size / 1e9:.3g} GB, above MTQ_FULL_FINETUNE_MAX_GB "
            f"({max_gb} GB; checkpoints hold the weights and twice that of optimizer state in Redis); "
            "use lora, dora or qlora")
    quantization = None
    if quant_bits:
        _, config = quantize_model(model, config, group_size=None, bits=quant_bits, mode="affine")
        quantization = {k: config["quantization"][k] for k in ("group_size", "bits", "mode")}
    mx.eval(model.parameters())
    return config, quantization


def save_full_model(model: nn.Module, tokenizer, config: dict, out_dir: Path, train_config: dict) -> None:
    """A complete mlx_lm model directory (`mlx_lm.load(dir)`): every weight (model.safetensors),
    the base's config.json and tokenizer; adapter_config.json records how it was trained."""
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "adapter_config.json").write_text(json.dumps(train_config, indent=2))


def make_optimizer(cfg: TrainConfig) -> optim.Optimizer:
    """mlx_lm's trainer's optimizers, as the seed server's SFT uses them: MLX's Adam / AdamW
    without bias correction (GRPO's is TRL's, bias-corrected: worker/grpo.py)."""
    lr = build_schedule(cfg.lr_schedule.model_dump()) if cfg.lr_schedule else cfg.learning_rate
    if cfg.optimizer == "adam":
        return optim.Adam(learning_rate=lr)
    return optim.AdamW(learning_rate=lr, weight_decay=cfg.weight_decay)


def value_and_grad_step(module: nn.Module, loss_fn: Callable, micro_batches: list[tuple]) -> tuple[dict, dict]:
    """Average the loss, metrics and gradients of a step's micro-batches (gradient
    accumulation: the same update as one batch of all their rows, for equal sizes)."""
    vg = nn.value_and_grad(module, loss_fn)
    total, metrics = None, {}
    n = len(micro_batches)
    for args in micro_batches:
        (loss, stats), grads = vg(module, *args)
        total = grads if total is None else tree_map(lambda a, b: a + b, total, grads)
        for k, v in {"loss": loss, **stats}.items():
            metrics[k] = metrics.get(k, 0.0) + v / n
        mx.eval(total, metrics)
    grads = {k: v / n for k, v in tree_flatten(total)}
    grad_norm = mx.sqrt(sum((g * g).sum() for g in grads.values()))
    metrics["grad_norm"] = grad_norm
    return {k: float(v.item()) for k, v in metrics.items()}, tree_unflatten(list(grads.items()))


# --------------------------------------------------------------------------- the job


def run_job(job: JobRun, spec, make_trainer: Callable, fine_tune_type: str = "lora", quant_bits: int | None = None) -> dict:
    """Load the model and the datasets, attach the adapter, run the steps with checkpoints,
    evaluations, progress and events, and commit the adapter (plus what the trainer adds).
    `full` and a quantized base (quant_bits) train a private copy of the model, freed at the end."""
    settings, cfg = load_settings(), spec.config
    t0 = time.perf_counter()
    job.mark("loading_model")
    private = fine_tune_type == "full" or quant_bits is not None
    if private:
        model, tokenizer, base_config, quantization = private_base(spec.model_id, settings, fine_tune_type, quant_bits)
        cached = False
    else:
        model, tokenizer, cached = get_model(spec.model_id, settings)
        base_config = quantization = None
    if not cached:  # a model loaded, or (private copy) the shared one dropped: the advertisement says so
        job.publish_loaded(loaded_model_ids())

    def write_files(trainer: Trainer, out_dir: Path) -> None:
        if fine_tune_type == "full":
            save_full_model(model, tokenizer, base_config, out_dir, adapter_config(cfg, "full"))
        else:
            trainer.save(out_dir, adapter_config(cfg, fine_tune_type, quantization))

    try:
        return _train(job, spec, make_trainer, model, tokenizer, fine_tune_type, private, settings, t0, cached, write_files)
    finally:
        remove_adapter_layers(model)  # the process keeps a shared model for the next job
        if private:
            del model
            mx.clear_cache()  # the private copy's memory goes back now, not when the next job allocates


def _train(job: JobRun, spec, make_trainer: Callable, model, tokenizer, fine_tune_type: str, private: bool,
           settings, t0: float, cached: bool, write_files: Callable) -> dict:
    cfg = spec.config
    r = job.lease.r
    train = getattr(spec, "preference_pairs", None)
    train = [p.model_dump() for p in train] if train else load_rows(r, spec.dataset, settings, spec.row_format, "dataset")
    valid = load_rows(r, spec.valid_dataset, settings, spec.row_format, "valid_dataset", split="valid")
    if valid is None and isinstance(spec.dataset, str):  # a data directory's valid.jsonl
        valid = load_rows(r, spec.dataset, settings, spec.row_format, "dataset", split="valid")
    job.write(event={"type": "model_ready", "cached": cached, "private_copy": private, "load_s": time.perf_counter() - t0,
                     "train_rows": len(train), "valid_rows": len(valid or [])})

    mx.random.seed(cfg.seed)  # LoRA init
    attach_adapter(model, cfg, fine_tune_type)
    with gradient_checkpointing(model, cfg.gradient_checkpointing):
        trainer = make_trainer(model, tokenizer, spec, train, valid)
        if trainer.truncated:
            job.write(event={"type": "truncated", "rows": trainer.truncated, "max_seq_length": cfg.max_seq_length})
        state = TrainState()
        saved = job.load_checkpoint()
        if saved:
            state = checkpoints.restore(trainer.module, trainer.optimizer, saved)
            job.write(event={"type": "resumed", "from_step": state.step}, resumed_from=state.step)
        saver = checkpoints.CheckpointSaver(job, cfg.steps_per_save, cfg.checkpoint_interval_s, start_step=state.step)
        step_type = f"{spec.kind}_step"
        if valid and state.step == 0:  # before training, as mlx_lm reports it
            job.mark("scoring")
            job.write(event={"type": "eval", "iter": 0, **trainer.evaluate()})
        try:
            while state.step < cfg.iters:
                if job.should_stop():
                    raise Cancelled()
                job.mark("updating")
                metrics = trainer.step(state, on_finite_loss=saver.flush)
                job.step_done()
                last = state.step == cfg.iters
                if valid and (state.step == 1 or state.step % cfg.steps_per_eval == 0 or last):
                    job.mark("scoring")
                    metrics.update(trainer.evaluate())
                    job.write(event={"type": "eval", "iter": state.step, **{k: v for k, v in metrics.items() if k.startswith("val")}})
                progress = {"iter": state.step, "total_iters": cfg.iters, **metrics}
                event = {"type": step_type, "worker": job.lease.worker, **progress} \
                    if state.step % cfg.steps_per_report == 0 or last else None
                job.write(event=event, progress=progress)
                state.history.append({k: metrics[k] for k in ("loss", "learning_rate", "step_time")})
                saver.maybe_snapshot(trainer.module, trainer.optimizer, state)
                if not private:  # scoring requests use the shared copy: a private job leaves them to idle workers
                    job.between_steps(spec.model_id)
        except Cancelled:
            if job.marks.hand_back_requested:  # the worker is shutting down: keep what was done
                saver.save_now(trainer.module, trainer.optimizer, state)
            raise
    out = adapter_dir(settings, spec.model_id, spec.adapter_name or job.job_id)
    job.commit_adapter(out, lambda d: write_files(trainer, d))
    kept = state.history[-checkpoints.HISTORY_KEPT:]
    first = state.step - len(kept) + 1
    return {"adapter_path": str(out), "adapter": (spec.model_id, spec.adapter_name),
            "history": [{"step": first + i, **h} for i, h in enumerate(kept)]}


class Trainer:
    """The steps of a supervised kind. A subclass sets `module` (trainable parameters: the
    adapter, plus a reward model's head) and defines `loss(module, *arrays) -> (loss, stats)`
    and `arrays(indices, rows) -> (arrays, tokens)` for a batch of its rows."""

    module: nn.Module
    truncated = 0  # rows cut to max_seq_length

    def __init__(self, module: nn.Module, cfg: TrainConfig, train: list, valid: list | None):
        self.module, self.cfg, self.train_rows, self.valid_rows = module, cfg, train, valid
        self.optimizer = make_optimizer(cfg)
        self.optimizer.init(module.trainable_parameters())

    def step(self, state: TrainState, on_finite_loss: Callable[[], None] = lambda: None) -> dict[str, float]:
        """One optimizer step; on_finite_loss is called once the current weights gave a finite
        loss and gradient (the moment they are known good to checkpoint)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        mx.random.seed(cfg.seed * 1_000_003 + state.step)  # LoRA dropout: a function of (seed, step)
        micro = [self.arrays(ids, self.train_rows) for ids in
                 batch_rows(len(self.train_rows), cfg.batch_size, state.step, cfg.grad_accumulation_steps, cfg.seed)]
        self.module.train()
        metrics, grads = value_and_grad_step(self.module, self.loss, [arrays for arrays, _ in micro])
        self.module.eval()
        check_finite(metrics, state.step + 1)
        on_finite_loss()
        self.optimizer.update(self.module, grads)
        mx.eval(self.module.trainable_parameters(), self.optimizer.state)
        n_tokens = sum(n for _, n in micro)
        state.step += 1
        state.num_tokens += n_tokens
        dt = time.perf_counter() - t0
        lr = self.optimizer.learning_rate
        return {**metrics, "learning_rate": float(lr.item() if isinstance(lr, mx.array) else lr),
                "num_tokens": state.num_tokens, "tokens_per_second": n_tokens / max(dt, 1e-9),
                "peak_memory_gb": mx.get_peak_memory() / 1e9, "step_time": dt}

    def evaluate(self) -> dict[str, float]:
        """The loss and statistics over val_batches batches of the valid rows, as val_<name>."""
        totals: dict[str, float] = {}
        batches = eval_batches(len(self.valid_rows), self.cfg.batch_size, self.cfg.val_batches)
        n = sum(len(ids) for ids in batches)
        for ids in batches:
            arrays, _ = self.arrays(ids, self.valid_rows)
            loss, stats = self.loss(self.module, *arrays)
            for k, v in {"loss": loss, **stats}.items():
                totals[k] = totals.get(k, 0.0) + float(v.item()) * len(ids) / n
        return {f"val_{k}": v for k, v in totals.items()}

    def save(self, out_dir: Path, config: dict) -> None:
        save_lora(self.module, out_dir, config)


def check_finite(metrics: dict, step: int) -> None:
    if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
        raise NonFiniteLoss(f"non-finite loss or gradient at step {step} (loss={metrics['loss']}, "
                            f"grad_norm={metrics['grad_norm']})")


def save_lora(module: nn.Module, out_dir: Path, config: dict) -> None:
    """adapters.safetensors + adapter_config.json, as mlx_lm writes and loads them."""
    mx.save_safetensors(str(out_dir / "adapters.safetensors"), dict(tree_flatten(module.trainable_parameters())))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
