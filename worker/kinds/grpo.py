"""GRPO with LoRA on an mlx_lm model, top to bottom.

One step (= one `iter` of the job config), GRPOTrainer.step, in four phases:

  1. rollout: take B = batch_size prompts; sample G = group_size completions each, all B*G rows
     decoding together (the batched sampler, worker/decode/). For every completion token t we keep
         old_logp_t = log pi_old(o_t | q, o_<t)      (logits / temperature, as sampled)
     The sampling KV cache is freed when sampling returns, before the loss step.
     A completion ends at EOS, at max_completion_len, or just after the token that
     completes a stop string (its text is cut before the stop string).
  2. score: each completion on its text decoded without special tokens: r_i
     (worker/rewards/; NaN when every reward source returned None).
  3. advantages: the rewards normalised inside each group of G over the scorable completions:
         A_i = (r_i - nanmean_group(r)) / (nanstd(r) + 1e-4)    std: of the group, the batch, or 1
         A_i = 0 where r_i is NaN (or where the std is undefined: fewer than 2 scorable)
  4. update, mu = num_iterations times: forward the B*G sequences under the current LoRA weights
     theta, and minimise the clipped surrogate (TRL's GRPO):
         log_ratio_t = logp_t - old_logp_t                 token level
                     = mean_t(logp_t - old_logp_t)         sequence level (GSPO), one per row
         ratio_t     = exp(log_ratio_t)
         loss_t      = -min(ratio_t * A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_i)   (worker/runtime/surrogate.py)
                       + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)      (k3 KL)
     where ref_t is the log-prob under the base model (the same weights with LoRA off),
     computed only when beta > 0. old_logp is, as in TRL:
         mu == 1:  stop_gradient(logp): the ratio is exactly 1 and the update on-policy,
                   also under LoRA dropout (sampling runs without it, the loss with it)
         mu > 1:   log-probs recorded in the mode the loss runs in: sampling's own when
                   lora_dropout == 0, else a train-mode (dropout) forward pass before the
                   first update
     Aggregated over completion tokens (mask m):
         grpo:    sum_i( sum_t m loss_t / sum_t m ) / (B*G)
         bnpo:    sum m loss_t / sum m
         dapo:    sum m loss_t / sum m          (tokens of the whole generation batch)
         dr_grpo: sum m loss_t / (B*G * max_completion_len)
     Memory: the rows go through forward+backward micro_batch_size at a time and the
     gradients add up. Every normaliser above (B*G, sum m) is the whole step's, so the sum
     of the micro-batches' losses and gradients is the step's. Log-probs of the chosen
     tokens are computed from the last hidden states of completion positions only, a
     chunk of positions at a time (full-vocabulary float32 logits of one chunk at once);
     with gradient checkpointing each layer keeps only its input and recomputes the rest
     in the backward pass (worker/runtime/memory_plan.py estimates all this before the job
     starts). The optimizer step: AdamW on the LoRA weights only, bias-corrected as PyTorch's
     (TRL's numerics: betas adam_beta1/adam_beta2, eps adam_epsilon), gradients clipped to
     max_grad_norm:
         m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  theta *= 1 - lr * weight_decay
         theta -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

The phases are GRPOTrainer's methods (rollout, score, advantages, loss_batch and update, loss):
the kinds built on this sampler and its reward sources replace phase 3 and the loss (rloo.py,
reinforce.py).

On a gang of N workers (config.workers, worker/runtime/gang_group.py) each rank runs the four
phases on every N-th of the step's B prompts with their groups: it pads them to the whole step's
width and draws each row's random numbers as that row of the whole batch would (so it samples
what one worker would), sums every rank's rewards into the whole (B, G) before the advantages,
and sums the loss, its statistics and gradients (normalised by the whole step's B*G and tokens)
before clipping: the update is one worker's for the same B prompts.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from shared.schemas import GRPOConfig, JobCreate, PromptItem
from worker.agentic.answering import Answerer, RowEpisode
from worker.decode.draw import Samples, SamplingParams
from worker.decode.episodes import Limits, make_episode_step, sample_episodes
from worker.decode.sampling import make_decode_step, sample
from worker.rewards.batch import RewardStopped
from worker.runtime.adapter_layers import lora_disabled
from worker.runtime.gang_group import SOLO, Gang
from worker.runtime.logprobs import (
    as_item,
    completion_logprobs,
    divisor,
    eos_token_ids,
    left_pad,
    prompt_messages,
    prompt_token_ids,
)
from worker.runtime.memory_plan import GB, logits_chunk_tokens, model_shape, plan_memory
from worker.runtime.scalars import as_inputs
from worker.runtime.surrogate import clipped_sides, clipped_surrogate
from worker.runtime.train_core import Cancelled, TrainState, batch_indices, check_finite, clipped, make_optimizer, step_seed

ADV_EPS = 1e-4
# The per-step `samples` event lives in Redis: each completion in it is cut to SAMPLE_TEXT_CHARS,
# and to fewer when the step has so many rows that the event would pass SAMPLES_EVENT_CHARS.
SAMPLE_TEXT_CHARS = 2000
SAMPLES_EVENT_CHARS = 262_144
HISTORY_METRICS = ("loss", "reward", "reward_std", "entropy", "completions/mean_length", "learning_rate", "step_time")
LENGTH_BUCKET = 16  # pad completion lengths to a multiple of this so the loss compiles for few shapes
EVAL_STEP = 1_000_002  # evaluations draw from this step's key: past every job's steps (iters is at most 1,000,000)


# --------------------------------------------------------------------------- the math


def nan_mean(x: np.ndarray, axis=None, keepdims: bool = False) -> np.ndarray:
    """Mean over the non-NaN values; NaN where there is none (torch.nanmean)."""
    valid = ~np.isnan(x)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(valid, x, 0.0).sum(axis, keepdims=keepdims) / valid.sum(axis, keepdims=keepdims)


def nan_std(x: np.ndarray, axis=None, keepdims: bool = False) -> np.ndarray:
    """Unbiased std over the non-NaN values; NaN where there are fewer than 2 (TRL's nanstd)."""
    valid = ~np.isnan(x)
    n = valid.sum(axis, keepdims=keepdims)
    with np.errstate(invalid="ignore", divide="ignore"):
        sq = np.where(valid, (x - nan_mean(x, axis, keepdims=True)) ** 2, 0.0).sum(axis, keepdims=keepdims)
        return np.where(n > 1, np.sqrt(sq / np.maximum(n - 1, 1)), np.nan)


def advantages_from_rewards(rewards: np.ndarray, scale_rewards: str) -> np.ndarray:
    """rewards: (B, G), NaN = unscorable. Returns (B, G) advantages, normalised per group
    over the scorable completions (TRL's convention: unbiased std; advantage 0 for an
    unscorable completion and where the std is undefined, e.g. groups of one)."""
    mean = nan_mean(rewards, axis=1, keepdims=True)
    if scale_rewards == "group":
        std = nan_std(rewards, axis=1, keepdims=True)
    elif scale_rewards == "batch":
        std = np.full_like(mean, nan_std(rewards))
    else:
        std = np.zeros_like(mean) + (1.0 - ADV_EPS)  # divide by exactly 1
    with np.errstate(invalid="ignore"):
        advantages = (rewards - mean) / (std + ADV_EPS)
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32)


