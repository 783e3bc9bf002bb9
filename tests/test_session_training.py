"""The Tinker training client (worker/sessions/training_client.py) and its losses
(worker/sessions/losses.py) on the tiny generated model, without Redis:

- cross_entropy against mlx_lm's own loss (default_loss, a mean: times the token count), on the
  tied model and on an untied one whose lm_head carries LoRA (train_unembed);
- importance_sampling, ppo, cispo and dro against their formulas written here in NumPy (ppo's
  clipped surrogate: tests/policy_reference.py, which GRPO's tests share), the gradient as the
  formula's d loss / d logprob pulled back through the model by mx.vjp, with tokens clipped on
  both sides;
- optim_step against AdamW written by hand, with weight decay and clipping; accumulation; two
  clients on one base; state / load_state; adapter_files in mlx_lm.load; every error message.
"""

import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load
from mlx_lm.models import qwen3
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers
from policy_reference import d_surrogate_d_ratio, surrogate

from worker.runtime import memory_plan
from worker.runtime.adapter_layers import adapter_layers, remove_adapter_layers
from worker.runtime.projection_groups import fuse_shared_inputs
from worker.sessions.training_client import BadRequest, LoraConfig, TrainingClient, saved_lora_config

LENGTHS = (7, 12, 3, 9)
ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


@pytest.fixture(scope="module")
def base(tiny_model):
    """The tiny model as a worker keeps a shared one: loaded once, its projections fused."""
    model, _ = load(str(tiny_model))
    fuse_shared_inputs(model)
    return model


@pytest.fixture(scope="module")
def untied(tiny_model):
    """The tiny model with an lm_head of its own (random), so that train_unembed has a layer."""
    config = json.loads((tiny_model / "config.json").read_text())
    model = qwen3.Model(qwen3.ModelArgs.from_dict({**config, "tie_word_embeddings": False}))
    weights = mx.load(str(tiny_model / "model.safetensors"))
    shape = (config["vocab_size"], config["hidden_size"])
    weights["lm_head.weight"] = 0.02 * mx.random.normal(shape, key=mx.random.key(3))
    model.load_weights(list(weights.items()))
    model.eval()
    fuse_shared_inputs(model)
    return model


def make_data(rng, lengths=LENGTHS, vocab=1000) -> list:
    """Cross-entropy datums: (input tokens, {target_tokens: the next tokens, weights: 1})."""
    data = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1)
        data.append((seq[:-1].astype(np.int32), {"target_tokens": seq[1:].astype(np.int64),
                                                 "weights": np.ones(n, np.float32)}))
    return data


def trained_client(model, seed=1, rank=4, **flags) -> TrainingClient:
    """A client one step away from its start, so that every LoRA matrix has a gradient (B = 0 at
    the start leaves A's gradient 0)."""
    client = TrainingClient(model, LoraConfig(rank=rank, seed=seed, **flags))
    client.forward_backward(make_data(np.random.default_rng(99)), "cross_entropy", {}, False)
    client.optim_step(**ADAM)
    return client


def flat(tree) -> dict[str, np.ndarray]:
    return {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(tree)}


def params(client) -> dict[str, np.ndarray]:
    with client.attached() as model:
        return flat(model.trainable_parameters())


def assert_close(got: dict, want: dict, rtol=2e-4):
    assert got.keys() == want.keys()
    for k in want:
        scale = max(np.abs(want[k]).max(), 1e-12)
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=rtol * scale, err_msg=k)


