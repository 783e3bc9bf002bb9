"""The GKD job kind: on-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes"), as TRL's GKDTrainer computes it, on
rows {prompt, completion}. The student is the job's model with LoRA; the teacher another model
the worker has, with the same tokenizer (the job's own model_id: its base, the LoRA off).

Each step takes batch_size rows; with probability lmbda (one draw per step, from the step's
seed) the student samples their completions itself (on-policy: GRPO's sampler, worker/decode/,
at `temperature`, up to max_new_tokens, EOS included), else they are the rows' completions
(EOS appended). Both models read prompt + completion; at every completion token t, with the
student's and the teacher's next-token distributions S_t = softmax(s_t / T), P_t = softmax(p_t / T)
over the vocabulary (T = 1 in the job, as GKDTrainer's loss; the sampling temperature is apart):

    beta = 0:   D_t = KL(P_t || S_t) = sum_v P (log P - log S)                 (forward KL)
    beta = 1:   D_t = KL(S_t || P_t) = sum_v S (log S - log P)                 (reverse KL)
    else:       M_t = (1 - beta) S_t + beta P_t
                D_t = beta KL(P_t || M_t) + (1 - beta) KL(S_t || M_t)          (generalized JSD)
    loss = sum_t m_t D_t / max(sum_t m_t, 1)       m: the completion tokens (TRL's batchmean over labels)

Only the student gets gradients (the teacher's logits are constants). Metrics: loss (the mean
D), entropy (the student's mean per-token entropy over the completion tokens, DistillationTrainer's
name), on_policy (1 for a step on the student's samples), completions/mean_length; on the valid
rows (always their completions) val_loss and val_entropy.

The teacher's hidden states at the completion positions are computed once per batch, without
gradient; the loss projects both models' hidden states to the vocabulary a chunk of positions
at a time (each chunk a checkpoint: recomputed in the backward pass), so one chunk's
full-vocabulary logits of each model exist at a time, as TRL's chunked divergence does.
"""

import math
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.utils import checkpoint

from shared.datasets import DatasetError
from worker.decode.draw import SamplingParams
from worker.decode.sampling import make_decode_step, sample
from worker.kinds import supervised_trainer
from worker.kinds.grpo import LENGTH_BUCKET
from worker.kinds.supervised_trainer import Trainer, completion_rows
from worker.runtime.adapter_layers import lora_disabled
from worker.runtime.logprobs import PaddingMaskCache, eos_token_ids, left_pad, lm_head, log_softmax
from worker.runtime.memory_plan import logits_chunk_tokens
from worker.runtime.models import ModelNotFound, UnsupportedBase, get_model
from worker.runtime.train_core import Cancelled, step_seed

# --------------------------------------------------------------------------- the math


def generalized_jsd(student_logits: mx.array, teacher_logits: mx.array, beta: float | mx.array,
                    temperature: float = 1.0) -> mx.array:
    """D_t at every position: logits (..., V) -> (...). TRL's generalized_jsd_loss before masking.
    beta: an array between 0 and 1 (a compiled step's input, worker/runtime/scalars.py) or a number."""
    s = log_softmax(student_logits, temperature)
    t = log_softmax(teacher_logits, temperature)
    if not isinstance(beta, mx.array) and beta == 0:
        return (mx.exp(t) * (t - s)).sum(-1)
    if not isinstance(beta, mx.array) and beta == 1:
        return (mx.exp(s) * (s - t)).sum(-1)
    log = mx.log if isinstance(beta, mx.array) else math.log
    m = mx.logaddexp(s + log(1 - beta), t + log(beta))
    return beta * (mx.exp(t) * (t - m)).sum(-1) + (1 - beta) * (mx.exp(s) * (s - m)).sum(-1)


def gkd_loss(divergence: mx.array, mask: mx.array) -> mx.array:
    """The mean of D_t over the completion tokens: divergence and mask (rows, L)."""
    return (divergence * mask).sum() / mx.maximum(mask.sum(), 1.0)


def on_policy_step(lmbda: float, seed: int, step: int) -> bool:
    """Whether step `step` trains on the student's own samples: a draw of the step's seed below lmbda."""
    return np.random.RandomState(step_seed(seed, step) % 2**32).random_sample() < lmbda


