"""Online DPO and XPO with LoRA on an mlx_lm model: DPO on pairs the policy samples, ranked by a judge.

One step (= one `iter`), on B = batch_size prompts:

  1. rollout (GRPO's sampler, worker/kinds/grpo.py): for each prompt a pair of completions (a, b),
         Online DPO: both sampled by the policy pi_theta (base + LoRA), G = 2 rows per prompt
         XPO:        a by the policy, b by the reference pi_ref (the same weights, LoRA off:
                     its B matrices zero while it samples), each from a key of its own
  2. judge: the job's reward sources (worker/rewards/, as GRPO's: a reward model of this
     project, an endpoint, graders, python functions) score every completion: s_a, s_b;
     minus missing_eos_penalty for one that did not end. a is chosen where s_a >= s_b (TRL's
     tie rule); an unscorable completion (NaN) ranks below any scored one.
  3. update: one AdamW step (GRPO's optimizer and clipping) on TRL's loss, with sequence
     log-probs summed over the completion tokens (EOS included), of the logits as they are
     (no temperature: TRL's):
         z_i      = [log pi_theta(y_w) - log pi_ref(y_w)] - [log pi_theta(y_l) - log pi_ref(y_l)]
         dpo_i    = -log sigma(beta z_i)          sigmoid
                  = (z_i - 1 / (2 beta))^2        ipo (of the sums, as TRL's online trainers)
         Online DPO: loss = mean_i dpo_i                      (worker/kinds/dpo_job.py dpo_loss)
         XPO:        loss = mean_i [dpo_i + alpha log pi_theta(b_i)]   b_i: the reference's sample
     pi_ref's log-probs are computed once per step, before the update (no gradient).

Metrics, TRL's names (OnlineDPOTrainer / XPOTrainer), means over the step's pairs or rows:
  rewards/chosen = beta (log pi_theta(y_w) - log pi_ref(y_w)), rewards/rejected likewise,
  rewards/margins, rewards/accuracies = mean[rewards/chosen > rewards/rejected], beta;
  objective/kl = mean over rows of sum_t (log pi_theta - log pi_ref), objective/entropy =
  -mean over rows of log pi_theta(y);
  Online DPO: logps/chosen, logps/rejected (the policy's), objective/non_score_reward =
  -beta objective/kl, objective/scores (the judge's mean), objective/scores_margin (chosen -
  rejected), objective/rlhf_reward = objective/scores + objective/non_score_reward,
  val/contain_eos_token;
  XPO: logps/chosen = mean log pi_theta(y_w) + mean log pi_ref(y_w) (TRL's sum of the two),
  logps/rejected likewise, loss/dpo, loss/xpo (= alpha mean log pi_theta(b)), alpha,
  objective/model_scores, objective/ref_scores, objective/scores_margin (model - ref),
  val/model_contain_eos_token, val/ref_contain_eos_token.

Memory: the loss runs over micro-batches of pairs (half the memory plan's micro_batch_size
rows), gradients and metrics summed with the whole step's pair count as normaliser; on a gang
of N workers (config.workers) each rank takes every N-th prompt and the sums run across ranks
(the loss is a mean over independent pairs), as GRPO's.
"""

import contextlib
import dataclasses
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map, tree_map_with_path

from worker.decode.sampling import sample
from worker.kinds import grpo_job
from worker.kinds.dpo_job import dpo_loss
from worker.kinds.grpo import Batch, GRPOTrainer, Rollout, completions, make_batch, nan_mean, samples_event, step_metrics
from worker.runtime.adapter_layers import lora_disabled
from worker.runtime.logprobs import completion_logprobs, sequence_logps
from worker.runtime.projection_groups import PAIR
from worker.runtime.scalars import as_inputs, mean
from worker.runtime.train_core import Cancelled, TrainState, check_finite, clipped, step_seed

# --------------------------------------------------------------------------- the math


