"""A worker's models warmed up before its first job. MLX compiles its kernels on first use,
which makes a fresh machine's first step slow (docs/performance.md, "The first step and the
kernel cache"), so a training process that finds its kernel cache empty
(worker/supervisor/kernel_cache.py) runs throwaway GRPO steps of each model its worker offers
(`mtq worker --models`) while no job waits. The step decodes, scores, and takes the loss and an
update with a fresh LoRA of a job's defaults, as a job's first step does, on a small batch:
MLX's kernels depend on the ops and dtypes, not on the batch's size, the LoRA rank or a job's
numbers (worker/runtime/scalars.py), so a job's first step then finds them in the cache. They do
depend on which blocks have LoRA, so it takes one such step per LoRA layout (lora_layouts). The
model stays loaded for the jobs.
"""

import logging
import time
from typing import Callable

import mlx.core as mx

from shared.schemas import GRPOConfig, JobCreate
from shared.settings import Settings
from worker.kinds.grpo import GRPOTrainer
from worker.rewards.scorer import build_scorer
from worker.runtime.adapter_layers import attach_adapter, remove_adapter_layers
from worker.runtime.gang_group import SOLO
from worker.runtime.models import get_model
from worker.runtime.train_core import TrainState

log = logging.getLogger(__name__)

# Two of each so that no axis has size 1 (MLX compiles another kernel for a broadcast one).
PROMPTS = ["Warm up, first prompt.", "Warm up, the second prompt."]
CONFIG = {"group_size": 2, "batch_size": 2, "max_completion_len": 8, "iters": 1}


def warm_up(model_id: str, settings: Settings, should_stop: Callable[[], bool]) -> float:
    """A GRPO step of the model per LoRA layout, discarded (the model keeps no adapter); the seconds."""
    t0 = time.perf_counter()
    model, tokenizer, _ = get_model(model_id, settings)
    for layers in lora_layouts(len(model.layers)):
        spec = JobCreate.model_validate({"model_id": model_id, "prompts": PROMPTS,
                                         "config": {**CONFIG, "lora_layers": layers}})
        mx.random.seed(0)
        attach_adapter(model, spec.config)
        try:
            with build_scorer(spec, "warm-up") as scorer:
                GRPOTrainer(model, tokenizer, spec, scorer, SOLO).step(TrainState(), should_stop)
        finally:
            remove_adapter_layers(model)
    return time.perf_counter() - t0


def lora_layouts(blocks: int) -> list[int]:
    """The warm-up steps' lora_layers: all but the first block (at most a job's default), the last
    block alone, and all. Blocks without LoRA run their forward without gradients, and a LoRA
    block's backward differs with where its input comes from (the embedding, a block with or
    without LoRA): other fused kernels, which a job of another layout would compile. The steps
    after the first compile only those (tests/test_phases.py)."""
    if blocks < 2:
        return [-1]
    return list(dict.fromkeys([min(GRPOConfig.model_fields["lora_layers"].default, blocks - 1), 1, -1]))


def warm_up_all(model_ids: list[str], settings: Settings, job_waiting: Callable[[], bool],
                mark: Callable[[], None]) -> None:
    """warm_up each model in turn until a job waits (it compiles what it needs itself). A model
    that fails to load or step is logged and skipped: its jobs fail with the reason."""
    for model_id in model_ids:
        if job_waiting():
            return
        try:
            seconds = warm_up(model_id, settings, should_stop=lambda: mark() or False)
            log.info("warmed up %s in %.1f s (MLX's kernels compiled into the cache)", model_id, seconds)
        except Exception:
            log.exception("warming up %s failed", model_id)
