"""The GRPO job kind: the shared model with a fresh LoRA (or the adapter its init_adapter
names), the job's reward sources, and the trainer (worker/kinds/grpo.py, where the math is), as
the Run the job loop drives (worker/runtime/job_loop.py). What is GRPO's own around the steps:
the reward scorer (closed with the job), progress marks and /metrics timings around scoring,
a `samples` event per step, and the evaluations on its validation_prompts (`eval` events)."""

import contextlib
import functools
import json
import time
from typing import Iterator

import mlx.core as mx

from shared.adapters import init_adapter_dir
from shared.metrics import recorder
from shared.schemas import JobCreate
from worker.agentic.answering import Answerer
from worker.agentic.environment import Environment
from worker.agentic.tools import Toolbox
from worker.kinds.grpo import HISTORY_METRICS, GRPOTrainer
from worker.rewards.scorer import build_scorer
from worker.runtime import score_requests
from worker.runtime.adapter_layers import adapter_config, attach_adapter, remove_adapter_layers, save_adapter, started_from
from worker.runtime.models import get_model
from worker.runtime.train_core import Run


@contextlib.contextmanager
def load(job, spec: JobCreate, settings, trainer_class: type[GRPOTrainer] = GRPOTrainer) -> Iterator[Run]:
    """trainer_class: GRPO's, or that of a kind built on its phases (rloo.py, reinforce.py,
    online_dpo.py)."""
    cfg = spec.config
    t0 = time.perf_counter()
    model, tokenizer, cached = get_model(spec.model_id, settings)
    if not cached:
        job.publish_loaded()
    init = init_adapter_dir(job.lease.r, settings, spec.init_adapter)
    job.write(event={"type": "model_ready", "cached": cached, "load_s": time.perf_counter() - t0, **started_from(spec)})
    reward_model = functools.partial(score_requests.reward_model_rewards, tenant=job.tenant)  # its owner's reward models
    waiting = functools.partial(job.serving_while, spec.model_id)  # answers scoring requests while a reward server waits
    with build_scorer(spec, job.job_id, reward_model=reward_model, waiting=waiting) as scorer, \
            answerer(spec, settings, tokenizer) as answers:
        mx.random.seed(cfg.seed)  # LoRA init and dropout
        attach_adapter(model, cfg, init=init)
        try:
            trainer = trainer_class(model, tokenizer, spec, MarkedScorer(scorer, job), job.gang, answers)
            job.write(memory_plan=json.dumps(trainer.memory.as_record()))  # GET on the job shows it
            step, evaluate = sampling_calls(trainer, job)

            # On a gang rank 0 evaluates alone, as the supervised kinds do; the others wait for it
            # in the next step's first sum across ranks.
            yield Run(module=model, optimizer=trainer.optimizer, step=step,
                      save=lambda out_dir: save_adapter(model, out_dir, adapter_config(cfg)), phase="sampling",
                      history_metrics=HISTORY_METRICS, steps_per_save=cfg.checkpoint_every,
                      evaluate=evaluate if spec.validation_prompts and job.gang.rank == 0 else None,
                      steps_per_eval=cfg.eval_interval)
        finally:
            remove_adapter_layers(model)  # the process keeps the model for the next job


def sampling_calls(trainer: GRPOTrainer, job):
    """The Run's step and evaluate of a kind that samples (GRPO's and those built on it, PPO's):
    each step's time and tokens/s to /metrics and its samples as an event; evaluation marked."""
    def step(state, should_stop, on_finite_loss):
        metrics, samples = trainer.step(state, should_stop, on_finite_loss)
        recorder.observe("mtq_step_seconds", metrics["step_time"])
        recorder.observe("mtq_tokens_per_second", metrics["tokens_per_second"])
        return metrics, [{"type": "samples", **samples}]

    def evaluate(steps_done):
        job.mark("sampling")
        return trainer.evaluate(steps_done, job.should_stop)
    return step, evaluate


@contextlib.contextmanager
def answerer(spec: JobCreate, settings, tokenizer) -> Iterator[Answerer | None]:
    """A multi-turn job's tools and environment (None for a job of one turn), closed with the job."""
    if not spec.multi_turn:
        yield None
        return
    toolbox = environment = None
    try:
        toolbox = Toolbox(spec.tools, settings, spec.config, tokenizer) if spec.tools else None
        environment = Environment(spec.environment, settings, spec.config) if spec.environment else None
        answers = Answerer(tokenizer, spec.config, toolbox, environment)
    except BaseException:
        for part in (toolbox, environment):
            if part is not None:
                part.close()
        raise
    try:
        yield answers
    finally:
        answers.close()


class MarkedScorer:
    """The job's reward scorer, leaving progress marks around each call (a reward call that
    never returns shows up as a stall in phase 'scoring'), timed for /metrics."""

    def __init__(self, scorer, job):
        self.scorer, self.job = scorer, job

    def score(self, *args, **kwargs):
        self.job.mark("scoring")
        t0 = time.perf_counter()
        try:
            return self.scorer.score(*args, **kwargs)
        finally:
            recorder.observe("mtq_scoring_seconds", time.perf_counter() - t0)
            self.job.mark("updating")
