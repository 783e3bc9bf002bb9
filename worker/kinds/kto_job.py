"""The KTO job kind (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization"), as TRL's KTOTrainer computes it, on unpaired rows {prompt, completion, label}:
label true for a desirable completion, false for an undesirable one.

For a row (x, y), log pi(y | x) = sum_t log pi(y_t | x, y_<t) over the completion tokens (EOS
included), pi_theta the policy (base + LoRA) and pi_ref the same weights with the LoRA off
(worker/runtime/adapter_layers.py lora_disabled, as DPO: no second copy):

    r(x, y) = log pi_theta(y | x) - log pi_ref(y | x)
    z_0     = max(0, mean_i [log pi_theta(y'_i | x_i) - log pi_ref(y'_i | x_i)])     no gradient
              the KL estimate, from mismatched pairs: each row's prompt x_i with y'_i the
              completion of the batch's previous row (the last row's for the first), as TRL
              rotates a batch's completions by one
    desirable row:    loss = w_D (1 - sigma(beta (r - z_0)))
    undesirable row:  loss = w_U (1 - sigma(beta (z_0 - r)))
    loss = mean over the batch's rows                         (w_D, w_U: desirable_weight, undesirable_weight)

Metrics, TRL's names: rewards/chosen = mean of beta r over the desirable rows, rewards/rejected
over the undesirable ones, rewards/margins = rewards/chosen - rewards/rejected, kl = z_0,
logps/chosen and logps/rejected the policy's mean log pi(y | x) of each label. A batch without
rows of one label counts that label's means as 0 (TRL leaves them out of its average).

A batch's rows go through the model in one right-padded batch with the gradient; the reference
and the KL estimate's rows (policy and reference) are forward passes without one.
"""

import mlx.core as mx

from worker.kinds import supervised_trainer
from worker.kinds.supervised_trainer import Trainer, completion_rows
from worker.runtime.adapter_layers import lora_disabled
from worker.runtime.logprobs import sequence_logps, token_logps
from worker.runtime.scalars import mean
from worker.runtime.train_core import PaddedBatch, Rows, pad_rows

# --------------------------------------------------------------------------- the math


def kl_estimate(mismatched_logps: mx.array, mismatched_ref_logps: mx.array) -> mx.array:
    """z_0 from the mismatched pairs' sequence log-probs (N,) under the policy and the reference."""
    return mx.stop_gradient(mx.maximum(mean(mismatched_logps - mismatched_ref_logps), 0.0))


def kto_loss(logps: mx.array, ref_logps: mx.array, kl: mx.array, labels: mx.array, *, beta: float | mx.array,
             desirable_weight: float | mx.array,
             undesirable_weight: float | mx.array) -> tuple[mx.array, dict[str, mx.array]]:
    """Sequence log-probs (N,) of policy and reference, z_0, labels (N,) of 1 (desirable) or 0 ->
    the mean loss and TRL's metrics."""
    r = logps - ref_logps
    desirable = desirable_weight * (1 - mx.sigmoid(beta * (r - kl)))
    undesirable = undesirable_weight * (1 - mx.sigmoid(beta * (kl - r)))
    losses = labels * desirable + (1 - labels) * undesirable

    def mean_of(values: mx.array, which: mx.array) -> mx.array:
        return (values * which).sum() / mx.maximum(which.sum(), 1.0)

    chosen, rejected = mean_of(beta * r, labels), mean_of(beta * r, 1 - labels)
    return mean(losses), {
        "rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected, "kl": kl,
        "logps/chosen": mean_of(logps, labels), "logps/rejected": mean_of(logps, 1 - labels),
    }


# --------------------------------------------------------------------------- the trainer


def mismatched(rows: list[dict], ids: list[int]) -> list[tuple[str, str]]:
    """The KL estimate's (prompt, completion) pairs of a batch: each row's prompt with the
    previous row's completion, the first row's with the last's."""
    return [(rows[i]["prompt"], rows[j]["completion"]) for i, j in zip(ids, ids[-1:] + ids[:-1])]


def completion_logps(model, batch: PaddedBatch) -> mx.array:
    return sequence_logps(token_logps(model(batch.inputs), batch.targets), batch.mask)


class KTOTrainer(Trainer):
    def __init__(self, model, tokenizer, spec, train: list[dict], valid: list[dict] | None):
        cfg = spec.config
        self.tokenizer = tokenizer
        self.train_tok, n_cut = completion_rows(tokenizer, [(r["prompt"], r["completion"]) for r in train],
                                                cfg.max_seq_length)
        self.valid_tok, n_cut_valid = completion_rows(tokenizer, [(r["prompt"], r["completion"]) for r in valid],
                                                      cfg.max_seq_length) if valid else (None, 0)
        self.truncated = n_cut + n_cut_valid
        super().__init__(model, cfg, train, valid)

    def arrays(self, ids, rows):
        tok = self.train_tok if rows is self.train_rows else self.valid_tok
        batch = pad_rows(Rows([tok.tokens[i] for i in ids], [tok.starts[i] for i in ids]))
        kl_rows, _ = completion_rows(self.tokenizer, mismatched(rows, ids), self.cfg.max_seq_length)
        kl_batch = pad_rows(kl_rows)
        kl_logps = completion_logps(self.module, kl_batch)
        with lora_disabled(self.module):  # the reference policy: the same weights, LoRA off
            ref = completion_logps(self.module, batch)
            kl = kl_estimate(kl_logps, completion_logps(self.module, kl_batch))
        mx.eval(ref, kl)
        labels = mx.array([float(rows[i]["label"]) for i in ids])
        return (batch.inputs, batch.targets, batch.mask, labels, ref, kl), int(batch.mask.sum().item())

    def loss_numbers(self, cfg) -> dict[str, float]:
        return {"beta": cfg.beta, "desirable_weight": cfg.desirable_weight, "undesirable_weight": cfg.undesirable_weight}

    def loss(self, model, inputs, targets, mask, labels, ref, kl):
        logps = sequence_logps(token_logps(model(inputs), targets), mask)
        n = self.numbers
        return kto_loss(logps, ref, kl, labels, beta=n["beta"], desirable_weight=n["desirable_weight"],
                        undesirable_weight=n["undesirable_weight"])


def load(job, spec, settings):
    """The job's Run (worker/kinds/supervised_trainer.py load)."""
    return supervised_trainer.load(job, spec, settings, KTOTrainer)
