"""The reward-model job kind: a scalar value head on the base model + LoRA
(worker/kinds/reward_head.py), trained on preference pairs with the Bradley-Terry loss (TRL's
RewardTrainer).

    r(x, y) = w . h_last(x, y) + b       h_last: the final hidden state (after the model's
                                         last norm) at the row's last token (EOS)
    loss    = -mean log sigma(r(x, y_w) - r(x, y_l))
    accuracy = mean[r(x, y_w) > r(x, y_l)],  margin = mean[r(x, y_w) - r(x, y_l)]

The adapter directory holds mlx_lm's adapter files plus the head (shared/adapters.py HEAD_FILE);
reward scoring (POST /admin/api/fine-tune/reward/score) and GRPO's `reward_model` reward source
read it back (worker/runtime/score_requests.py).
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from shared.adapters import HEAD_FILE
from shared.train_specs import RewardJobCreate
from worker.kinds import supervised_trainer
from worker.kinds.reward_head import RewardModel, load_head, new_head, save_head
from worker.kinds.supervised_trainer import PreferenceTrainer
from worker.runtime.adapter_layers import save_adapter
from worker.runtime.scalars import mean

# --------------------------------------------------------------------------- the math


def bradley_terry_loss(chosen: mx.array, rejected: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
    """Rewards (N,) of chosen and rejected completions -> mean loss, accuracy, margin."""
    diff = chosen - rejected
    return -mean(nn.log_sigmoid(diff)), {"accuracy": mean((diff > 0).astype(mx.float32)), "margin": mean(diff)}


# --------------------------------------------------------------------------- the trainer


class RewardTrainer(PreferenceTrainer):
    def __init__(self, model, tokenizer, spec: RewardJobCreate, train, valid):
        super().__init__(RewardModel(model, new_head(model)), tokenizer, spec.config, train, valid)

    def arrays(self, ids, rows):
        batch = self.padded(ids, rows)
        return (batch.inputs, batch.lengths), int(batch.lengths.sum().item())

    @staticmethod
    def loss(module, inputs, lengths):
        rewards = module(inputs, lengths)
        n = inputs.shape[0] // 2
        return bradley_terry_loss(rewards[:n], rewards[n:])

    def start_from(self, init: Path) -> None:
        if (init / HEAD_FILE).is_file():  # a reward model's: its head too (another kind's adapter: a fresh head)
            self.module.head = load_head(init)

    def save(self, out_dir: Path, config: dict) -> None:
        save_adapter(self.module.lm, out_dir, {**config, "value_head": HEAD_FILE, "reward_model": True})  # the seed's mark
        save_head(self.module.head, out_dir)


def load(job, spec: RewardJobCreate, settings):
    """The job's Run (worker/kinds/supervised_trainer.py load)."""
    return supervised_trainer.load(job, spec, settings, RewardTrainer)
