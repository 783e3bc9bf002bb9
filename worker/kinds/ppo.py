"""PPO with a value head (TRL's PPOTrainer), on LoRA, top to bottom.

The policy is the base with the job's LoRA; the value function V is a linear head on the same
model's last hidden states (worker/kinds/reward_head.py: the reward job's head, here read at
every completion position): one forward pass gives both, and the value loss trains the LoRA too.
The reference policy is the base with the LoRA off (no second copy).

One step (= one `iter`), PPOTrainer.train's loop body:

  1. rollout: B = batch_size prompts, G = group_size completions each (TRL: 1), sampled as
     GRPO's (worker/kinds/grpo.py: the same sampler, stop strings and rows); N = B*G rows, mask m
     the completion tokens (EOS, or a stop string's last token, included).
  2. score: the job's reward sources (any of GRPO's: worker/rewards/) give each completion its
     score s_i (an unscorable one: 0); missing_eos_penalty is subtracted where a completion was
     cut at max_completion_len.
  3. at the rollout's weights, no gradient, one forward pass each:
         old_logp_t = log pi_old(o_t | q, o_<t)      (logits / temperature)
         V_t        = w . h_t + b                    h_t: the hidden state that predicts o_t
         ref_t      = log pi_ref(o_t | q, o_<t)      (when kl_coef > 0)
     per-token rewards, the score added at the completion's last token T:
         kl_t = old_logp_t - ref_t   (k1)   or   exp(r_t) - 1 - r_t, r_t = ref_t - old_logp_t   (k3)
         R_t  = -kl_coef * kl_t + [t == T] s_i
     (whiten_rewards: R whitened over the rollout's tokens, its mean kept). GAE, V and R 0 past T:
         delta_t = R_t + gamma V_{t+1} - V_t
         A_t     = delta_t + gamma lam A_{t+1}
         ret_t   = A_t + V_t
     and A whitened over the rollout's tokens: (A - mean) / sqrt(var + 1e-8), var unbiased.
  4. update: num_ppo_epochs passes; each shuffles the N rows (seeded by the step) into
     num_mini_batches minibatches, and each minibatch is one AdamW update of the LoRA and the
     head (gradient clipped to max_grad_norm), minimising, over its tokens (masked means):
         ratio_t   = exp(logp_t - old_logp_t)
         pg_loss   = mean_t max(-A_t ratio_t, -A_t clip(ratio_t, 1 - cliprange, 1 + cliprange))
         Vc_t      = clip(V_t, V_old_t - cliprange_value, V_old_t + cliprange_value)
         vf_loss   = 0.5 mean_t max((V_t - ret_t)^2, (Vc_t - ret_t)^2)
         loss      = pg_loss + vf_coef * vf_loss
     A minibatch goes through forward+backward micro_batch_size rows at a time (GRPO's memory
     plan), each part normalised by the minibatch's tokens, so the parts add up to it.

Where this differs from TRL's code: the score sits at the last completion token (TRL puts it one
past the EOS, on a padding position whose value it also trains); old_logp comes from a forward
pass, not the sampler's logits (the same distribution: the first update's ratio is exactly 1);
the statistics are masked means (TRL's approxkl and ratio average padding in).

Metrics, named as TRL's: objective/kl (mean over rows of sum_t kl_t), objective/entropy (of
sum_t -old_logp_t), objective/non_score_reward (of sum_t -kl_coef kl_t), objective/scores,
objective/rlhf_reward (their sum), and the means over the step's updates of policy/approxkl_avg
(0.5 mean_t (logp - old_logp)^2), policy/clipfrac_avg, loss/policy_avg, loss/value_avg,
val/clipfrac_avg, val/ratio (its variance over updates: val/ratio_var); `loss` is the mean of
the updates' losses; reward, completions/*, entropy ... as GRPO's.
"""

import contextlib
import functools
import json
import time
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from shared.adapters import HEAD_FILE, init_adapter_dir
from shared.ppo_specs import PPOJobCreate
from worker.kinds.grpo import GRPOTrainer, samples_event, step_metrics
from worker.kinds.grpo_job import MarkedScorer, sampling_calls
from worker.kinds.reward_head import RewardModel, load_head, new_head, save_head
from worker.rewards.scorer import build_scorer
from worker.runtime import score_requests
from worker.runtime.adapter_layers import (
    adapter_config, attach_adapter, lora_disabled, remove_adapter_layers, save_adapter, started_from,
)
from worker.runtime.logprobs import completion_hidden, head_logprobs
from worker.runtime.models import get_model
from worker.runtime.scalars import as_inputs
from worker.runtime.surrogate import clipped_surrogate
from worker.runtime.train_core import Cancelled, Run, TrainState, check_finite, clipped, make_optimizer, step_seed