def grpo_loss(
    logp: mx.array,
    old_logp: mx.array,
    ref_logp: mx.array | None,
    advantages: mx.array,
    mask: mx.array,
    *,
    loss_type: str,
    importance_sampling_level: str,
    epsilon_low: float | mx.array,
    epsilon_high: float | mx.array,
    beta: float | mx.array,
    max_completion_len: int | mx.array,
    n_rows: mx.array | None = None,
    n_tokens: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """The GRPO objective for rows of completion tokens. logp, old_logp, ref_logp, mask:
    (rows, T); advantages: (rows,). Returns the scalar loss and per-step statistics. The numbers
    may be arrays, a compiled step's inputs (worker/runtime/scalars.py); an array beta counts as
    above 0 (the KL term is there).

    n_rows, n_tokens: the whole step's rows and max(completion tokens, 1) when these rows
    are one micro-batch of it (default: these rows' own). Loss and statistics are sums over
    these rows divided by step-wide counts, so the micro-batches' values add up to the step's."""
    mask = mask.astype(mx.float32)
    n_rows = mask.shape[0] if n_rows is None else n_rows
    n_tokens = mx.maximum(mask.sum(), 1.0) if n_tokens is None else n_tokens
    tokens_per_row = mx.maximum(mask.sum(axis=1), 1.0)
    log_ratio = logp - old_logp
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(axis=1) / tokens_per_row)[:, None]
    ratio = mx.exp(log_ratio)
    A = advantages[:, None]
    per_token = clipped_surrogate(ratio, A, 1.0 - epsilon_low, 1.0 + epsilon_high)

    kl = None
    if isinstance(beta, mx.array) or beta > 0.0:
        d = ref_logp - logp
        kl = mx.exp(d) - d - 1.0
        per_token = per_token + beta * kl

    if loss_type == "grpo":
        loss = ((per_token * mask).sum(axis=1) / tokens_per_row).sum() / n_rows
    elif loss_type in ("bnpo", "dapo"):
        loss = (per_token * mask).sum() / n_tokens
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (n_rows * max_completion_len)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    # Statistics as TRL defines them: means over completion tokens, or over sequences when
    # the ratio is one per sequence (sequence level).
    def token_mean(x):
        return (mx.broadcast_to(x, mask.shape) * mask).sum() / n_tokens

    def ratio_mean(x):
        return x.sum() / n_rows if importance_sampling_level == "sequence" else token_mean(x)

    low, high = clipped_sides(ratio, A, 1.0 - epsilon_low, 1.0 + epsilon_high)
    stats = {
        "clip_ratio/low_mean": ratio_mean(low.astype(mx.float32)),
        "clip_ratio/high_mean": ratio_mean(high.astype(mx.float32)),
        "clip_ratio/region_mean": ratio_mean((low | high).astype(mx.float32)),
        "mean_ratio": ratio_mean(ratio),
    }
    if kl is not None:
        stats["kl"] = token_mean(kl)
    return loss, stats


