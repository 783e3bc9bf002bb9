"""Tinker's loss functions (the `loss_fn` of forward_backward), top to bottom.

A datum is N input tokens and its loss_fn_inputs, one row per input position: position i
predicts target_tokens[i]. With
    lp_i = log p_theta(target_tokens[i] | input tokens 0..i)   the learner's log-prob, float32, of
                                                               the full softmax (the output `logprobs`)
    q_i  = loss_fn_inputs["logprobs"][i]                       the sampler's log-prob
    A_i  = loss_fn_inputs["advantages"][i]
    r_i  = exp(lp_i - q_i)                                     the importance ratio
the loss of each position is

    loss_fn              loss_i                                       loss_fn_config (default)
    cross_entropy        -w_i lp_i         (w: weights)               none
                         (N, K) inputs: -sum_k w_ik lp_ik, K target tokens per position
                         (top-K distillation); `logprobs` is then (N, K)
    importance_sampling  -r_i A_i                                     none
    ppo                  -min(r_i A_i, clip(r_i, lo, hi) A_i)         clip_low_threshold lo (0.8),
                         (worker/runtime/surrogate.py, GRPO's)        clip_high_threshold hi (1.2)
    cispo                -sg(clip(r_i, lo, hi)) lp_i A_i              as ppo
                         (sg: a constant, no gradient through it)
    dro                  -(lp_i A_i - beta/2 (lp_i - q_i)^2)          beta (0.05)

and a call's loss is the SUM of loss_i over every position of every datum (Tinker's
convention: no mean), the metric `loss:sum`. lo and hi are absolute bounds on the ratio;
Tinker's docs fix its epsilon at 0.2, hence 0.8 and 1.2. ppo and cispo also take them per
position as loss_fn_inputs (clip_low_threshold, clip_high_threshold: (N,) float32, in place
of the config's). dro's beta has no documented default; 0.05 is the docs' example.
gspo, stable_reinforce and custom are not supported by this server.

check_call says what is wrong with a call (its loss_fn, config keys, and each datum's inputs:
names, dtypes, shapes, values), in a message naming the field, before anything runs.
"""

import math

import mlx.core as mx
import numpy as np

from worker.runtime.surrogate import clipped_surrogate

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
REQUIRED_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": RL_INPUTS,
    "ppo": RL_INPUTS,
    "cispo": RL_INPUTS,
    "dro": RL_INPUTS,
}
OPTIONAL_INPUTS = {"ppo": tuple(CLIP_DEFAULTS), "cispo": tuple(CLIP_DEFAULTS)}
CONFIG_DEFAULTS = {"cross_entropy": {}, "importance_sampling": {}, "ppo": CLIP_DEFAULTS, "cispo": CLIP_DEFAULTS,
                   "dro": {"beta": 0.05}}
LOSS_FNS = tuple(REQUIRED_INPUTS)


# --------------------------------------------------------------------------- the math


def loss_config(loss_fn: str, config: dict) -> dict[str, float]:
    """The call's config with its loss's defaults filled in (a call check_call passed)."""
    return {**CONFIG_DEFAULTS[loss_fn], **{k: float(v) for k, v in config.items()}}


def token_losses(loss_fn: str, lp: mx.array, inputs: dict[str, mx.array], config: dict[str, float]) -> mx.array:
    """loss_i of the table above at every position, the shape of lp: (rows, positions), or
    (rows, positions, K) for cross_entropy. inputs: the loss_fn_inputs, padded alike."""
    if loss_fn == "cross_entropy":
        return -inputs["weights"] * lp
    q, A = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "dro":
        return -(lp * A - 0.5 * config["beta"] * (lp - q) ** 2)
    ratio = mx.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -ratio * A
    lo = inputs.get("clip_low_threshold", config["clip_low_threshold"])
    hi = inputs.get("clip_high_threshold", config["clip_high_threshold"])
    if loss_fn == "ppo":
        return clipped_surrogate(ratio, A, lo, hi)
    return -mx.stop_gradient(mx.clip(ratio, lo, hi)) * lp * A  # cispo


# --------------------------------------------------------------------------- what a call may ask


def check_call(loss_fn: str, config: dict, data: list, vocab_size: int, max_tokens: int) -> str | None:
    """What is wrong with a forward_backward call, in words naming the field; None if nothing.
    data: (input tokens (N,), loss_fn_inputs {name: array}) per datum."""
    if loss_fn not in REQUIRED_INPUTS:
        return f"loss_fn {str(loss_fn)[:100]!r} is not supported by this server (it supports {', '.join(LOSS_FNS)})"
    error = _config_error(loss_fn, config)
    if error:
        return error
    if not data:
        return "data is empty: forward_backward needs at least one datum"
    cfg = loss_config(loss_fn, config)
    for i, datum in enumerate(data):
        error = _datum_error(loss_fn, cfg, i, datum, vocab_size, max_tokens)
        if error:
            return error
    return None


