"""worker/kinds/grpo.py's math against an independent NumPy (float64) implementation of
Hugging Face TRL's GRPO objective, written from TRL's definitions:

  advantages   A = (r - mean_group(r)) / (std + 1e-4), torch's unbiased std (ddof=1) of the
               group ("group") or of the whole batch ("batch"); "none": r - mean_group(r).
  log ratio    logp - old_logp per token; sequence level (GSPO): masked mean per row,
               broadcast over the row's tokens. ratio = exp(log ratio).
  per token    -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)   (tests/policy_reference.py)
               + beta * (exp(ref - logp) - (ref - logp) - 1)
  aggregation  grpo:    mean over rows of (masked sum / max(row count, 1))
               bnpo,
               dapo:    masked sum / max(total count, 1)
               dr_grpo: masked sum / (rows * max_completion_len)
  metrics      clip_ratio/low = ratio < 1 - eps_low and A < 0, high = ratio > 1 + eps_high
               and A > 0, region = either; masked means over completion tokens, as are
               mean_ratio and kl; at sequence level the clip metrics and mean_ratio are
               means over sequences (every row, one value each), as TRL logs them.

The gradient d loss / d logp is derived analytically (checked here against central finite
differences of the NumPy loss) and compared with mx.grad through grpo_loss.
"""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from policy_reference import clipped_sides, d_surrogate_d_ratio, surrogate

from worker.kinds.grpo import advantages_from_rewards, grpo_loss

EPS_LOW = 0.2
EPS_HIGHS = (0.2, 0.28)  # equal to eps_low, and larger (DAPO's clip-higher)
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
LEVELS = ("token", "sequence")
BETAS = (0.0, 0.04)
MAX_COMPLETION_LEN = 9  # > T, so dr_grpo's constant differs from every other normaliser
KINK_MARGIN = 0.02  # |log ratio - log(clip bound)| kept above this so finite differences are smooth

CONFIGS = list(itertools.product(LOSS_TYPES, LEVELS, BETAS, EPS_HIGHS))
CONFIG_IDS = [f"{lt}-{lvl}-beta{b}-eh{eh}" for lt, lvl, b, eh in CONFIGS]


# --------------------------------------------------------------------------- reference (NumPy, float64)


def ref_advantages(rewards: np.ndarray, scale_rewards: str) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    B, G = r.shape
    centred = r - r.mean(axis=1, keepdims=True)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = r.std(axis=1, ddof=1, keepdims=True) if G > 1 else np.zeros((B, 1))
    elif scale_rewards == "batch":
        std = np.full((B, 1), r.std(ddof=1) if r.size > 1 else 0.0)
    else:
        raise ValueError(scale_rewards)
    return centred / (std + 1e-4)


def _log_ratio(logp, old_logp, mask, level):
    """Per-token log importance weight, (rows, T); sequence level is constant along each row."""
    lr = logp - old_logp
    if level == "token":
        return lr
    n = np.maximum(mask.sum(axis=1), 1.0)
    seq = (lr * mask).sum(axis=1) / n
    return np.broadcast_to(seq[:, None], lr.shape).copy()


def _token_weights(mask, loss_type, max_completion_len):
    """d loss / d per_token_loss: the aggregation is linear in the per-token losses."""
    rows = mask.shape[0]
    if loss_type == "grpo":
        n = np.maximum(mask.sum(axis=1, keepdims=True), 1.0)
        return mask / n / rows
    if loss_type in ("bnpo", "dapo"):
        return mask / max(mask.sum(), 1.0)
    if loss_type == "dr_grpo":
        return mask / (rows * max_completion_len)
    raise ValueError(loss_type)