# --------------------------------------------------------------------------- the batch


@dataclass
class Batch:
    """B*G rows: left-padded prompt, then completion (right-padded to a length bucket)."""

    inputs: mx.array  # (rows, P + L) int32
    left_pad: mx.array  # (rows,) int32
    completion: mx.array  # (rows, L) int32
    mask: mx.array  # (rows, L) bool
    old_logp: mx.array  # (rows, L) float32
    advantages: mx.array | None = None  # (rows,) float32, once phase 3 has them
    ref_logp: mx.array | None = None


def make_batch(prompt_ids: list[list[int]], samples: Samples, mask: mx.array, group_size: int,
               width: int | None = None) -> Batch:
    prompts, pad = left_pad([p for p in prompt_ids for _ in range(group_size)], pad_id=0, width=width)
    used = max(int(samples.steps), 1)
    L = min(samples.tokens.shape[1], math.ceil(used / LENGTH_BUCKET) * LENGTH_BUCKET)
    completion = samples.tokens[:, :L]
    return Batch(
        inputs=mx.concatenate([prompts, completion], axis=1),
        left_pad=pad,
        completion=completion,
        mask=mask[:, :L],
        old_logp=samples.logprobs[:, :L],
    )


# --------------------------------------------------------------------------- completions as text


def completion_text(tokenizer, tokens: list[int]) -> str:
    """What reward functions see: special tokens (EOS, chat markers) left out, as TRL decodes."""
    return tokenizer.decode(tokens, skip_special_tokens=True)


def cut_at_stop_strings(tokenizer, tokens: list[int], stops: list[str]) -> tuple[str, int, bool]:
    """Text cut just before the first stop string, the tokens that stay in the completion
    (up to the one that completes the stop string), and whether a stop string was found."""
    text = completion_text(tokenizer, tokens)
    hits = [text.find(s) for s in stops if s and s in text]
    if not hits:
        return text, len(tokens), False
    cut = min(hits)
    for n in range(1, len(tokens) + 1):  # fewest tokens whose text reaches past the stop string
        if len(completion_text(tokenizer, tokens[:n])) > cut:
            return text[:cut], n, True
    return text[:cut], len(tokens), True


def completions(tokenizer, samples: Samples,
                stops: list[str]) -> tuple[list[list[int]], list[str], list[int], list[bool], mx.array]:
    """Each sampled row's body (its tokens without its EOS: what its text decodes), its text for
    the rewards (cut before a stop string), its tokens in the loss (its EOS, or the stop
    string's last token, included), whether it ended (EOS or a stop string) and the loss mask."""
    rows = samples.tokens.tolist()
    lengths = samples.mask.sum(axis=1).tolist()
    ended = samples.ended.tolist()
    # A row that ended has its EOS as last token: part of the loss, not of the text.
    bodies = [r[: n - 1] if e else r[:n] for r, n, e in zip(rows, lengths, ended)]
    mask = samples.mask
    if not stops:
        return bodies, [completion_text(tokenizer, body) for body in bodies], lengths, ended, mask
    texts, cut = [], []
    for i, body in enumerate(bodies):
        text, k, hit = cut_at_stop_strings(tokenizer, body, stops)
        texts.append(text)
        cut.append(k if hit else lengths[i])
        ended[i] = ended[i] or hit
    return bodies, texts, cut, ended, mx.arange(mask.shape[1])[None, :] < mx.array(cut)[:, None]


# --------------------------------------------------------------------------- the trainer


class JobDoesNotFitModel(ValueError):
    """The job asks for more than the model has: its context or its vocabulary."""


def check_fits_model(model: nn.Module, prompt_ids: list[list[int]], cfg: GRPOConfig, multi_turn: bool = False,
                     name: str = "prompts") -> None:
    """Before the first step: every prompt (tokenised; of the spec's field `name`) plus
    max_completion_len (a multi-turn job's: max_episode_len) fits the model's context, and top_k
    is within its vocabulary. (The API could only estimate from characters.)"""
    args = getattr(model, "args", None)
    context = getattr(args, "max_position_embeddings", None)
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    after, what = (cfg.episode_len, "max_episode_len") if multi_turn else (cfg.max_completion_len, "max_completion_len")
    if context and len(prompt_ids[longest]) + after > context:
        raise JobDoesNotFitModel(
            f"{name}[{longest}] is {len(prompt_ids[longest])} tokens; with {what} "
            f"{after} that exceeds the model's context of {context} tokens"
        )
    vocab = getattr(args, "vocab_size", None)
    if vocab and cfg.top_k > vocab:
        raise JobDoesNotFitModel(f"top_k {cfg.top_k} is larger than the model's vocabulary ({vocab} tokens)")


