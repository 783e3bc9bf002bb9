"""The GRPO job kind: load the model, attach a LoRA, run the steps, checkpoint, write the adapter.

Runs in the training process (worker/training_process.py), on its main thread. The math is
in worker/grpo.py; this module is the job around it: progress and sample events, checkpoints
in Redis that any worker resumes from, and the adapter committed through the job's lease.
"""

import logging
import time

import mlx.core as mx

from shared.adapters import adapter_dir
from shared.metrics import recorder
from shared.schemas import JobCreate, Progress
from shared.settings import load_settings
from worker import checkpoints
from worker.grpo import Cancelled, GRPOTrainer, NonFiniteLoss, TrainState
from worker.memory import MemoryEstimateError
from worker.models import ModelNotFound, attach_lora, get_model, loaded_model_ids, save_adapter
from worker.rewards import RewardError, build_scorer
from worker.training_process import JobRun

log = logging.getLogger(__name__)
USER_ERRORS = (ModelNotFound, RewardError, NonFiniteLoss, MemoryEstimateError, checkpoints.CheckpointMismatch)


def run(job: JobRun, spec_json: str) -> dict:
    spec = JobCreate.model_validate_json(spec_json)
    settings = load_settings()
    cfg = spec.config
    t0 = time.perf_counter()
    job.mark("loading_model")
    model, tokenizer, cached = get_model(spec.model_id, settings)
    if not cached:
        job.publish_loaded(loaded_model_ids())
    job.write(event={"type": "model_ready", "cached": cached, "load_s": time.perf_counter() - t0})
    with build_scorer(spec, job.job_id) as scorer:
        mx.random.seed(cfg.seed)  # LoRA init and dropout
        attach_lora(model, cfg)
        trainer = GRPOTrainer(model, tokenizer, spec, MarkedScorer(scorer, job))
        state = TrainState()
        saved = job.load_checkpoint()
        if saved:
            state = checkpoints.restore(model, trainer.optimizer, saved)
            job.write(event={"type": "resumed", "from_step": state.step}, resumed_from=state.step)
            log.info("job %s: resumed from the checkpoint of step %d", job.job_id, state.step)

        saver = checkpoints.CheckpointSaver(job, cfg.checkpoint_every, cfg.checkpoint_interval_s, start_step=state.step)
        try:
            while state.step < cfg.iters:
                if job.should_stop():
                    raise Cancelled()
                job.mark("sampling")
                metrics, samples = trainer.step(state, job.should_stop, on_finite_loss=saver.flush)
                job.step_done()
                # As the seed server: progress.iter counts completed steps, events carry the
                # 0-based index of the step they report.
                progress = Progress(iter=state.step, total_iters=cfg.iters, **metrics)
                step_index = state.step - 1
                job.write(event={**progress.model_dump(exclude_none=True), "type": "grpo_step", "iter": step_index,
                                 "worker": job.lease.worker}, progress=progress)
                job.write_kept({"type": "samples", "iter": step_index, **samples}, settings.samples_events_kept)
                recorder.observe("mtq_step_seconds", metrics["step_time"])
                recorder.observe("mtq_tokens_per_second", metrics["tokens_per_second"])
                recorder.flush(job.lease.r)
                saver.maybe_snapshot(model, trainer.optimizer, state)
                job.between_steps(spec.model_id)
                log.info("job %s step %d/%d loss %.4f reward %.4f (%.2fs)", job.job_id, state.step, cfg.iters,
                         metrics["loss"], metrics["reward"], metrics["step_time"])
        except Cancelled:
            if job.marks.hand_back_requested:  # the worker is shutting down: keep what was done
                saver.save_now(model, trainer.optimizer, state)
            raise

    out = adapter_dir(settings, spec.model_id, spec.adapter_name or job.job_id)
    job.commit_adapter(out, lambda d: save_adapter(model, cfg, d))
    # The history holds the last steps, one entry each (a resumed run restored the earlier ones).
    kept = state.history[-checkpoints.HISTORY_KEPT:]
    first = state.step - len(kept) + 1
    return {"adapter_path": str(out), "adapter": (spec.model_id, spec.adapter_name),
            "history": [{"step": first + i, **h} for i, h in enumerate(kept)]}


class MarkedScorer:
    """The job's reward scorer, leaving progress marks around each call (a reward call that
    never returns shows up as a stall in phase 'scoring'), timed for /metrics."""

    def __init__(self, scorer, job: JobRun):
        self.scorer, self.job = scorer, job

    def score(self, *args, **kwargs):
        self.job.mark("scoring")
        t0 = time.perf_counter()
        try:
            return self.scorer.score(*args, **kwargs)
        finally:
            recorder.observe("mtq_scoring_seconds", time.perf_counter() - t0)
            self.job.mark("updating")
