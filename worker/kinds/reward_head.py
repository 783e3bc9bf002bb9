"""A reward model: the language model (with its adapter) and a linear value head on the final
hidden state at a row's last token (EOS),

    r(x, y) = w . h_last(x, y) + b

trained by the reward-model kind (worker/kinds/reward_model_job.py) and read back by reward
scoring (worker/runtime/score_requests.py: POST /admin/api/fine-tune/reward/score, and GRPO's
`reward_model` reward source). The head lives beside the adapter's files as
value_head.safetensors.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from shared.adapters import HEAD_FILE
from worker.runtime.logprobs import pair_tokens
from worker.runtime.train_core import Rows, pad_rows

SCORE_ROWS = 16  # rows scored in one padded forward pass


class RewardModel(nn.Module):
    """The language model (its LoRA trainable) and a linear value head."""

    def __init__(self, lm: nn.Module, head: nn.Linear):
        super().__init__()
        self.lm, self.head = lm, head

    def __call__(self, inputs: mx.array, lengths: mx.array) -> mx.array:
        hidden = self.lm.model(inputs)  # (N, W, D): mlx_lm's models keep the trunk as .model
        last = mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0, :]
        return self.head(last.astype(mx.float32))[:, 0]


def new_head(model: nn.Module) -> nn.Linear:
    """A head whose every reward starts at 0 (the Bradley-Terry loss starts at log 2)."""
    head = nn.Linear(model.args.hidden_size, 1)
    head.weight = head.weight * 0.0
    return head


def save_head(head: nn.Linear, out_dir: Path) -> None:
    mx.save_safetensors(str(out_dir / HEAD_FILE), {"weight": head.weight, "bias": head.bias})


def load_head(adapter_dir: Path) -> nn.Linear:
    weights = mx.load(str(adapter_dir / HEAD_FILE))
    head = nn.Linear(weights["weight"].shape[1], 1)
    head.load_weights(list(weights.items()))
    return head


def score_completions(model: nn.Module, tokenizer, head: nn.Linear, prompts: list[str], completions: list[str]) -> list[float]:
    """Rewards of (prompt, completion) rows; `model` must carry the reward model's adapter
    (worker/runtime/adapter_layers.py adapter_swapped). Rows as in training: prompt, completion, EOS."""
    rewards: list[float] = []
    for start in range(0, len(prompts), SCORE_ROWS):
        rows = [pair_tokens(tokenizer, p, c) for p, c in zip(prompts[start:start + SCORE_ROWS], completions[start:start + SCORE_ROWS])]
        batch = pad_rows(Rows([t for t, _ in rows], [s for _, s in rows]))
        rewards += RewardModel(model, head)(batch.inputs, batch.lengths).tolist()
    return [float(x) for x in rewards]
