"""The reward-model job kind: a scalar value head on the base model + LoRA, trained on
preference pairs with the Bradley-Terry loss (TRL's RewardTrainer).

    r(x, y) = w . h_last(x, y) + b       h_last: the final hidden state (after the model's
                                         last norm) at the row's last token (EOS)
    loss    = -mean log sigma(r(x, y_w) - r(x, y_l))
    accuracy = mean[r(x, y_w) > r(x, y_l)],  margin = mean[r(x, y_w) - r(x, y_l)]

The adapter directory holds mlx_lm's adapter files plus `value_head.safetensors`; reward
scoring (POST /admin/api/fine-tune/reward/score, worker/scoring.py) and GRPO's
`reward_model` reward source (worker/rewards.py) both load it with `load_head` and score
with `score_completions`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from shared.train_specs import RewardJobCreate
from worker import supervised
from worker.dpo_job import PreferenceTrainer
from worker.grpo import Cancelled  # noqa: F401  (the kind's Cancelled: training_process catches it)
from worker.supervised import Rows, pad_rows, pair_tokens

if TYPE_CHECKING:  # the job's handle; the trainers run without the worker (bench/train_step.py)
    from worker.training_process import JobRun

USER_ERRORS = supervised.USER_ERRORS
HEAD_FILE = "value_head.safetensors"
SCORE_ROWS = 16  # rows scored in one padded forward pass


# --------------------------------------------------------------------------- the math


def bradley_terry_loss(chosen: mx.array, rejected: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
    """Rewards (N,) of chosen and rejected completions -> mean loss, accuracy, margin."""
    diff = chosen - rejected
    return -nn.log_sigmoid(diff).mean(), {"accuracy": (diff > 0).astype(mx.float32).mean(), "margin": diff.mean()}


class RewardModel(nn.Module):
    """The language model (its LoRA trainable) and a linear value head."""

    def __init__(self, lm: nn.Module, head: nn.Linear):
        super().__init__()
        self.lm, self.head = lm, head

    def __call__(self, inputs: mx.array, lengths: mx.array) -> mx.array:
        hidden = self.lm.model(inputs)  # (N, W, D): mlx_lm's models keep the trunk as .model
        last = mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0, :]
        return self.head(last.astype(mx.float32))[:, 0]


# --------------------------------------------------------------------------- the trainer


class RewardTrainer(PreferenceTrainer):
    def __init__(self, model, tokenizer, spec: RewardJobCreate, train, valid):
        head = nn.Linear(model.args.hidden_size, 1)
        head.weight = head.weight * 0.0  # every reward starts at 0 (loss log 2)
        super().__init__(RewardModel(model, head), tokenizer, spec.config, train, valid)

    def arrays(self, ids, rows):
        batch = self.padded(ids, rows)
        return (batch.inputs, batch.lengths), int(batch.lengths.sum().item())

    @staticmethod
    def loss(module, inputs, lengths):
        rewards = module(inputs, lengths)
        n = inputs.shape[0] // 2
        return bradley_terry_loss(rewards[:n], rewards[n:])

    def save(self, out_dir: Path, config: dict) -> None:
        supervised.save_lora(self.module.lm, out_dir, {**config, "value_head": HEAD_FILE})
        mx.save_safetensors(str(out_dir / HEAD_FILE), {"weight": self.module.head.weight, "bias": self.module.head.bias})


def run(job: JobRun, spec_json: str) -> dict:
    return supervised.run_job(job, RewardJobCreate.model_validate_json(spec_json), RewardTrainer)


# --------------------------------------------------------------------------- scoring


def load_head(adapter_dir: Path) -> nn.Linear:
    weights = mx.load(str(adapter_dir / HEAD_FILE))
    head = nn.Linear(weights["weight"].shape[1], 1)
    head.load_weights(list(weights.items()))
    return head


def score_completions(model: nn.Module, tokenizer, head: nn.Linear, prompts: list[str], completions: list[str]) -> list[float]:
    """Rewards of (prompt, completion) rows; `model` must carry the reward model's adapter
    (worker/scoring.py adapter_swapped). Rows as in training: prompt, completion, EOS."""
    rewards: list[float] = []
    for start in range(0, len(prompts), SCORE_ROWS):
        rows = [pair_tokens(tokenizer, p, c) for p, c in zip(prompts[start:start + SCORE_ROWS], completions[start:start + SCORE_ROWS])]
        batch = pad_rows(Rows([t for t, _ in rows], [s for _, s in rows]))
        rewards += RewardModel(model, head)(batch.inputs, batch.lengths).tolist()
    return [float(x) for x in rewards]
