"""The job loop: one for every kind (shared/kinds.py), as mlx_lm's tuner/trainer.py `train` is
one for SFT and DPO with an injected loss and batch iterator.

A kind's worker module has `load(job, spec, settings)`: a context manager that loads the model
and the data, attaches the adapter, writes the `model_ready` event and yields the kind's Run
(worker/runtime/train_core.py: its step, its artefact, its intervals); on exit it undoes what it
did. The loop does the rest, the same for every kind:

    resume from the job's checkpoint in Redis, if it has one (any worker resumes any job)
    until `iters` steps are done:
        a cancel or hand-back stops the job before the step (and inside it: should_stop)
        one optimizer step: its metrics, and events to keep (GRPO's samples)
        evaluate on the valid rows or prompts (first, every steps_per_eval, last)
        progress every step; a step event every steps_per_report (and at the last); with the
        metrics under the seed server's names too (the kind's seed_aliases), and for SFT
        mlx_lm's reports (worker/runtime/reports.py)
        a checkpoint every steps_per_save steps or checkpoint_interval_s, written once the
        next step found its weights good (worker/runtime/checkpoints.py CheckpointSaver)
        answer log-prob requests waiting for this model (worker/runtime/score_requests.py)
    commit the artefact through the job's lease, and return the completed record's fields

A hand-back (the worker shutting down) checkpoints what was done first.

USER_ERRORS are failures whose message is the whole story: the job fails with it, no traceback.
"""

import logging
import time
from typing import Callable

import mlx.core as mx

from shared.adapters import AdapterFileError, adapter_dir
from shared.datasets import DatasetError
from shared.kinds import Kind
from shared.metrics import recorder
from shared.settings import Settings, load_settings
from worker.agentic.episode import EpisodeFailed
from worker.rewards.batch import RewardError
from worker.runtime import checkpoints
from worker.runtime.adapter_layers import AdapterMismatch
from worker.runtime.memory_plan import MemoryEstimateError
from worker.runtime.models import ModelNotFound, UnsupportedBase
from worker.runtime.reports import Reports, completed_event
from worker.runtime.train_core import Cancelled, NonFiniteLoss, Run, TrainState

log = logging.getLogger(__name__)
USER_ERRORS = (ModelNotFound, UnsupportedBase, DatasetError, RewardError, NonFiniteLoss, MemoryEstimateError,
               checkpoints.CheckpointMismatch, AdapterFileError, AdapterMismatch, EpisodeFailed)


def run(job, kind: Kind, spec, load: Callable) -> dict:
    """Run the job (`job`: worker/runtime/training_process.py JobRun) of `kind` to its end; the fields of
    its completed record (adapter_path, history...). Raises Cancelled when it was cancelled or
    handed back, and the kind's failures."""
    settings = load_settings()
    job.mark("loading_model")
    with load(job, spec, settings) as kind_run:
        fields = train(job, kind, spec, kind_run, settings)
        del kind_run  # a private copy of the model goes with the load's context, below
    mx.clear_cache()  # the job's buffers go back now, not when the next job allocates
    return fields


def train(job, kind: Kind, spec, run: Run, settings: Settings) -> dict:
    cfg = spec.config
    state = TrainState()
    saved = job.load_checkpoint()
    if saved:
        state = checkpoints.restore(run.module, run.optimizer, saved, run.reference)
        job.write(event={"type": "resumed", "from_step": state.step}, resumed_from=state.step)
        log.info("job %s: resumed from the checkpoint of step %d", job.job_id, state.step)
    saver = checkpoints.CheckpointSaver(job, run.steps_per_save, cfg.checkpoint_interval_s, start_step=state.step)
    reports = Reports(state.num_tokens) if kind.mlx_reports else None
    if run.evaluate and state.step == 0:  # before training, as mlx_lm reports it
        evaluate(job, run, state.step, reports)
    try:
        while state.step < cfg.iters:
            if job.stop_before_step():
                raise Cancelled()
            job.mark(run.phase)
            metrics, kept = run.step(state, job.should_stop, saver.flush)
            job.step_done()
            last = state.step == cfg.iters
            if run.evaluate and (state.step == 1 or state.step % run.steps_per_eval == 0 or last):
                metrics.update(evaluate(job, run, state.step, reports))
            report(job, kind, state, cfg.iters, metrics, state.step % run.steps_per_report == 0 or last, reports)
            step_index = state.step - 1 + kind.first_step
            for event in kept:
                job.write_kept({**event, "iter": step_index}, settings.samples_events_kept)
            recorder.flush(job.lease.r)
            state.history.append({k: metrics[k] for k in run.history_metrics})
            saver.maybe_snapshot(run.module, run.optimizer, state, run.reference)
            if run.serves_scoring:
                job.between_steps(spec.model_id)
            log.info("job %s step %d/%d loss %.4f (%.2fs)", job.job_id, state.step, cfg.iters, metrics["loss"],
                     metrics["step_time"])
    except Cancelled:
        if job.handing_back:  # a worker (of its gang) is shutting down: keep what was done
            saver.save_now(run.module, run.optimizer, state, run.reference)
        raise

    out = adapter_dir(settings, spec.model_id, spec.adapter_name or job.job_id)
    job.commit_adapter(out, run.save)
    # The history holds the last steps, one entry each (a resumed run restored the earlier ones).
    kept_history = state.history[-checkpoints.HISTORY_KEPT:]
    first = state.step - len(kept_history) + 1
    return {"adapter_path": str(out), "adapter": (spec.model_id, spec.adapter_name),
            "history": [{"step": first + i, **h} for i, h in enumerate(kept_history)],
            "events": [completed_event(out)] if reports else []}


def evaluate(job, run: Run, step: int, reports: Reports | None) -> dict:
    """The validation metrics after `step` steps, and their `eval` event (mlx_lm's reports: a `val_loss` one too)."""
    job.mark("scoring")
    t0 = time.perf_counter()
    evaluation = run.evaluate(step)
    job.write(event={"type": "eval", "iter": step, **evaluation})
    if reports is not None:
        job.write(event=reports.val_loss_event(step, evaluation["val_loss"], time.perf_counter() - t0))
    return evaluation


def report(job, kind: Kind, state: TrainState, iters: int, metrics: dict, reported: bool, reports: Reports | None) -> None:
    """The job's progress (completed steps, as the seed server's `progress.iter`, with the
    kind's metrics under the seed's names too), and on a reported step its step event, whose
    `iter` counts from the kind's first_step, and mlx_lm's report."""
    progress = {"iter": state.step, "total_iters": iters, **metrics, **{seed: metrics[ours] for seed, ours in kind.seed_aliases}}
    event = {"type": kind.step_event, "worker": job.lease.worker, **progress,
             "iter": state.step - 1 + kind.first_step} if reported else None
    if reports is not None:
        progress.update(reports.progress(state.step, iters, metrics))
    job.write(event=event, progress=progress)
    if reported and reports is not None:
        job.write(event=reports.train_loss_event(progress))