def pair_loss(policy_a: mx.array, policy_b: mx.array, ref_a: mx.array, ref_b: mx.array, a_chosen: mx.array, *,
              beta: float | mx.array, loss_type: str,
              alpha: float | mx.array | None = None) -> tuple[mx.array, dict[str, mx.array]]:
    """Sequence log-prob sums (N,) of each pair's completions a and b under the policy and the
    reference, and whether the judge chose a -> the mean loss and TRL's metrics. alpha: XPO's
    (b is the reference's sample); None: Online DPO."""
    chosen, rejected = mx.where(a_chosen, policy_a, policy_b), mx.where(a_chosen, policy_b, policy_a)
    ref_chosen, ref_rejected = mx.where(a_chosen, ref_a, ref_b), mx.where(a_chosen, ref_b, ref_a)
    # Lengths of 1: OnlineDPOTrainer's ipo takes the summed log-ratios, where DPOTrainer's averages them per token.
    ones = mx.ones(chosen.shape)
    loss, stats = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, ones, ones, beta=beta, loss_types=[loss_type],
                           loss_weights=[1.0])
    kl = (mean(policy_a - ref_a) + mean(policy_b - ref_b)) / 2
    stats = {**stats, "objective/kl": kl, "objective/entropy": -(mean(policy_a) + mean(policy_b)) / 2}
    if alpha is None:
        return loss, {**stats, "objective/non_score_reward": -beta * kl}
    xpo = alpha * mean(policy_b)
    stats.update({"loss/dpo": loss, "loss/xpo": xpo, "logps/chosen": mean(chosen) + mean(ref_chosen),
                  "logps/rejected": mean(rejected) + mean(ref_rejected)})
    return loss + xpo, stats


def judge_pairs(scores: np.ndarray, ended: np.ndarray, missing_eos_penalty: float | None) -> tuple[np.ndarray, np.ndarray]:
    """The judge's scores (N, 2) of each pair's completions (NaN: unscorable) and whether each
    ended -> the scores after the missing-EOS penalty, and whether a (column 0) is chosen."""
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * ~ended
    ranked = np.nan_to_num(scores, nan=-np.inf)
    return scores, ranked[:, 0] >= ranked[:, 1]


def judge_metrics(scores: np.ndarray, ended: np.ndarray, a_chosen: np.ndarray, xpo: bool) -> dict[str, float]:
    """TRL's judge metrics of the whole step's scores (N, 2), ended (N, 2) and choices (N,)."""
    if xpo:
        return {"objective/model_scores": float(np.nan_to_num(nan_mean(scores[:, 0]))),
                "objective/ref_scores": float(np.nan_to_num(nan_mean(scores[:, 1]))),
                "objective/scores_margin": float(np.nan_to_num(nan_mean(scores[:, 0] - scores[:, 1]))),
                "val/model_contain_eos_token": float(ended[:, 0].mean()),
                "val/ref_contain_eos_token": float(ended[:, 1].mean())}
    sign = np.where(a_chosen, 1.0, -1.0)
    return {"objective/scores": float(np.nan_to_num(nan_mean(scores))),
            "objective/scores_margin": float(np.nan_to_num(nan_mean(sign * (scores[:, 0] - scores[:, 1])))),
            "val/contain_eos_token": float(ended.mean())}


# --------------------------------------------------------------------------- the trainer


def sequence_logprobs(model: nn.Module, rows: tuple, chunk_tokens: int, checkpointing: bool = False) -> mx.array:
    """log pi(y) of rows (inputs, left_pad, completion, mask): the completion tokens' log-probs
    of the logits as they are (temperature 1, TRL's), summed."""
    inputs, pad, completion, mask = rows
    return sequence_logps(completion_logprobs(model, inputs, pad, completion, 1.0, chunk_tokens, checkpointing), mask)