HISTORY_METRICS = ("loss", "reward", "objective/kl", "loss/policy_avg", "loss/value_avg", "learning_rate", "step_time")
WHITEN_EPS = 1e-8

# --------------------------------------------------------------------------- the math


def masked_whiten(x: np.ndarray, mask: np.ndarray, shift_mean: bool = True) -> np.ndarray:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries, var unbiased (TRL's masked_whiten);
    shift_mean=False keeps the mean."""
    n = mask.sum()
    mean = (x * mask).sum() / max(n, 1)
    var = ((x - mean) ** 2 * mask).sum() / max(n - 1, 1)
    whitened = (x - mean) / np.sqrt(var + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def token_kl(logp: np.ndarray, ref_logp: np.ndarray, estimator: str) -> np.ndarray:
    """The per-token KL estimate of the policy from the reference (Schulman's k1 or k3)."""
    r = ref_logp - logp
    return -r if estimator == "k1" else np.expm1(r) - r


def token_rewards(scores: np.ndarray, kl: np.ndarray, mask: np.ndarray, kl_coef: float) -> np.ndarray:
    """R_t = -kl_coef kl_t on the completion tokens, plus the row's score at its last one. (N, L)."""
    rewards = -kl_coef * kl * mask
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)  # the last completion token of each row
    rewards[np.arange(len(scores)), last] += scores
    return rewards


def gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimates and returns, (N, L) each; rewards and values 0 past a row's end."""
    advantages = np.zeros_like(rewards)
    last = np.zeros(rewards.shape[0], rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        next_values = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        last = rewards[:, t] + gamma * next_values - values[:, t] + gamma * lam * last
        advantages[:, t] = last
    return advantages, advantages + values


def ppo_loss(logp: mx.array, values: mx.array, old_logp: mx.array, old_values: mx.array, advantages: mx.array,
             returns: mx.array, mask: mx.array, *, cliprange: float | mx.array, cliprange_value: float | mx.array,
             vf_coef: float | mx.array,
             n_tokens: mx.array | None = None) -> tuple[mx.array, dict[str, mx.array]]:
    """PPO's clipped policy loss and clipped value loss over rows of completion tokens, all (rows, L).
    n_tokens: the whole minibatch's tokens when these rows are a micro-batch of it (default:
    these rows'): every term is a sum over tokens divided by it, so the parts add up."""
    mask = mask.astype(mx.float32)
    n_tokens = mx.maximum(mask.sum(), 1.0) if n_tokens is None else n_tokens

    def mean(x):
        return (x * mask).sum() / n_tokens

    v_clipped = mx.clip(values, old_values - cliprange_value, old_values + cliprange_value)
    vf1, vf2 = mx.square(values - returns), mx.square(v_clipped - returns)
    vf_loss = 0.5 * mean(mx.maximum(vf1, vf2))
    log_ratio = logp - old_logp
    ratio = mx.exp(log_ratio)
    pg_loss = mean(clipped_surrogate(ratio, advantages, 1.0 - cliprange, 1.0 + cliprange))
    pg_clipped = -advantages * mx.clip(ratio, 1.0 - cliprange, 1.0 + cliprange) > -advantages * ratio
    return pg_loss + vf_coef * vf_loss, {
        "loss/policy_avg": pg_loss, "loss/value_avg": vf_loss,
        "policy/clipfrac_avg": mean(pg_clipped.astype(mx.float32)), "val/clipfrac_avg": mean((vf2 > vf1).astype(mx.float32)),
        "policy/approxkl_avg": 0.5 * mean(mx.square(log_ratio)), "val/ratio": mean(ratio),
    }


# --------------------------------------------------------------------------- the trainer


class PPOTrainer(GRPOTrainer):
    """GRPO's trainer for its rollout, scoring and evaluation; PPO's own rollout values,
    advantages and updates. `module`: the policy and its value head, the job's trainable
    weights (and its checkpoint's)."""

    def __init__(self, model: nn.Module, tokenizer, spec: PPOJobCreate, scorer, head: nn.Linear):
        super().__init__(model, tokenizer, spec, scorer)
        cfg = self.cfg
        self.module = RewardModel(model, head)
        self.optimizer = make_optimizer(cfg, cfg.iters * cfg.num_ppo_epochs * cfg.num_mini_batches)
        self.optimizer.init(self.module.trainable_parameters())
        clip = as_inputs(cliprange=cfg.cliprange, cliprange_value=cfg.cliprange_value, vf_coef=cfg.vf_coef)
        self.numbers.update(clip)  # the compiled step's inputs (worker/runtime/scalars.py), with the temperature

        def loss_fn(module, inputs, pad, completion, mask, old_logp, old_values, advantages, returns, n_tokens):
            logp, values = self.policy_and_values(module, inputs, pad, completion, self.memory.gradient_checkpointing)
            return ppo_loss(logp, values, old_logp, old_values, advantages, returns, mask, n_tokens=n_tokens,
                            **{name: self.numbers[name] for name in clip})

        value_and_grad = nn.value_and_grad(self.module, loss_fn)
        state = [self.module.state, mx.random.state]

        def micro_batch_step(*arrays):
            (loss, stats), grads = value_and_grad(self.module, *arrays)
            return loss, stats, grads

        self.ppo_step = mx.compile(micro_batch_step, inputs=[*state, self.numbers], outputs=state)

    def policy_and_values(self, module: RewardModel, inputs: mx.array, pad: mx.array, completion: mx.array,
                          checkpointing: bool = False) -> tuple[mx.array, mx.array]:
        """log pi(o_t) and V_t at every completion position, from one forward pass."""
        rows, L = completion.shape
        hidden = completion_hidden(module.lm, inputs, pad, L, checkpointing)
        logp = head_logprobs(module.lm, hidden.reshape(rows * L, -1), completion.reshape(-1, 1),
                             self.numbers["temperature"], self.chunk_tokens).reshape(rows, L)
        # The head reads the hidden states with their gradient stopped: the value loss trains the
        # head alone, so a large value error never moves the policy (docs/kinds.md#ppo).
        return logp, module.head(mx.stop_gradient(hidden).astype(mx.float32))[..., 0]

    def rollout_values(self, batch) -> tuple[np.ndarray, np.ndarray]:
        """Phase 3's old_logp and V at the rollout's weights (no gradient), micro-batch by micro-batch."""
        parts = []
        for rows in self.micro_batches(batch):
            part = self.policy_and_values(self.module, batch.inputs[rows], batch.left_pad[rows], batch.completion[rows])
            mx.eval(part)  # now, one micro-batch at a time (peak memory)
            parts.append(part)
        return tuple(np.array(mx.concatenate(p), dtype=np.float64) for p in zip(*parts))

    def step(self, state: TrainState, should_stop: Callable[[], bool],
             on_finite_loss: Callable[[], None] = lambda: None) -> tuple[dict[str, float], dict]:
        """One iter, the module docstring's four phases. Returns the metrics and the samples event."""
        cfg = self.cfg
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        rollout = self.rollout(state.step, should_stop)
        rewards, reward_metrics = self.score(rollout, state.step, should_stop)
        scores = np.nan_to_num(rewards.reshape(-1), nan=0.0)
        if cfg.missing_eos_penalty is not None:
            scores = scores - cfg.missing_eos_penalty * ~np.array(rollout.ended)

        batch = self.loss_batch(rollout)  # beta is 0: no reference pass there (kl_coef's is below)
        mask = np.array(batch.mask, dtype=np.float64)
        old_logp, old_values = self.rollout_values(batch)
        if cfg.kl_coef > 0:
            with lora_disabled(self.model):
                ref_logp = np.array(self.forward_logprobs(batch), dtype=np.float64)
        else:
            ref_logp = old_logp
        kl = token_kl(old_logp, ref_logp, cfg.kl_estimator) * mask
        token_reward = token_rewards(scores, kl, mask, cfg.kl_coef)
        if cfg.whiten_rewards:
            token_reward = masked_whiten(token_reward, mask, shift_mean=False) * mask
        values = old_values * mask
        advantages, returns = gae(token_reward, values, cfg.gamma, cfg.lam)
        advantages = masked_whiten(advantages, mask) * mask
        as_mx = functools.partial(mx.array, dtype=mx.float32)
        arrays = (as_mx(old_logp), as_mx(values), as_mx(advantages), as_mx(returns))
        updates, grad_norm = self.ppo_updates(batch, arrays, state.step, should_stop, on_finite_loss)

        tokens = sum(rollout.lengths) + sum(len(p) for p in rollout.prompt_ids) * rollout.rows_per_prompt
        state.num_tokens += tokens
        loss = float(np.mean([u["loss"] for u in updates]))
        metrics = step_metrics(rollout, rewards, reward_metrics, mx.array(loss), {}, grad_norm, self.optimizer,
                               state.num_tokens)
        non_score = (-cfg.kl_coef * kl).sum(axis=1).mean()
        ratios = [u["val/ratio"] for u in updates]
        metrics.update({
            **{k: float(np.mean([u[k] for u in updates])) for k in updates[0] if k != "loss"},
            "objective/kl": float(kl.sum(axis=1).mean()),
            "objective/entropy": float((-old_logp * mask).sum(axis=1).mean()),
            "objective/non_score_reward": float(non_score),
            "objective/scores": float(scores.mean()),
            "objective/rlhf_reward": float(non_score + scores.mean()),
            "val/ratio_var": float(np.var(ratios, ddof=1)) if len(ratios) > 1 else 0.0,
            "val/num_eos_tokens": int(np.array(rollout.samples.ended).sum()),
            "episode": (state.step + 1) * len(scores),
        })
        metrics["step_time"] = time.perf_counter() - t0
        state.step += 1
        return metrics, samples_event(rollout, rewards)

    def ppo_updates(self, batch, arrays: tuple[mx.array, ...], step: int, should_stop: Callable[[], bool],
                    on_finite_loss: Callable[[], None]) -> tuple[list[dict[str, float]], mx.array]:
        """Phase 4: num_ppo_epochs x num_mini_batches updates. Returns each update's loss and
        statistics, and the last one's gradient norm."""
        cfg = self.cfg
        n = batch.inputs.shape[0]
        size = n // cfg.num_mini_batches
        shuffle = np.random.RandomState(step_seed(cfg.seed, step) % 2**32)  # as before on resume
        updates, grad_norm = [], None
        self.model.train()
        for _ in range(cfg.num_ppo_epochs):
            order = shuffle.permutation(n)
            for j in range(cfg.num_mini_batches):
                if updates and should_stop():
                    raise Cancelled()
                rows = mx.array(order[j * size:(j + 1) * size])
                loss, stats, grad_norm, grads = self.minibatch_grads(batch, rows, arrays)
                mx.eval(loss, stats, grad_norm)
                check_finite(loss.item(), grad_norm.item(), step + 1)
                if not updates:
                    on_finite_loss()
                self.optimizer.update(self.module, grads)
                mx.eval(self.module.trainable_parameters(), self.optimizer.state)
                updates.append({"loss": loss.item(), **{k: v.item() for k, v in stats.items()}})
        self.model.eval()
        return updates, grad_norm

    def minibatch_grads(self, batch, rows: mx.array, arrays: tuple[mx.array, ...]):
        """A minibatch's loss, statistics, gradient norm and clipped gradients, summed over its micro-batches."""
        inputs, pad, completion, mask = (batch.inputs[rows], batch.left_pad[rows], batch.completion[rows], batch.mask[rows])
        per_row = [a[rows] for a in arrays]
        n_tokens = mx.maximum(mask.sum(), 1).astype(mx.float32)
        m = self.memory.micro_batch_size
        total = None
        for i in range(0, rows.shape[0], m):
            part = self.ppo_step(inputs[i:i + m], pad[i:i + m], completion[i:i + m], mask[i:i + m],
                                 *(a[i:i + m] for a in per_row), n_tokens)
            total = part if total is None else tree_map(mx.add, total, part)
            mx.eval(total)
        loss, stats, grads = total
        grads, grad_norm = clipped(grads, self.cfg.max_grad_norm)
        return loss, stats, grad_norm, grads

    def save(self, out_dir: Path) -> None:
        """The adapter, and the value head beside it (value_head.safetensors, as a reward model's)."""
        save_adapter(self.model, out_dir, {**adapter_config(self.cfg), "value_head": HEAD_FILE})
        save_head(self.module.head, out_dir)


# --------------------------------------------------------------------------- the job


def start_head(model: nn.Module, init: Path | None) -> nn.Linear:
    """The init_adapter's value head where it has one (a reward model's or a PPO job's), else a head of 0s."""
    return load_head(init) if init is not None and (init / HEAD_FILE).is_file() else new_head(model)


@contextlib.contextmanager
def load(job, spec: PPOJobCreate, settings) -> Iterator[Run]:
    """The job's Run: the shared model with the job's LoRA and value head, its reward sources."""
    cfg = spec.config
    t0 = time.perf_counter()
    model, tokenizer, cached = get_model(spec.model_id, settings)
    if not cached:
        job.publish_loaded()
    init = init_adapter_dir(job.lease.r, settings, spec.init_adapter)
    job.write(event={"type": "model_ready", "cached": cached, "load_s": time.perf_counter() - t0, **started_from(spec)})
    reward_model = functools.partial(score_requests.reward_model_rewards, tenant=job.tenant)
    waiting = functools.partial(job.serving_while, spec.model_id)  # answers scoring requests while a reward server waits
    with build_scorer(spec, job.job_id, reward_model=reward_model, waiting=waiting) as scorer:
        mx.random.seed(cfg.seed)  # LoRA init
        attach_adapter(model, cfg, init=init)
        try:
            trainer = PPOTrainer(model, tokenizer, spec, MarkedScorer(scorer, job), start_head(model, init))
            job.write(memory_plan=json.dumps(trainer.memory.as_record()))
            step, evaluate = sampling_calls(trainer, job)

            yield Run(module=trainer.module, optimizer=trainer.optimizer, step=step, save=trainer.save, phase="sampling",
                      history_metrics=HISTORY_METRICS, steps_per_save=cfg.checkpoint_every,
                      evaluate=evaluate if spec.validation_prompts else None, steps_per_eval=cfg.eval_interval)
        finally:
            remove_adapter_layers(model)  # the process keeps the model for the next job
