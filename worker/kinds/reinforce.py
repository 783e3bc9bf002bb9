"""REINFORCE with a KL penalty, as mlx-lm-lora's rlhf_reinforce, with LoRA on an mlx_lm model, top
to bottom. Its phases 1, 2 and 4 are GRPO's (worker/kinds/grpo.py: the batched sampler, every
reward source, micro-batches, gradient checkpointing, the optimizer, a gang of workers); the
advantages and the loss are its own:

  3. advantages, per completion (r_i: the reward, NaN = unscorable):
         kl_i = sum_t m_t (old_logp_t - ref_logp_t)     when beta > 0: first-order log-ratio to the
                                                         base model (LoRA off), summed
         A_i  = r_i - beta * kl_i                       no baseline (mlx-lm-lora has none)
     A_i = 0 where r_i is NaN. old_logp: the sampler's log-probs (logits / temperature).
  4. update, once per sampled batch (on-policy: REINFORCE has no importance ratio):
         loss = -sum_i A_i sum_t m_t logp_t / sum_i sum_t m_t     over the step's completion tokens
     Reported: kl = the mean over completion tokens of old_logp_t - ref_logp_t (TRL's name).

Where this differs from mlx-lm-lora's code, on purpose: the log-probs are those of the sampled
tokens (it takes each position's argmax) over the completion's tokens (its mask also covers the
prompt), and kl_i is a constant of the gradient (there it is differentiated too). So the gradient
is REINFORCE's estimate of that of E[r - beta * KL(pi || ref)], the objective its docstring names.

Its gradient needs no other row's value: on a gang of workers (config.workers) each rank's rows
take their advantages from their own rewards, and only the token count is the whole step's.
"""

import functools

import mlx.core as mx
import numpy as np

from worker.kinds import grpo_job
from worker.kinds.grpo import Batch, GRPOTrainer
from worker.kinds.rloo import sequence_kl

# --------------------------------------------------------------------------- the math


def reinforce_advantages(rewards: np.ndarray, kl: np.ndarray, beta: float) -> np.ndarray:
    """rewards, kl: (rows,) (rewards NaN = unscorable). Returns (rows,) r - beta * kl, 0 where unscorable."""
    return np.nan_to_num(rewards - beta * kl, nan=0.0).astype(np.float32)


def reinforce_loss(logp: mx.array, ref_logp: mx.array | None, advantages: mx.array, mask: mx.array, *,
                   n_tokens: mx.array | None = None) -> tuple[mx.array, dict[str, mx.array]]:
    """REINFORCE's objective for rows of completion tokens (logp, ref_logp, mask: (rows, T);
    advantages: (rows,); n_tokens: the whole step's when these rows are a micro-batch of it).
    ref_logp: for the kl statistic (None: beta is 0, no statistic)."""
    mask = mask.astype(mx.float32)
    n_tokens = mx.maximum(mask.sum(), 1.0) if n_tokens is None else n_tokens
    loss = -(advantages * (logp * mask).sum(axis=1)).sum() / n_tokens
    stats = {}
    if ref_logp is not None:
        stats["kl"] = ((mx.stop_gradient(logp) - ref_logp) * mask).sum() / n_tokens
    return loss, stats


# --------------------------------------------------------------------------- the trainer


class ReinforceTrainer(GRPOTrainer):
    """GRPO's trainer with REINFORCE's advantages and loss (phases 3 and 4's objective)."""

    def advantages(self, every: np.ndarray, batch: Batch) -> np.ndarray:
        rewards = every[self.positions].reshape(-1)
        if self.cfg.beta == 0:
            return reinforce_advantages(rewards, np.zeros_like(rewards), 0.0)
        kl = sequence_kl(np.array(batch.old_logp), np.array(batch.ref_logp), np.array(batch.mask))
        return reinforce_advantages(rewards, kl, self.cfg.beta)

    def loss(self, logp, old_logp, ref_logp, advantages, mask, n_rows, n_tokens):
        return reinforce_loss(logp, ref_logp if self.cfg.beta > 0 else None, advantages, mask, n_tokens=n_tokens)


load = functools.partial(grpo_job.load, trainer_class=ReinforceTrainer)
