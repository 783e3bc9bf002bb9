"""RLOO (REINFORCE Leave-One-Out, Ahmadian et al. 2024) as TRL 1.16's RLOOTrainer, with LoRA on an
mlx_lm model, top to bottom. Its phases 1, 2 and 4 are GRPO's (worker/kinds/grpo.py: the batched
sampler, every reward source, micro-batches, gradient checkpointing, the optimizer, a gang of
workers); the advantages and the loss are its own:

  3. advantages, over the B groups of G completions (r_i: the reward, NaN = unscorable):
         kl_i  = sum_t m_t (old_logp_t - ref_logp_t)       when beta > 0: first-order log-ratio to
                                                             the base model (LoRA off), summed
         r'_i  = r_i - beta * kl_i                          the KL is a reward penalty
         b_i   = sum_{j != i, scorable} r'_j / (n - 1)      leave-one-out baseline, n = scorable in the group
         A_i   = r'_i - b_i
     normalize_advantages: A = (A - nanmean(A)) / (nanstd(A) + 1e-4) over the whole step.
     A_i = 0 where r_i is NaN or where it is its group's only scorable completion.
     old_logp: the sampler's log-probs (logits / temperature; TRL recomputes them in a forward
     pass of the same weights: the same up to float rounding).
  4. update, mu = num_iterations times, one importance ratio per completion:
         logp_i  = sum_t m_t logp_t                         (old_logp_i likewise)
         ratio_i = exp(logp_i - old_logp_i)                 exactly 1 on the first update (mu = 1: always)
         loss    = sum_i -min(ratio_i A_i, clip(ratio_i, 1 - eps_low, 1 + eps_high) A_i) / (B*G)
     Reported as TRL does: kl = the mean over completion tokens of old_logp_t - ref_logp_t, and
     clip_ratio/low_mean, high_mean and region_mean over completions.

As the leave-one-out advantages of a group sum to 0, the loss of an on-policy update is 0 (in TRL
too) while its gradient is not; its value moves only on the later updates of num_iterations > 1.
On a gang of workers (config.workers) the KL penalties are summed into the whole step's (B, G)
with the rewards, so every rank's baselines and normalisation are one worker's.
"""

import functools

import mlx.core as mx
import numpy as np

from worker.kinds import grpo_job
from worker.kinds.grpo import ADV_EPS, Batch, GRPOTrainer, nan_mean, nan_std
from worker.runtime.surrogate import clipped_sides, clipped_surrogate

# --------------------------------------------------------------------------- the math


def sequence_kl(old_logp: np.ndarray, ref_logp: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(rows, T) log-probs and mask -> (rows,) summed first-order log-ratio to the reference."""
    return ((old_logp - ref_logp) * mask).sum(axis=1)


def rloo_advantages(rewards: np.ndarray, normalize: bool) -> np.ndarray:
    """rewards: (B, G), the KL penalty already taken off, NaN = unscorable. Returns (B, G)
    leave-one-out advantages (TRL's RLOOTrainer, nan-aware)."""
    n = (~np.isnan(rewards)).sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        baselines = (np.nansum(rewards, axis=1, keepdims=True) - rewards) / (n - 1)
        advantages = rewards - baselines
        if normalize:
            advantages = (advantages - nan_mean(advantages)) / (nan_std(advantages) + ADV_EPS)
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32)


def rloo_loss(logp: mx.array, old_logp: mx.array, ref_logp: mx.array | None, advantages: mx.array, mask: mx.array, *,
              epsilon_low: float | mx.array, epsilon_high: float | mx.array, n_rows: mx.array | None = None,
              n_tokens: mx.array | None = None) -> tuple[mx.array, dict[str, mx.array]]:
    """RLOO's objective for rows of completion tokens (as grpo_loss: logp, old_logp, ref_logp, mask
    (rows, T), advantages (rows,); n_rows, n_tokens: the whole step's when these rows are a
    micro-batch of it). ref_logp: for the kl statistic (None: beta is 0, no statistic)."""
    mask = mask.astype(mx.float32)
    n_rows = mask.shape[0] if n_rows is None else n_rows
    n_tokens = mx.maximum(mask.sum(), 1.0) if n_tokens is None else n_tokens
    ratio = mx.exp(((logp - old_logp) * mask).sum(axis=1))
    loss = clipped_surrogate(ratio, advantages, 1.0 - epsilon_low, 1.0 + epsilon_high).sum() / n_rows
    low, high = clipped_sides(ratio, advantages, 1.0 - epsilon_low, 1.0 + epsilon_high)
    stats = {
        "clip_ratio/low_mean": low.astype(mx.float32).sum() / n_rows,
        "clip_ratio/high_mean": high.astype(mx.float32).sum() / n_rows,
        "clip_ratio/region_mean": (low | high).astype(mx.float32).sum() / n_rows,
    }
    if ref_logp is not None:
        stats["kl"] = ((old_logp - ref_logp) * mask).sum() / n_tokens
    return loss, stats


# --------------------------------------------------------------------------- the trainer


class RLOOTrainer(GRPOTrainer):
    """GRPO's trainer with RLOO's advantages and loss (phases 3 and 4's objective)."""

    def advantages(self, every: np.ndarray, batch: Batch) -> np.ndarray:
        cfg = self.cfg
        if cfg.beta > 0:
            kl = sequence_kl(np.array(batch.old_logp), np.array(batch.ref_logp), np.array(batch.mask))
            every = every - cfg.beta * self.whole_batch(kl.reshape(len(self.positions), cfg.group_size))
        return rloo_advantages(every, cfg.normalize_advantages)[self.positions]

    def loss(self, logp, old_logp, ref_logp, advantages, mask, n_rows, n_tokens):
        return rloo_loss(logp, old_logp, ref_logp if self.cfg.beta > 0 else None, advantages, mask,
                         epsilon_low=self.numbers["epsilon_low"], epsilon_high=self.numbers["epsilon_high"],
                         n_rows=n_rows, n_tokens=n_tokens)


load = functools.partial(grpo_job.load, trainer_class=RLOOTrainer)
