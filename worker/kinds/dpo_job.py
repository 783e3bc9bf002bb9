"""The DPO and ORPO job kinds (one module, `method` "dpo" or "orpo"), on preference pairs.

For a pair (x, y_w chosen, y_l rejected), with log pi(y | x) = sum_t log pi(y_t | x, y_<t) over
the completion tokens (EOS included), pi_theta the policy (base + LoRA) and pi_ref the same
weights with the LoRA off (worker/runtime/adapter_layers.py lora_disabled: no second copy). The
reference never changes, so each pair's log-probs under it are computed at the pair's first step
and kept, with the job's checkpoint too (worker/kinds/supervised_trainer.py ReferenceLogps):

DPO (Rafailov et al. 2023) and TRL's other DPO loss types. Per pair, with sequence sums,
c = log pi_theta(y_w) - log pi_ref(y_w), r = log pi_theta(y_l) - log pi_ref(y_l), z = beta (c - r),
s the sigmoid, eps = label_smoothing, and |y| a completion's tokens (EOS included):
    sigmoid:      -(1 - eps) log s(z) - eps log s(-z)   (eps > 0: conservative DPO, TRL before 1.0)
    hinge:        max(0, 1 - z)                                                     (SLiC)
    ipo:          (c / |y_w| - r / |y_l| - 1 / (2 beta))^2                          (Azar et al. 2023, as TRL)
    exo_pair:     s(z) (log s(z) - log(1 - eps)) + s(-z) (log s(-z) - log eps)      (Ji et al. 2024)
    nca_pair:     -log s(beta c) - 1/2 log s(-beta c) - 1/2 log s(-beta r)          (Chen et al. 2024)
    robust:       (-(1 - eps) log s(z) + eps log s(-z)) / (1 - 2 eps)               (Chowdhury et al. 2024)
    bco_pair:     -log s(beta c) - log s(-beta r)                                   (Jung et al. 2024)
    sppo_hard:    (c - 1 / (2 beta))^2 + (r + 1 / (2 beta))^2                       (Wu et al. 2024)
    apo_zero:     1 - s(beta c) + s(beta r)                                         (D'Oosterlinck et al. 2024)
    apo_down:     s(beta c) + 1 - s(z)
    sigmoid_norm: -log s(beta (c / |y_w| - r / |y_l|))
  loss = sum_k loss_weights[k] * mean over pairs of loss_type[k]'s (TRL's loss_type list; weights 1 by default).
  rewards/chosen = beta c, rewards/rejected = beta r (every loss type, as TRL 1.16),
  rewards/accuracies = mean[rewards/chosen > rewards/rejected], rewards/margins = mean[chosen - rejected].
  Every one is a mean over pairs of each pair's own loss, so a gang's weighted sum of shares is the same loss.

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
from worker.runtime.scalars import mean

# --------------------------------------------------------------------------- the math


def preference_metrics(chosen_reward: mx.array, rejected_reward: mx.array, chosen_logps: mx.array,
                       rejected_logps: mx.array) -> dict[str, mx.array]:
    """TRL's rewards/* and logps/* metrics of a batch of pairs, for DPO and ORPO alike."""
    return {
        "rewards/chosen": mean(chosen_reward),
        "rewards/rejected": mean(rejected_reward),
        "rewards/accuracies": mean((chosen_reward > rejected_reward).astype(mx.float32)),
        "rewards/margins": mean(chosen_reward - rejected_reward),
        "logps/chosen": mean(chosen_logps),
        "logps/rejected": mean(rejected_logps),
    }


def pair_losses(c: mx.array, r: mx.array, chosen_len: mx.array, rejected_len: mx.array, loss_type: str, *,
                beta: float | mx.array, eps: float | mx.array) -> mx.array:
    """Each pair's loss of one loss type (above), from its log-ratios c and r (N,) and token counts."""
    z = beta * (c - r)
    if loss_type == "sigmoid":
        return -(1 - eps) * nn.log_sigmoid(z) - eps * nn.log_sigmoid(-z)
    if loss_type == "hinge":
        return nn.relu(1 - z)
    if loss_type == "ipo":
        return (c / chosen_len - r / rejected_len - 1 / (2 * beta)) ** 2
    if loss_type == "exo_pair":
        return mx.sigmoid(z) * (nn.log_sigmoid(z) - mx.log1p(-eps)) + mx.sigmoid(-z) * (nn.log_sigmoid(-z) - mx.log(eps))
    if loss_type == "nca_pair":
        return -nn.log_sigmoid(beta * c) - 0.5 * nn.log_sigmoid(-beta * c) - 0.5 * nn.log_sigmoid(-beta * r)
    if loss_type == "robust":
        return (-(1 - eps) * nn.log_sigmoid(z) + eps * nn.log_sigmoid(-z)) / (1 - 2 * eps)
    if loss_type == "bco_pair":
        return -nn.log_sigmoid(beta * c) - nn.log_sigmoid(-beta * r)
    if loss_type == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - mx.sigmoid(beta * c) + mx.sigmoid(beta * r)
    if loss_type == "apo_down":
        return mx.sigmoid(beta * c) + 1 - mx.sigmoid(z)
    if loss_type == "sigmoid_norm":
        return -nn.log_sigmoid(beta * (c / chosen_len - r / rejected_len))
    raise ValueError(f"unknown loss_type {loss_type!r}")