def ref_loss(logp, old_logp, ref_logp, adv, mask, *, loss_type, level, eps_low, eps_high, beta, max_completion_len):
    ratio = np.exp(_log_ratio(logp, old_logp, mask, level))
    A = adv[:, None]
    per_token = surrogate(ratio, A, 1 - eps_low, 1 + eps_high)
    if beta > 0:
        d = ref_logp - logp
        per_token = per_token + beta * (np.exp(d) - d - 1)
    # written per loss type (not via _token_weights) so the two routes check each other
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1.0)).mean()
    elif loss_type in ("bnpo", "dapo"):
        loss = (per_token * mask).sum() / max(mask.sum(), 1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (mask.shape[0] * max_completion_len)
    else:
        raise ValueError(loss_type)
    return float(loss)


def ref_clipped(ratio, adv, eps_low, eps_high):
    return clipped_sides(ratio, adv[:, None], 1 - eps_low, 1 + eps_high)


def ref_grad(logp, old_logp, ref_logp, adv, mask, *, loss_type, level, eps_low, eps_high, beta, max_completion_len):
    """Analytic d loss / d logp.

    -min(r A, clip(r) A) has derivative -A in r, except where the clipped branch is the
    smaller one, i.e. exactly TRL's low/high clipped tokens, where it is 0.
    token level: dr_t/dlogp_t = r_t.  sequence level: dr_i/dlogp_t = r_i m_t / n_i.
    k3 KL: d/dlogp (e^d - d - 1) with d = ref - logp is 1 - e^d."""
    w = _token_weights(mask, loss_type, max_completion_len)
    ratio = np.exp(_log_ratio(logp, old_logp, mask, level))
    dl_dr = d_surrogate_d_ratio(ratio, adv[:, None], 1 - eps_low, 1 + eps_high)
    if level == "token":
        g = w * dl_dr * ratio
    else:
        n = np.maximum(mask.sum(axis=1, keepdims=True), 1.0)
        # dl_dr and ratio are constant along a row
        row = (w * dl_dr * ratio).sum(axis=1, keepdims=True)
        g = row * mask / n
    if beta > 0:
        g = g + w * beta * (1 - np.exp(ref_logp - logp))
    return g


def ref_stats(logp, old_logp, ref_logp, adv, mask, *, level, eps_low, eps_high, beta):
    ratio = np.exp(_log_ratio(logp, old_logp, mask, level))
    low, high = ref_clipped(ratio, adv, eps_low, eps_high)
    N = max(mask.sum(), 1.0)

    def mm(x):
        return float((x * mask).sum() / N)

    def per_sequence(x):  # one value per row (the ratio is constant along a row), every row counts
        return float(np.mean([x[i, 0] for i in range(x.shape[0])]))

    ratio_mean = per_sequence if level == "sequence" else mm
    out = {
        "clip_ratio/low_mean": ratio_mean(low),
        "clip_ratio/high_mean": ratio_mean(high),
        "clip_ratio/region_mean": ratio_mean(low | high),
        "mean_ratio": ratio_mean(ratio),
    }
    if beta > 0:
        d = ref_logp - logp
        out["kl"] = mm(np.exp(d) - d - 1)  # per token at either level
    return out


# --------------------------------------------------------------------------- inputs


def make_inputs():
    """6 rows x 7 tokens. Row lengths 7, 5, 0 (fully masked), 3, 6, 1; advantages of both
    signs; per-token log ratios in [-0.6, 0.6] (clipping on both sides, both advantage
    signs) and per-row means chosen so the sequence level also clips on both sides, with
    one row (mean log ratio 0.215, ratio 1.24) clipped when eps_high = 0.2 but not 0.28.
    Padding positions hold arbitrary finite values that must not matter."""
    rng = np.random.default_rng(1234)
    rows, T = 6, 7
    lengths = np.array([7, 5, 0, 3, 6, 1])
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    adv = np.array([1.3, -0.9, 0.7, -1.1, 0.5, -0.4])
    seq_targets = np.array([0.4, -0.5, 0.0, 0.3, 0.215, -0.05])
    kinks = np.log([1 - EPS_LOW] + [1 + eh for eh in EPS_HIGHS])

    def far_from_kinks(x):
        return np.all(np.abs(x[..., None] - kinks) > KINK_MARGIN, axis=-1)

    lr = np.zeros((rows, T))
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        for _ in range(10_000):
            x = rng.uniform(-0.6, 0.6, n)
            x += seq_targets[i] - x.mean()  # exact row mean for the sequence level
            if far_from_kinks(x).all() and np.abs(x).max() < 1.0:
                break
        else:  # pragma: no cover
            raise RuntimeError("could not draw log ratios away from the clip bounds")
        lr[i, :n] = x
    old_logp = -rng.uniform(0.2, 3.0, (rows, T))
    logp = old_logp + lr
    ref_logp = logp + rng.uniform(-0.5, 0.5, (rows, T))
    pad = mask == 0
    logp[pad] = rng.uniform(-4.0, 2.0, pad.sum())  # garbage: large ratios if it leaked in
    old_logp[pad] = rng.uniform(-4.0, 0.0, pad.sum())
    ref_logp[pad] = rng.uniform(-4.0, 0.0, pad.sum())
    # Round-trip through float32 so both sides see exactly the same numbers.
    f32 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731
    return dict(logp=f32(logp), old_logp=f32(old_logp), ref_logp=f32(ref_logp), adv=f32(adv), mask=mask)


INPUTS = make_inputs()


def mlx_call(cfg_logp, inp, loss_type, level, beta, eps_high):
    return grpo_loss(
        cfg_logp,
        mx.array(inp["old_logp"].astype(np.float32)),
        mx.array(inp["ref_logp"].astype(np.float32)),
        mx.array(inp["adv"].astype(np.float32)),
        mx.array(inp["mask"].astype(bool)),
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_low=EPS_LOW,
        epsilon_high=eps_high,
        beta=beta,
        max_completion_len=MAX_COMPLETION_LEN,
    )


def ref_kwargs(loss_type, level, beta, eps_high):
    return dict(loss_type=loss_type, level=level, eps_low=EPS_LOW, eps_high=eps_high, beta=beta,
                max_completion_len=MAX_COMPLETION_LEN)


def np_args(inp):
    return inp["logp"], inp["old_logp"], inp["ref_logp"], inp["adv"], inp["mask"]


# --------------------------------------------------------------------------- sanity of the fixture and the reference


def test_inputs_exercise_both_clip_sides():
    inp = INPUTS
    for level in LEVELS:
        for eh in EPS_HIGHS:
            s = ref_stats(*np_args(inp), level=level, eps_low=EPS_LOW, eps_high=eh, beta=0.0)
            assert s["clip_ratio/low_mean"] > 0, (level, eh)
            assert s["clip_ratio/high_mean"] > 0, (level, eh)
            assert s["clip_ratio/region_mean"] < 1, (level, eh)
            # some token sits outside the range on the side where the advantage does NOT
            # get clipped (it keeps its gradient)
            ratio = np.exp(_log_ratio(inp["logp"], inp["old_logp"], inp["mask"], level))
            A = inp["adv"][:, None]
            m = inp["mask"] > 0
            assert (m & (ratio > 1 + eh) & (A < 0)).any() or (m & (ratio < 1 - EPS_LOW) & (A > 0)).any()
    # eps_high matters: the 1.24 row is clipped at 0.2 but not at 0.28
    hi = [ref_stats(*np_args(inp), level="sequence", eps_low=EPS_LOW, eps_high=eh, beta=0.0)["clip_ratio/high_mean"]
          for eh in EPS_HIGHS]
    assert hi[0] > hi[1]


@pytest.mark.parametrize("loss_type,level,beta,eps_high", CONFIGS, ids=CONFIG_IDS)
def test_reference_gradient_matches_finite_differences(loss_type, level, beta, eps_high):
    inp = INPUTS
    kw = ref_kwargs(loss_type, level, beta, eps_high)
    logp, old, ref, adv, mask = np_args(inp)
    g = ref_grad(logp, old, ref, adv, mask, **kw)
    h = 1e-6
    fd = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        up, dn = logp.copy(), logp.copy()
        up[idx] += h
        dn[idx] -= h
        fd[idx] = (ref_loss(up, old, ref, adv, mask, **kw) - ref_loss(dn, old, ref, adv, mask, **kw)) / (2 * h)
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-8)