# --------------------------------------------------------------------------- the trainer


def completion_batch(prompts: list[list[int]], completions: list[list[int]]) -> tuple[mx.array, mx.array, mx.array]:
    """Rows of left-padded prompt, then completion right-padded to a multiple of LENGTH_BUCKET (the
    layout of GRPO's loss, worker/runtime/logprobs.py completion_logprobs): inputs, each row's left
    padding, and the completion tokens' mask (rows, L)."""
    prompt_tokens, pad = left_pad(prompts, pad_id=0)
    L = LENGTH_BUCKET * math.ceil(max(1, max(len(c) for c in completions)) / LENGTH_BUCKET)
    tokens = mx.array([c + [0] * (L - len(c)) for c in completions], dtype=mx.int32)
    mask = mx.array([[1.0] * len(c) + [0.0] * (L - len(c)) for c in completions], dtype=mx.float32)
    return mx.concatenate([prompt_tokens, tokens], axis=1), pad, mask


def completion_hidden(model: nn.Module, inputs: mx.array, pad: mx.array, L: int) -> mx.array:
    """The last hidden states of the positions that predict the L completion tokens: (rows * L, D)."""
    hidden = model.model(inputs, cache=[PaddingMaskCache(pad) for _ in model.layers])
    return hidden[:, -L - 1:-1].reshape(inputs.shape[0] * L, -1)