def dpo_loss(chosen: mx.array, rejected: mx.array, ref_chosen: mx.array, ref_rejected: mx.array, chosen_len: mx.array,
             rejected_len: mx.array, *, beta: float | mx.array, loss_types: list[str],
             loss_weights: list[float | mx.array],
             label_smoothing: float | mx.array = 0.0) -> tuple[mx.array, dict[str, mx.array]]:
    """Sequence log-prob sums (N,) of policy and reference, completion token counts -> the loss and TRL's metrics."""
    c, r = chosen - ref_chosen, rejected - ref_rejected
    loss = sum(w * mean(pair_losses(c, r, chosen_len, rejected_len, t, beta=beta, eps=label_smoothing))
               for t, w in zip(loss_types, loss_weights, strict=True))
    return loss, preference_metrics(beta * c, beta * r, chosen, rejected)


def chosen_nll(logps: mx.array, mask: mx.array) -> mx.array:
    """The mean cross-entropy over the chosen rows' (the first half's) completion tokens: ORPO's and CPO's NLL."""
    n = logps.shape[0] // 2
    return -(logps[:n] * mask[:n]).sum() / mx.maximum(mask[:n].sum(), 1.0)


def orpo_loss(chosen_mean: mx.array, rejected_mean: mx.array, nll: mx.array, *, lambda_odds: float | mx.array,
              beta: float | mx.array) -> tuple[mx.array, dict[str, mx.array]]:
    """Per-token mean log-probs (N,) of chosen and rejected, the chosen NLL -> loss and metrics."""
    log_odds = (chosen_mean - rejected_mean) - (mx.log1p(-mx.exp(chosen_mean)) - mx.log1p(-mx.exp(rejected_mean)))
    ratio = nn.log_sigmoid(log_odds)
    chosen_reward, rejected_reward = beta * chosen_mean, beta * rejected_mean
    return nll - lambda_odds * mean(ratio), {
        "nll_loss": nll,
        "log_odds_ratio": mean(ratio),
        "log_odds_chosen": mean(log_odds),
        **preference_metrics(chosen_reward, rejected_reward, chosen_mean, rejected_mean),
    }


# --------------------------------------------------------------------------- the trainer


class DPOTrainer(PreferenceTrainer):
    def __init__(self, model, tokenizer, spec, train, valid):
        self.method = spec.kind
        super().__init__(model, tokenizer, spec.config, train, valid)
        # DPO's reference log-probs, once per pair (ORPO has no reference).
        if self.method == "dpo":
            self.reference = ReferenceLogps({"train": len(train), "valid": len(valid or [])}, 2, "sum")

    def loss_numbers(self, cfg) -> dict[str, float]:
        if self.method == "orpo":
            return {"beta": cfg.beta, "lambda_odds": cfg.lambda_odds}
        return {"beta": cfg.beta, "label_smoothing": cfg.label_smoothing,
                **{f"loss_weight_{k}": w for k, w in enumerate(cfg.weights)}}

    def reference_logps(self, ids: list[int], rows: list[dict]) -> mx.array:
        """Pairs `ids`' chosen then rejected sequence log-probs under the reference: the same weights, LoRA off."""
        batch = self.padded(ids, rows)
        with lora_disabled(self.module):
            ref = sequence_logps(token_logps(self.module(batch.inputs), batch.targets), batch.mask)
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
        cfg, numbers, n = self.cfg, self.numbers, inputs.shape[0] // 2
        logps = token_logps(model(inputs), targets)
        if self.method == "orpo":
            means = sequence_logps(logps, mask, average=True)
            return orpo_loss(means[:n], means[n:], chosen_nll(logps, mask), lambda_odds=numbers["lambda_odds"],
                             beta=numbers["beta"])
        seq, lengths = sequence_logps(logps, mask), mx.maximum(mask.sum(axis=-1), 1.0)
        return dpo_loss(seq[:n], seq[n:], ref[:n], ref[n:], lengths[:n], lengths[n:], beta=numbers["beta"],
                        loss_types=cfg.loss_types, label_smoothing=numbers["label_smoothing"],
                        loss_weights=[numbers[f"loss_weight_{k}"] for k in range(len(cfg.loss_types))])


def load(job, spec, settings):
    """The job's Run (worker/kinds/supervised_trainer.py load); the spec's kind says DPO or ORPO."""
    return supervised_trainer.load(job, spec, settings, DPOTrainer)
