"""The decode of chat and text completions (worker/runtime/completions.py): rows of several
requests in one batch, each with its own prompt and token limit, run by the GRPO sampler's
compiled step (worker/decode/sampling.py make_decode_step). Unlike sample(), which returns a
step's whole rollout, the rows go to the host as they grow: after the first token, then every
CHUNK positions, the caller gets each row's new tokens (to stream them, cut at stop strings)
and says which rows it ends and whether the decode goes on (a busy worker's time slice ends).
"""

from typing import Callable

import mlx.core as mx
import numpy as np

from worker.decode.draw import SamplingParams, draw
from worker.decode.graph_patches import lora_args
from worker.decode.kv_cache import Slots, StaticKVCache
from worker.decode.sampling import CHUNK, is_eos
from worker.runtime.logprobs import left_pad, lm_head

# on_chunk(tokens, logprobs): each row's new tokens (its EOS included, none once it has
# finished) and their log-probs. Returns the rows the caller ends (bool per row), or None to
# stop the decode here.
OnChunk = Callable[[list[list[int]], list[list[float]]], np.ndarray | None]


def decode(model, step: Callable, prompts: list[list[int]], row_keys: list[np.ndarray], params: SamplingParams,
           eos_ids: list[int], on_chunk: OnChunk) -> None:
    """Decode each row from its prompt until it draws an EOS, the caller ends it, or it has a
    token for each of its keys (its last chunk may run past that: the caller keeps what it asked
    for). row_keys[row]: the random keys of its next draws, shape (limit, 2), so that a row draws
    what it would alone, in any batch and from any turn it goes on at."""
    limits = [len(k) for k in row_keys]
    prompt_tokens, pad = left_pad(prompts, pad_id=0)
    width = prompt_tokens.shape[1]
    longest = max(limits)
    capacity = width + longest
    slots = Slots(capacity, mx.array(0, dtype=mx.int32), pad, width)
    caches = [StaticKVCache(capacity, slots) for _ in model.layers]
    logits = lm_head(model)(model.model(prompt_tokens, cache=caches)[:, -1, :])
    keys, values = [c.keys for c in caches], [c.values for c in caches]

    lora = lora_args(model)
    # Draw i's key for each row; a row past its limit draws with its last key (its token is not kept).
    step_keys = np.stack([k[np.minimum(np.arange(longest), n - 1)] for k, n in zip(row_keys, limits)], axis=1)
    tokens, logp, _ = draw(logits, mx.array(step_keys[0]), params)
    finished = is_eos(tokens, eos_ids)
    chunk = [(tokens, logp, mx.ones(tokens.shape, dtype=mx.bool_))]
    steps = 1
    while True:
        got, logps, valid = (np.array(mx.stack([c[j] for c in chunk], axis=1)) for j in range(3))
        ended = on_chunk([got[r][valid[r]].tolist() for r in range(len(prompts))],
                         [logps[r][valid[r]].tolist() for r in range(len(prompts))])
        if ended is None:
            return
        done = np.array(finished) | ended | (steps >= np.array(limits))
        if done.all():
            return
        finished, chunk = mx.array(done), []
        for i in range(min(CHUNK, longest - steps)):
            tokens, logp, _, valid, finished, keys, values = step(
                tokens, keys, values, mx.array(width + steps + i - 1, dtype=mx.int32), pad, finished,
                mx.array(step_keys[steps + i]), lora, None)
            chunk.append((tokens, logp, valid))
            mx.async_eval(tokens, logp, valid, finished)
        steps += len(chunk)
