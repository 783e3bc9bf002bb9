"""GRPO with LoRA on an mlx_lm model, top to bottom.

One step (= one `iter` of the job config):

  1. take B = batch_size prompts; sample G = group_size completions each, all B*G rows
     decoding together (worker/sampling.py). For every completion token t we keep
         old_logp_t = log pi_old(o_t | q, o_<t)      (logits / temperature, as sampled)
  2. score each completion: r_i (worker/rewards.py), and turn rewards into advantages,
     normalised inside each group of G:
         A_i = (r_i - mean_group(r)) / (std(r) + 1e-4)     std: of the group, the batch, or 1
  3. mu = num_iterations times: forward the B*G sequences under the current LoRA weights
     theta, and minimise the clipped surrogate (TRL's GRPO):
         log_ratio_t = logp_t - old_logp_t                 token level
                     = mean_t(logp_t - old_logp_t)         sequence level (GSPO), one per row
         ratio_t     = exp(log_ratio_t)
         loss_t      = -min(ratio_t * A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_i)
                       + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)      (k3 KL)
     where ref_t is the log-prob under the base model (the same weights with LoRA off),
     computed only when beta > 0. Aggregated over completion tokens (mask m):
         grpo:    mean_i( sum_t m loss_t / sum_t m )
         bnpo:    sum m loss_t / sum m
         dapo:    sum m loss_t / sum m          (tokens of the whole generation batch)
         dr_grpo: sum m loss_t / (B*G * max_completion_len)
     AdamW on the LoRA weights only, gradients clipped to max_grad_norm.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from shared.schemas import GRPOConfig, JobCreate, PromptItem
from worker.rewards import RewardStopped
from worker.sampling import PaddingMaskCache, Samples, SamplingParams, left_pad, make_decode_step, sample, token_logprobs

ADV_EPS = 1e-4
SAMPLE_TEXT_CHARS = 2000  # completions in the per-step `samples` event are cut to this (the events live in Redis)
HISTORY_METRICS = ("loss", "reward", "reward_std", "entropy", "completions/mean_length", "learning_rate", "step_time")
LENGTH_BUCKET = 16  # pad completion lengths to a multiple of this so the loss compiles for few shapes


# --------------------------------------------------------------------------- the math


def advantages_from_rewards(rewards: np.ndarray, scale_rewards: str) -> np.ndarray:
    """rewards: (B, G). Returns (B, G) advantages, normalised per group (TRL's convention:
    unbiased std; groups of one have zero advantage)."""
    mean = rewards.mean(axis=1, keepdims=True)
    G = rewards.shape[1]
    if scale_rewards == "group":
        std = rewards.std(axis=1, ddof=1, keepdims=True) if G > 1 else np.zeros_like(mean)
    elif scale_rewards == "batch":
        std = np.full_like(mean, rewards.std(ddof=1) if rewards.size > 1 else 0.0)
    else:
        std = np.zeros_like(mean) + (1.0 - ADV_EPS)  # divide by exactly 1
    return ((rewards - mean) / (std + ADV_EPS)).astype(np.float32)


def grpo_loss(
    logp: mx.array,
    old_logp: mx.array,
    ref_logp: mx.array | None,
    advantages: mx.array,
    mask: mx.array,
    *,
    loss_type: str,
    importance_sampling_level: str,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    max_completion_len: int,
) -> tuple[mx.array, dict[str, mx.array]]:
    """The GRPO objective for rows of completion tokens. logp, old_logp, ref_logp, mask:
    (rows, T); advantages: (rows,). Returns the scalar loss and per-step statistics."""
    mask = mask.astype(mx.float32)
    tokens_per_row = mx.maximum(mask.sum(axis=1), 1.0)
    log_ratio = logp - old_logp
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(axis=1) / tokens_per_row)[:, None]
    ratio = mx.exp(log_ratio)
    clipped = mx.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    A = advantages[:, None]
    per_token = -mx.minimum(ratio * A, clipped * A)

    kl = None
    if beta > 0.0:
        d = ref_logp - logp
        kl = mx.exp(d) - d - 1.0
        per_token = per_token + beta * kl

    if loss_type == "grpo":
        loss = ((per_token * mask).sum(axis=1) / tokens_per_row).mean()
    elif loss_type in ("bnpo", "dapo"):
        loss = (per_token * mask).sum() / mx.maximum(mask.sum(), 1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (mask.shape[0] * max_completion_len)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    # Statistics, masked means over completion tokens (TRL's clip_ratio/* definitions).
    def masked_mean(x):
        return (mx.broadcast_to(x, mask.shape) * mask).sum() / mx.maximum(mask.sum(), 1.0)

    low = (ratio < 1.0 - epsilon_low) & (A < 0)
    high = (ratio > 1.0 + epsilon_high) & (A > 0)
    stats = {
        "clip_ratio/low_mean": masked_mean(low.astype(mx.float32)),
        "clip_ratio/high_mean": masked_mean(high.astype(mx.float32)),
        "clip_ratio/region_mean": masked_mean((low | high).astype(mx.float32)),
        "mean_ratio": masked_mean(ratio),
    }
    if kl is not None:
        stats["kl"] = masked_mean(kl)
    return loss, stats


# --------------------------------------------------------------------------- the batch


@dataclass
class Batch:
    """B*G rows: left-padded prompt, then completion (right-padded to a length bucket)."""

    inputs: mx.array  # (rows, P + L) int32
    left_pad: mx.array  # (rows,) int32
    prompt_width: int  # P
    completion: mx.array  # (rows, L) int32
    mask: mx.array  # (rows, L) bool
    old_logp: mx.array  # (rows, L) float32
    advantages: mx.array  # (rows,) float32
    ref_logp: mx.array | None = None


def completion_logprobs(model: nn.Module, batch: Batch, temperature: float) -> tuple[mx.array, mx.array]:
    """log pi(o_t) and entropy for every completion position, one forward pass for all rows."""
    caches = [PaddingMaskCache(batch.left_pad) for _ in model.layers]
    logits = model(batch.inputs, cache=caches)
    logits = logits[:, batch.prompt_width - 1 : -1, :]  # position t predicts token t + 1
    return token_logprobs(logits, batch.completion, temperature)


def make_batch(prompt_ids: list[list[int]], samples: Samples, mask: mx.array, advantages: np.ndarray, group_size: int) -> Batch:
    prompts, pad = left_pad([p for p in prompt_ids for _ in range(group_size)], pad_id=0)
    used = max(int(samples.steps), 1)
    L = min(samples.tokens.shape[1], math.ceil(used / LENGTH_BUCKET) * LENGTH_BUCKET)
    completion = samples.tokens[:, :L]
    return Batch(
        inputs=mx.concatenate([prompts, completion], axis=1),
        left_pad=pad,
        prompt_width=prompts.shape[1],
        completion=completion,
        mask=mask[:, :L],
        old_logp=samples.logprobs[:, :L],
        advantages=mx.array(advantages.reshape(-1)),
    )


# --------------------------------------------------------------------------- prompts


def prompt_token_ids(tokenizer, item: PromptItem, use_chat_template: bool) -> list[int]:
    """Raw text with `tokenizer.encode` (the seed server's way, and the default); the chat
    template for string prompts only with use_chat_template, and always for chat messages
    (a list of messages has no text of its own)."""
    chat = use_chat_template or isinstance(item.prompt, list)
    if chat and getattr(tokenizer, "chat_template", None):
        messages = item.prompt if isinstance(item.prompt, list) else [{"role": "user", "content": item.prompt}]
        messages = [m if isinstance(m, dict) else m.model_dump() for m in messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    text = item.prompt if isinstance(item.prompt, str) else "\n".join(m.content for m in item.prompt)
    return list(tokenizer.encode(text))


def as_item(prompt: Any) -> PromptItem:
    return prompt if isinstance(prompt, PromptItem) else PromptItem(prompt=prompt)


def batch_indices(n_prompts: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Prompts for step `step`: walk a seeded shuffle of all prompts, a new shuffle per epoch.
    A pure function of (step, seed), so a resumed job sees the same batches."""
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(k, n_prompts)
        out.append(int(np.random.RandomState((seed + 7919 * epoch) % 2**32).permutation(n_prompts)[pos]))  # RandomState takes < 2**32
    return out


def cut_at_stop_strings(tokenizer, tokens: list[int], stops: list[str]) -> tuple[str, int, bool]:
    """Text cut just before the first stop string, the tokens that stay in the completion
    (up to the one that completes the stop string), and whether a stop string was found."""
    text = tokenizer.decode(tokens)
    hits = [text.find(s) for s in stops if s and s in text]
    if not hits:
        return text, len(tokens), False
    cut = min(hits)
    for n in range(1, len(tokens) + 1):  # fewest tokens whose text reaches past the stop string
        if len(tokenizer.decode(tokens[:n])) > cut:
            return text[:cut], n, True
    return text[:cut], len(tokens), True


# --------------------------------------------------------------------------- training


@dataclass
class TrainState:
    step: int = 0  # completed iters
    num_tokens: int = 0
    history: list[dict] = field(default_factory=list)


def learning_rate_schedule(cfg: GRPOConfig) -> Callable | float:
    total = cfg.iters * cfg.num_iterations
    warm = min(cfg.warmup_steps, total)
    if cfg.lr_scheduler == "constant":
        main: Any = cfg.learning_rate
        if not warm:
            return main
        main = optim.linear_schedule(cfg.learning_rate, cfg.learning_rate, 1)
    elif cfg.lr_scheduler == "cosine":
        main = optim.cosine_decay(cfg.learning_rate, max(total - warm, 1))
    else:
        main = optim.linear_schedule(cfg.learning_rate, 0.0, max(total - warm, 1))
    if not warm:
        return main
    return optim.join_schedules([optim.linear_schedule(0.0, cfg.learning_rate, warm), main], [warm])


class Cancelled(Exception):
    pass


class NonFiniteLoss(Exception):
    pass


class JobDoesNotFitModel(ValueError):
    """The job asks for more than the model has: its context or its vocabulary."""


def check_fits_model(model: nn.Module, prompt_ids: list[list[int]], cfg: GRPOConfig) -> None:
    """Before the first step: every prompt (tokenised) plus max_completion_len fits the
    model's context, and top_k is within its vocabulary. (The API could only estimate from
    characters.)"""
    args = getattr(model, "args", None)
    context = getattr(args, "max_position_embeddings", None)
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    if context and len(prompt_ids[longest]) + cfg.max_completion_len > context:
        raise JobDoesNotFitModel(
            f"prompts[{longest}] is {len(prompt_ids[longest])} tokens; with max_completion_len "
            f"{cfg.max_completion_len} that exceeds the model's context of {context} tokens"
        )
    vocab = getattr(args, "vocab_size", None)
    if vocab and cfg.top_k > vocab:
        raise JobDoesNotFitModel(f"top_k {cfg.top_k} is larger than the model's vocabulary ({vocab} tokens)")


class GRPOTrainer:
    """Runs the steps of one job on a model with LoRA attached (worker/models.py)."""

    def __init__(self, model: nn.Module, tokenizer, spec: JobCreate, scorer):
        self.model, self.tokenizer, self.spec, self.cfg, self.scorer = model, tokenizer, spec, spec.config, scorer
        cfg = self.cfg
        self.items = [as_item(p) for p in spec.prompts]
        self.prompt_ids = [prompt_token_ids(tokenizer, it, cfg.use_chat_template) for it in self.items]
        check_fits_model(model, self.prompt_ids, cfg)
        eos = getattr(tokenizer, "eos_token_ids", None)
        self.eos_ids = sorted(eos) if eos is not None else [tokenizer.eos_token_id]
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.sampling = SamplingParams(cfg.max_completion_len, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)
        self.decode_step = make_decode_step(model, self.sampling, self.eos_ids, pad_id)
        self.optimizer = optim.AdamW(learning_rate=learning_rate_schedule(cfg), weight_decay=cfg.weight_decay)
        self.optimizer.init(model.trainable_parameters())

        loss_kwargs = dict(
            loss_type=cfg.loss_type, importance_sampling_level=cfg.importance_sampling_level,
            epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_upper, beta=cfg.beta,
            max_completion_len=cfg.max_completion_len,
        )

        def loss_fn(model, inputs, left_pad_, completion, mask, old_logp, ref_logp, advantages):
            batch = Batch(inputs, left_pad_, inputs.shape[1] - completion.shape[1], completion, mask, old_logp, advantages)
            logp, _ = completion_logprobs(model, batch, cfg.temperature)
            return grpo_loss(logp, old_logp, ref_logp, advantages, mask, **loss_kwargs)

        value_and_grad = nn.value_and_grad(model, loss_fn)
        state = [model.state, mx.random.state]

        def loss_and_grads(*arrays):
            (loss, stats), grads = value_and_grad(model, *arrays)
            if cfg.max_grad_norm is not None:
                grads, grad_norm = optim.clip_grad_norm(grads, cfg.max_grad_norm)
            else:
                grad_norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
            return loss, stats, grad_norm, grads

        self.loss_and_grads = mx.compile(loss_and_grads, inputs=state, outputs=state)

    # One iter: sample, score, update mu times. Returns the step's metrics and what was sampled.
    def step(
        self, state: TrainState, should_stop: Callable[[], bool], on_finite_loss: Callable[[], None] = lambda: None
    ) -> tuple[dict[str, float], dict]:
        """on_finite_loss: called once the current weights gave a finite loss and gradient
        (before they are updated): the moment they are known to be good to checkpoint."""
        cfg, model, tok = self.cfg, self.model, self.tokenizer
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        idx = batch_indices(len(self.items), cfg.batch_size, state.step, cfg.seed)
        items = [self.items[i] for i in idx]
        prompt_ids = [self.prompt_ids[i] for i in idx]

        # Every step's randomness (sampling, LoRA dropout) is a function of (seed, step):
        # reproducible, and a job resumed from a checkpoint continues as it would have.
        step_seed = cfg.seed * 1_000_003 + state.step
        mx.random.seed(step_seed)
        model.eval()
        samples = sample(
            model, self.decode_step, prompt_ids, cfg.group_size, self.sampling, self.eos_ids,
            mx.random.key(step_seed), should_stop,
        )
        if samples is None:
            raise Cancelled()
        t_sampled = time.perf_counter()

        # Text for the rewards; stop strings end a completion early (host side).
        rows = samples.tokens.tolist()
        lengths = samples.mask.sum(axis=1).tolist()
        ended = samples.ended.tolist()
        texts, mask = [], samples.mask
        # A row that ended has its EOS as last token: part of the loss, not of the text.
        bodies = [r[: n - 1] if e else r[:n] for r, n, e in zip(rows, lengths, ended)]
        if cfg.stop:
            cut = []
            for i, body in enumerate(bodies):
                text, k, hit = cut_at_stop_strings(tok, body, cfg.stop)
                texts.append(text)
                cut.append(k if hit else lengths[i])
                ended[i] = ended[i] or hit
            lengths = cut
            mask = mx.arange(mask.shape[1])[None, :] < mx.array(cut)[:, None]
        else:
            texts = [tok.decode(body) for body in bodies]
        G = cfg.group_size
        completions = [texts[b * G : (b + 1) * G] for b in range(len(items))]
        try:
            rewards, reward_metrics = self.scorer.score(
                state.step, items, completions, token_counts=[lengths[b * G : (b + 1) * G] for b in range(len(items))],
                should_stop=should_stop,
            )
        except RewardStopped:  # cancelled while waiting on a reward server
            raise Cancelled() from None
        advantages = advantages_from_rewards(np.asarray(rewards, dtype=np.float32), cfg.scale_rewards)
        if cfg.mask_truncated_completions:
            mask = mask & mx.array(ended)[:, None]

        batch = make_batch(prompt_ids, samples, mask, advantages, G)
        if cfg.beta > 0:
            with lora_disabled(model):
                batch.ref_logp, _ = completion_logprobs(model, batch, cfg.temperature)
                mx.eval(batch.ref_logp)  # now, not fused into the training graph (peak memory)
        ref = batch.ref_logp if batch.ref_logp is not None else batch.old_logp  # unused when beta == 0

        model.train()
        for mu in range(cfg.num_iterations):
            if mu and should_stop():
                raise Cancelled()
            loss, stats, grad_norm, grads = self.loss_and_grads(
                batch.inputs, batch.left_pad, batch.completion, batch.mask, batch.old_logp, ref, batch.advantages
            )
            mx.eval(loss, grad_norm, stats)
            if not (math.isfinite(loss.item()) and math.isfinite(grad_norm.item())):
                raise NonFiniteLoss(f"non-finite loss or gradient at step {state.step + 1} (loss={loss.item()}, grad_norm={grad_norm.item()})")
            if mu == 0:
                on_finite_loss()
            self.optimizer.update(model, grads)
            mx.eval(model.trainable_parameters(), self.optimizer.state)
        model.eval()

        # Metrics, named as TRL users know them.
        n_tokens = int(sum(lengths))
        state.num_tokens += n_tokens + sum(len(p) for p in prompt_ids) * G
        group_std = rewards.std(axis=1, ddof=1) if G > 1 else np.zeros(len(items))
        length_arr = np.asarray(lengths)
        sampled_tokens = samples.steps * len(rows)
        metrics = {
            "loss": float(loss.item()),
            "reward": float(rewards.mean()),
            "reward_std": float(group_std.mean()),
            "frac_reward_zero_std": float(np.isclose(group_std, 0.0).mean()),
            **{k: float(v.item()) for k, v in stats.items()},
            "entropy": float(((samples.entropy * samples.mask).sum() / mx.maximum(samples.mask.sum(), 1)).item()),
            "completions/mean_length": float(length_arr.mean()),
            "completions/min_length": float(length_arr.min()),
            "completions/max_length": float(length_arr.max()),
            "completions/clipped_ratio": float(1.0 - np.mean(ended)),
            "num_tokens": state.num_tokens,
            "grad_norm": float(grad_norm.item()),
            "learning_rate": float(self.optimizer.learning_rate.item()),
            "tokens_per_second": sampled_tokens / max(t_sampled - t0, 1e-9),
            "peak_memory_gb": mx.get_peak_memory() / 1e9,
            "n_samples": len(rows),
            **reward_metrics,
        }
        metrics["mean_reward"] = metrics["reward"]
        metrics["step_time"] = time.perf_counter() - t0
        state.step += 1
        state.history.append({k: metrics[k] for k in HISTORY_METRICS})
        shown = [[text[:SAMPLE_TEXT_CHARS] for text in group] for group in completions]
        samples_record = {"prompt_indices": idx, "completions": shown, "rewards": rewards.tolist()}
        return metrics, samples_record


class lora_disabled:
    """Context: LoRA layers contribute nothing (the base model = the reference policy)."""

    def __init__(self, model: nn.Module):
        self.layers = [m for _, m in model.named_modules() if hasattr(m, "lora_a") and hasattr(m, "scale")]

    def __enter__(self):
        self.scales = [m.scale for m in self.layers]
        for m in self.layers:
            m.scale = 0.0

    def __exit__(self, *exc):
        for m, s in zip(self.layers, self.scales):
            m.scale = s
