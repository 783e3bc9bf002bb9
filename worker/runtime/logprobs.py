"""Log-probabilities of tokens under a model, and how prompts and completions become tokens
for them: the one place that GRPO's loss, the preference kinds, reward models and log-prob
scoring (worker/runtime/score_requests.py) all take them from.

    completion_logprobs   log softmax(logits_t / T)[o_t] of left-padded prompt + completion rows,
                          from the last hidden states of completion positions only (GRPO, scoring)
    token_logps           log softmax(logits)[target] at every position of right-padded rows
                          (the supervised kinds); sequence_logps their sum (or mean) per row
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from shared.schemas import PromptItem
from worker.decode.sampling import PaddingMaskCache, lm_head, token_logprobs
from worker.runtime.models import gradient_checkpointing


def completion_logprobs(
    model: nn.Module, inputs: mx.array, pad: mx.array, completion: mx.array, temperature: float,
    chunk_tokens: int, checkpointing: bool = False,
) -> mx.array:
    """log pi(o_t) for every completion position: one forward pass of the transformer for
    all rows, then the output head on completion positions only, chunk_tokens positions at
    a time. Each chunk is an mx.checkpoint: its full-vocabulary logits are recomputed in the
    backward pass rather than kept, so one chunk's logits exist at a time."""
    caches = [PaddingMaskCache(pad) for _ in model.layers]
    with gradient_checkpointing(model, checkpointing):
        hidden = model.model(inputs, cache=caches)
    rows, L = completion.shape
    hidden = hidden[:, -L - 1 : -1].reshape(rows * L, -1)  # position t predicts token t + 1
    tokens = completion.reshape(-1)
    head = lm_head(model)

    def chunk_logp(start):
        return mx.checkpoint(lambda h: token_logprobs(head(h), tokens[start : start + chunk_tokens], temperature)[0])(
            hidden[start : start + chunk_tokens]
        )

    return mx.concatenate([chunk_logp(i) for i in range(0, rows * L, chunk_tokens)]).reshape(rows, L)


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
        messages = item.prompt if isinstance(item.prompt, list) else [{"role": "user", "content": item.prompt}]
        messages = [m if isinstance(m, dict) else m.model_dump() for m in messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    text = item.prompt if isinstance(item.prompt, str) else "\n".join(m.content for m in item.prompt)
    return list(tokenizer.encode(text))


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