# --------------------------------------------------------------------------- grpo_loss vs the reference


@pytest.mark.parametrize("loss_type,level,beta,eps_high", CONFIGS, ids=CONFIG_IDS)
def test_loss_value(loss_type, level, beta, eps_high):
    inp = INPUTS
    loss, _ = mlx_call(mx.array(inp["logp"].astype(np.float32)), inp, loss_type, level, beta, eps_high)
    expected = ref_loss(*np_args(inp), **ref_kwargs(loss_type, level, beta, eps_high))
    assert loss.shape == ()
    np.testing.assert_allclose(loss.item(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type,level,beta,eps_high", CONFIGS, ids=CONFIG_IDS)
def test_gradient_wrt_logp(loss_type, level, beta, eps_high):
    inp = INPUTS
    g = mx.grad(lambda lp: mlx_call(lp, inp, loss_type, level, beta, eps_high)[0])(
        mx.array(inp["logp"].astype(np.float32))
    )
    g = np.array(g, dtype=np.float64)
    expected = ref_grad(*np_args(inp), **ref_kwargs(loss_type, level, beta, eps_high))
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-7)
    # padding has exactly zero gradient (fully masked row 2 included)
    assert np.all(g[inp["mask"] == 0] == 0.0)


@pytest.mark.parametrize("loss_type,level,beta,eps_high", CONFIGS, ids=CONFIG_IDS)
def test_stats(loss_type, level, beta, eps_high):
    inp = INPUTS
    _, stats = mlx_call(mx.array(inp["logp"].astype(np.float32)), inp, loss_type, level, beta, eps_high)
    expected = ref_stats(*np_args(inp), level=level, eps_low=EPS_LOW, eps_high=eps_high, beta=beta)
    assert set(stats) == set(expected)
    for k, v in expected.items():
        assert stats[k].shape == (), k
        np.testing.assert_allclose(stats[k].item(), v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_fully_masked_batch_is_finite():
    """Every normaliser has its min-1 guard: an all-padding batch gives 0, not NaN."""
    inp = dict(INPUTS, mask=np.zeros_like(INPUTS["mask"]))
    for loss_type, level, beta, eh in CONFIGS:
        lp = mx.array(inp["logp"].astype(np.float32))
        loss, stats = mlx_call(lp, inp, loss_type, level, beta, eh)
        g = mx.grad(lambda x: mlx_call(x, inp, loss_type, level, beta, eh)[0])(lp)
        assert loss.item() == 0.0
        assert all(np.isfinite(v.item()) for v in stats.values())
        assert np.all(np.array(g) == 0.0)


# --------------------------------------------------------------------------- clipping acts


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("eps_high", EPS_HIGHS)
def test_clipping_zeroes_the_gradient(level, eps_high):
    """Ratio beyond the bound on the side the advantage pushes towards: zero gradient.
    Beyond the bound on the other side: the unclipped gradient -A * ratio * weight."""
    # one token per row (so token and sequence level coincide in the ratio), 4 rows
    log_ratio = np.array([0.5, -0.5, -0.5, 0.5])  # ratios 1.65, 0.61, 0.61, 1.65
    adv = np.array([1.0, -1.0, 1.0, -1.0])
    T = 3
    old = np.full((4, T), -1.0)
    logp = old.copy()
    logp[:, 0] += log_ratio
    mask = np.zeros((4, T))
    mask[:, 0] = 1
    inp = dict(logp=logp, old_logp=old, ref_logp=old, adv=adv, mask=mask)
    g = mx.grad(lambda lp: mlx_call(lp, inp, "bnpo", level, 0.0, eps_high)[0])(mx.array(logp.astype(np.float32)))
    g = np.array(g, dtype=np.float64)
    assert g[0, 0] == 0.0  # A > 0, ratio > 1 + eps_high: clipped
    assert g[1, 0] == 0.0  # A < 0, ratio < 1 - eps_low: clipped
    ratio = np.exp(log_ratio)
    np.testing.assert_allclose(g[2, 0], -adv[2] * ratio[2] / 4, rtol=1e-5)  # A > 0, ratio low: not clipped
    np.testing.assert_allclose(g[3, 0], -adv[3] * ratio[3] / 4, rtol=1e-5)  # A < 0, ratio high: not clipped
    assert np.all(g[:, 1:] == 0.0)
    _, stats = mlx_call(mx.array(logp.astype(np.float32)), inp, "bnpo", level, 0.0, eps_high)
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(0.25)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(0.25)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(0.5)


def test_clipped_sequence_zeroes_the_whole_row():
    """GSPO: a clipped sequence ratio stops the gradient for all its tokens, while an
    unclipped row spreads -A * ratio / n over its tokens."""
    old = np.full((2, 4), -1.0)
    logp = old + np.array([[0.9, 0.3, 0.0, 0.0], [0.9, 0.3, 0.0, 0.0]])  # row means 0.6 over 2 tokens
    mask = np.array([[1, 1, 0, 0], [1, 1, 0, 0]], dtype=np.float64)
    adv = np.array([1.0, -1.0])
    inp = dict(logp=logp, old_logp=old, ref_logp=old, adv=adv, mask=mask)
    g = mx.grad(lambda lp: mlx_call(lp, inp, "grpo", "sequence", 0.0, 0.28)[0])(mx.array(logp.astype(np.float32)))
    g = np.array(g, dtype=np.float64)
    assert np.all(g[0] == 0.0)
    r = np.exp(0.6)
    np.testing.assert_allclose(g[1, :2], [r / 2 / 2] * 2, rtol=1e-5)  # -A * r / n / rows
    assert np.all(g[1, 2:] == 0.0)


# --------------------------------------------------------------------------- advantages


REWARDS = np.array(
    [
        [1.0, 0.0, 0.5, 0.25],
        [0.3, 0.3, 0.3, 0.3],  # all equal
        [2.0, -1.0, 0.0, 3.5],
    ],
    dtype=np.float32,
)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_match_reference(scale_rewards):
    got = advantages_from_rewards(REWARDS, scale_rewards)
    assert got.shape == REWARDS.shape
    np.testing.assert_allclose(got, ref_advantages(REWARDS, scale_rewards), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[1], 0.0)  # a group of equal rewards has no signal
    np.testing.assert_allclose(got.sum(axis=1), 0.0, atol=1e-5)  # centred on the group mean


def test_advantages_group_scale_is_unbiased_std():
    r = np.array([[0.0, 1.0]], dtype=np.float32)  # ddof=1 std = 0.7071, ddof=0 std = 0.5
    got = advantages_from_rewards(r, "group")
    np.testing.assert_allclose(got, [[-0.5 / (np.sqrt(0.5) + 1e-4), 0.5 / (np.sqrt(0.5) + 1e-4)]], rtol=1e-6)


def test_advantages_batch_uses_group_mean_and_batch_std():
    got = advantages_from_rewards(REWARDS, "batch")
    std = np.asarray(REWARDS, np.float64).std(ddof=1)
    centred = REWARDS - REWARDS.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(got, centred / (std + 1e-4), rtol=1e-5, atol=1e-6)


def test_advantages_none_is_only_centred():
    got = advantages_from_rewards(REWARDS, "none")
    np.testing.assert_allclose(got, REWARDS - REWARDS.mean(axis=1, keepdims=True), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("B", [1, 3])
def test_advantages_group_of_one_is_zero(scale_rewards, B):
    r = np.arange(B, dtype=np.float32).reshape(B, 1) + 0.5
    with np.errstate(all="raise"):  # no 0/0, no ddof warnings
        got = advantages_from_rewards(r, scale_rewards)
    assert got.shape == (B, 1)
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got, 0.0)


# --------------------------------------------------------------------------- unscorable completions (TRL's NaN)


def test_unscorable_completions_get_zero_advantage_and_stay_out_of_group_statistics():
    nan = np.nan
    rewards = np.array([[1.0, nan, 3.0, 2.0], [nan, nan, nan, nan], [5.0, nan, nan, nan]], dtype=np.float32)
    got = advantages_from_rewards(rewards, "group")
    scored = np.array([1.0, 3.0, 2.0])  # the first group without its NaN
    np.testing.assert_allclose(got[0, [0, 2, 3]], (scored - scored.mean()) / (scored.std(ddof=1) + 1e-4), rtol=1e-5)
    assert got[0, 1] == 0.0
    np.testing.assert_array_equal(got[1:], 0.0)  # nothing scorable / one scorable: std undefined
    batch = advantages_from_rewards(rewards, "batch")
    valid = rewards[~np.isnan(rewards)].astype(np.float64)
    np.testing.assert_allclose(batch[0, 0], (1.0 - 2.0) / (valid.std(ddof=1) + 1e-4), rtol=1e-5)
    assert np.isfinite(batch).all() and batch[1].tolist() == [0.0] * 4


# --------------------------------------------------------------------------- the optimizer


def test_first_updates_equal_pytorch_adamw():
    """The trainer's optimizer (bias-corrected AdamW with the config's betas and eps) against
    PyTorch's AdamW update written in NumPy, on fixed gradients, three steps."""
    import mlx.nn as nn

    from shared.schemas import GRPOConfig
    from worker.runtime.train_core import make_optimizer

    cfg = GRPOConfig(learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6)
    rng = np.random.default_rng(0)
    theta = rng.normal(size=(3, 4)).astype(np.float32)
    grads = [rng.normal(size=(3, 4)).astype(np.float32) * s for s in (1.0, 0.1, 3.0)]
    layer = nn.Linear(4, 3, bias=False)
    layer.weight = mx.array(theta)
    opt = make_optimizer(cfg, cfg.iters)
    opt.init(layer.trainable_parameters())

    p, m, v = theta.astype(np.float64), np.zeros((3, 4)), np.zeros((3, 4))
    b1, b2, eps, lr, wd = 0.8, 0.99, 1e-6, 1e-2, 0.1
    for t, g in enumerate(grads, start=1):
        opt.update(layer, {"weight": mx.array(g)})
        p = p * (1 - lr * wd)  # torch.optim.AdamW, decoupled weight decay
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g.astype(np.float64) ** 2
        p = p - lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
        np.testing.assert_allclose(np.array(layer.weight), p, rtol=1e-5, atol=1e-6)
    # Without bias correction the first step would be 1 / (1 - b1) / sqrt(1 / (1 - b2)) ~ 0.5x (here) as large.
    assert abs(p - theta).max() > 1e-3
