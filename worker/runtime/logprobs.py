"""Log-probabilities of tokens under a model, and how prompts and completions become tokens
for them: the one place that GRPO's loss, the preference kinds, reward models, log-prob
scoring (worker/runtime/score_requests.py) and the decoder (worker/decode/) all take them from,
so that sampling (pi_old) and the loss (pi_theta) see the same distribution.

    token_logprobs        log softmax(logits / T)[token] and the entropy, in float32 (sampling);
                          log_softmax (which head_logprobs takes too) and pick its two halves
    completion_logprobs   log softmax(logits_t / T)[o_t] of left-padded prompt + completion rows,
                          from the last hidden states of completion positions only (GRPO, scoring);
                          completion_hidden those hidden states (PPO's value head reads them too)
    head_logprobs         log softmax(head(h) / T)[token] of hidden states, K tokens each, the
                          output head a chunk of positions at a time (completion_logprobs, the
                          Tinker training client: worker/sessions/training_client.py)
    token_logps           log softmax(logits)[target] at every position of right-padded rows
                          (the supervised kinds); sequence_logps their sum (or mean) per row
    PaddingMaskCache      what a full forward pass over left-padded rows gives mlx_lm's models as
                          their cache: the causal + padding mask (attention_mask), nothing stored
    lm_head               a model's output projection (its lm_head or its tied embedding)
    left_pad              prompts as left-padded rows
"""

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.utils import checkpoint

from shared.schemas import PromptItem
from worker.runtime.models import gradient_checkpointing


class PaddingMaskCache:
    """A 'cache' for one full forward pass over left-padded rows (the loss): it stores
    nothing and only supplies the causal + padding mask, so that any mlx_lm model works."""

    def __init__(self, left_pad: mx.array):
        self.left_pad = left_pad
        self.offset = 0

    def update_and_fetch(self, keys, values):
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size=None) -> mx.array:
        pos = mx.arange(n)
        return attention_mask(pos, pos, self.left_pad)


def attention_mask(q_pos: mx.array, k_pos: mx.array, left_pad: mx.array) -> mx.array:
    """(rows, 1, queries, keys): causal, padding hidden. A padding query sees only itself:
    a row with every key masked gives NaN in attention (on CUDA), which would reach the
    gradients even though padding positions are never used."""
    causal = k_pos[None, :] <= q_pos[:, None]  # also hides buffer slots not written yet
    not_pad = k_pos[None, :] >= left_pad[:, None]
    itself = k_pos[None, :] == q_pos[:, None]
    return ((causal[None] & not_pad[:, None, :]) | itself[None])[:, None]


def lm_head(model: nn.Module) -> Callable[[mx.array], mx.array]:
    """The output projection of an mlx_lm model whose logits are head(model.model(x)):
    its lm_head, or the tied embedding."""
    return model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens.as_linear


def log_softmax(logits: mx.array, temperature: float | mx.array) -> mx.array:
    """log softmax(logits / temperature) in float32 (temperature 0, greedy, counts as 1; an
    array is a compiled function's input, worker/runtime/scalars.py: divisor(), never 0)."""
    if not isinstance(temperature, mx.array):
        temperature = divisor(temperature)
    logits = logits.astype(mx.float32) / temperature
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def divisor(temperature: float) -> float:
    """What log_softmax divides the logits by: the temperature, 1 for greedy's 0."""
    return temperature if temperature > 0 else 1.0


def pick(logp_all: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
    """log p(token) and the entropy of the distribution, from log_softmax's output."""
    logp = mx.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]
    return logp, (mx.exp(logp_all) * -logp_all).sum(-1)  # negated inside: fused, not a primitive after the sum


def token_logprobs(logits: mx.array, tokens: mx.array, temperature: float | mx.array) -> tuple[mx.array, mx.array]:
    """log p(token) and entropy of softmax(logits / temperature), in float32.

    Sampling's (pi_old); the loss (pi_theta, head_logprobs) takes the same log_softmax, so
    both see the same distribution.
    """
    return pick(log_softmax(logits, temperature), tokens)


def completion_logprobs(
    model: nn.Module, inputs: mx.array, pad: mx.array, completion: mx.array, temperature: float | mx.array,
    chunk_tokens: int, checkpointing: bool = False,
) -> mx.array:
    """log pi(o_t) for every completion position: one forward pass of the transformer for
    all rows, then the output head on completion positions only (head_logprobs)."""
    rows, L = completion.shape
    hidden = completion_hidden(model, inputs, pad, L, checkpointing).reshape(rows * L, -1)
    return head_logprobs(model, hidden, completion.reshape(-1, 1), temperature, chunk_tokens).reshape(rows, L)


