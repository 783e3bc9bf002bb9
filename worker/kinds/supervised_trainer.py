"""What the supervised kinds (SFT, DPO, ORPO, KTO, reward models) share: their trainer
(`Trainer`: one optimizer step over micro-batches of token rows, evaluation on the valid rows),
prompt/completion texts and preference pairs as token rows, DPO's reference log-probs, and
`load`, the job around the trainer: the model (the shared one, or a private copy for full and
quantized fine-tuning), the datasets, the adapter, and the Run the job loop drives
(worker/runtime/job_loop.py).

Each kind module (worker/kinds/sft_job.py, dpo_job.py, kto_job.py, reward_model_job.py) writes
its math at its top, a Trainer with its `arrays` (a batch of its rows) and `loss`, and `load`.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map
from mlx_lm.utils import save_config, save_model

from shared.adapters import init_adapter_dir
from shared.datasets import load_rows
from shared.memory_estimate import supervised_checkpointing
from shared.routing import step_of
from shared.train_specs import TrainConfig
from worker.runtime.adapter_layers import adapter_config, attach_adapter, remove_adapter_layers, save_adapter, started_from
from worker.runtime.gang_group import SOLO, Gang
from worker.runtime.logprobs import pair_tokens
from worker.runtime.memory_plan import device_kind, device_memory_bytes, model_shape, weights_bytes
from worker.runtime.models import get_model, gradient_checkpointing, private_base
from worker.runtime.qat import check_qat, qat_loss, qat_step
from worker.runtime.scalars import as_inputs
from worker.runtime.train_core import (
    Rows,
    Run,
    TrainState,
    batch_rows,
    check_finite,
    clipped,
    cut,
    eval_batches,
    make_optimizer,
    pad_rows,
    step_seed,
)

HISTORY_METRICS = ("loss", "learning_rate", "step_time")


# --------------------------------------------------------------------------- the trainer


def make_step(module: nn.Module, optimizer, loss_fn: Callable, accumulation: int, numbers: dict[str, mx.array],
              gang: Gang = SOLO, compiled: bool = True) -> Callable:
    """One micro-batch of an optimizer step, as mlx_lm's trainer makes its step: compiled with
    the model's, the optimizer's and the random state as inputs and outputs, so that the
    forward, backward and update are one graph MLX simplifies and fuses. numbers: the
    trainer's (Trainer.numbers: what loss_fn reads, max_grad_norm, and the accumulation's
    count), inputs too. Gradient accumulation sums the micro-batches' gradients (and metrics),
    then averages them: the same update as one batch of all their rows, for equal sizes. In a
    gang (worker/runtime/gang_group.py) each rank has a share of every micro-batch: its mean
    counts by its `share` of the micro-batch's normaliser (an array: a new value is not a new
    compile), and the ranks' sums are summed before the update.

        step(arrays, share, running, do_update) -> (running, metrics)
        running: the summed (gradients, metrics) so far (None at the first micro-batch);
        do_update: the last micro-batch: the mean gradient's norm (before clipping, as TRL
        reports it), the gradient clipped to numbers' max_grad_norm (none: not clipped), the update.
        arrays None: no micro-batch, only the update of `running` (a gang's rank evaluates its
        local sums first, to time its own work: Gang.measure)."""
    vg = nn.value_and_grad(module, loss_fn)

    def step(arrays, share, running, do_update: bool):
        if arrays is None:
            grads, metrics = running
        else:
            (loss, stats), grads = vg(module, *arrays)
            metrics = {"loss": loss, **stats}
            if gang.size > 1:
                grads = tree_map(lambda g: g * share, grads)
                metrics = {k: v * share for k, v in metrics.items()}
            if running is not None:
                grads = tree_map(mx.add, grads, running[0])
                metrics = {k: v + running[1][k] for k, v in metrics.items()}
            if not do_update:
                return (grads, metrics), None
        grads, metrics = gang.sum_tree((grads, metrics))
        count = numbers["accumulation"]  # an input: every count the same kernels
        if accumulation > 1:  # by 1 a kernel of its own per gradient (the norm and the update read it)
            grads = tree_map(lambda g: g / count.astype(g.dtype), grads)
        metrics = {k: v / count.astype(v.dtype) for k, v in metrics.items()}
        grads, metrics["grad_norm"] = clipped(grads, numbers.get("max_grad_norm"))
        optimizer.update(module, grads)
        return None, metrics

    if not compiled:
        return step
    state = [module.state, optimizer.state, mx.random.state]
    return mx.compile(step, inputs=[*state, numbers], outputs=state)


class Trainer:
    """The steps of a supervised kind. A subclass sets `module` (trainable parameters: the
    adapter, plus a reward model's head) and defines `loss(module, *arrays) -> (loss, stats)`
    and `arrays(indices, rows) -> (arrays, tokens)` for a batch of its rows; its loss reads the
    numbers of its `loss_numbers` from `self.numbers`, arrays its compiled step takes as inputs
    rather than numbers compiled into its kernels (worker/runtime/scalars.py)."""

    module: nn.Module
    truncated = 0  # rows cut to max_seq_length
    reference: ReferenceLogps | None = None  # log-probs kept with the checkpoint (DPO's reference)
    compiled = True  # the step compiled (make_step); the benchmark and a test compare it with the plain one
    gang: Gang = SOLO  # worker/runtime/gang_group.py: this process's rank of the job's gang

    def __init__(self, module: nn.Module, cfg: TrainConfig, train: list, valid: list | None):
        self.module, self.cfg, self.train_rows, self.valid_rows = module, cfg, train, valid
        self.optimizer = make_optimizer(cfg, cfg.iters, cfg.optimizer, cfg.lr_schedule and cfg.lr_schedule.model_dump(),
                                        cfg.momentum)
        self.optimizer.init(module.trainable_parameters())
        # A schedule runs on the host before each update (step): in the compiled update its numbers (the
        # learning rate, warm-up, length) were constants of a kernel, compiled again for each job's.
        self.schedule = self.optimizer._schedulers.pop("learning_rate", None)
        clip = {"max_grad_norm": cfg.max_grad_norm} if cfg.max_grad_norm is not None else {}
        self.numbers = as_inputs(**self.loss_numbers(cfg), **clip, accumulation=cfg.grad_accumulation_steps)
        self.micro_steps, self.micro_step_state = {}, None  # made at a step's first use (make_step), below: plain, QAT
        check_qat(module, cfg)

    def step(self, state: TrainState, on_finite_loss: Callable[[], None] = lambda: None) -> dict[str, float]:
        """One optimizer step; on_finite_loss is called once the current weights gave a finite
        loss and gradient (the moment they are known good to checkpoint)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        mx.random.seed(step_seed(cfg.seed, state.step))  # LoRA dropout
        ids = batch_rows(len(self.train_rows), cfg.batch_size, state.step, cfg.grad_accumulation_steps, cfg.seed)
        shares = [self.gang.share(rows) for rows in ids]  # this rank's rows of each micro-batch (all, alone)
        micro = [self.arrays(rows, self.train_rows) for rows in shares]
        weights = [self.weight(rows, n) for rows, (_, n) in zip(shares, micro)]
        parts = [1.0] * len(micro) if self.gang.size == 1 else [
            w / max(t, 1e-30) for w, t in zip(weights, self.gang.sum(mx.array(weights, dtype=mx.float32)).tolist())]
        if self.micro_step_state is not self.optimizer.state:  # a checkpoint's restore put in a new state
            self.micro_steps, self.micro_step_state = {}, self.optimizer.state
        qat = qat_step(cfg, state.step)
        if self.schedule is not None:  # the value mlx.optimizers' update would set from it
            self.optimizer.learning_rate = self.schedule(self.optimizer.step)
        if qat not in self.micro_steps:
            self.micro_steps[qat] = make_step(self.module, self.optimizer, qat_loss(self.loss, cfg.qat) if qat else self.loss,
                                              len(micro), self.numbers, self.gang, self.compiled)
        self.module.train()
        running, local = None, time.perf_counter()
        solo = self.gang.size == 1  # a gang's rank sums its micro-batches, times that, then updates
        for k, ((arrays, _), part) in enumerate(zip(micro, parts)):
            running, metrics = self.micro_steps[qat](arrays, mx.array(part, dtype=mx.float32), running,
                                                     solo and k == len(micro) - 1)
            mx.eval(running if running is not None else (metrics, self.module.state, self.optimizer.state))
        if not solo:
            rows = sum(map(len, shares))
            self.gang.local_work_done(rows)
            local = time.perf_counter() - local
            _, metrics = self.micro_steps[qat](None, mx.array(1.0), running, True)
            mx.eval(metrics, self.module.state, self.optimizer.state)
            per_rank = [sum(n) for n in zip(*(self.gang.rows_per_rank(len(rows)) for rows in ids))]
            shared_rows = {f"gang/rows_rank{r}": float(n) for r, n in enumerate(per_rank)}
            self.gang.measure(local, rows)  # the next step's shares
        self.module.eval()
        metrics = {k: float(v.item()) for k, v in metrics.items()}
        # A non-finite loss fails the job; the update it made is never checkpointed (on_finite_loss is not called).
        check_finite(metrics["loss"], metrics["grad_norm"], state.step + 1)
        on_finite_loss()
        n_tokens = sum(n for _, n in micro)
        if self.gang.size > 1:
            n_tokens = int(self.gang.sum(mx.array(n_tokens)).item())
        state.step += 1
        state.num_tokens += n_tokens
        dt = time.perf_counter() - t0
        lr = self.optimizer.learning_rate
        return {**metrics, **({} if solo else shared_rows), "learning_rate": float(lr.item() if isinstance(lr, mx.array) else lr),
                "examples": sum(map(len, ids)), "num_tokens": state.num_tokens, "tokens_per_second": n_tokens / max(dt, 1e-9),
                "peak_memory_gb": mx.get_peak_memory() / 1e9, "step_time": dt}

    def loss_numbers(self, cfg) -> dict[str, float]:
        """The numbers the loss computes with, by name (self.numbers holds them as arrays)."""
        return {}

    @staticmethod
    def weight(ids: list[int], tokens: int) -> float:
        """A micro-batch's normaliser, of which a gang's rank has a share: its examples (the
        loss is a mean over them); SFT's is its tokens."""
        return float(len(ids))

    def evaluate(self) -> dict[str, float]:
        """The loss and statistics over val_batches batches of the valid rows, as val_<name>; with
        QAT through the fake-quantized weights (the loss of the model as it will be quantized)."""
        totals: dict[str, float] = {}
        batches = eval_batches(len(self.valid_rows), self.cfg.batch_size, self.cfg.val_batches)
        n = sum(len(ids) for ids in batches)
        loss_fn = qat_loss(self.loss, self.cfg.qat) if self.cfg.qat_enable else self.loss
        for ids in batches:
            arrays, _ = self.arrays(ids, self.valid_rows)
            loss, stats = loss_fn(self.module, *arrays)
            for k, v in {"loss": loss, **stats}.items():
                totals[k] = totals.get(k, 0.0) + float(v.item()) * len(ids) / n
        return {f"val_{k}": v for k, v in totals.items()}

    def save(self, out_dir: Path, config: dict) -> None:
        save_adapter(self.module, out_dir, config)

    def start_from(self, init: Path) -> None:
        """What the kind's module has beside the adapter, from the init_adapter's directory (the
        adapter itself is in place: attach_adapter). Nothing, but for a reward model's head."""


# --------------------------------------------------------------------------- preference pairs


def completion_rows(tokenizer, texts: list[tuple[str, str]], max_len: int) -> tuple[Rows, int]:
    """(prompt, completion) texts as token rows (worker/runtime/logprobs.py pair_tokens), cut to
    max_len, and how many rows were cut."""
    rows = [pair_tokens(tokenizer, prompt, completion) for prompt, completion in texts]
    return cut(Rows([t for t, _ in rows], [s for _, s in rows]), max_len)


def pair_rows(tokenizer, pairs: list[dict], max_len: int) -> tuple[Rows, Rows, int]:
    """Chosen rows and rejected rows (cut to max_len), and how many rows were cut."""
    chosen, n1 = completion_rows(tokenizer, [(p["prompt"], p["chosen"]) for p in pairs], max_len)
    rejected, n2 = completion_rows(tokenizer, [(p["prompt"], p["rejected"]) for p in pairs], max_len)
    return chosen, rejected, n1 + n2


class ReferenceLogps:
    """Each example's sequence log-probs under the reference policy (the base: the LoRA off),
    computed at the example's first use and kept, since the reference never changes. They go
    with the job's checkpoint (worker/runtime/checkpoints.py), so a resumed job neither recomputes
    them nor gets other numbers. One table per split: rows of `width` log-probs (a pair's
    chosen and rejected), NaN until computed. `what` names the values (DPO's sums; a
    checkpoint's tables of other values, IPO's per-token means before every loss type took
    sums, are computed again)."""

    def __init__(self, sizes: dict[str, int], width: int, what: str):
        self.tables = {split: np.full((n, width), np.nan, np.float32) for split, n in sizes.items()}
        self.what = what
        self.computed = 0  # examples computed by this process (tests count them)

    def get(self, split: str, ids: list[int], compute: Callable[[list[int]], mx.array]) -> mx.array:
        """The log-probs of examples `ids`, column by column ((width x len(ids),): all chosen,
        then all rejected); compute(missing) gives those of examples not seen yet, in that order."""
        table = self.tables[split]
        missing = sorted({i for i in ids if np.isnan(table[i, 0])})
        if missing:
            table[missing] = np.array(compute(missing)).reshape(table.shape[1], len(missing)).T
            self.computed += len(missing)
        return mx.array(table[ids].T.reshape(-1))

    def arrays(self) -> dict[str, mx.array]:
        """A copy, for a checkpoint."""
        return {f"{split}/{self.what}": mx.array(table) for split, table in self.tables.items()}

    def restore(self, arrays: dict[str, mx.array]) -> None:
        """A checkpoint's tables, where they fit this job's datasets (else they are computed again)."""
        for split, table in self.tables.items():
            saved = arrays.get(f"{split}/{self.what}")
            if saved is not None and saved.shape == table.shape:
                self.tables[split] = np.array(saved)


class PreferenceTrainer(Trainer):
    """Rows of pairs: a batch is its pairs' chosen rows, then their rejected rows."""

    def __init__(self, module, tokenizer, cfg, train: list[dict], valid: list[dict] | None):
        self.train_tok = pair_rows(tokenizer, train, cfg.max_seq_length)
        self.valid_tok = pair_rows(tokenizer, valid, cfg.max_seq_length) if valid else None
        self.truncated = self.train_tok[2] + (self.valid_tok[2] if self.valid_tok else 0)
        super().__init__(module, cfg, train, valid)

    def split(self, rows: list[dict]) -> str:
        return "train" if rows is self.train_rows else "valid"

    def padded(self, ids: list[int], rows: list[dict]):
        chosen, rejected, _ = self.train_tok if rows is self.train_rows else self.valid_tok
        return pad_rows(Rows([chosen.tokens[i] for i in ids] + [rejected.tokens[i] for i in ids],
                             [chosen.starts[i] for i in ids] + [rejected.starts[i] for i in ids]))


# --------------------------------------------------------------------------- the job


def load_datasets(r, spec, settings, tenant: str | None = None) -> tuple[list[dict], list[dict] | None]:
    """The training rows (or pairs) and the valid rows, if any (shared/datasets.py); a
    trainer's job (tenant) reads only that trainer's files."""
    train = getattr(spec, "preference_pairs", None)
    train = [p.model_dump() for p in train] if train else load_rows(r, spec.dataset, settings, spec.row_format, "dataset",
                                                                     tenant=tenant)
    valid = load_rows(r, spec.valid_dataset, settings, spec.row_format, "valid_dataset", split="valid", tenant=tenant)
    if valid is None and isinstance(spec.dataset, str):  # a data directory's valid.jsonl
        valid = load_rows(r, spec.dataset, settings, spec.row_format, "dataset", split="valid")
    return train, valid


@contextlib.contextmanager
def load(job, spec, settings, make_trainer: Callable, fine_tune_type: str = "lora",
         quantization: dict | None = None) -> Iterator[Run]:
    """The model and the datasets, the adapter attached, the trainer made: its Run. `full` and
    a quantized base (quantization: quantize_model's arguments) train a private copy of the
    model, which is left to go with the job; the shared model is left without the job's adapter."""
    cfg = spec.config
    t0 = time.perf_counter()
    private = fine_tune_type == "full" or quantization is not None
    if private:
        model, tokenizer, base_config, quantization = private_base(spec.model_id, settings, fine_tune_type, quantization)
        cached = False
    else:
        model, tokenizer, cached = get_model(spec.model_id, settings)
        base_config = quantization = None
    if not cached:  # a model loaded, or (private copy) the shared one dropped: the advertisement says so
        job.publish_loaded()
    try:
        train, valid = load_datasets(job.lease.r, spec, settings, job.tenant)
        init = init_adapter_dir(job.lease.r, settings, spec.init_adapter)
        job.write(event={"type": "model_ready", "cached": cached, "private_copy": private,
                         "load_s": time.perf_counter() - t0, "train_rows": len(train), "valid_rows": len(valid or []),
                         **started_from(spec)})
        mx.random.seed(cfg.seed)  # LoRA init
        attach_adapter(model, cfg, fine_tune_type, init)
        with gradient_checkpointing(model, planned_checkpointing(job, spec, model)):
            trainer = make_trainer(model, tokenizer, spec, train, valid)
            trainer.gang = job.gang
            if init is not None:
                trainer.start_from(init)
            if trainer.truncated:
                job.write(event={"type": "truncated", "rows": trainer.truncated, "max_seq_length": cfg.max_seq_length})

            def save(out_dir: Path) -> None:
                if fine_tune_type == "full":
                    save_full_model(model, tokenizer, base_config, out_dir, adapter_config(cfg, "full"))
                else:
                    trainer.save(out_dir, adapter_config(cfg, fine_tune_type, quantization))

            yield Run(
                module=trainer.module, optimizer=trainer.optimizer,
                step=lambda state, should_stop, on_finite_loss: (trainer.step(state, on_finite_loss), []),
                save=save, phase="updating", history_metrics=HISTORY_METRICS, steps_per_save=cfg.steps_per_save,
                steps_per_report=cfg.steps_per_report,
                evaluate=(lambda step: trainer.evaluate()) if valid and job.gang.rank == 0 else None,  # rank 0 reports it
                steps_per_eval=cfg.steps_per_eval,
                serves_scoring=not private,  # scoring requests use the shared copy: a private job leaves them to idle workers
                reference=trainer.reference,
            )
    finally:
        remove_adapter_layers(model)  # the process keeps a shared model for the next job


def planned_checkpointing(job, spec, model: nn.Module) -> bool:
    """gradient_checkpointing as the job asks, else where this worker's memory needs it
    (shared/memory_estimate.py supervised_checkpointing); a memory_plan event says why."""
    cfg = spec.config
    if cfg.gradient_checkpointing:
        return True
    step = step_of(spec)
    on, reason = supervised_checkpointing(model_shape(model), weights_bytes(model), step["rows"], step["width"],
                                          device_kind(), device_memory_bytes(), qat=step.get("qat", False),
                                          full_layers=step["full_layers"], optimizer_states=step["optimizer_states"])
    if on and cfg.lora_dropout > 0:
        on, reason = False, reason.replace("on:", "left off (lora_dropout > 0: recomputed layers would draw new masks):")
    if reason:
        job.write(event={"type": "memory_plan", "gradient_checkpointing": on, "reason": reason})
    return on


def save_full_model(model: nn.Module, tokenizer, config: dict, out_dir: Path, train_config: dict) -> None:
    """A complete mlx_lm model directory (`mlx_lm.load(dir)`): every weight (model.safetensors),
    the base's config.json and tokenizer; adapter_config.json records how it was trained."""
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "adapter_config.json").write_text(json.dumps(train_config, indent=2))