class GKDTrainer(Trainer):
    def __init__(self, model, tokenizer, spec, train: list[dict], valid: list[dict] | None, teacher: nn.Module,
                 teacher_tokenizer, should_stop: Callable[[], bool] = lambda: False):
        cfg = spec.config
        self.should_stop = should_stop  # the job's: a cancel stops sampling between its chunks
        check_same_vocabulary(model, tokenizer, spec.model_id, teacher, teacher_tokenizer, spec.teacher_model_id)
        self.teacher = teacher
        self.train_tok, n_cut = completion_rows(tokenizer, [(r["prompt"], r["completion"]) for r in train],
                                                cfg.max_seq_length)
        self.valid_tok, n_cut_valid = completion_rows(tokenizer, [(r["prompt"], r["completion"]) for r in valid],
                                                      cfg.max_seq_length) if valid else (None, 0)
        self.truncated = n_cut + n_cut_valid
        too_long = [i for i, s in enumerate(self.train_tok.starts) if s + cfg.max_new_tokens > cfg.max_seq_length]
        if cfg.lmbda > 0 and too_long:
            i = too_long[0]
            raise DatasetError(f"dataset[{i}]: its prompt is {self.train_tok.starts[i]} tokens; with max_new_tokens "
                               f"{cfg.max_new_tokens} a sampled row passes max_seq_length ({cfg.max_seq_length})")
        self.eos_ids = eos_token_ids(tokenizer)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.sampling = SamplingParams(cfg.max_new_tokens, cfg.temperature)  # GKDTrainer's: top_k 0, top_p 1
        self.decode_step = make_decode_step(model, self.sampling, self.eos_ids, pad_id) if cfg.lmbda > 0 else None
        self.chunk_tokens = logits_chunk_tokens(model.args.vocab_size)
        self.on_policy, self.key, self.lengths = False, None, []
        super().__init__(model, cfg, train, valid)

    def loss_numbers(self, cfg) -> dict[str, float]:
        return {"beta": cfg.beta} if 0 < cfg.beta < 1 else {}

    def step(self, state, on_finite_loss=lambda: None) -> dict[str, float]:
        self.on_policy = on_policy_step(self.cfg.lmbda, self.cfg.seed, state.step)
        self.key = mx.random.key(step_seed(self.cfg.seed, state.step))  # the samples: as before on resume
        self.lengths = []
        metrics = super().step(state, on_finite_loss)
        return {**metrics, "on_policy": float(self.on_policy),
                "completions/mean_length": float(np.mean(self.lengths))}

    def arrays(self, ids: list[int], rows: list[dict]):
        tok = self.train_tok if rows is self.train_rows else self.valid_tok
        prompts = [tok.tokens[i][:tok.starts[i]] for i in ids]
        if self.on_policy and rows is self.train_rows:
            completions = self.sample(prompts)
        else:
            completions = [tok.tokens[i][tok.starts[i]:] for i in ids]
        inputs, pad, mask = completion_batch(prompts, completions)
        with lora_disabled(self.teacher):  # a teacher that is the job's own model: its base
            teacher_hidden = completion_hidden(self.teacher, inputs, pad, mask.shape[1])
        mx.eval(teacher_hidden)
        self.lengths += [len(c) for c in completions]
        return (inputs, pad, mask, teacher_hidden), sum(map(len, completions))

    def sample(self, prompts: list[list[int]]) -> list[list[int]]:
        """The student's completion of each prompt (its EOS included when it ended)."""
        self.key, key = mx.random.split(self.key)
        self.module.eval()  # no LoRA dropout in sampling
        samples = sample(self.module, self.decode_step, prompts, 1, self.sampling, self.eos_ids, key, self.should_stop)
        if samples is None:
            raise Cancelled()
        return [row[:n] for row, n in zip(samples.tokens.tolist(), samples.mask.sum(axis=1).tolist())]

    def loss(self, model, inputs, pad, mask, teacher_hidden):
        rows, L = mask.shape
        hidden = completion_hidden(model, inputs, pad, L)
        divergence, entropy = self.divergence(model, hidden, teacher_hidden)
        n = mx.maximum(mask.sum(), 1.0)
        return gkd_loss(divergence.reshape(rows, L), mask), {"entropy": (entropy.reshape(rows, L) * mask).sum() / n}

    def divergence(self, model, hidden: mx.array, teacher_hidden: mx.array) -> tuple[mx.array, mx.array]:
        """D_t and the student's entropy at each position, from both models' hidden states, the
        output heads chunk_tokens positions at a time. mlx.nn.utils.checkpoint (as
        worker/runtime/logprobs.py head_logprobs): the student's head gets its gradient."""
        head, teacher_head = lm_head(model), lm_head(self.teacher)
        owner = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens
        beta = self.numbers.get("beta", self.cfg.beta)  # an input where it is neither 0 nor 1

        def per_position(h, h_teacher):
            logits = head(h)
            logp = log_softmax(logits, 1.0)
            return (generalized_jsd(logits, mx.stop_gradient(teacher_head(h_teacher)), beta),
                    -(mx.exp(logp) * logp).sum(-1))

        chunk = checkpoint(owner, per_position)
        parts = [chunk(hidden[i:i + self.chunk_tokens], teacher_hidden[i:i + self.chunk_tokens])
                 for i in range(0, hidden.shape[0], self.chunk_tokens)]
        return mx.concatenate([d for d, _ in parts]), mx.concatenate([e for _, e in parts])


def check_same_vocabulary(model, tokenizer, name: str, teacher, teacher_tokenizer, teacher_name: str) -> None:
    """GKD compares the two models' distributions token by token: the same vocabulary, the same tokens."""
    sizes = (model.args.vocab_size, teacher.args.vocab_size)
    if sizes[0] != sizes[1] or tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        raise UnsupportedBase(
            f"teacher {teacher_name!r} has another vocabulary than {name!r} ({sizes[1]} and {sizes[0]} logits): GKD "
            "compares their next-token distributions token by token, so the teacher needs the student's tokenizer")


def load(job, spec, settings):
    """The job's Run (worker/kinds/supervised_trainer.py load); the teacher is loaded after the
    student, so that worker/runtime/models.py, which keeps the last MAX_LOADED_MODELS used,
    keeps both."""

    def make_trainer(model, tokenizer, spec, train, valid) -> GKDTrainer:
        try:
            teacher, teacher_tokenizer, cached = get_model(spec.teacher_model_id, settings)
        except ModelNotFound as e:
            raise ModelNotFound(f"teacher_model_id: {e}") from None
        if not cached:
            job.publish_loaded()
        return GKDTrainer(model, tokenizer, spec, train, valid, teacher, teacher_tokenizer, job.should_stop)

    return supervised_trainer.load(job, spec, settings, make_trainer)