def completion_hidden(model: nn.Module, inputs: mx.array, pad: mx.array, L: int, checkpointing: bool = False) -> mx.array:
    """The last hidden states (rows, L, D) of the positions that predict the last L tokens of
    left-padded rows (position t predicts token t + 1): what the output head reads, and PPO's
    value head (worker/kinds/ppo.py)."""
    caches = [PaddingMaskCache(pad) for _ in model.layers]
    with gradient_checkpointing(model, checkpointing):
        hidden = model.model(inputs, cache=caches)
    return hidden[:, -L - 1 : -1]


def head_logprobs(model: nn.Module, hidden: mx.array, tokens: mx.array, temperature: float | mx.array,
                  chunk_tokens: int) -> mx.array:
    """log softmax(head(h) / T)[token] of hidden states (M, D) for tokens (M, K), K of them per
    position: the output head chunk_tokens positions at a time. Each chunk is a checkpoint of
    the head: its full-vocabulary logits are recomputed in the backward pass rather than kept,
    so one chunk's logits exist at a time. mlx.nn.utils.checkpoint rather than mx.checkpoint,
    which passes no gradient to what its function closes over: the head's own trainable
    weights (a LoRA on lm_head) get theirs."""
    head = lm_head(model)
    owner = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens

    def chunk_logp(start):
        picked = tokens[start : start + chunk_tokens]
        logp = checkpoint(owner, lambda h: mx.take_along_axis(log_softmax(head(h), temperature), picked, axis=-1))
        return logp(hidden[start : start + chunk_tokens])

    return mx.concatenate([chunk_logp(i) for i in range(0, hidden.shape[0], chunk_tokens)])


def token_logps(logits: mx.array, targets: mx.array) -> mx.array:
    """log softmax(logits)[target] at every position, in float32: (N, W)."""
    logits = logits.astype(mx.float32)
    return mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - mx.logsumexp(logits, axis=-1)


def sequence_logps(logps: mx.array, mask: mx.array, average: bool = False) -> mx.array:
    """Sum (or mean) over each row's masked tokens: (N, T) -> (N,)."""
    total = (logps * mask).sum(axis=-1)
    return total / mx.maximum(mask.sum(axis=-1), 1.0) if average else total


# --------------------------------------------------------------------------- tokens


def as_item(prompt: Any) -> PromptItem:
    return prompt if isinstance(prompt, PromptItem) else PromptItem(prompt=prompt)


def prompt_token_ids(tokenizer, item: PromptItem, use_chat_template: bool) -> list[int]:
    """Raw text with `tokenizer.encode` (the seed server's way, and the default); the chat
    template for string prompts only with use_chat_template, and always for chat messages
    (a list of messages has no text of its own)."""
    chat = use_chat_template or isinstance(item.prompt, list)
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(prompt_messages(item.prompt), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    text = item.prompt if isinstance(item.prompt, str) else "\n".join(m.content for m in item.prompt)
    return list(tokenizer.encode(text))


def prompt_messages(prompt) -> list[dict]:
    """A prompt (text, or chat messages) as the chat messages a chat template takes."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [m if isinstance(m, dict) else m.model_dump() for m in prompt]


def eos_token_ids(tokenizer) -> list[int]:
    """The tokens that end a completion (mlx_lm's TokenizerWrapper may name several), sorted."""
    eos = getattr(tokenizer, "eos_token_ids", None)
    return sorted(eos) if eos is not None else [tokenizer.eos_token_id]


def completion_token_ids(tokenizer, completion: str) -> list[int]:
    """A completion's tokens as given text: no special tokens added."""
    return list(tokenizer.encode(completion, add_special_tokens=False))


def pair_tokens(tokenizer, prompt: str, completion: str) -> tuple[list[int], int]:
    """A prompt + completion row as the preference kinds and reward scoring tokenise it: the
    prompt as raw text (as log-prob scoring does), the completion without special tokens,
    then EOS. Returns (tokens, where the completion starts)."""
    p = list(tokenizer.encode(prompt))
    c = completion_token_ids(tokenizer, completion) + [tokenizer.eos_token_id]
    return p + c, len(p)


def left_pad(prompts: list[list[int]], pad_id: int, width: int | None = None) -> tuple[mx.array, mx.array]:
    """Prompts left-padded to one width (the longest's, or `width`: a gang's rank pads its share as
    the whole batch would be, so that its positions are the same)."""
    width = max(max(len(p) for p in prompts), width or 0)
    rows = [[pad_id] * (width - len(p)) + p for p in prompts]
    return mx.array(rows, dtype=mx.int32), mx.array([width - len(p) for p in prompts], dtype=mx.int32)