@dataclass
class Rollout:
    """Phase 1's result: the step's prompts and their B*G sampled completions, group by group."""

    indices: list[int]  # the step's prompts
    items: list[PromptItem]
    prompt_ids: list[list[int]]
    samples: Samples
    bodies: list[list[int]]  # each completion's tokens without its EOS (what its text decodes)
    texts: list[str]  # each completion's text for the rewards (cut before a stop string)
    lengths: list[int]  # each completion's tokens in the loss (its EOS, or the stop string's last token, included)
    ended: list[bool]  # ended by EOS or a stop string (not cut at max_completion_len)
    mask: mx.array  # (rows, L) bool: the completion tokens (of a multi-turn row: the model's)
    seconds: float  # of sampling
    width: int  # the prompts' padded width: the longest of the whole step's (a gang's too)
    rows_per_prompt: int  # rows each of prompt_ids stands for: G, or 1 where each row has its own (multi-turn)
    episodes: list[RowEpisode] = field(default_factory=list)  # a multi-turn step's, row by row

    def groups(self, per_row: list) -> list[list]:
        """A per-row list as B groups of G."""
        G = len(per_row) // len(self.items)
        return [per_row[b * G:(b + 1) * G] for b in range(len(self.items))]


class GRPOTrainer:
    """Runs the steps of one job on a model with LoRA attached (worker/runtime/adapter_layers.py)."""

    def __init__(self, model: nn.Module, tokenizer, spec: JobCreate, scorer, gang: Gang = SOLO,
                 answerer: Answerer | None = None):
        self.model, self.tokenizer, self.spec, self.cfg, self.scorer = model, tokenizer, spec, spec.config, scorer
        cfg = self.cfg
        self.answerer = answerer  # a multi-turn job's tools and environment (docs/agentic.md)
        # A gang's rank (worker/runtime/gang_group.py) takes every size-th prompt of a step, and its groups' rows.
        self.gang = gang
        self.positions = gang.share(list(range(cfg.batch_size)))
        rows = tuple(b * cfg.group_size + g for b in self.positions for g in range(cfg.group_size))
        self.items = [as_item(p) for p in spec.prompts]
        if answerer is None:
            self.prompt_ids = [prompt_token_ids(tokenizer, it, cfg.use_chat_template) for it in self.items]
        else:  # with the tools' schemas; an environment's first observation comes on top, per episode
            self.prompt_ids = [answerer.conversation(prompt_messages(it.prompt)).prompt_tokens() for it in self.items]
        check_fits_model(model, self.prompt_ids, cfg, answerer is not None)
        # Validation prompts (a job of one turn's: the schema refuses them with tools or an environment).
        self.val_items = [as_item(p) for p in spec.validation_prompts or []]
        self.val_ids = [prompt_token_ids(tokenizer, it, cfg.use_chat_template) for it in self.val_items]
        if self.val_ids:
            check_fits_model(model, self.val_ids, cfg, name="validation_prompts")
        self.eos_ids = eos_token_ids(tokenizer)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.sampling = SamplingParams(cfg.max_completion_len, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
                                       *((rows, cfg.batch_size * cfg.group_size) if gang.size > 1 else ()))
        # An evaluation's rows are all its own (on a gang it runs on rank 0 alone: grpo_job.py).
        self.eval_sampling = SamplingParams(cfg.max_completion_len, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)
        # Memory: fails here, before anything runs, when even one row cannot fit. A gang's rank
        # holds its rows only (as shared/routing.py member_step sizes it).
        width = max(len(p) for p in self.prompt_ids) + (cfg.max_completion_len if answerer is None else cfg.episode_len)
        self.memory = plan_memory(
            model, len(rows), width, cfg.use_gradient_checkpointing,
            cfg.micro_batch_size, cfg.max_memory_gb,
        )
        self.pad_id = pad_id
        if answerer is None:
            self.decode_step = make_decode_step(model, self.sampling, self.eos_ids, pad_id,
                                                dense=self.memory.dense_decode_gb > 0)
        else:
            self.decode_step = make_episode_step(model, self.sampling, self.eos_ids, pad_id,
                                                 dense=self.memory.dense_decode_gb > 0)
        self.optimizer = make_optimizer(cfg, cfg.iters * cfg.num_iterations)
        self.optimizer.init(model.trainable_parameters())
        self.chunk_tokens = logits_chunk_tokens(model_shape(model).vocab)
        # The loss's numbers as inputs of the compiled step, not compiled into its kernels
        # (worker/runtime/scalars.py); beta only where the KL term is there.
        self.numbers = as_inputs(temperature=divisor(cfg.temperature), epsilon_low=cfg.epsilon_low,
                                 epsilon_high=cfg.epsilon_upper, max_completion_len=cfg.max_completion_len,
                                 **({"beta": cfg.beta} if cfg.beta > 0 else {}))
        # MLX queues GPU work ahead of the host and frees a buffer only once its kernel has
        # run, so without a limit the whole backward pass (recomputed layers included) can
        # be alive at once. Above this limit its scheduler waits for queued work first.
        mx.set_memory_limit(int(self.memory.memory_limit_gb * GB))  # with a budget (max_memory_gb): the budget

        on_policy = cfg.num_iterations == 1

        def loss_fn(model, inputs, pad, completion, mask, old_logp, ref_logp, advantages, n_rows, n_tokens):
            logp = completion_logprobs(
                model, inputs, pad, completion, self.numbers["temperature"], self.chunk_tokens,
                self.memory.gradient_checkpointing,
            )
            if on_policy:  # TRL: old = detached current log-probs, so the ratio is exactly 1
                old_logp = mx.stop_gradient(logp)
            return self.loss(logp, old_logp, ref_logp, advantages, mask, n_rows, n_tokens)

        value_and_grad = nn.value_and_grad(model, loss_fn)
        state = [model.state, mx.random.state]

        def micro_batch_step(*arrays):
            (loss, stats), grads = value_and_grad(model, *arrays)
            return loss, stats, grads

        self.micro_batch_step = mx.compile(micro_batch_step, inputs=[*state, self.numbers], outputs=state)

    def loss(self, logp: mx.array, old_logp: mx.array, ref_logp: mx.array, advantages: mx.array, mask: mx.array,
             n_rows: mx.array, n_tokens: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        """The objective of phase 4 (grpo_loss; the kinds built on this trainer give their own)."""
        cfg, n = self.cfg, self.numbers
        return grpo_loss(logp, old_logp, ref_logp, advantages, mask, loss_type=cfg.loss_type,
                         importance_sampling_level=cfg.importance_sampling_level, epsilon_low=n["epsilon_low"],
                         epsilon_high=n["epsilon_high"], beta=n.get("beta", 0.0),
                         max_completion_len=n["max_completion_len"], n_rows=n_rows, n_tokens=n_tokens)

    def advantages(self, every: np.ndarray, batch: Batch) -> np.ndarray:
        """Phase 3: the whole step's (B, G) rewards (NaN = unscorable) as this rank's rows'
        advantages. The batch (its log-probs) is for the kinds built on this trainer."""
        return advantages_from_rewards(every, self.cfg.scale_rewards)[self.positions]

    def micro_batches(self, batch: Batch) -> list[slice]:
        m, rows = self.memory.micro_batch_size, batch.inputs.shape[0]
        return [slice(i, i + m) for i in range(0, rows, m)]

    def forward_logprobs(self, batch: Batch) -> mx.array:
        """log pi(o_t) of every completion token under the model as it is (no gradient)."""
        parts = []
        for rows in self.micro_batches(batch):
            logp = completion_logprobs(
                self.model, batch.inputs[rows], batch.left_pad[rows], batch.completion[rows], self.cfg.temperature,
                self.chunk_tokens,
            )
            mx.eval(logp)  # now, one micro-batch at a time (peak memory)
            parts.append(logp)
        return mx.concatenate(parts)

    def loss_and_grads(self, batch: Batch, ref_logp: mx.array) -> tuple[mx.array, dict, mx.array, dict]:
        """The step's loss, statistics, gradient norm and (clipped) gradients, summed over
        micro-batches (and a gang's ranks: the normalisers are the whole step's)."""
        n_rows = mx.array(self.cfg.batch_size * self.cfg.group_size, dtype=mx.float32)  # B*G: every row of the step
        n_tokens = mx.maximum(self.gang.sum(batch.mask.sum()), 1).astype(mx.float32)
        loss, stats, grads = None, None, None
        for rows in self.micro_batches(batch):
            part = self.micro_batch_step(
                batch.inputs[rows], batch.left_pad[rows], batch.completion[rows], batch.mask[rows],
                batch.old_logp[rows], ref_logp[rows], batch.advantages[rows], n_rows, n_tokens,
            )
            loss, stats, grads = part if loss is None else tree_map(mx.add, (loss, stats, grads), part)
            mx.eval(loss, stats, grads)
        loss, stats, grads = self.gang.sum_tree((loss, stats, grads))
        grads, grad_norm = clipped(grads, self.cfg.max_grad_norm)
        return loss, stats, grad_norm, grads

    def step(
        self, state: TrainState, should_stop: Callable[[], bool], on_finite_loss: Callable[[], None] = lambda: None
    ) -> tuple[dict[str, float], dict]:
        """One iter, the module docstring's four phases: rollout, score, advantages, update. Returns
        the step's metrics and its samples event. on_finite_loss: called once the current weights
        gave a finite loss and gradient (before they are updated), the moment they are known to
        be good to checkpoint."""
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        rollout = self.rollout(state.step, should_stop)
        rewards, reward_metrics = self.score(rollout, state.step, should_stop)
        every = self.whole_batch(rewards)  # (B, G): a gang's ranks' rewards together
        batch = self.loss_batch(rollout)
        batch.advantages = mx.array(self.advantages(every, batch).reshape(-1))
        loss, stats, grad_norm = self.update(batch, state.step, should_stop, on_finite_loss)

        tokens = sum(rollout.lengths) + sum(len(p) for p in rollout.prompt_ids) * rollout.rows_per_prompt
        state.num_tokens += tokens if self.gang.size == 1 else int(self.gang.sum(mx.array(tokens)).item())
        metrics = step_metrics(rollout, every, reward_metrics, loss, stats, grad_norm, self.optimizer, state.num_tokens,
                               self.gang, self.whole_batch)
        metrics["step_time"] = time.perf_counter() - t0
        state.step += 1
        return metrics, samples_event(rollout, rewards)

    def whole_batch(self, values: np.ndarray) -> np.ndarray:
        """A gang's rank's values of its prompts (rewards (B/N, G), or any shape led by its
        prompts) as the whole step's (B, ...), every rank's in its place (NaN stays NaN: the
        others add 0 there)."""
        if self.gang.size == 1:
            return values
        every = np.zeros((self.cfg.batch_size, *values.shape[1:]))
        every[self.positions] = values
        return np.array(self.gang.sum(mx.array(every, dtype=mx.float32)), dtype=np.float64)

    def rollout(self, step: int, should_stop: Callable[[], bool]) -> Rollout:
        """Phase 1: sample G completions for each of the step's B prompts; their texts, with
        stop strings ending a completion early (host side). A multi-turn job's: G episodes."""
        if self.answerer is not None:
            return self.episodes_rollout(step, should_stop)
        cfg, tok = self.cfg, self.tokenizer
        every = batch_indices(len(self.items), cfg.batch_size, step, cfg.seed)
        width = max(len(self.prompt_ids[i]) for i in every)  # as the whole step pads them
        idx = self.gang.share(every)
        prompt_ids = [self.prompt_ids[i] for i in idx]
        seed = step_seed(cfg.seed, step)  # sampling and LoRA dropout: reproducible, and as before on resume
        mx.random.seed(seed)
        self.model.eval()
        t0 = time.perf_counter()
        samples = sample(
            self.model, self.decode_step, prompt_ids, cfg.group_size, self.sampling, self.eos_ids,
            mx.random.key(seed), should_stop, width,
        )
        if samples is None:
            raise Cancelled()
        seconds = time.perf_counter() - t0
        bodies, texts, lengths, ended, mask = completions(tok, samples, cfg.stop)
        return Rollout(idx, [self.items[i] for i in idx], prompt_ids, samples, bodies, texts, lengths, ended, mask, seconds,
                       width, cfg.group_size)

    def episodes_rollout(self, step: int, should_stop: Callable[[], bool]) -> Rollout:
        """Phase 1 of a multi-turn job: G episodes of each of the step's B prompts, decoded
        together (worker/decode/episodes.py), their turns answered by the job's tools and
        environment. An episode's environment is reset with the step's seed plus its prompt's
        index: the G episodes of a prompt play the same game. Its completion, for the rewards,
        is its last turn's text."""
        cfg, tok, G = self.cfg, self.tokenizer, self.cfg.group_size
        idx = self.gang.share(batch_indices(len(self.items), cfg.batch_size, step, cfg.seed))
        seed = step_seed(cfg.seed, step)
        mx.random.seed(seed)
        self.model.eval()
        episodes = [self.answerer.episode(prompt_messages(self.items[i].prompt), (seed + i) % 2**31)
                    for i in idx for _ in range(G)]
        pool = self.answerer.pool
        t0 = time.perf_counter()
        try:
            prompt_ids = list(pool.map(RowEpisode.start, episodes))
            decoded = sample_episodes(
                self.model, self.decode_step, prompt_ids, self.sampling, Limits(cfg.max_turns, cfg.episode_len),
                self.eos_ids, self.pad_id, mx.random.key(seed), lambda r, tokens: episodes[r].answer(tokens), pool,
                should_stop)
        finally:
            for e in episodes:
                e.close()
        if decoded is None:
            raise Cancelled()
        seconds = time.perf_counter() - t0
        samples = decoded.samples
        for e, turns in zip(episodes, decoded.turns):
            e.turns = len(turns)
        rows = samples.tokens.tolist()
        bodies = []
        for r, turns in enumerate(decoded.turns):
            start, end = turns[-1] if turns else (0, 0)
            body = rows[r][start:end]
            bodies.append(body[:-1] if body and body[-1] in self.eos_ids else body)
        texts = [completion_text(tok, body) for body in bodies]
        lengths = samples.mask.sum(axis=1).tolist()
        return Rollout(idx, [self.items[i] for i in idx], prompt_ids, samples, bodies, texts, lengths,
                       samples.ended.tolist(), samples.mask, seconds, max(len(p) for p in prompt_ids), 1, episodes)

    def score(self, rollout: Rollout, step: int, should_stop: Callable[[], bool]) -> tuple[np.ndarray, dict[str, float]]:
        """Phase 2: the completions' rewards, (B, G) with NaN where unscorable, and the reward
        sources' metrics (worker/rewards/scorer.py)."""
        env = self.spec.environment
        if env is not None and self.spec.reward is None and not self.cfg.reward_endpoint:
            rewards, metrics = np.full((len(rollout.items), self.cfg.group_size), np.nan), {}  # the environment's alone
        else:
            try:
                rewards, metrics = self.scorer.score(step, rollout.items, rollout.groups(rollout.texts),
                                                     token_counts=rollout.groups(rollout.lengths), should_stop=should_stop,
                                                     whole=self.whole_batch)
            except RewardStopped:  # cancelled while waiting on a reward server
                raise Cancelled() from None
        if env is not None:  # its weighted reward added; NaN (unscorable) only where both are
            weighted = env.reward_weight * np.array(rollout.groups([e.env_reward for e in rollout.episodes]))
            both = np.isnan(rewards) & np.isnan(weighted)
            rewards = np.where(both, np.nan, np.nan_to_num(rewards) + np.nan_to_num(weighted))
        return rewards, metrics

    def evaluate(self, step: int, should_stop: Callable[[], bool]) -> dict[str, float]:
        """The validation prompts sampled by the current policy, eval_samples completions each, and
        scored by the job's reward sources: `val_reward` (the mean over scorable completions, 0 when
        there is none, as `reward`) and each source's `val_rewards/<name>/mean` and `/std`.

        Training goes on as without it: the model samples in eval mode (no LoRA dropout), no
        gradient is taken, and the draws come from a key of its own (of EVAL_STEP), not from the
        global random state; so an evaluation also draws the same numbers every time, and two
        differ by the policy alone. At most
        max(batch_size x group_size, eval_samples) rows decode at once, as a step's rollout does."""
        cfg, G = self.cfg, self.cfg.eval_samples
        per_decode = max(1, cfg.batch_size * cfg.group_size // G)
        starts = range(0, len(self.val_ids), per_decode)
        keys = mx.random.split(mx.random.key(step_seed(cfg.seed, EVAL_STEP)), len(starts))
        self.model.eval()
        texts, lengths = [], []
        for start, key in zip(starts, keys):
            prompts = self.val_ids[start:start + per_decode]
            samples = sample(self.model, self.decode_step, prompts, G, self.eval_sampling, self.eos_ids, key, should_stop)
            if samples is None:
                raise Cancelled()
            _, chunk_texts, chunk_lengths, _, _ = completions(self.tokenizer, samples, cfg.stop)
            texts += chunk_texts
            lengths += chunk_lengths

        def groups(rows: list) -> list[list]:
            return [rows[i * G:(i + 1) * G] for i in range(len(self.val_items))]

        try:
            rewards, metrics = self.scorer.score(step, self.val_items, groups(texts), token_counts=groups(lengths),
                                                 should_stop=should_stop)
        except RewardStopped:  # cancelled while waiting on a reward server
            raise Cancelled() from None
        return {"val_reward": float(np.nan_to_num(nan_mean(rewards))), **{f"val_{k}": v for k, v in metrics.items()}}

    def loss_batch(self, rollout: Rollout) -> Batch:
        """The rollout's tokens as the loss takes them (mask_truncated_completions: the completions
        cut at max_completion_len left out), with the reference policy's log-probs when beta > 0."""
        mask = rollout.mask & mx.array(rollout.ended)[:, None] if self.cfg.mask_truncated_completions else rollout.mask
        batch = make_batch(rollout.prompt_ids, rollout.samples, mask, rollout.rows_per_prompt, rollout.width)
        if self.cfg.beta > 0:
            with lora_disabled(self.model):
                batch.ref_logp = self.forward_logprobs(batch)
        return batch

    def update(self, batch: Batch, step: int, should_stop: Callable[[], bool],
               on_finite_loss: Callable[[], None]) -> tuple[mx.array, dict, mx.array]:
        """Phase 4: mu optimizer updates on the batch. Returns the last update's loss, statistics
        and gradient norm."""
        cfg, model = self.cfg, self.model
        ref = batch.ref_logp if batch.ref_logp is not None else batch.old_logp  # unused when beta == 0

        model.train()
        if cfg.num_iterations > 1 and cfg.lora_dropout > 0:
            batch.old_logp = self.forward_logprobs(batch)  # under dropout, as the loss sees the policy
        for mu in range(cfg.num_iterations):
            if mu and should_stop():
                raise Cancelled()
            loss, stats, grad_norm, grads = self.loss_and_grads(batch, ref)
            mx.eval(loss, grad_norm, stats)
            check_finite(loss.item(), grad_norm.item(), step + 1)
            if mu == 0:
                on_finite_loss()
            self.optimizer.update(model, grads)
            mx.eval(model.trainable_parameters(), self.optimizer.state)
        model.eval()
        return loss, stats, grad_norm


# --------------------------------------------------------------------------- what a step reports


def step_metrics(rollout: Rollout, rewards: np.ndarray, reward_metrics: dict, loss: mx.array, stats: dict,
                 grad_norm: mx.array, optimizer: optim.Optimizer, num_tokens: int, gang: Gang = SOLO,
                 whole: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> dict[str, float]:
    """A step's metrics, named as TRL users know them. On a gang (whole: a rank's values of its
    prompts as the whole step's, GRPOTrainer.whole_batch) the completions' lengths, their
    entropy and the episodes' metrics are every rank's; tokens_per_second and peak memory are
    this rank's."""
    samples = rollout.samples
    group_std = nan_std(rewards, axis=1)  # NaN where a group has fewer than 2 scorable completions
    defined = ~np.isnan(group_std)
    lengths = whole(np.asarray(rollout.lengths, dtype=np.float64).reshape(len(rollout.items), -1))
    ended = whole(np.asarray(rollout.ended, dtype=np.float64).reshape(len(rollout.items), -1))
    entropy = gang.sum(mx.stack([(samples.entropy * samples.mask).sum(), samples.mask.sum().astype(mx.float32)]))
    metrics = {
        "loss": float(loss.item()),
        # Over scorable completions (0 when there is none: metrics stay JSON numbers).
        "reward": float(np.nan_to_num(nan_mean(rewards))),
        "reward_std": float(group_std[defined].mean()) if defined.any() else 0.0,
        "frac_reward_zero_std": float(np.isclose(group_std, 0.0).mean()),  # undefined std: not zero (TRL)
        **{k: float(v.item()) for k, v in stats.items()},
        "entropy": float((entropy[0] / mx.maximum(entropy[1], 1)).item()),
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(1.0 - ended.mean()),
        "num_tokens": num_tokens,
        "grad_norm": float(grad_norm.item()),
        "learning_rate": float(optimizer.learning_rate.item()),
        # Tokens the model drew per second (a multi-turn decode also prefills what answered its turns).
        "tokens_per_second": (sum(rollout.lengths) if rollout.episodes else samples.steps * len(rollout.texts))
        / max(rollout.seconds, 1e-9),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "n_samples": lengths.size,
        **reward_metrics,
    }
    metrics["mean_reward"] = metrics["reward"]
    if rollout.episodes:
        metrics.update(episode_metrics(rollout.episodes, gang))
    return metrics


def episode_metrics(episodes: list[RowEpisode], gang: Gang = SOLO) -> dict[str, float]:
    """A multi-turn step's: model turns, tool calls and tool errors per episode, and the mean
    environment reward (over the episodes it rewarded), of the whole step: a gang's ranks' summed."""
    env = np.array([e.env_reward for e in episodes], dtype=np.float64)
    rewarded = ~np.isnan(env)
    totals = np.array([len(episodes), sum(e.turns for e in episodes), sum(e.tool_calls for e in episodes),
                       sum(e.tool_errors for e in episodes), env[rewarded].sum(), rewarded.sum()], dtype=np.float64)
    if gang.size > 1:
        totals = np.array(gang.sum(mx.array(totals, dtype=mx.float32)), dtype=np.float64)
    n, turns, calls, errors, env_sum, env_n = totals
    metrics = {"turns/mean": float(turns / n), "tool_calls/mean": float(calls / n), "tool_errors/mean": float(errors / n)}
    if episodes[0].environment is not None:
        metrics["env_reward"] = float(env_sum / env_n) if env_n else 0.0
    return metrics


def samples_event(rollout: Rollout, rewards: np.ndarray) -> dict:
    """The step's samples event: each completion's text, cut to fit SAMPLES_EVENT_CHARS, its reward,
    and its text's tokens with their summed sampling log-probs (logits / temperature): what a
    downstream trainer needs for its own ratios, and what the log-prob endpoint answers for the
    same prompt and completion text."""
    cut = min(SAMPLE_TEXT_CHARS, SAMPLES_EVENT_CHARS // len(rollout.texts))
    old_logp = np.array(rollout.samples.logprobs)
    if rollout.episodes:  # a multi-turn step's: every model token of the episode, and the conversation
        text_tokens = rollout.lengths
        sums = [float(row.sum()) for row in old_logp]  # 0 off the model's tokens
    else:
        text_tokens = [min(n, len(body)) for n, body in zip(rollout.lengths, rollout.bodies)]
        sums = [float(old_logp[i, :n].sum()) for i, n in enumerate(text_tokens)]
    event = {"prompt_indices": rollout.indices,
             "completions": [[text[:cut] for text in group] for group in rollout.groups(rollout.texts)],
             "rewards": [[None if np.isnan(r) else float(r) for r in group] for group in rewards],
             "token_counts": rollout.groups(text_tokens),
             "logprobs": rollout.groups(sums)}
    if rollout.episodes:
        conversations = [e.after_prompt() for e in rollout.episodes]
        per_message = max(1, cut // max(1, max(len(c) for c in conversations)))
        event["conversations"] = rollout.groups(
            [[{"role": m["role"], "content": m["content"][:per_message]} for m in c] for c in conversations])
    return event
