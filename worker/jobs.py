"""The rq job function: one GRPO job from `queued` to `completed` / `failed` / `cancelled`.

rq calls `run_grpo_job` in the worker process's main thread (worker/rq_worker.py), the
thread that loaded the model and owns its MLX streams. The worker holds the job through a
lease (worker/lease.py): every write it makes is fenced, so a worker that lost the job
writes nothing more. Checkpoints go to Redis (worker/checkpoints.py), so any worker can
resume a job whose worker died; a job that finds a checkpoint resumes from it.
"""

import logging
import os
import threading
import time
import traceback
from pathlib import Path

import mlx.core as mx
from rq import get_current_job

from shared import jobstore
from shared.schemas import JobCreate, Progress
from shared.settings import Settings, load_settings
from worker import checkpoints
from worker.grpo import Cancelled, GRPOTrainer, NonFiniteLoss, TrainState
from worker.lease import Lease, LeaseLost, set_current
from worker.memory import MemoryEstimateError
from worker.models import ModelNotFound, attach_lora, get_model, save_adapter
from worker.rewards import RewardError, build_scorer

log = logging.getLogger(__name__)
USER_ERRORS = (ModelNotFound, RewardError, NonFiniteLoss, MemoryEstimateError)  # the message says it all; no traceback


def run_grpo_job(job_id: str) -> str:
    rq_job = get_current_job()
    r = rq_job.connection
    worker_name = rq_job.worker_name or f"pid-{os.getpid()}"
    spec = jobstore.get_spec(r, job_id)
    if spec is None:
        return "deleted"
    lease = Lease.acquire(r, job_id, worker_name)
    if lease is None:
        return f"not started: job is {jobstore.get_status(r, job_id)}"
    set_current(lease)
    try:
        lease.write(event={
            "type": "started",
            "worker": worker_name,
            "pid": os.getpid(),
            "main_thread": threading.current_thread() is threading.main_thread(),
        })
        return run_with_lease(lease, spec, load_settings())
    except LeaseLost as e:
        log.warning("%s; leaving the job to its new owner", e)
        return "lease lost"
    finally:
        set_current(None)


def run_with_lease(lease: Lease, spec: JobCreate, settings: Settings) -> str:
    try:
        adapter_path = train(lease, spec, settings)
    except Cancelled:
        if lease.hand_back_requested.is_set():
            lease.hand_back()
            return "handed back"
        lease.finish("cancelled", {"type": "cancelled"})
        return "cancelled"
    except LeaseLost:
        raise
    except USER_ERRORS as e:
        lease.finish("failed", {"type": "failed", "error": str(e)}, error=str(e))
        return "failed"
    except Exception as e:
        log.error("job %s failed:\n%s", lease.job_id, traceback.format_exc())
        error = f"{type(e).__name__}: {e}"
        lease.finish("failed", {"type": "failed", "error": error}, error=error)
        return "failed"
    lease.finish("completed", {"type": "done", "adapter_path": str(adapter_path)}, adapter_path=str(adapter_path))
    return "completed"


def train(lease: Lease, spec: JobCreate, settings: Settings) -> Path:
    cfg = spec.config
    t0 = time.perf_counter()
    model, tokenizer, cached = get_model(spec.model_id, settings)
    lease.write(event={"type": "model_ready", "cached": cached, "load_s": time.perf_counter() - t0})
    with build_scorer(spec, lease.job_id) as scorer:
        mx.random.seed(cfg.seed)  # LoRA init and dropout
        attach_lora(model, cfg)
        trainer = GRPOTrainer(model, tokenizer, spec, scorer)
        state = TrainState()
        saved = lease.load_checkpoint()
        if saved:
            state = checkpoints.restore(model, trainer.optimizer, saved)
            lease.write(event={"type": "resumed", "from_step": state.step}, resumed_from=state.step)
            log.info("job %s: resumed from the checkpoint of step %d", lease.job_id, state.step)

        saver = CheckpointSaver(lease, cfg.checkpoint_every, cfg.checkpoint_interval_s, start_step=state.step)
        try:
            while state.step < cfg.iters:
                if lease.should_stop():
                    raise Cancelled()
                metrics, samples = trainer.step(state, lease.should_stop, on_finite_loss=saver.flush)
                progress = Progress(iter=state.step, total_iters=cfg.iters, **metrics)
                lease.write(event={"type": "grpo_step", "worker": lease.worker, **progress.model_dump()}, progress=progress)
                lease.write(event={"type": "samples", "iter": state.step, **samples})
                saver.maybe_snapshot(model, trainer.optimizer, state)
                log.info("job %s step %d/%d loss %.4f reward %.4f (%.2fs)", lease.job_id, state.step, cfg.iters,
                         metrics["loss"], metrics["reward"], metrics["step_time"])
        except Cancelled:
            if lease.hand_back_requested.is_set():  # the worker is shutting down: keep what was done
                saver.save_now(model, trainer.optimizer, state)
            raise

    out = save_adapter(model, cfg, adapter_dir(settings, spec.model_id, spec.adapter_name or lease.job_id))
    # A copy in Redis, so the adapter is not only on this worker's disk.
    lease.save_adapter({f.name: f.read_bytes() for f in out.iterdir() if f.is_file()})
    return out


class CheckpointSaver:
    """Writes a checkpoint only once its weights are known to be good.

    A snapshot is taken after a step (every `every` steps, or `interval_s` seconds) but
    written to Redis only when the next step has computed a finite loss and gradient with
    those weights (the trainer's on_finite_loss). So after a non-finite loss the last
    checkpoint is always one that trains, and `resume` continues from it.
    """

    def __init__(self, lease: Lease, every: int, interval_s: float, start_step: int):
        self.lease, self.every, self.interval_s = lease, every, interval_s
        self.pending: dict | None = None
        self.last_step = start_step  # of the last snapshot
        self.last_written = start_step  # of the last checkpoint in Redis
        self.last_time = time.monotonic()

    def maybe_snapshot(self, model, optimizer, state: TrainState) -> None:
        due = state.step - self.last_step >= self.every or time.monotonic() - self.last_time >= self.interval_s
        if due:
            self.pending = checkpoints.snapshot(model, optimizer, state)
            self.last_step, self.last_time = state.step, time.monotonic()

    def save_now(self, model, optimizer, state: TrainState) -> None:
        """Checkpoint the weights as they are (the worker is shutting down), unless they are
        not finite: then the last good checkpoint stays."""
        snap = checkpoints.snapshot(model, optimizer, state)
        if state.step > self.last_written and checkpoints.all_finite(snap):
            self.pending = snap
            self.flush()

    def flush(self) -> None:
        if self.pending is not None:
            step = self.pending["state"].step
            self.lease.save_checkpoint(step, checkpoints.to_blobs(self.pending))
            self.last_written = step
            self.lease.write(event={"type": "checkpoint", "step": step})
            self.pending = None


def adapter_dir(settings: Settings, model_id: str, adapter_name: str) -> Path:
    """$MTQ_HOME/adapters/<model_id>/<adapter_name>; a local model path contributes its directory name."""
    model_part = Path(model_id).name if Path(model_id).expanduser().exists() else model_id
    return settings.adapters_dir / model_part / adapter_name