@contextlib.contextmanager
def reference_sampling(model: nn.Module):
    """The policy as the reference while it samples: every LoRA B matrix zero. (The compiled
    decode step keeps its LoRA products, traced with them: zero B matrices make them add exactly
    nothing.)"""
    kept = model.trainable_parameters()  # a paired group's B is its pair's (PAIR): zeroed whole, as one array
    zero_b = lambda path, w: mx.zeros_like(w) if path.endswith(("lora_b", PAIR[1])) else w  # noqa: E731
    model.update(tree_map_with_path(zero_b, kept))
    try:
        yield
    finally:
        model.update(kept)


class OnlineDPOTrainer(GRPOTrainer):
    """GRPO's trainer (prompts, sampler, judge, evaluation, memory plan, optimizer) with the
    module docstring's step."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        cfg = self.cfg
        self.xpo = self.spec.kind == "xpo"
        # The compiled step's inputs (worker/runtime/scalars.py), not numbers compiled into its kernels.
        self.numbers.update(as_inputs(beta=cfg.beta, **({"alpha": cfg.alpha} if self.xpo else {})))
        chunk, checkpointing = self.chunk_tokens, self.memory.gradient_checkpointing

        def loss_fn(model, a, b, ref_a, ref_b, a_chosen, share):
            policy_a, policy_b = (sequence_logprobs(model, rows, chunk, checkpointing) for rows in (a, b))
            loss, stats = pair_loss(policy_a, policy_b, ref_a, ref_b, a_chosen, beta=self.numbers["beta"],
                                    loss_type=cfg.loss_type, alpha=self.numbers.get("alpha"))
            return loss * share, {k: v * share for k, v in stats.items()}

        value_and_grad = nn.value_and_grad(model, loss_fn)

        def micro_batch_step(*arrays):
            (loss, stats), grads = value_and_grad(model, *arrays)
            return loss, stats, grads

        state = [model.state, mx.random.state]
        self.micro_batch_step = mx.compile(micro_batch_step, inputs=[*state, self.numbers], outputs=state)

    def step(self, state: TrainState, should_stop: Callable[[], bool],
             on_finite_loss: Callable[[], None] = lambda: None) -> tuple[dict[str, float], dict]:
        cfg, t0 = self.cfg, time.perf_counter()
        mx.reset_peak_memory()
        rollout = self.rollout(state.step, should_stop)
        if self.xpo:
            reference = self.reference_rollout(rollout, state.step, should_stop)
            pairs = dataclasses.replace(rollout, texts=interleaved(rollout.texts, reference.texts),
                                        lengths=interleaved(rollout.lengths, reference.lengths))
            a, b = (make_batch(r.prompt_ids, r.samples, r.mask, 1, r.width) for r in (rollout, reference))
            ended = np.stack([rollout.ended, reference.ended], axis=1)
        else:
            pairs = rollout
            both = make_batch(rollout.prompt_ids, rollout.samples, rollout.mask, 2, rollout.width)
            a, b = (Batch(both.inputs[side::2], both.left_pad[side::2], both.completion[side::2], both.mask[side::2],
                          both.old_logp[side::2]) for side in (0, 1))
            ended = np.array(rollout.ended).reshape(-1, 2)
        scores, reward_metrics = self.score(pairs, state.step, should_stop)
        scores, a_chosen = judge_pairs(scores, ended, cfg.missing_eos_penalty)
        every = self.whole_batch(scores)  # (B, 2): a gang's ranks' together
        every_ended = self.whole_batch(ended.astype(np.float64)) > 0.5
        _, every_chosen = judge_pairs(every, every_ended, None)
        loss, stats, grad_norm = self.update_pairs(a, b, mx.array(a_chosen), state.step, on_finite_loss)

        tokens = sum(pairs.lengths) + sum(len(p) for p in rollout.prompt_ids) * 2
        state.num_tokens += tokens if self.gang.size == 1 else int(self.gang.sum(mx.array(tokens)).item())
        metrics = step_metrics(rollout, every, reward_metrics, loss, stats, grad_norm, self.optimizer, state.num_tokens,
                               self.gang, self.whole_batch)
        metrics.update(judge_metrics(every, every_ended, every_chosen, self.xpo), beta=cfg.beta)
        if self.xpo:
            metrics["alpha"] = cfg.alpha
        else:
            metrics["objective/rlhf_reward"] = metrics["objective/scores"] + metrics["objective/non_score_reward"]
        metrics["step_time"] = time.perf_counter() - t0
        state.step += 1
        return metrics, samples_event(rollout, scores if not self.xpo else scores[:, :1])

    def reference_rollout(self, rollout: Rollout, step: int, should_stop: Callable[[], bool]) -> Rollout:
        """XPO's other completion of each of the rollout's prompts: sampled by the reference, from
        a key of its own (the policy's is the step's)."""
        cfg = self.cfg
        key = mx.random.split(mx.random.key(step_seed(cfg.seed, step)))[1]
        t0 = time.perf_counter()
        with reference_sampling(self.model):
            samples = sample(self.model, self.decode_step, rollout.prompt_ids, 1, self.sampling, self.eos_ids, key,
                             should_stop, rollout.width)
        if samples is None:
            raise Cancelled()
        bodies, texts, lengths, ended, mask = completions(self.tokenizer, samples, cfg.stop)
        return dataclasses.replace(rollout, samples=samples, bodies=bodies, texts=texts, lengths=lengths, ended=ended,
                                   mask=mask, seconds=time.perf_counter() - t0)

    def update_pairs(self, a: Batch, b: Batch, a_chosen: mx.array, step: int,
                     on_finite_loss: Callable[[], None]) -> tuple[mx.array, dict, mx.array]:
        """One optimizer step on the pairs (a_i, b_i): the reference's log-probs first, then the
        loss's gradients summed over micro-batches of pairs (and a gang's ranks)."""
        model, n = self.model, len(a_chosen)
        per = max(1, self.memory.micro_batch_size // 2)
        parts = [slice(i, i + per) for i in range(0, n, per)]
        arrays = [[(x.inputs[s], x.left_pad[s], x.completion[s], x.mask[s]) for x in (a, b)] for s in parts]
        refs = []
        with lora_disabled(model):
            for part in arrays:
                refs.append([sequence_logprobs(model, rows, self.chunk_tokens) for rows in part])
                mx.eval(refs[-1])
        model.train()
        loss = stats = grads = None
        for s, (rows_a, rows_b), (ref_a, ref_b) in zip(parts, arrays, refs):
            share = mx.array(len(range(n)[s]) / self.cfg.batch_size, dtype=mx.float32)
            part = self.micro_batch_step(rows_a, rows_b, ref_a, ref_b, a_chosen[s], share)
            loss, stats, grads = part if loss is None else tree_map(mx.add, (loss, stats, grads), part)
            mx.eval(loss, stats, grads)
        loss, stats, grads = self.gang.sum_tree((loss, stats, grads))
        grads, grad_norm = clipped(grads, self.cfg.max_grad_norm)
        mx.eval(loss, grad_norm, stats)
        check_finite(loss.item(), grad_norm.item(), step + 1)
        on_finite_loss()
        self.optimizer.update(model, grads)
        mx.eval(model.trainable_parameters(), self.optimizer.state)
        model.eval()
        return loss, stats, grad_norm


def interleaved(first: list, second: list) -> list:
    """[first[0], second[0], first[1], ...]: per-row lists as pairs, the form GRPO's groups of 2 take."""
    return [x for pair in zip(first, second) for x in pair]


def load(job, spec, settings):
    """The job's Run: GRPO's (worker/kinds/grpo_job.py) with this module's trainer."""
    return grpo_job.load(job, spec, settings, OnlineDPOTrainer)
