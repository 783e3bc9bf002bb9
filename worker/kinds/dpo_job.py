"""The DPO and ORPO job kinds (one module, `method` "dpo" or "orpo"), on preference pairs.

For a pair (x, y_w chosen, y_l rejected), with log pi(y | x) = sum_t log pi(y_t | x, y_<t) over
the completion tokens (EOS included), pi_theta the policy (base + LoRA) and pi_ref the same
weights with the LoRA off (worker/runtime/adapter_layers.py lora_disabled: no second copy). The
reference never changes, so each pair's log-probs under it are computed at the pair's first step
and kept, with the job's checkpoint too (worker/kinds/supervised_trainer.py ReferenceLogps):

DPO (Rafailov et al. 2023), z = [log pi_theta(y_w) - log pi_ref(y_w)] - [log pi_theta(y_l) - log pi_ref(y_l)]:
    sigmoid: loss = -(1 - eps) log sigma(beta z) - eps log sigma(-beta z)     (eps = label_smoothing)
    hinge:   loss = max(0, 1 - beta z)                                          (SLiC)
    ipo:     loss = (z - 1 / (2 beta))^2   with per-token mean log-probs        (Azar et al. 2023, as TRL)
  rewards/chosen = beta (log pi_theta(y_w) - log pi_ref(y_w)), rewards/rejected likewise,
  rewards/accuracies = mean[rewards/chosen > rewards/rejected], rewards/margins = mean[chosen - rejected].

ORPO (Hong et al. 2024), with per-token mean log-probs P_w = mean_t log pi_theta(y_w,t), P_l likewise:
    log odds(y) = P - log(1 - exp(P))
    loss = NLL(y_w) - lambda * mean log sigma(log odds(y_w) - log odds(y_l))
  NLL: mean cross-entropy over the chosen completions' tokens; lambda = config.lambda_odds (the
  seed server's name; TRL's ORPO calls it beta); nll_loss, log_odds_ratio (= mean log sigma(...)),
  log_odds_chosen, rewards/* = beta * P (TRL's).

Chosen and rejected rows of a batch go through the model in one right-padded batch: rows
0..N-1 chosen, N..2N-1 rejected.
"""

import mlx.core as mx
import mlx.nn as nn

from worker.kinds import supervised_trainer
from worker.kinds.supervised_trainer import PreferenceTrainer, ReferenceLogps
from worker.runtime.adapter_layers import lora_disabled
from worker.runtime.logprobs import sequence_logps, token_logps

# --------------------------------------------------------------------------- the math


def preference_metrics(chosen_reward: mx.array, rejected_reward: mx.array, chosen_logps: mx.array,
                       rejected_logps: mx.array) -> dict[str, mx.array]:
    """TRL's rewards/* and logps/* metrics of a batch of pairs, for DPO and ORPO alike."""
    return {
        "rewards/chosen": chosen_reward.mean(),
        "rewards/rejected": rejected_reward.mean(),
        "rewards/accuracies": (chosen_reward > rejected_reward).astype(mx.float32).mean(),
        "rewards/margins": (chosen_reward - rejected_reward).mean(),
        "logps/chosen": chosen_logps.mean(),
        "logps/rejected": rejected_logps.mean(),
    }


def dpo_loss(chosen: mx.array, rejected: mx.array, ref_chosen: mx.array, ref_rejected: mx.array, *,
             beta: float, loss_type: str, label_smoothing: float = 0.0) -> tuple[mx.array, dict[str, mx.array]]:
    """Sequence log-probs (N,) of policy and reference -> the mean loss and TRL's metrics."""
    chosen_reward = beta * (chosen - ref_chosen)
    rejected_reward = beta * (rejected - ref_rejected)
    z = (chosen - ref_chosen) - (rejected - ref_rejected)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * nn.log_sigmoid(beta * z) - label_smoothing * nn.log_sigmoid(-beta * z)
    elif loss_type == "hinge":
        losses = nn.relu(1 - beta * z)
    elif loss_type == "ipo":
        losses = (z - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return losses.mean(), preference_metrics(chosen_reward, rejected_reward, chosen, rejected)


def orpo_loss(chosen_mean: mx.array, rejected_mean: mx.array, nll: mx.array, *, lambda_odds: float,
              beta: float) -> tuple[mx.array, dict[str, mx.array]]:
    """Per-token mean log-probs (N,) of chosen and rejected, the chosen NLL -> loss and metrics."""
    log_odds = (chosen_mean - rejected_mean) - (mx.log1p(-mx.exp(chosen_mean)) - mx.log1p(-mx.exp(rejected_mean)))
    ratio = nn.log_sigmoid(log_odds)
    chosen_reward, rejected_reward = beta * chosen_mean, beta * rejected_mean
    return nll - lambda_odds * ratio.mean(), {
        "nll_loss": nll,
        "log_odds_ratio": ratio.mean(),
        "log_odds_chosen": log_odds.mean(),
        **preference_metrics(chosen_reward, rejected_reward, chosen_mean, rejected_mean),
    }


# --------------------------------------------------------------------------- the trainer


class DPOTrainer(PreferenceTrainer):
    def __init__(self, model, tokenizer, spec, train, valid):
        self.method = spec.kind
        super().__init__(model, tokenizer, spec.config, train, valid)
        # DPO's reference log-probs, once per pair (ORPO has no reference).
        if self.method == "dpo":
            self.reference = ReferenceLogps({"train": len(train), "valid": len(valid or [])}, 2,
                                            "mean" if self.cfg.loss_type == "ipo" else "sum")

    def reference_logps(self, ids: list[int], rows: list[dict]) -> mx.array:
        """Pairs `ids`' chosen then rejected sequence log-probs under the reference: the same weights, LoRA off."""
        batch = self.padded(ids, rows)
        with lora_disabled(self.module):
            ref = sequence_logps(token_logps(self.module(batch.inputs), batch.targets), batch.mask,
                                 average=self.cfg.loss_type == "ipo")
        mx.eval(ref)
        return ref

    def arrays(self, ids, rows):
        batch = self.padded(ids, rows)
        if self.reference is None:
            ref = mx.zeros((batch.inputs.shape[0],))
        else:
            ref = self.reference.get(self.split(rows), ids, lambda missing: self.reference_logps(missing, rows))
        return (batch.inputs, batch.targets, batch.mask, ref), int(batch.mask.sum().item())

    def loss(self, model, inputs, targets, mask, ref):
        cfg, n = self.cfg, inputs.shape[0] // 2
        logps = token_logps(model(inputs), targets)
        if self.method == "orpo":
            mean = sequence_logps(logps, mask, average=True)
            nll = -(logps[:n] * mask[:n]).sum() / mx.maximum(mask[:n].sum(), 1.0)
            return orpo_loss(mean[:n], mean[n:], nll, lambda_odds=cfg.lambda_odds, beta=cfg.beta)
        seq = sequence_logps(logps, mask, average=cfg.loss_type == "ipo")
        return dpo_loss(seq[:n], seq[n:], ref[:n], ref[n:], beta=cfg.beta, loss_type=cfg.loss_type,
                        label_smoothing=cfg.label_smoothing)


def load(job, spec, settings):
    """The job's Run (worker/kinds/supervised_trainer.py load); the spec's kind says DPO or ORPO."""
    return supervised_trainer.load(job, spec, settings, DPOTrainer)