def plain_logprobs(model, tokens, targets) -> mx.array:
    """log softmax(model(tokens))[target], one datum, the whole vocabulary at once."""
    logits = model(mx.array(tokens)[None])[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.take_along_axis(logp, mx.array(targets.reshape(len(tokens), -1).astype(np.int32)), axis=-1).reshape(
        targets.shape)


def reference(client, data, d_loss_d_lp):
    """Each datum's log-probs (float64) under the client's adapter, and the gradient of a loss
    whose derivative in them is d_loss_d_lp(log-probs) (per datum), by mx.vjp through the model."""
    with client.attached() as model:
        names, arrays = zip(*tree_flatten(model.trainable_parameters()))

        def lps(*weights):
            model.update(tree_unflatten(list(zip(names, weights))))
            return [plain_logprobs(model, tokens, inputs["target_tokens"]) for tokens, inputs in data]

        values = [np.array(v, dtype=np.float64) for v in lps(*arrays)]
        cotangents = [mx.array(c.astype(np.float32)) for c in d_loss_d_lp(values)]
        _, grads = mx.vjp(lps, list(arrays), cotangents)
        return values, {k: np.array(g, dtype=np.float64) for k, g in zip(names, grads)}


# --------------------------------------------------------------------------- cross_entropy


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_cross_entropy_equals_mlx_lm_loss(which, base, untied):
    """loss:sum and the gradients are mlx_lm's default_loss (a mean over tokens) times the token
    count; on the untied model the lm_head's LoRA is trained and gets its share."""
    model = base if which == "tied" else untied
    client = trained_client(model)
    assert client.info()["train_unembed"] == (which == "untied")
    assert ("lm_head" in client.keys) == (which == "untied")
    data = make_data(np.random.default_rng(0))
    outputs, metrics = client.forward_backward(data, "cross_entropy", {}, False)

    width = max(LENGTHS) + 1
    rows = np.zeros((len(data), width), np.int32)
    for r, (tokens, inputs) in enumerate(data):
        rows[r, :len(tokens) + 1] = np.append(tokens, inputs["target_tokens"][-1])
    lengths = mx.array([[1, n] for n in LENGTHS])
    with client.attached() as m:
        (mean, ntoks), grads = nn.value_and_grad(m, default_loss)(m, mx.array(rows), lengths)
    ntoks = int(ntoks.item())
    assert ntoks == sum(LENGTHS)
    assert math.isclose(metrics["loss:sum"], mean.item() * ntoks, rel_tol=1e-5)
    want = {k: v * ntoks for k, v in flat(grads).items()}
    assert_close(flat(client.grads), want)
    if which == "untied":
        assert np.abs(flat(client.grads)["lm_head.lora_a"]).max() > 0
    for out, (tokens, inputs) in zip(outputs, data):
        assert out["logprobs"].shape == (len(tokens),) and out["logprobs"].dtype == np.float32
        np.testing.assert_allclose(out["elementwise_loss"], -out["logprobs"] * inputs["weights"], rtol=1e-6)
    assert math.isclose(sum(float(o["elementwise_loss"].sum()) for o in outputs), metrics["loss:sum"], rel_tol=1e-5)


def test_cross_entropy_top_k_and_weights(base):
    """(N, K) target_tokens and weights: -sum_k w lp over K candidates per position, logprobs (N, K);
    a datum with (N,) targets beside it keeps its (N,) outputs."""
    rng = np.random.default_rng(5)
    client = trained_client(base)
    data = make_data(rng, (6, 4))
    K = 3
    tokens, _ = data[0]
    data[0] = (tokens, {"target_tokens": rng.integers(0, 1000, (6, K)).astype(np.int64),
                        "weights": rng.uniform(-0.5, 1.0, (6, K)).astype(np.float32)})
    data[1][1]["weights"] = rng.uniform(0, 2, 4).astype(np.float32)
    outputs, metrics = client.forward_backward(data, "cross_entropy", {}, False)
    weights = [inputs["weights"].astype(np.float64) for _, inputs in data]
    lps, grads = reference(client, data, lambda lps: [-w for w in weights])
    assert [o["logprobs"].shape for o in outputs] == [(6, K), (4,)]
    for out, lp in zip(outputs, lps):
        np.testing.assert_allclose(out["logprobs"], lp, rtol=1e-5, atol=1e-5)
    assert math.isclose(metrics["loss:sum"], sum(-(w * lp).sum() for w, lp in zip(weights, lps)), rel_tol=1e-5)
    assert_close(flat(client.grads), grads)


def test_micro_batches_and_checkpointing_change_nothing(base, monkeypatch):
    """Datums one per micro-batch, with gradient checkpointing (memory made so small that one row
    fits only with it), give what one micro-batch gives."""
    data = make_data(np.random.default_rng(1))
    whole = TrainingClient(base, LoraConfig(rank=4, seed=7))
    _, m1 = whole.forward_backward(data, "cross_entropy", {}, False)
    assert len(whole.micro_batches(list(LENGTHS))) == 1

    split = TrainingClient(base, LoraConfig(rank=4, seed=7))
    # Room for two rows with checkpointing and none without (a tiny model's own estimates say
    # checkpointing saves nothing: it has 2 layers).
    monkeypatch.setattr(memory_plan, "loss_bytes", lambda s, rows, width, checkpointing: rows * (1 if checkpointing else 3))
    monkeypatch.setattr(memory_plan, "device_memory_bytes", lambda: split.weights + 2)
    by_length = sorted(range(len(LENGTHS)), key=lambda i: -LENGTHS[i])
    assert split.micro_batches(list(LENGTHS)) == [(by_length[:2], True), (by_length[2:], True)]
    _, m2 = split.forward_backward(data, "cross_entropy", {}, False)
    assert math.isclose(m1["loss:sum"], m2["loss:sum"], rel_tol=1e-5)
    assert_close(flat(split.grads), flat(whole.grads))


def test_forward_only_keeps_no_gradient(base):
    client = TrainingClient(base, LoraConfig(rank=4, seed=1))
    data = make_data(np.random.default_rng(2))
    _, forward = client.forward_backward(data, "cross_entropy", {}, True)
    assert client.grads is None
    _, backward = client.forward_backward(data, "cross_entropy", {}, False)
    assert forward == backward and client.grads is not None


# --------------------------------------------------------------------------- the RL losses


LOW, HIGH, BETA = 0.85, 1.25, 0.3
KINK_MARGIN = 0.03


def rl_case(client, rng):
    """RL datums whose sampler log-probs make the log ratio r chosen per position (away from
    log LOW and log HIGH), with advantages of both signs, so that tokens clip on both sides."""
    data = make_data(rng)
    outputs, _ = client.forward_backward(data, "cross_entropy", {}, True)
    choices = np.array([-0.6, -0.35, -0.1, 0.05, 0.12, 0.4, 0.6])
    assert np.all(np.abs(choices[:, None] - np.log([LOW, HIGH, 0.5, 1.7])) > KINK_MARGIN)
    k = np.arange(sum(LENGTHS))  # every (log ratio, advantage) pair, position after position
    log_ratio, advantages = choices[k % 7], np.array([-1.3, 0.4, -0.6, 1.1])[(k // 7) % 4]
    out, start = [], 0
    for (tokens, inputs), o in zip(data, outputs):
        at = slice(start, start + len(tokens))
        start += len(tokens)
        out.append((tokens, {"target_tokens": inputs["target_tokens"],
                             "logprobs": (o["logprobs"].astype(np.float64) - log_ratio[at]).astype(np.float32),
                             "advantages": advantages[at].astype(np.float32)}))
    return out


def formula(loss_fn, lp, q, A, lo, hi):
    """(the loss, d loss / d lp) of one datum, from the formulas (module docstring of losses.py)."""
    r = np.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(r * A).sum(), -A * r
    if loss_fn == "ppo":
        return surrogate(r, A, lo, hi).sum(), d_surrogate_d_ratio(r, A, lo, hi) * r
    if loss_fn == "cispo":
        c = np.clip(r, lo, hi)
        return -(c * lp * A).sum(), -c * A
    if loss_fn == "dro":
        return -(lp * A - 0.5 * BETA * (lp - q) ** 2).sum(), -(A - BETA * (lp - q))
    raise ValueError(loss_fn)


@pytest.mark.parametrize("loss_fn,per_position", [("importance_sampling", False), ("ppo", False), ("ppo", True),
                                                   ("cispo", False), ("cispo", True), ("dro", False)])
def test_rl_loss_equals_its_formula(loss_fn, per_position, base):
    rng = np.random.default_rng(11)
    client = trained_client(base)
    data = rl_case(client, rng)
    config = {"importance_sampling": {}, "dro": {"beta": BETA}}.get(
        loss_fn, {"clip_low_threshold": LOW, "clip_high_threshold": HIGH})
    bounds = []
    for tokens, inputs in data:
        lo, hi = np.full(len(tokens), LOW), np.full(len(tokens), HIGH)
        if per_position:  # thresholds of their own at some positions, in place of the config's
            lo[::3], hi[::3] = 0.5, 1.7
            inputs["clip_low_threshold"], inputs["clip_high_threshold"] = lo.astype(np.float32), hi.astype(np.float32)
        bounds.append((lo, hi))
    outputs, metrics = client.forward_backward(data, loss_fn, config, False)

    q = [inputs["logprobs"].astype(np.float64) for _, inputs in data]
    A = [inputs["advantages"].astype(np.float64) for _, inputs in data]
    lps, grads = reference(client, data, lambda lps: [formula(loss_fn, lp, q_, a, lo, hi)[1]
                                                       for lp, q_, a, (lo, hi) in zip(lps, q, A, bounds)])
    loss = sum(formula(loss_fn, lp, q_, a, lo, hi)[0] for lp, q_, a, (lo, hi) in zip(lps, q, A, bounds))
    assert math.isclose(metrics["loss:sum"], loss, rel_tol=1e-4, abs_tol=1e-4)
    assert_close(flat(client.grads), grads)
    for out, lp in zip(outputs, lps):
        assert set(out) == {"logprobs"}
        np.testing.assert_allclose(out["logprobs"], lp, rtol=1e-5, atol=1e-5)

    # The case clips: tokens outside the bounds on both sides, with both advantage signs.
    r, adv = np.exp(np.concatenate(lps) - np.concatenate(q)), np.concatenate(A)
    lo, hi = (np.concatenate(b) for b in zip(*bounds))
    for side in (r < lo, r > hi):
        assert (side & (adv < 0)).any() and (side & (adv > 0)).any()


def test_ppo_default_bounds_are_0_8_and_1_2(base):
    client = trained_client(base)
    data = rl_case(client, np.random.default_rng(4))
    _, default = client.forward_backward(data, "ppo", {}, True)
    _, explicit = client.forward_backward(data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, True)
    _, other = client.forward_backward(data, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, True)
    assert default == explicit != other


# --------------------------------------------------------------------------- optim_step


def test_optim_step_is_adamw_by_hand(base):
    """Three steps of bias-corrected, decoupled-weight-decay AdamW (PyTorch's) in NumPy, with
    hyperparameters changing between steps and the gradient clipped to a global norm in one."""
    client = TrainingClient(base, LoraConfig(rank=4, seed=3))
    rng = np.random.default_rng(8)
    assert client.optim_step(**ADAM) == {"skipped": 1.0, "step": 0.0}  # no gradient: nothing happens
    steps = [dict(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0),
             dict(learning_rate=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05, grad_clip_norm=0.5),
             dict(learning_rate=5e-3, beta1=0.9, beta2=0.999, eps=1e-12, weight_decay=0.0, grad_clip_norm=1e6)]
    p = params(client)
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    norms = []
    for t, hp in enumerate(steps, start=1):
        client.forward_backward(make_data(rng), "cross_entropy", {}, False)
        g = flat(client.grads)
        norm = math.sqrt(sum((x ** 2).sum() for x in g.values()))
        norms.append(norm)
        if hp["grad_clip_norm"] > 0:
            g = {k: x * min(1.0, hp["grad_clip_norm"] / (norm + 1e-6)) for k, x in g.items()}
        lr, b1, b2, eps, wd = (hp[k] for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay"))
        for k in p:
            p[k] = p[k] * (1 - lr * wd)
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            p[k] = p[k] - lr / (1 - b1 ** t) * m[k] / (np.sqrt(v[k]) / np.sqrt(1 - b2 ** t) + eps)
        metrics = client.optim_step(**hp)
        assert metrics["step"] == t and math.isclose(metrics["grad_norm"], norm, rel_tol=1e-5)
        assert client.grads is None
        assert_close(params(client), p, rtol=1e-4)
    assert norms[1] > 2 * steps[1]["grad_clip_norm"]  # the second step's gradient was clipped, by half or more


def test_gradients_accumulate_until_optim_step(base):
    """Two forward_backward calls then one optim_step equal one call with both datums."""
    d1, d2 = make_data(np.random.default_rng(6), (5,)), make_data(np.random.default_rng(7), (8, 3))
    two = TrainingClient(base, LoraConfig(rank=4, seed=5))
    one = TrainingClient(base, LoraConfig(rank=4, seed=5))
    for client in (two, one):  # a first step, so that every matrix has a gradient
        client.forward_backward(d1, "cross_entropy", {}, False)
        client.optim_step(**ADAM)
    _, a = two.forward_backward(d1, "cross_entropy", {}, False)
    _, b = two.forward_backward(d2, "cross_entropy", {}, False)
    _, both = one.forward_backward(d1 + d2, "cross_entropy", {}, False)
    assert math.isclose(a["loss:sum"] + b["loss:sum"], both["loss:sum"], rel_tol=1e-5)
    assert_close(flat(two.grads), flat(one.grads))
    two.optim_step(**ADAM)
    one.optim_step(**ADAM)
    assert_close(params(two), params(one), rtol=1e-5)


# --------------------------------------------------------------------------- a shared base


def test_clients_share_a_base_without_disturbing_it(base, tiny_model):
    """Two clients on one base: training one changes neither the other nor the base, and a
    job's adapter layers in the model are back in place after every call."""
    tokens = mx.array(np.random.default_rng(3).integers(0, 1000, (1, 10)))
    before = np.array(base(tokens))
    linear_to_lora_layers(base, 1, {"rank": 2, "scale": 1.0, "dropout": 0.0})  # a job's own layers
    own = adapter_layers(base)
    try:
        a = TrainingClient(base, LoraConfig(rank=4, seed=1))
        b = TrainingClient(base, LoraConfig(rank=8, seed=2, train_mlp=False))
        data = make_data(np.random.default_rng(4))
        b_before, _ = b.forward_backward(data, "cross_entropy", {}, True)
        base.unfreeze()  # whatever else did with the base, a client trains its own layers alone
        for _ in range(3):
            a.forward_backward(data, "cross_entropy", {}, False)
            assert {k.rsplit(".", 1)[-1] for k in flat(a.grads)} == {"lora_a", "lora_b"}
            a.optim_step(**ADAM)
            assert [(n, id(m)) for n, m in adapter_layers(base)] == [(n, id(m)) for n, m in own]
        a_after, _ = a.forward_backward(data, "cross_entropy", {}, True)
        b_after, _ = b.forward_backward(data, "cross_entropy", {}, True)
        for x, y, z in zip(b_before, b_after, a_after):
            np.testing.assert_array_equal(x["logprobs"], y["logprobs"])
            assert np.abs(z["logprobs"] - y["logprobs"]).max() > 1e-3  # a learned something
        assert b.info()["train_mlp"] is False and all(k.startswith("self_attn.") for k in b.keys)
    finally:
        remove_adapter_layers(base)
    assert adapter_layers(base) == []
    np.testing.assert_array_equal(np.array(base(tokens)), before)
    fresh, _ = load(str(tiny_model))
    np.testing.assert_allclose(np.array(fresh(tokens)), before, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- weights as bytes


def test_state_round_trip_continues_training(base):
    rng = np.random.default_rng(12)
    a = trained_client(base, seed=1)
    blobs = a.state()
    assert saved_lora_config(blobs) == LoraConfig(rank=4, seed=1)
    b = TrainingClient(base, LoraConfig(rank=4, seed=2))
    b.load_state(blobs, with_optimizer=True)
    c = TrainingClient(base, LoraConfig(rank=4, seed=3))
    c.load_state(blobs, with_optimizer=False)
    start = params(a)
    assert_close(params(b), start, rtol=0)
    assert_close(params(c), start, rtol=0)
    data = make_data(rng)
    for client in (a, b, c):
        client.forward_backward(data, "cross_entropy", {}, False)
    g = flat(c.grads)
    for client in (a, b, c):
        client.optim_step(**ADAM)
    assert b.train_state.step == a.train_state.step == 2 and c.train_state.step == 1
    assert_close(params(b), params(a), rtol=1e-6)
    # Weights only: the optimizer starts afresh, its first step lr * g / (|g| + eps) per weight.
    lr, eps = ADAM["learning_rate"], ADAM["eps"]
    assert_close(params(c), {k: start[k] - lr * g[k] / (np.abs(g[k]) + eps) for k in start}, rtol=1e-4)
    assert max(np.abs(params(c)[k] - params(a)[k]).max() for k in start) > 1e-4  # a's moments mattered


def test_adapter_files_load_in_mlx_lm(base, tiny_model, tmp_path):
    client = trained_client(base)
    files = client.adapter_files()
    assert sorted(files) == ["adapter_config.json", "adapters.safetensors"]
    config = json.loads(files["adapter_config.json"])
    assert config["lora_parameters"] == {"rank": 4, "scale": 32 / 4, "dropout": 0.0, "keys": client.keys}
    for name, blob in files.items():
        (tmp_path / name).write_bytes(blob)
    loaded, _ = load(str(tiny_model), adapter_path=str(tmp_path))
    tokens = mx.array(np.random.default_rng(9).integers(0, 1000, (2, 11)))
    with client.attached() as model:
        ours = np.array(model(tokens))
    np.testing.assert_allclose(np.array(loaded(tokens)), ours, rtol=1e-4, atol=1e-5)
    assert np.abs(ours - np.array(base(tokens))).max() > 1e-3  # the adapter is not the base


# --------------------------------------------------------------------------- what it refuses


def datum(n=7, **inputs):
    rng = np.random.default_rng(0)
    base_inputs = {"target_tokens": rng.integers(0, 1000, n).astype(np.int64), "weights": np.ones(n, np.float32)}
    return rng.integers(0, 1000, n).astype(np.int32), {**base_inputs, **inputs}


def rl(n=7, **inputs):
    tokens, d = datum(n)
    return tokens, {"target_tokens": d["target_tokens"], "logprobs": np.full(n, -7.0, np.float32),
                    "advantages": np.ones(n, np.float32), **inputs}


def without(d, name):
    tokens, inputs = d
    return tokens, {k: v for k, v in inputs.items() if k != name}


BAD_CALLS = [
    ("gspo", {}, [rl()], "loss_fn 'gspo' is not supported by this server (it supports cross_entropy, "
                         "importance_sampling, ppo, cispo, dro)"),
    ("stable_reinforce", {}, [rl()], "loss_fn 'stable_reinforce' is not supported by this server"),
    ("custom", {}, [datum()], "loss_fn 'custom' is not supported by this server"),
    ("cross_entropy", {"beta": 1.0}, [datum()], "loss_fn_config key 'beta' is not used by cross_entropy (it takes none)"),
    ("dro", {"clip_low_threshold": 0.8}, [rl()], "loss_fn_config key 'clip_low_threshold' is not used by dro (it takes beta)"),
    ("ppo", {"clip_low_threshold": "low"}, [rl()], "loss_fn_config['clip_low_threshold'] must be a finite number, got 'low'"),
    ("ppo", {"clip_high_threshold": math.inf}, [rl()], "loss_fn_config['clip_high_threshold'] must be a finite number"),
    ("dro", {"beta": -1.0}, [rl()], "loss_fn_config['beta'] must not be negative, got -1.0"),
    ("cispo", {"clip_low_threshold": 1.3}, [rl()], "loss_fn_config clip_low_threshold 1.3 is above clip_high_threshold 1.2"),
    ("cross_entropy", {}, [], "data is empty: forward_backward needs at least one datum"),
    ("cross_entropy", {}, [(np.zeros(7, np.float32), datum()[1])], "data[0].model_input must be a 1-D array of token ids"),
    ("cross_entropy", {}, [datum(), (np.zeros(0, np.int32), datum(0)[1])], "data[1].model_input has no tokens"),
    ("cross_entropy", {}, [datum(4097)], "data[0].model_input has 4097 tokens, more than the model's context of 4096"),
    ("cross_entropy", {}, [(np.array([1, 5000, 2], np.int32), datum(3)[1])],
     "data[0].model_input holds token id 5000, outside the model's vocabulary (0..1023)"),
    ("cross_entropy", {}, [datum(), without(datum(), "weights")],
     "data[1].loss_fn_inputs lacks 'weights' (cross_entropy takes target_tokens, weights)"),
    ("importance_sampling", {}, [rl(mask=np.ones(7, np.float32))],
     "data[0].loss_fn_inputs['mask'] is not an input of importance_sampling (it takes target_tokens, logprobs, advantages)"),
    ("importance_sampling", {}, [rl(clip_low_threshold=np.ones(7, np.float32))],
     "data[0].loss_fn_inputs['clip_low_threshold'] is not an input of importance_sampling"),
    ("cross_entropy", {}, [datum(target_tokens=np.ones(7, np.float32))],
     "data[0].loss_fn_inputs['target_tokens'] must hold token ids (integers), got float32"),
    ("ppo", {}, [rl(advantages=np.ones(7, np.int64))],
     "data[0].loss_fn_inputs['advantages'] must hold floating-point numbers, got int64"),
    ("ppo", {}, [rl(advantages=np.ones(6, np.float32))],
     "data[0].loss_fn_inputs['advantages'] has shape (6,), expected (7,): one row per input token"),
    ("ppo", {}, [rl(target_tokens=np.ones((7, 2), np.int64))],
     "data[0].loss_fn_inputs['target_tokens'] has shape (7, 2), expected (7,)"),
    ("cross_entropy", {}, [datum(weights=np.ones((7, 0), np.float32))],
     "data[0].loss_fn_inputs['weights'] has shape (7, 0), expected (7,) or (7, K)"),
    ("cross_entropy", {}, [datum(target_tokens=np.ones((7, 2), np.int64))],
     "data[0].loss_fn_inputs['weights'] has shape (7,), target_tokens (7, 2): they must match"),
    ("cross_entropy", {}, [datum(weights=np.array([1, 1, np.nan, 1, 1, 1, 1], np.float32))],
     "data[0].loss_fn_inputs['weights'] is not finite at position 2"),
    ("dro", {}, [rl(target_tokens=np.array([0, 1, 2, -3, 4, 5, 6]))],
     "data[0].loss_fn_inputs['target_tokens'] holds token id -3, outside the model's vocabulary"),
    ("cross_entropy", {}, [(np.arange(7, dtype=np.int32), [1, 2])], "data[0].loss_fn_inputs must be a dict"),
    ("ppo", {}, [rl(clip_high_threshold=np.full(7, 0.5, np.float32))],
     "data[0]: clip_low_threshold is above clip_high_threshold at position 0"),
    ("cispo", {}, [rl(clip_low_threshold=np.full(7, -0.5, np.float32))],
     "data[0].loss_fn_inputs['clip_low_threshold'] must not be negative"),
]


@pytest.mark.parametrize("loss_fn,config,data,message", BAD_CALLS, ids=[m[:40] for *_, m in BAD_CALLS])
def test_bad_forward_backward_says_why(loss_fn, config, data, message, base):
    client = TrainingClient(base, LoraConfig(rank=2, seed=0))
    with pytest.raises(BadRequest) as e:
        client.forward_backward(data, loss_fn, config, False)
    assert message in str(e.value)
    assert client.grads is None


BAD_STEPS = [
    (dict(beta1=1.0), "adam_params.beta1 must be in [0, 1), got 1.0"),
    (dict(beta2=-0.1), "adam_params.beta2 must be in [0, 1), got -0.1"),
    (dict(eps=0.0), "adam_params.eps must be positive"),
    (dict(learning_rate=math.nan), "adam_params.learning_rate must be a finite number, got 'nan'"),
    (dict(weight_decay=-0.01), "adam_params.weight_decay must not be negative, got -0.01"),
    (dict(grad_clip_norm="1"), "adam_params.grad_clip_norm must be a finite number, got '1'"),
]


@pytest.mark.parametrize("change,message", BAD_STEPS, ids=[m[:30] for _, m in BAD_STEPS])
def test_bad_optim_step_says_why(change, message, base):
    client = TrainingClient(base, LoraConfig(rank=2, seed=0))
    client.forward_backward([datum()], "cross_entropy", {}, False)
    before = params(client)
    with pytest.raises(BadRequest) as e:
        client.optim_step(**{**ADAM, **change})
    assert message in str(e.value)
    assert client.grads is not None  # still there for a good step
    assert_close(params(client), before, rtol=0)


def test_non_finite_gradient_is_refused(base):
    client = TrainingClient(base, LoraConfig(rank=2, seed=0))
    client.forward_backward([datum(weights=np.full(7, 3e38, np.float32))], "cross_entropy", {}, False)
    before = params(client)
    with pytest.raises(BadRequest, match="the summed gradient is not finite"):
        client.optim_step(**ADAM)
    assert client.grads is None
    assert_close(params(client), before, rtol=0)


def test_bad_clients_and_states_say_why(base, untied):
    with pytest.raises(BadRequest, match=r"lora_config.rank must be an integer from 1 to 512, got 0"):
        TrainingClient(base, LoraConfig(rank=0))
    with pytest.raises(BadRequest, match=r"lora_config.seed must be an integer from 0 to 2\*\*63 - 1, got -1"):
        TrainingClient(base, LoraConfig(rank=2, seed=-1))
    with pytest.raises(BadRequest, match="lora_config trains nothing"):
        TrainingClient(base, LoraConfig(rank=2, train_attn=False, train_mlp=False, train_unembed=False))
    with pytest.raises(BadRequest, match="embeddings are tied: it has no lm_head of its own"):
        TrainingClient(base, LoraConfig(rank=2, train_attn=False, train_mlp=False))
    only_head = TrainingClient(untied, LoraConfig(rank=2, train_attn=False, train_mlp=False))
    assert only_head.keys == ["lm_head"]

    client = TrainingClient(base, LoraConfig(rank=4, seed=0))
    other = TrainingClient(base, LoraConfig(rank=8, seed=0)).state()
    with pytest.raises(BadRequest, match=r"the checkpoint's LoRA \(rank 8, 7 projections\) does not fit this "
                                         r"client's \(rank 4, 7 projections\)"):
        client.load_state(other, with_optimizer=True)
    del other["lora_config"]
    with pytest.raises(BadRequest, match="the checkpoint does not fit this job's LoRA"):
        client.load_state(other, with_optimizer=False)
    with pytest.raises(BadRequest, match="the checkpoint lacks optimizer"):
        client.load_state({k: v for k, v in client.state().items() if k != "optimizer"}, with_optimizer=True)
