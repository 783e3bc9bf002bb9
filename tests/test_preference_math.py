"""The supervised kinds' losses (worker/kinds/sft_job.py, worker/kinds/dpo_job.py, worker/kinds/reward_model_job.py)
against independent NumPy implementations written from the papers' formulas, on fixed
inputs with padding: the loss, TRL's metrics, and the gradients (NumPy: central finite
differences in float64 of the NumPy loss).

    SFT:  mean over unmasked tokens of -log softmax(logits)[target]
    DPO (Rafailov et al. 2023, eq. 7; label smoothing = conservative DPO):
          -(1-e) log s(b z) - e log s(-b z),  z = (pi_w - ref_w) - (pi_l - ref_l), sequence sums
    IPO (Azar et al. 2023, eq. 17, TRL's per-token means): (z - 1/(2 b))^2
    hinge (SLiC, as TRL): max(0, 1 - b z); and TRL 1.16's other pairwise DPO loss types (np_dpo),
          summed with loss_weights
    CPO (Xu et al. 2024) and SimPO (Meng et al. 2024), as TRL's CPOTrainer: reference-free, the
          policy's sequence sums (ipo, simpo: per-token means), + cpo_alpha x the chosen NLL
    ORPO (Hong et al. 2024, eqs. 6-7): NLL_w - lambda log s(log(odds_w / odds_l)), odds = P/(1-P),
          P = exp(mean token log-prob)
    Bradley-Terry: -log s(r_w - r_l)
    KTO (Ethayarajh et al. 2024, eq. 8, as TRL's KTOTrainer): r = pi - ref (sequence sums),
          z0 = max(0, mean(pi' - ref')) over the mismatched pairs, no gradient;
          desirable w_D (1 - s(b (r - z0))), undesirable w_U (1 - s(b (z0 - r))), mean over rows
"""

import mlx.core as mx
import numpy as np
import pytest

from shared.train_specs import DPO_LOSS_TYPES
from worker.kinds.cpo_job import cpo_loss
from worker.kinds.dpo_job import dpo_loss, orpo_loss
from worker.kinds.kto_job import kl_estimate, kto_loss, mismatched
from worker.kinds.reward_model_job import bradley_terry_loss
from worker.kinds.sft_job import masked_mean, token_losses
from worker.runtime.logprobs import sequence_logps, token_logps
from worker.runtime.train_core import Rows, pad_rows

RTOL, ATOL = 1e-4, 1e-5
rng = np.random.default_rng(0)
# 2 pairs: rows 0-1 chosen, 2-3 rejected; T = 6 completion positions, right padding.
MASK = np.array([[1, 1, 1, 1, 0, 0],
                 [1, 1, 0, 0, 0, 0],
                 [1, 1, 1, 1, 1, 1],
                 [1, 1, 1, 0, 0, 0]], dtype=np.float64)
TOKEN_LOGPS = -rng.uniform(0.05, 3.0, size=MASK.shape)  # policy, per token
REF_LOGPS = -rng.uniform(0.05, 3.0, size=MASK.shape)


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += eps
        down[i] -= eps
        g[i] = (f(up) - f(down)) / (2 * eps)
    return g


def close(a, b):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), b, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- NumPy references


def np_sft(logits, targets, mask):
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return -(picked * mask).sum() / mask.sum()


