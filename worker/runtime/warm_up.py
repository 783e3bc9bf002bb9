"""A worker's models warmed up before its first job. MLX compiles its kernels on first use, which
makes a fresh machine's first step slow (docs/performance.md, "The first step and the kernel
cache"), so a training process that finds its kernel cache empty
(worker/supervisor/kernel_cache.py) runs throwaway GRPO steps of each model its worker offers (`mtq
worker --models`) while no job waits. The step decodes, scores, and takes the loss and an update
with a fresh LoRA of a job's defaults, as a job's first step does, on a small batch: MLX's kernels
depend on the ops and dtypes, not on the batch's size, the LoRA rank or a job's numbers
(worker/runtime/scalars.py), so a job's first step then finds them in the cache. They do depend on
which blocks have LoRA, so it takes one such step per LoRA layout (lora_layouts), and on an axis of
size 1 (a batch of one row); then an RLOO step (its loss, which REINFORCE's shares, and the
reference pass of its default beta), the supervised kinds' steps (SUPERVISED), whose losses
are kernels of their own, and steps with the options most jobs that set one set (OPTIONS).
A job that arrives stops the warm-up between two steps. The model stays loaded for the jobs.
"""

import logging
import time
from typing import Callable

import mlx.core as mx

from shared.kinds import KINDS
from shared.schemas import GRPOConfig
from shared.settings import Settings
from worker.kinds.cpo_job import CPOTrainer
from worker.kinds.dpo_job import DPOTrainer
from worker.kinds.grpo import GRPOTrainer
from worker.kinds.kto_job import KTOTrainer
from worker.kinds.reward_model_job import RewardTrainer
from worker.kinds.rloo import RLOOTrainer
from worker.kinds.sft_job import SFTTrainer
from worker.rewards.scorer import build_scorer
from worker.runtime.adapter_layers import attach_adapter, remove_adapter_layers
from worker.runtime.gang_group import SOLO
from worker.runtime.models import get_model
from worker.runtime.train_core import TrainState

log = logging.getLogger(__name__)

# Two of each so that no axis has size 1 (MLX compiles another kernel for a broadcast one: a supervised step of
# one row has its own, SUPERVISED_STEPS).
PROMPTS = ["Warm up, first prompt.", "Warm up, the second prompt."]
CONFIG = {"group_size": 2, "batch_size": 2, "max_completion_len": 8, "iters": 1}
TEXT = [f"Warm up, row {i}: a few words to train on." for i in range(2)]
PAIRS = [{"prompt": p, "chosen": "Yes, gladly.", "rejected": "No."} for p in TEXT]
# The supervised kinds' trainers and rows, and their steps after GRPO's: SFT's per LoRA layout (the steps' own
# backward kernels), then each kind's loss at its default layout, on two rows (pairs) and on one.
SUPERVISED = {
    "sft": (SFTTrainer, [{"text": t} for t in TEXT]),
    "dpo": (DPOTrainer, PAIRS),
    "orpo": (DPOTrainer, PAIRS),
    "kto": (KTOTrainer, [{"prompt": p, "completion": "Yes.", "label": i == 0} for i, p in enumerate(TEXT)]),
    "cpo": (CPOTrainer, PAIRS),
    "reward": (RewardTrainer, PAIRS),
}
SUPERVISED_STEPS = [("sft", {"batch_size": 1}), ("kto", {})]  # KTO takes two rows at least
SUPERVISED_STEPS += [(kind, batch) for kind in ("dpo", "orpo", "cpo", "reward") for batch in ({}, {"batch_size": 1})]
# The policy-gradient kinds' trainers: GRPO's steps per LoRA layout, then RLOO's at its defaults.
POLICY = {"grpo": GRPOTrainer, "rloo": RLOOTrainer}
# Last, common options that are kernels of their own (bench/warm_options.py; on a CPU after the steps above, `tiny`:
# GRPO's KL term 3 and a top-p filter 3, in two compiled functions, so one step serves either alone; a loss
# micro-batch of one row 8, which a tight memory plan picks; SFT's gradient accumulation 5 in a step of 3
# micro-batches, which holds those of any other count), at the first LoRA layout (a job's default one on a model of
# more blocks).
OPTIONS = [("grpo", {"beta": 0.04, "top_p": 0.9}), ("grpo", {"micro_batch_size": 1}),
           ("sft", {"grad_accumulation_steps": 3})]


def warm_up(model_id: str, settings: Settings, should_stop: Callable[[], bool],
            job_waiting: Callable[[], bool]) -> float:
    """A GRPO and an SFT step of the model per LoRA layout, then an RLOO step, SUPERVISED_STEPS and
    OPTIONS, all discarded (the model keeps no adapter), until a job waits; the seconds."""
    t0 = time.perf_counter()
    model, tokenizer, _ = get_model(model_id, settings)
    layouts = [{"lora_layers": layers} for layers in lora_layouts(len(model.layers))]
    steps = [(kind, layout) for kind in ("grpo", "sft") for layout in layouts] + [("rloo", {})] + SUPERVISED_STEPS
    steps += [(kind, {**layouts[0], **options}) for kind, options in OPTIONS]
    for kind, config in steps:
        if job_waiting():
            break
        mx.random.seed(0)
        if kind in POLICY:
            spec = KINDS[kind].spec_model.model_validate({"model_id": model_id, "prompts": PROMPTS,
                                                          "config": {**CONFIG, **config}})
        else:
            trainer, rows = SUPERVISED[kind]
            spec = KINDS[kind].spec_model.model_validate({"model_id": model_id, "dataset": rows,
                                                          "config": {"batch_size": 2, "iters": 1, **config}})
        attach_adapter(model, spec.config)
        try:
            if kind in POLICY:
                with build_scorer(spec, "warm-up") as scorer:
                    POLICY[kind](model, tokenizer, spec, scorer, SOLO).step(TrainState(), should_stop)
            else:
                trainer(model, tokenizer, spec, rows, None).step(TrainState())
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
            seconds = warm_up(model_id, settings, should_stop=lambda: mark() or False, job_waiting=job_waiting)
            log.info("warmed up %s in %.1f s (MLX's kernels compiled into the cache)", model_id, seconds)
        except Exception:
            log.exception("warming up %s failed", model_id)