def _config_error(loss_fn: str, config: dict) -> str | None:
    known = CONFIG_DEFAULTS[loss_fn]
    for key, value in config.items():
        if key not in known:
            takes = f"it takes {', '.join(known)}" if known else "it takes none"
            return f"loss_fn_config key {str(key)[:100]!r} is not used by {loss_fn} ({takes})"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"loss_fn_config[{key!r}] must be a finite number, got {str(value)[:100]!r}"
        if value < 0:
            return f"loss_fn_config[{key!r}] must not be negative, got {value}"
    cfg = loss_config(loss_fn, config)
    if "clip_low_threshold" in cfg and cfg["clip_low_threshold"] > cfg["clip_high_threshold"]:
        return (f"loss_fn_config clip_low_threshold {cfg['clip_low_threshold']} is above clip_high_threshold "
                f"{cfg['clip_high_threshold']} (they are absolute bounds on the ratio, e.g. 0.8 and 1.2)")
    return None


def _datum_error(loss_fn: str, cfg: dict[str, float], i: int, datum, vocab_size: int, max_tokens: int) -> str | None:
    tokens, inputs = datum
    where = f"data[{i}]"
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        return f"{where}.model_input must be a 1-D array of token ids"
    n = len(tokens)
    if n == 0:
        return f"{where}.model_input has no tokens"
    if n > max_tokens:
        return f"{where}.model_input has {n} tokens, more than the model's context of {max_tokens}"
    error = _ids_error(f"{where}.model_input", tokens, vocab_size)
    if error:
        return error
    if not isinstance(inputs, dict):
        return f"{where}.loss_fn_inputs must be a dict of arrays"
    required, optional = REQUIRED_INPUTS[loss_fn], OPTIONAL_INPUTS.get(loss_fn, ())
    takes = ", ".join(required + optional)
    for name in required:
        if name not in inputs:
            return f"{where}.loss_fn_inputs lacks {name!r} ({loss_fn} takes {takes})"
    for name, value in inputs.items():
        field = f"{where}.loss_fn_inputs[{str(name)[:100]!r}]"
        if name not in required and name not in optional:
            return f"{field} is not an input of {loss_fn} (it takes {takes})"
        if not isinstance(value, np.ndarray):
            return f"{field} must be an array"
        integer = name == "target_tokens"
        if integer and not np.issubdtype(value.dtype, np.integer):
            return f"{field} must hold token ids (integers), got {value.dtype}"
        if not integer and not np.issubdtype(value.dtype, np.floating):
            return f"{field} must hold floating-point numbers, got {value.dtype}"
        top_k = loss_fn == "cross_entropy" and value.ndim == 2 and value.shape[0] == n and value.shape[1] >= 1
        if value.shape != (n,) and not top_k:
            shapes = f"({n},) or ({n}, K)" if loss_fn == "cross_entropy" else f"({n},)"
            return f"{field} has shape {value.shape}, expected {shapes}: one row per input token"
        if integer and (error := _ids_error(field, value, vocab_size)):
            return error
        if not integer and not np.isfinite(value).all():
            return f"{field} is not finite at position {int(np.argwhere(~np.isfinite(value))[0][0])}"
    if loss_fn == "cross_entropy" and inputs["weights"].shape != inputs["target_tokens"].shape:
        return (f"{where}.loss_fn_inputs['weights'] has shape {inputs['weights'].shape}, target_tokens "
                f"{inputs['target_tokens'].shape}: they must match")
    for name in optional:
        if name in inputs and (inputs[name] < 0).any():
            return f"{where}.loss_fn_inputs[{name!r}] must not be negative"
    if "clip_low_threshold" in inputs or "clip_high_threshold" in inputs:
        lo = inputs.get("clip_low_threshold", cfg["clip_low_threshold"])
        hi = inputs.get("clip_high_threshold", cfg["clip_high_threshold"])
        if np.any(np.asarray(lo) > np.asarray(hi)):
            j = int(np.argmax(np.broadcast_to(np.asarray(lo) > np.asarray(hi), (n,))))
            return f"{where}: clip_low_threshold is above clip_high_threshold at position {j}"
    return None


def _ids_error(field: str, ids: np.ndarray, vocab_size: int) -> str | None:
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        return f"{field} holds token id {int(ids[bad][0])}, outside the model's vocabulary (0..{vocab_size - 1})"
    return None