def np_dpo(token_logps, ref_token_logps, mask, beta, loss_types, eps=0.0, weights=None):
    """TRL 1.16's DPOTrainer loss types (trl/trainer/dpo_trainer.py _compute_loss), written again in NumPy."""
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    pi, ref, length = (token_logps * mask).sum(1), (ref_token_logps * mask).sum(1), mask.sum(1)
    n = len(pi) // 2
    c, r = pi[:n] - ref[:n], pi[n:] - ref[n:]
    z = beta * (c - r)
    norm = c / length[:n] - r / length[n:]
    per_type = {
        "sigmoid": -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z),
        "hinge": np.maximum(0.0, 1 - z),
        "ipo": (norm - 1 / (2 * beta)) ** 2,
        "exo_pair": (sigmoid(z) * (log_sigmoid(z) - np.log(1 - eps)) + sigmoid(-z) * (log_sigmoid(-z) - np.log(eps))
                     if eps else None),
        "nca_pair": -log_sigmoid(beta * c) - 0.5 * log_sigmoid(-beta * c) - 0.5 * log_sigmoid(-beta * r),
        "robust": (-(1 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1 - 2 * eps),
        "bco_pair": -log_sigmoid(beta * c) - log_sigmoid(-beta * r),
        "sppo_hard": (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2,
        "apo_zero": 1 - sigmoid(beta * c) + sigmoid(beta * r),
        "apo_down": sigmoid(beta * c) + 1 - sigmoid(z),
        "sigmoid_norm": -log_sigmoid(beta * norm),
    }
    weights = weights or [1.0] * len(loss_types)
    loss = sum(w * per_type[t].mean() for t, w in zip(loss_types, weights))
    rc, rr = beta * c, beta * r
    metrics = {"rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(), "rewards/accuracies": (rc > rr).mean(),
               "rewards/margins": (rc - rr).mean(), "logps/chosen": pi[:n].mean(), "logps/rejected": pi[n:].mean()}
    return loss, metrics


def np_cpo(token_logps, mask, beta, loss_type, eps, alpha, gamma):
    """TRL 1.16's CPOTrainer (trl/experimental/cpo/cpo_trainer.py cpo_loss, get_batch_loss_metrics) in NumPy."""
    n = len(token_logps) // 2
    logps = (token_logps * mask).sum(1)
    if loss_type in ("ipo", "simpo"):
        logps = logps / mask.sum(1)
    logits = logps[:n] - logps[n:]
    if loss_type == "simpo":
        logits = logits - gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        losses = -log_sigmoid(beta * logits) * (1 - eps) - log_sigmoid(-beta * logits) * eps
    elif loss_type == "hinge":
        losses = np.maximum(0.0, 1 - beta * logits)
    else:
        losses = (logits - 1 / (2 * beta)) ** 2
    nll = -(token_logps[:n] * mask[:n]).sum() / mask[:n].sum()
    rc, rr = beta * logps[:n], beta * logps[n:]
    metrics = {"rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(), "rewards/accuracies": (rc > rr).mean(),
               "rewards/margins": (rc - rr).mean(), "logps/chosen": logps[:n].mean(), "logps/rejected": logps[n:].mean(),
               "nll_loss": nll}
    return losses.mean() + alpha * nll, metrics


def np_orpo(token_logps, mask, lam):
    n = len(token_logps) // 2
    mean = (token_logps * mask).sum(1) / mask.sum(1)
    p = np.exp(mean)
    odds = p / (1 - p)
    ratio = log_sigmoid(np.log(odds[:n] / odds[n:]))
    nll = -(token_logps[:n] * mask[:n]).sum() / mask[:n].sum()
    return nll - lam * ratio.mean(), {"nll_loss": nll, "log_odds_ratio": ratio.mean(),
                                      "log_odds_chosen": np.log(odds[:n] / odds[n:]).mean()}


def np_bradley_terry(chosen, rejected):
    return -log_sigmoid(chosen - rejected).mean()


def np_kto(token_logps, ref_token_logps, kl_token_logps, kl_ref_token_logps, mask, kl_mask, labels, beta, w_d, w_u):
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    pi, ref = (token_logps * mask).sum(1), (ref_token_logps * mask).sum(1)
    z0 = max(0.0, ((kl_token_logps * kl_mask).sum(1) - (kl_ref_token_logps * kl_mask).sum(1)).mean())
    r = pi - ref
    desirable, undesirable = labels == 1, labels == 0
    losses = np.concatenate([w_d * (1 - sigmoid(beta * (r[desirable] - z0))),
                             w_u * (1 - sigmoid(beta * (z0 - r[undesirable])))])
    metrics = {"rewards/chosen": (beta * r[desirable]).mean(), "rewards/rejected": (beta * r[undesirable]).mean(),
               "kl": z0, "logps/chosen": pi[desirable].mean(), "logps/rejected": pi[undesirable].mean()}
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return losses.mean(), metrics


# --------------------------------------------------------------------------- tests


def test_sft_masked_cross_entropy_and_gradient():
    logits = rng.normal(size=(2, 5, 7))
    targets = rng.integers(0, 7, size=(2, 5))
    mask = np.array([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=np.float64)  # prompt masked, padding masked
    t, m = mx.array(targets), mx.array(mask, dtype=mx.float32)
    loss, grad = mx.value_and_grad(lambda x: masked_mean(token_losses(token_logps(x, t), "nll"), m))(
        mx.array(logits, dtype=mx.float32))
    close(loss.item(), np_sft(logits, targets, mask))
    close(np.array(grad), numeric_grad(lambda x: np_sft(x, targets, mask), logits))
    assert np.all(np.array(grad)[mask == 0] == 0)  # padding and prompt get no gradient


def test_pad_rows_masks_the_trained_tokens_only():
    batch = pad_rows(Rows([[5, 6, 7, 8], [1, 2]], starts=[2, 1]))
    targets, mask = np.array(batch.targets), np.array(batch.mask)
    # row 0: targets are tokens 1..3 (6, 7, 8); trained from token index 2 (7, 8)
    assert targets[0, :3].tolist() == [6, 7, 8] and mask[0, :4].tolist() == [0, 1, 1, 0]
    assert targets[1, :1].tolist() == [2] and mask[1].sum() == 1
    assert np.array(batch.lengths).tolist() == [4, 2] and batch.inputs.shape[1] % 32 == 0


def test_token_logps_is_log_softmax_at_the_target():
    logits = rng.normal(size=(2, 3, 11))
    targets = rng.integers(0, 11, size=(2, 3))
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    close(np.array(token_logps(mx.array(logits, dtype=mx.float32), mx.array(targets))),
          np.take_along_axis(ref, targets[..., None], -1)[..., 0])


@pytest.mark.parametrize("loss_types,beta,eps,weights", [
    *[([t], 0.1, 0.0, None) for t in DPO_LOSS_TYPES if t != "exo_pair"],
    (["sigmoid"], 0.5, 0.2, None), (["hinge"], 0.3, 0.0, None), (["ipo"], 2.0, 0.0, None), (["robust"], 0.3, 0.2, None),
    (["exo_pair"], 0.3, 1e-3, None), (["sppo_hard"], 2.0, 0.0, None),
    (["sigmoid", "bco_pair", "ipo"], 0.2, 0.0, [0.8, 0.2, 1.5])])
def test_dpo_losses_metrics_and_gradients(loss_types, beta, eps, weights):
    mask, ref = mx.array(MASK, dtype=mx.float32), mx.array(REF_LOGPS, dtype=mx.float32)
    ref_seq, lengths = sequence_logps(ref, mask), mask.sum(axis=1)

    def f(token_logps):
        seq = sequence_logps(token_logps, mask)
        return dpo_loss(seq[:2], seq[2:], ref_seq[:2], ref_seq[2:], lengths[:2], lengths[2:], beta=beta,
                        loss_types=loss_types, loss_weights=weights or [1.0] * len(loss_types), label_smoothing=eps)

    loss, metrics = f(mx.array(TOKEN_LOGPS, dtype=mx.float32))
    grad = mx.grad(lambda x: f(x)[0])(mx.array(TOKEN_LOGPS, dtype=mx.float32))
    want, want_metrics = np_dpo(TOKEN_LOGPS, REF_LOGPS, MASK, beta, loss_types, eps, weights)
    close(loss.item(), want)
    for name, value in want_metrics.items():
        close(metrics[name].item(), value)
    close(np.array(grad), numeric_grad(lambda x: np_dpo(x, REF_LOGPS, MASK, beta, loss_types, eps, weights)[0], TOKEN_LOGPS))
    assert np.all(np.array(grad)[MASK == 0] == 0)


def test_dpo_at_the_reference_is_log_2_with_zero_rewards():
    """Policy == reference (a fresh LoRA): z = 0, loss = log 2, every reward 0."""
    seq, length = mx.array([-3.0, -5.0]), mx.array([2.0, 3.0])
    loss, metrics = dpo_loss(seq, seq, seq, seq, length, length, beta=0.1, loss_types=["sigmoid"], loss_weights=[1.0])
    close(loss.item(), np.log(2))
    assert metrics["rewards/margins"].item() == 0 and metrics["rewards/accuracies"].item() == 0


@pytest.mark.parametrize("loss_type,beta,eps,alpha,gamma", [
    ("sigmoid", 0.1, 0.0, 1.0, 0.5), ("sigmoid", 0.5, 0.2, 0.0, 0.5), ("hinge", 0.3, 0.0, 1.0, 0.5),
    ("ipo", 0.5, 0.0, 0.3, 0.5), ("simpo", 2.0, 0.0, 0.0, 0.5), ("simpo", 2.5, 0.1, 1.0, 1.4)])
def test_cpo_and_simpo_losses_metrics_and_gradients(loss_type, beta, eps, alpha, gamma):
    mask = mx.array(MASK, dtype=mx.float32)

    def f(token_logps):
        return cpo_loss(token_logps, mask, beta=beta, loss_type=loss_type, label_smoothing=eps, cpo_alpha=alpha,
                        simpo_gamma=gamma)

    x = mx.array(TOKEN_LOGPS, dtype=mx.float32)
    loss, metrics = f(x)
    grad = mx.grad(lambda v: f(v)[0])(x)
    want, want_metrics = np_cpo(TOKEN_LOGPS, MASK, beta, loss_type, eps, alpha, gamma)
    close(loss.item(), want)
    for name, value in want_metrics.items():
        close(metrics[name].item(), value)
    close(np.array(grad), numeric_grad(lambda v: np_cpo(v, MASK, beta, loss_type, eps, alpha, gamma)[0], TOKEN_LOGPS))
    assert np.all(np.array(grad)[MASK == 0] == 0)


@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_orpo_loss_metrics_and_gradients(lam):
    """lam: the odds-ratio term's weight (lambda_odds); beta only scales the rewards/* metrics."""
    mask = mx.array(MASK, dtype=mx.float32)

    def f(token_logps):
        mean = sequence_logps(token_logps, mask, average=True)
        nll = -(token_logps[:2] * mask[:2]).sum() / mask[:2].sum()
        return orpo_loss(mean[:2], mean[2:], nll, lambda_odds=lam, beta=0.3)

    x = mx.array(TOKEN_LOGPS, dtype=mx.float32)
    loss, metrics = f(x)
    grad = mx.grad(lambda v: f(v)[0])(x)
    want, want_metrics = np_orpo(TOKEN_LOGPS, MASK, lam)
    close(loss.item(), want)
    for name, value in want_metrics.items():
        close(metrics[name].item(), value)
    close(metrics["rewards/chosen"].item(), 0.3 * ((TOKEN_LOGPS * MASK).sum(1) / MASK.sum(1))[:2].mean())
    close(np.array(grad), numeric_grad(lambda v: np_orpo(v, MASK, lam)[0], TOKEN_LOGPS))


def test_bradley_terry_loss_metrics_and_gradients():
    chosen, rejected = rng.normal(size=5), rng.normal(size=5)
    (loss, metrics) = bradley_terry_loss(mx.array(chosen, dtype=mx.float32), mx.array(rejected, dtype=mx.float32))
    g_c, g_r = mx.grad(lambda c, r: bradley_terry_loss(c, r)[0], argnums=(0, 1))(
        mx.array(chosen, dtype=mx.float32), mx.array(rejected, dtype=mx.float32))
    close(loss.item(), np_bradley_terry(chosen, rejected))
    close(metrics["accuracy"].item(), (chosen > rejected).mean())
    close(metrics["margin"].item(), (chosen - rejected).mean())
    close(np.array(g_c), numeric_grad(lambda c: np_bradley_terry(c, rejected), chosen))
    close(np.array(g_r), numeric_grad(lambda r: np_bradley_terry(chosen, r), rejected))


@pytest.mark.parametrize("beta,w_d,w_u,kl_shift", [(0.1, 1.0, 1.0, 1.0), (0.5, 1.33, 0.7, 2.0), (2.0, 1.0, 1.0, -3.0)])
def test_kto_loss_metrics_and_gradients(beta, w_d, w_u, kl_shift):
    """4 rows (2 desirable, 2 not, interleaved), padded; the KL estimate from 4 other padded
    rows, whose policy-minus-reference log-probs are shifted by kl_shift: a negative mean (-3)
    is clamped to z0 = 0."""
    labels = np.array([1.0, 0.0, 0.0, 1.0])
    kl_mask = MASK[[3, 0, 1, 2]]
    kl_logps, kl_ref = -rng.uniform(0.05, 3.0, size=MASK.shape), -rng.uniform(0.05, 3.0, size=MASK.shape) - kl_shift
    mask, f32 = mx.array(MASK, dtype=mx.float32), lambda a: mx.array(a, dtype=mx.float32)
    ref = sequence_logps(f32(REF_LOGPS), mask)
    kl = kl_estimate(sequence_logps(f32(kl_logps), f32(kl_mask)), sequence_logps(f32(kl_ref), f32(kl_mask)))

    def f(token_logps):
        return kto_loss(sequence_logps(token_logps, mask), ref, kl, f32(labels), beta=beta, desirable_weight=w_d,
                        undesirable_weight=w_u)

    loss, metrics = f(f32(TOKEN_LOGPS))
    grad = mx.grad(lambda x: f(x)[0])(f32(TOKEN_LOGPS))
    def want_of(x):
        return np_kto(x, REF_LOGPS, kl_logps, kl_ref, MASK, kl_mask, labels, beta, w_d, w_u)

    want, want_metrics = want_of(TOKEN_LOGPS)
    close(loss.item(), want)
    for name, value in want_metrics.items():
        close(metrics[name].item(), value)
    assert (metrics["kl"].item() == 0) == (kl_shift < 0)
    # z0 carries no gradient (TRL detaches it): the NumPy gradient holds it fixed, as a number.
    close(np.array(grad), numeric_grad(lambda x: want_of(x)[0], TOKEN_LOGPS))
    assert np.all(np.array(grad)[MASK == 0] == 0)
    kl_grad = mx.grad(lambda x: kl_estimate(sequence_logps(x, f32(kl_mask)), sequence_logps(f32(kl_ref), f32(kl_mask))))(
        f32(kl_logps))
    assert np.all(np.array(kl_grad) == 0)


def test_kto_at_the_reference_is_half_the_weights_with_zero_rewards():
    """Policy == reference (a fresh LoRA): r = 0 and z0 = 0, each row's loss is w (1 - s(0)) = w / 2."""
    seq, labels = mx.array([-3.0, -5.0, -4.0]), mx.array([1.0, 0.0, 0.0])
    kl = kl_estimate(seq, seq)
    loss, metrics = kto_loss(seq, seq, kl, labels, beta=0.1, desirable_weight=1.5, undesirable_weight=0.6)
    close(loss.item(), (1.5 + 0.6 + 0.6) / 2 / 3)
    assert metrics["rewards/margins"].item() == 0 and metrics["kl"].item() == 0


def test_kto_mismatched_pairs_rotate_the_batch_s_completions_by_one():
    """TRL's KL pairs: (x_1, y_n), (x_2, y_1), ..., (x_n, y_n-1), within the batch the rows are drawn into."""
    rows = [{"prompt": f"x{i}", "completion": f"y{i}", "label": i % 2 == 0} for i in range(6)]
    assert mismatched(rows, [4, 1, 5]) == [("x4", "y5"), ("x1", "y4"), ("x5", "y1")]


@pytest.mark.parametrize("loss_type", [*DPO_LOSS_TYPES, "cpo", "simpo", "cpo-with-nll"])
def test_a_gangs_shares_sum_to_the_loss_only_where_the_gang_is_allowed(loss_type):
    """A gang's ranks each take the loss of their share of a batch's pairs, weighted by its share
    of the pairs, and sum (worker/kinds/supervised_trainer.py make_step): the batch's loss for every
    DPO loss type and for CPO without its NLL; not with the NLL (a mean over tokens), which is why
    CPO refuses workers > 1 with cpo_alpha > 0."""
    x = -rng.uniform(0.05, 3.0, size=(6, 5))  # 3 pairs: rows 0-2 chosen (2, 1 and 5 tokens), 3-5 rejected
    ref = -rng.uniform(0.05, 3.0, size=x.shape)
    mask = np.array([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]],
                    dtype=np.float64)

    def loss(pairs: list[int]) -> float:
        rows = pairs + [p + 3 for p in pairs]
        t, m = mx.array(x[rows], dtype=mx.float32), mx.array(mask[rows], dtype=mx.float32)
        n = len(pairs)
        if loss_type in ("cpo", "simpo", "cpo-with-nll"):
            return cpo_loss(t, m, beta=2.0, loss_type="simpo" if loss_type == "simpo" else "sigmoid", label_smoothing=0.0,
                            cpo_alpha=1.0 if loss_type == "cpo-with-nll" else 0.0, simpo_gamma=0.5)[0].item()
        seq, ref_seq, lengths = sequence_logps(t, m), sequence_logps(mx.array(ref[rows], dtype=mx.float32), m), m.sum(axis=1)
        return dpo_loss(seq[:n], seq[n:], ref_seq[:n], ref_seq[n:], lengths[:n], lengths[n:], beta=0.3,
                        loss_types=[loss_type], loss_weights=[1.0], label_smoothing=0.1)[0].item()

    shares = loss([0]) * 1 / 3 + loss([1, 2]) * 2 / 3
    if loss_type == "cpo-with-nll":
        assert abs(shares - loss([0, 1, 2])) > 1e-3
    else:
        close(shares, loss([0, 1, 2]))
