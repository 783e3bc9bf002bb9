"""The rq job function: one GRPO job from `queued` to `completed` / `failed` / `cancelled`.

rq calls `run_grpo_job` in the worker process's main thread (worker/rq_worker.py), the
thread that loaded the model and owns its MLX streams. Every state change goes through
shared.jobstore, so the API sees progress as it happens.
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
from shared.keys import adapter_key
from shared.schemas import JobCreate, Progress
from shared.settings import Settings, load_settings
from worker.grpo import Cancelled, GRPOTrainer, NonFiniteLoss, TrainState
from worker.models import ModelNotFound, attach_lora, get_model, save_adapter
from worker.rewards import RewardError, build_scorer

log = logging.getLogger(__name__)
USER_ERRORS = (ModelNotFound, RewardError, NonFiniteLoss)  # the message says it all; no traceback


def run_grpo_job(job_id: str) -> str:
    rq_job = get_current_job()
    r = rq_job.connection
    settings = load_settings()
    spec = jobstore.get_spec(r, job_id)
    if spec is None:
        return "deleted"
    started = jobstore.transition(
        r, job_id, ["queued"], status="running", started_at=time.time(), worker=rq_job.worker_name or "", error=None
    )
    if not started:
        return f"not started: job is {jobstore.get_status(r, job_id)}"
    jobstore.append_event(r, job_id, {
        "type": "started",
        "worker": rq_job.worker_name,
        "pid": os.getpid(),
        "main_thread": threading.current_thread() is threading.main_thread(),
    })
    try:
        adapter_path = train(r, job_id, spec, settings)
    except Cancelled:
        finish(r, job_id, "cancelled")
        return "cancelled"
    except USER_ERRORS as e:
        finish(r, job_id, "failed", error=str(e))
        return "failed"
    except Exception as e:
        log.error("job %s failed:\n%s", job_id, traceback.format_exc())
        finish(r, job_id, "failed", error=f"{type(e).__name__}: {e}")
        return "failed"
    finish(r, job_id, "completed", adapter_path=str(adapter_path))
    return "completed"


def train(r, job_id: str, spec: JobCreate, settings: Settings) -> Path:
    cfg = spec.config
    model, tokenizer = get_model(spec.model_id, settings)
    with build_scorer(spec, job_id) as scorer:
        mx.random.seed(cfg.seed)  # LoRA init and dropout
        attach_lora(model, cfg)
        trainer = GRPOTrainer(model, tokenizer, spec, scorer)
        state = TrainState()

        def should_stop() -> bool:
            return jobstore.cancel_requested(r, job_id)

        while state.step < cfg.iters:
            if should_stop():
                raise Cancelled()
            metrics = trainer.step(state, should_stop)
            progress = Progress(iter=state.step, total_iters=cfg.iters, **metrics)
            jobstore.transition(r, job_id, ["running"], progress=progress)
            jobstore.append_event(r, job_id, {"type": "grpo_step", **progress.model_dump()})
            log.info("job %s step %d/%d loss %.4f reward %.4f (%.2fs)", job_id, state.step, cfg.iters,
                     metrics["loss"], metrics["reward"], metrics["step_time"])

    out = save_adapter(model, cfg, adapter_dir(settings, spec.model_id, spec.adapter_name or job_id))
    # A copy in Redis, so the adapter is not only on this worker's disk.
    r.hset(adapter_key(job_id), mapping={f.name: f.read_bytes() for f in out.iterdir() if f.is_file()})
    return out


def adapter_dir(settings: Settings, model_id: str, adapter_name: str) -> Path:
    """$MTQ_HOME/adapters/<model_id>/<adapter_name>; a local model path contributes its directory name."""
    model_part = Path(model_id).name if Path(model_id).expanduser().exists() else model_id
    return settings.adapters_dir / model_part / adapter_name


def finish(r, job_id: str, status: str, error: str | None = None, adapter_path: str | None = None) -> None:
    fields = {"status": status, "finished_at": time.time(), "error": error}
    if adapter_path:
        fields["adapter_path"] = adapter_path
    if jobstore.transition(r, job_id, ["running"], **fields):
        event = {"done": {"type": "done", "adapter_path": adapter_path},
                 "failed": {"type": "failed", "error": error},
                 "cancelled": {"type": "cancelled"}}[{"completed": "done"}.get(status, status)]
        jobstore.append_event(r, job_id, event)
