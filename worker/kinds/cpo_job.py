"""The CPO job kind (SimPO too: loss_type simpo), on preference pairs, as TRL's CPOTrainer.

Reference-free: no pi_ref, no reference log-probs kept. For a pair (x, y_w chosen, y_l rejected),
with pi_theta the policy (base + LoRA), L(y) = sum_t log pi_theta(y_t | x, y_<t) over the
completion tokens (EOS included), or their mean for ipo and simpo (SimPO's length
normalisation), u = L(y_w) - L(y_l), s the sigmoid, eps = label_smoothing:

    sigmoid (CPO, Xu et al. 2024):   -(1 - eps) log s(beta u) - eps log s(-beta u)
    simpo (SimPO, Meng et al. 2024):  the same of u - gamma / beta   (gamma = simpo_gamma, the target margin)
    hinge:                            max(0, 1 - beta u)
    ipo:                              (u - 1 / (2 beta))^2
  loss = mean over pairs + cpo_alpha * NLL(y_w)
  NLL: mean cross-entropy over the chosen completions' tokens (nll_loss; SimPO proper: cpo_alpha 0).
  rewards/chosen = beta L(y_w), rewards/rejected = beta L(y_l), rewards/accuracies, rewards/margins,
  logps/* = L (TRL's metrics).

A gang (workers > 1) needs cpo_alpha 0: the NLL is a mean over tokens, which the gang's sum of
per-pair shares does not reproduce (shared/train_specs.py CPOConfig).
Chosen and rejected rows of a batch go through the model in one right-padded batch: rows
0..N-1 chosen, N..2N-1 rejected.
"""

import mlx.core as mx
import mlx.nn as nn

from worker.kinds import supervised_trainer
from worker.kinds.dpo_job import chosen_nll, preference_metrics
from worker.kinds.supervised_trainer import PreferenceTrainer
from worker.runtime.logprobs import sequence_logps, token_logps
from worker.runtime.scalars import mean

# --------------------------------------------------------------------------- the math


def cpo_loss(logps: mx.array, mask: mx.array, *, beta: float | mx.array, loss_type: str,
             label_smoothing: float | mx.array, cpo_alpha: float | mx.array,
             simpo_gamma: float | mx.array) -> tuple[mx.array, dict[str, mx.array]]:
    """Token log-probs and completion mask (2N, T), chosen rows first -> the loss and TRL's metrics."""
    n = logps.shape[0] // 2
    seq = sequence_logps(logps, mask, average=loss_type in ("ipo", "simpo"))
    u = seq[:n] - seq[n:]
    if loss_type == "simpo":
        u = u - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        losses = -(1 - label_smoothing) * nn.log_sigmoid(beta * u) - label_smoothing * nn.log_sigmoid(-beta * u)
    elif loss_type == "hinge":
        losses = nn.relu(1 - beta * u)
    elif loss_type == "ipo":
        losses = (u - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    nll = chosen_nll(logps, mask)
    return mean(losses) + cpo_alpha * nll, {
        "nll_loss": nll, **preference_metrics(beta * seq[:n], beta * seq[n:], seq[:n], seq[n:])}


# --------------------------------------------------------------------------- the trainer


class CPOTrainer(PreferenceTrainer):
    def __init__(self, model, tokenizer, spec, train, valid):
        super().__init__(model, tokenizer, spec.config, train, valid)

    def arrays(self, ids, rows):
        batch = self.padded(ids, rows)
        return (batch.inputs, batch.targets, batch.mask), int(batch.mask.sum().item())

    def loss_numbers(self, cfg) -> dict[str, float]:
        return {"beta": cfg.beta, "label_smoothing": cfg.label_smoothing, "cpo_alpha": cfg.cpo_alpha,
                "simpo_gamma": cfg.simpo_gamma}

    def loss(self, model, inputs, targets, mask):
        n = self.numbers
        return cpo_loss(token_logps(model(inputs), targets), mask, beta=n["beta"], loss_type=self.cfg.loss_type,
                        label_smoothing=n["label_smoothing"], cpo_alpha=n["cpo_alpha"], simpo_gamma=n["simpo_gamma"])


def load(job, spec, settings):
    """The job's Run (worker/kinds/supervised_trainer.py load)."""
    return supervised_trainer.load(job, spec, settings, CPOTrainer)
