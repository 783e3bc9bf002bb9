"""worker/decode/'s batched decoder gives what a straightforward decoder gives.

The reference below decodes every row on its own, uncompiled, with mlx_lm's own KV cache
(no padding, no mask, no fixed-size buffer), and makes the same random draws: token t of
every row is drawn by one mx.random.categorical over all rows' filtered log-probs with key
t of mx.random.split(key, max_tokens + 1). Whatever the decoder does to be fast (shared
masks, buffer layout, how KV is written, how attention runs), tokens, log-probs, entropies,
the completion mask and the EOS flags must come out the same: tokens exactly, floats to
float32 rounding (the tiny model is float32).
"""

import json
import os
import re
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from conftest import ROOT
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.tuner.utils import linear_to_lora_layers

from worker.decode import (attention_kernel, embed_kernel, graph_patches, lora_kernel, norm_kernel, ptx_cache,
                           quantized_kernel, sampling, swiglu_kernel)
from worker.decode.draw import SamplingParams
from worker.decode.sampling import compacted, kernel_fits, make_decode_step, sample
from worker.runtime.make_model import make_model
from worker.runtime.projection_groups import decode_groups, fuse_shared_inputs

PAD = 7


@pytest.fixture(scope="module")
def model(tiny_model):
    """The tiny model as a worker loads it: its q/k/v and gate/up weights fused (fuse_shared_inputs)."""
    model = mlx_lm.load(str(tiny_model))[0]
    assert fuse_shared_inputs(model) == 2 * len(model.layers)
    model.freeze()
    return model


def with_lora(model):
    """The model, fused as a worker loads it, with LoRA on every projection of its top block (as
    GRPO samples with it), B not zero so that the LoRA products count. Seeded: mlx_lm draws A
    from MLX's global generator, and an A of another run can leave every token of a test's
    decode as the base model's."""
    fuse_shared_inputs(model)
    model.freeze()
    mx.random.seed(0)
    linear_to_lora_layers(model, 1, {"rank": 4, "scale": 2.0, "dropout": 0.0})
    model.eval()
    for i, (name, b) in enumerate(tree_flatten(model.trainable_parameters())):
        if name.endswith("lora_b"):
            model.update(tree_unflatten([(name, 0.05 * mx.random.normal(b.shape, key=mx.random.key(i)))]))
    return model


@pytest.fixture(scope="module")
def lora_model(tiny_model):
    return with_lora(mlx_lm.load(str(tiny_model))[0])


def reference_decode(model, prompts, group_size, p: SamplingParams, eos_ids, key):
    rows = [prompt for prompt in prompts for _ in range(group_size)]
    caches = [make_prompt_cache(model) for _ in rows]
    logits = [model(mx.array(r)[None], cache=c)[0, -1] for r, c in zip(rows, caches)]
    keys = mx.random.split(key, p.max_tokens + 1)
    n = len(rows)
    tokens, logprobs, entropy, mask = (np.zeros((n, p.max_tokens), dt) for dt in (np.int64, np.float32, np.float32, bool))
    ended = np.zeros(n, dtype=bool)
    for t in range(p.max_tokens):
        x = mx.stack(logits).astype(mx.float32) / (p.temperature or 1.0)
        logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if p.temperature == 0:
            nxt = mx.argmax(mx.stack(logits), axis=-1)
        else:
            filtered = logp  # the job's filters, in this order, on log softmax(logits / T)
            for used, apply, value in ((p.top_k > 0, apply_top_k, p.top_k), (p.top_p < 1, apply_top_p, p.top_p),
                                       (p.min_p > 0, apply_min_p, p.min_p)):
                filtered = apply(filtered, value) if used else filtered
            nxt = mx.random.categorical(filtered, key=keys[t])
        ent = -(mx.exp(logp) * logp).sum(-1)
        for r in range(n):
            if ended[r]:
                continue
            tok = nxt[r].item()
            tokens[r, t], logprobs[r, t], entropy[r, t], mask[r, t] = tok, logp[r, tok].item(), ent[r].item(), True
            ended[r] = tok in eos_ids
        if ended.all():
            break
        logits = [model(mx.array([[int(tokens[r, t])]]), cache=caches[r])[0, -1] for r in range(n)]
    return tokens, logprobs, entropy, mask, ended


CASES = {
    # Prompts of different lengths (left padding), groups, some rows ending at EOS.
    "categorical": (dict(max_tokens=20), [[5, 9, 11, 300, 2], [17], [40, 41, 42, 43, 44, 45, 46, 47, 48]], 3),
    "filtered": (dict(max_tokens=12, temperature=0.7, top_k=50, top_p=0.9, min_p=0.05), [[3, 4], [8, 9, 10, 11]], 2),
    "greedy": (dict(max_tokens=10, temperature=0.0), [[1, 2, 3], [600, 601]], 2),
    "one row": (dict(max_tokens=18), [[12, 13, 14]], 1),  # categorical of one row draws otherwise
    "one prompt": (dict(max_tokens=12), [[12, 13, 14, 15]], 4),  # its padding repeated: a broadcast, stride 0
}
EOS = list(range(0, 1024, 24))  # about 4% of the vocabulary: rows end at different steps


def decode_both(model, case, queries):
    params, prompts, group_size = CASES[case]
    p = SamplingParams(**params)
    key = mx.random.key(3)
    want = reference_decode(model, prompts, group_size, p, EOS, key)
    got = sample(model, make_decode_step(model, p, EOS, PAD, queries), prompts, group_size, p, EOS, key)
    assert_same(got, want, p)
    return want


def assert_same(got, want, p):
    tokens, logprobs, entropy, mask, ended = want
    np.testing.assert_array_equal(np.array(got.mask), mask)
    np.testing.assert_array_equal(np.where(mask, np.array(got.tokens), -1), np.where(mask, tokens, -1))
    np.testing.assert_allclose(np.array(got.logprobs), logprobs, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(got.entropy), entropy, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.array(got.ended), ended)
    assert got.steps >= mask.sum(axis=1).max()


@pytest.mark.parametrize("queries", [1, 2])  # 2: the decode step CUDA gets (fused_queries)
@pytest.mark.parametrize("case", CASES)
def test_batched_decode_equals_row_by_row_decode(model, case, queries):
    tokens, logprobs, entropy, mask, ended = decode_both(model, case, queries)
    if case == "categorical":  # the case exercises what it is meant to
        assert 0 < ended.sum() < len(ended) and mask.sum(axis=1).min() < CASES[case][0]["max_tokens"]


def test_decode_with_lora_equals_row_by_row_decode(lora_model, model):
    """The decode step's groups (worker/decode/graph_patches.py: grouped_projections: fused base weights, one
    pair of LoRA matmuls per group) give what each LoRA layer gives alone; and the LoRA changes
    the tokens (it is not a no-op)."""
    groups = decode_groups(lora_model)
    # q/k/v and gate/up of both blocks fused, those of the top block with LoRA; its o and down alone.
    assert [(len(g.modules), g.lora, g.fused is not None) for g in groups] == [
        (3, False, True), (2, False, True), (3, True, True), (2, True, True), (1, True, False), (1, True, False)]
    tokens, _, _, mask, _ = decode_both(lora_model, "categorical", 2)
    base = reference_decode(model, *CASES["categorical"][1:], SamplingParams(**CASES["categorical"][0]), EOS,
                            mx.random.key(3))
    assert (np.where(mask, tokens, -1) != np.where(base[3], base[0], -1)).any()


def test_rows_that_finished_are_dropped_and_the_samples_stay_the_same(model, lora_model):
    """Once half the rows have finished (at a chunk's end), sample() decodes the others only, a
    power of two of rows with finished ones filling it (compacted), and each row draws what it
    would draw in the whole batch: the same tokens, log-probs, entropies, mask and EOS flags as
    the row-by-row reference; and a gang's share (batch_rows) compacts the same way."""
    assert compacted(np.array([1, 1, 1, 0, 0, 1, 1, 1], bool)).tolist() == [3, 4]
    assert compacted(np.array([1, 0, 1, 0, 0, 1, 1, 1], bool)).tolist() == [0, 1, 3, 4]
    assert compacted(np.array([0, 0, 0, 1, 1], bool)) is None and compacted(np.array([0], bool)) is None
    prompts, group_size = [[5, 9, 11, 300, 2], [17], [40, 41, 42]], 4  # 12 rows
    eos = list(range(0, 1024, 16))  # 1 in 16 tokens: rows end at every chunk
    for m, params in ((model, dict(max_tokens=40)), (lora_model, dict(max_tokens=40, temperature=0.7, top_k=50, top_p=0.9))):
        p = SamplingParams(**params)
        step = make_decode_step(m, p, eos, PAD)
        calls = []
        counted = lambda *args: calls.append(args[0].shape[0]) or step(*args)  # noqa: E731
        got = sample(m, counted, prompts, group_size, p, eos, mx.random.key(4))
        want = reference_decode(m, prompts, group_size, p, eos, mx.random.key(4))
        assert_same(got, want, p)
        assert calls[0] == 12 and min(calls) < 12 and got.steps > 17, calls  # compacted, and went on decoding
        share = SamplingParams(**params, batch_rows=tuple(range(4, 12)), batch_height=12)  # the last two prompts' rows
        calls.clear()
        part = sample(m, counted, prompts[1:], group_size, share, eos, mx.random.key(4), width=5)
        assert_same(part, tuple(a[4:] for a in want), share)
        assert min(calls) < 8


def test_is_eos_is_membership_in_the_ids_however_many():
    """is_eos: a chain of compares up to sampling.EOS_CHAIN ids, one (rows, ids) compare past it."""
    tokens = mx.array([0, 3, 7, 9, 16, 40, 45, 1023], dtype=mx.int32)
    longest_chain = list(range(0, 3 * sampling.EOS_CHAIN, 3))
    for ids in ([], [7], [3, 9], longest_chain, longest_chain + [1023], list(range(0, 1024, 24))):
        np.testing.assert_array_equal(np.array(sampling.is_eos(tokens, ids)), np.isin(np.array(tokens), ids))


def test_the_draw_s_bookkeeping_fuses_into_the_step_s_kernels(tiny_model):
    """The step's EOS compares, the cast of the drawn tokens and the entropy's sign run inside
    compiled kernels next to them, not as primitives of their own: on CUDA each primitive is
    about a kernel launch's host work (docs/performance.md, the H200's decode graph)."""
    model = mlx_lm.load(str(tiny_model))[0]
    eos = [3, 9]
    p = SamplingParams(max_tokens=6)
    step = make_decode_step(model, p, eos, PAD)
    calls = []
    sample(model, lambda *a: calls.append(a) or step(*a), [[5, 9, 11], [17]], 2, p, eos, mx.random.key(0))
    mx.eval(calls[1])
    path = ROOT / ".pytest-bookkeeping.dot"
    try:
        mx.export_to_dot(str(path), *[a for _, a in tree_flatten(list(step(*calls[1])))])
        labels = re.findall(r'label ="([^"]+)", shape=rectangle', path.read_text())
    finally:
        path.unlink(missing_ok=True)
    assert not {"BitwiseOr", "Negative", "Any", "Equal"} & set(labels), labels
    assert any(label.startswith("Compiled") and "Select" in label and label.count("Equal") == 2 for label in labels)
    assert any(label.startswith("Compiled") and "ExpNegativeMultiply" in label for label in labels)


def test_fusing_changes_neither_outputs_nor_memory(tiny_model):
    """fuse_shared_inputs: the same logits, and the projections' weights become views of the fused
    ones (the model's memory grows by no copy of them)."""
    model = mlx_lm.load(str(tiny_model))[0]
    x = mx.array([[5, 9, 11, 300, 2]])
    before = model(x)
    mx.eval(before)
    active = mx.get_active_memory()
    assert fuse_shared_inputs(model) == 2 * len(model.layers)
    after = model(x)
    mx.eval(after)
    np.testing.assert_array_equal(np.array(after), np.array(before))
    fused = sum(v.nbytes for layer in model.layers for parent in (layer.self_attn, layer.mlp)
                for v in tree_flatten(parent.fused_inputs.fused.parameters()) for v in [v[1]])
    assert mx.get_active_memory() - active < fused / 4
    assert fuse_shared_inputs(model) == 0  # once


@pytest.mark.parametrize("dora", [False, True])  # DoRA: the compiled step takes the model's weights as inputs
def test_a_decode_step_sees_the_adapter_weights_of_each_step(tiny_model, dora):
    """The decode step is made once per job and its base weights are constants of the compiled
    step: the adapter's weights, changed by every optimizer step, must not be (LoRA: taken as
    an argument at every sample(); DoRA: the model's weights are inputs)."""
    model = mlx_lm.load(str(tiny_model))[0]
    fuse_shared_inputs(model)
    model.freeze()
    linear_to_lora_layers(model, 1, {"rank": 4, "scale": 2.0, "dropout": 0.0}, use_dora=dora)
    model.eval()
    params, prompts, group_size = CASES["categorical"]
    p = SamplingParams(**params)
    step = make_decode_step(model, p, EOS, PAD)
    tokens = []
    for seed in (1, 2):  # as an optimizer step does: new arrays in place of the adapter's
        model.update(tree_unflatten([(name, v + 0.05 * mx.random.normal(v.shape, key=mx.random.key(seed)))
                                     for name, v in tree_flatten(model.trainable_parameters())]))
        got = sample(model, step, prompts, group_size, p, EOS, mx.random.key(3))
        assert_same(got, reference_decode(model, prompts, group_size, p, EOS, mx.random.key(3)), p)
        tokens.append(np.array(got.tokens))
    assert (tokens[0] != tokens[1]).any()


def test_bench_decode_runs_and_counts(tiny_model, tmp_path):
    """bench/decode.py (the decode figures' command): every decoder timed and counted; the count
    as a CUDA GPU runs it is below the CPU's own, where MLX expands RMSNorm and RoPE. --undo made
    (LoRA on the last block): ours also without the add after o making o's x @ A, more
    primitives on the GPU, the same samples, its time beside the first variant's."""
    out = tmp_path / "decode.json"
    subprocess.run(
        [sys.executable, "bench/decode.py", str(tiny_model), "--rows", "4", "--tokens", "4", "--group-size", "2",
         "--reps", "1", "--queries", "1", "2", "--lora-layers", "1", "--undo", "made", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "MTQ_OPENBLAS": "0"}, check=True, timeout=300,
    )
    records = json.loads(out.read_text())
    ours = [f"ours sampling.py queries={q}{u}" for q in (1, 2) for u in ("", " undo made")]
    assert [r["decoder"] for r in records] == ours + ["mlx_lm batch_generate", "mlx_lm generate_step (1 row)"]
    for r in records:
        assert r["ms_per_position"] > 0 and 0 < r["primitives_gpu"] < r["primitives"]
        if r["decoder"].startswith("ours"):
            assert 0 < r["host_ms_per_position"] <= r["ms_per_position"]
    for default, undone in (records[0:2], records[2:4]):
        assert undone["primitives_gpu"] > default["primitives_gpu"]
        assert undone["rows_as_first"] == 1.0 and len(undone["vs_ours_first_by_round"]) == 1


def step_graph(model, step, case) -> str:
    """The dot graph of a decode step's outputs (its second call: the first one's inputs hold the prefill)."""
    params, prompts, group_size = CASES[case]
    calls = []

    def traced(*args):
        calls.append(args)
        return step(*args)

    sample(model, traced, prompts, group_size, SamplingParams(**params), EOS, mx.random.key(3))
    mx.eval(calls[1])
    path = ROOT / ".pytest-step.dot"
    try:
        mx.export_to_dot(str(path), *[a for _, a in tree_flatten(list(step(*calls[1])))])
        return path.read_text()
    finally:
        path.unlink(missing_ok=True)


def test_a_dense_decode_of_a_quantized_model_samples_what_the_quantized_one_does(tmp_path):
    """make_decode_step(dense=True) (what a job's memory budget buys on CUDA: worker/runtime/memory_plan.py)
    multiplies by dequantized copies of the weights, no quantized matmul left in the step, and
    samples the same tokens with the same log-probs to float rounding."""
    from worker.runtime.make_model import make_model
    model = mlx_lm.load(str(make_model(tmp_path / "q", size="tiny", quantize=8)))[0]
    fuse_shared_inputs(model)
    model.freeze()
    linear_to_lora_layers(model, 1, {"rank": 4, "scale": 2.0, "dropout": 0.0})
    model.eval()
    params, prompts, group_size = CASES["categorical"]
    p = SamplingParams(**params)
    steps = {dense: make_decode_step(model, p, EOS, PAD, dense=dense) for dense in (False, True)}
    assert "QuantizedMatmul" in step_graph(model, steps[False], "categorical")
    assert "QuantizedMatmul" not in step_graph(model, steps[True], "categorical")
    quantized, dense = (sample(model, steps[d], prompts, group_size, p, EOS, mx.random.key(3)) for d in (False, True))
    np.testing.assert_array_equal(np.array(dense.tokens), np.array(quantized.tokens))
    np.testing.assert_allclose(np.array(dense.logprobs), np.array(quantized.logprobs), atol=1e-4, rtol=1e-4)


cuda_only = pytest.mark.skipif(not attention_kernel.cuda(), reason="the decode's kernels run on MLX's CUDA backend")


@pytest.fixture(scope="module")
def quantized_lora_model(tiny_model):
    """The tiny model at 4 bits in groups of 32 (its tied output projection too), with LoRA."""
    model = mlx_lm.load(str(tiny_model))[0]
    nn.quantize(model, group_size=32, bits=4)
    return with_lora(model)


def assert_kernels_took_over(calls: dict, traces: int, layers: int, lora: bool):
    """calls: each kernel's positional arguments, a tuple per call, over `traces` traces of a
    decode step. Every block's two residual adds and norms and its activation ran as their
    kernels. The LoRA model's top block has LoRA on four groups (q/k/v, o, gate/up, down): the
    norms before q/k/v and gate/up and the activation before down made those groups' x @ A, the
    adds after o and down and the activation after gate/up their LoRA products (lora_kernel's
    own for them are left out of the graph), the add after o also o's x @ A from o's input
    (lora_kernel's down for it left out too); lora_kernel is still called for o's down and each
    group's up while the step is traced."""
    assert len(calls["add_norm"]) == 2 * traces * layers and len(calls["swiglu"]) == traces * layers
    n = traces if lora else 0
    assert len(calls["down"]) == n and len(calls["up"]) == 4 * n
    assert sum(len(a) > 3 and a[3] is not None for a in calls["add_norm"]) == 2 * n  # the ups
    assert sum(len(a) > 4 and a[4] is not None for a in calls["add_norm"]) == 2 * n  # the downs
    assert sum(len(a) > 5 and a[5] is not None for a in calls["add_norm"]) == n  # o's down, from o's input
    assert sum(a[1] is not None for a in calls["swiglu"]) == sum(a[2] is not None for a in calls["swiglu"]) == n


@cuda_only
@pytest.mark.parametrize("whole", [True, False], ids=["whole attention", "after norms and rope"])
@pytest.mark.parametrize("case", CASES)
def test_the_cuda_kernels_decode_what_mlx_ops_do(model, lora_model, quantized_lora_model, case, whole, monkeypatch):
    """On CUDA, the decode step's kernels sample what MLX's own ops do: the same tokens, log-probs
    to float32 rounding, with and without LoRA, over every case (padding, groups, rows ending at
    different steps). The attention by attention_kernel (which also writes the new key and value
    into the KV buffers, in place) in both forms: the Qwen3 attention whole, q/k norms and RoPE
    in the kernel, and the kernel after MLX's norms and RoPE (another model's form); each LoRA
    group's product by lora_kernel; each residual add and the norm after it by norm_kernel, and
    each MLP's activation by swiglu_kernel, which also make a LoRA group's last product where
    they take its output and the first one of the group reading theirs; and in a 4-bit model
    each quantized matmul by quantized_kernel, the tied output projection's too."""
    calls = {"attend": [], "down": [], "up": [], "add_norm": [], "swiglu": [], "matmul": []}
    for module, name in ((attention_kernel, "attend"), (lora_kernel, "down"), (lora_kernel, "up"),
                         (norm_kernel, "add_norm"), (swiglu_kernel, "swiglu"), (quantized_kernel, "matmul")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: calls[_n].append((a, kw)) or _k(*a, **kw))
    if not whole:
        monkeypatch.setattr(graph_patches, "kernel_norms_and_rope", lambda attention: False)
    params, prompts, group_size = CASES[case]
    p = SamplingParams(**params)
    for m in (model, lora_model, quantized_lora_model):
        assert kernel_fits(m)
        plain = sample(m, make_decode_step(m, p, EOS, PAD, queries=1, kernel=False), prompts, group_size, p, EOS,
                       mx.random.key(3))
        want = tuple(np.array(a) for a in (plain.tokens, plain.logprobs, plain.entropy, plain.mask, plain.ended))
        step = make_decode_step(m, p, EOS, PAD)  # by default on CUDA: the kernels where they fit (kernel_fits traces)
        for c in calls.values():
            c.clear()
        got = sample(m, step, prompts, group_size, p, EOS, mx.random.key(3))
        # In each trace of the compiled step (one per row count: finished rows are dropped), one
        # attention per layer.
        traces = len(calls["attend"]) // len(m.layers)
        assert traces >= 1 and len(calls["attend"]) == traces * len(m.layers)
        assert_kernels_took_over({k: [a for a, _ in c] for k, c in calls.items()}, traces, len(m.layers), m is not model)
        # q/k/v, o, gate/up and down of each block, and the output projection, in each trace of
        # at most quantized_kernel.MAX_ROWS rows (all of them if the batch has no more)
        per_trace = 4 * len(m.layers) + 1
        assert len(calls["matmul"]) % per_trace == 0 and len(calls["matmul"]) <= traces * per_trace
        if m is not quantized_lora_model:
            assert not calls["matmul"]
        elif len(prompts) * group_size <= quantized_kernel.MAX_ROWS:
            assert len(calls["matmul"]) == traces * per_trace
        assert all(("rope" in kw) == whole for _, kw in calls["attend"])
        assert_same(got, want, p)


@pytest.mark.parametrize("case", ["categorical", "one prompt"])
def test_the_kernels_take_over_the_lora_products_next_to_them(model, lora_model, case, monkeypatch):
    """What the decode step hands its kernels (graph_patches.Handoff), on a CPU made to look like CUDA:
    each kernel stood in for by MLX's ops of its formula. Every residual add, norm and MLP
    activation goes to its kernel; in the LoRA block the adds after o and down take those
    projections' base outputs and make their LoRA products, the norms before q/k/v and gate/up
    and the activation before down make those groups' x @ A, the activation takes gate/up's
    base output and makes its LoRA product; and the samples are those of MLX's ops alone."""
    def up(y, t, b, scale):
        return y + (scale * (t @ b)).astype(y.dtype).reshape(y.shape)

    def down(x, a):
        return x.reshape(-1, x.shape[-1]).astype(mx.float32) @ a

    def add_norm(x, r, norm, lora_up=None, a=None, made=None):
        if made is not None:  # up's t made here, from the projection's input
            lora_up = (down(*made), *lora_up[1:])
        h = x + (r if lora_up is None else up(r, *lora_up))
        return h, norm(h), None if a is None else down(norm(h), a)

    def activation(y, lora_up=None, a=None):
        out = swiglu(*mx.split(y if lora_up is None else up(y, *lora_up), 2, axis=-1))
        return out, None if a is None else down(out, a)

    calls = {"down": [], "up": [], "add_norm": [], "swiglu": []}
    for module, name, kernel in ((lora_kernel, "down", down), (lora_kernel, "up", up),
                                 (norm_kernel, "add_norm", add_norm), (swiglu_kernel, "swiglu", activation)):
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name: calls[_n].append(a) or _k(*a))
    params, prompts, group_size = CASES[case]
    p = SamplingParams(**params)
    for m in (model, lora_model):
        want = sample(m, make_decode_step(m, p, EOS, PAD, queries=1, kernel=False), prompts, group_size, p, EOS,
                      mx.random.key(3))
        want = tuple(np.array(a) for a in (want.tokens, want.logprobs, want.entropy, want.mask, want.ended))
        with monkeypatch.context() as cuda:
            for module in (attention_kernel, lora_kernel, norm_kernel, swiglu_kernel):
                cuda.setattr(module, "cuda", lambda: True)
            cuda.setattr(sampling, "kernel_fits", lambda model: False)  # the attention stays MLX's
            step = make_decode_step(m, p, EOS, PAD, queries=1)
            for c in calls.values():
                c.clear()
            got = sample(m, step, prompts, group_size, p, EOS, mx.random.key(3))
        traces = len(calls["swiglu"]) // len(m.layers)
        assert traces >= 1
        assert_kernels_took_over(calls, traces, len(m.layers), m is not model)
        assert_same(got, want, p)


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_kernel_that_folds_in_the_lora_kernels_gives_what_they_give(dtype):
    """norm_kernel's add_norm and swiglu_kernel's activation, given a LoRA group's base output and
    lora_kernel.up's other inputs, and the A of the group that reads their output, give exactly
    what lora_kernel.up, MLX's split and swiglu (or the plain add_norm) and lora_kernel.down give
    in turn, bit for bit: the same formulas, roundings and summation order; add_norm making up's
    t from the projection's input too (made) gives what it gives on lora_kernel.down's t."""
    rows, hidden, width, rank = 5, 96, 2 * 160, 12
    key = iter(mx.random.split(mx.random.key(0), 11))
    normal = lambda *shape: mx.random.normal(shape, key=next(key))  # noqa: E731
    norm = nn.RMSNorm(hidden)
    norm.weight = (1 + 0.1 * normal(hidden)).astype(dtype)
    x, y = normal(rows, hidden).astype(dtype), normal(rows, hidden).astype(dtype)
    t, b, a = normal(rows, rank), 0.3 * normal(rank, hidden), 0.3 * normal(hidden, rank + 4)
    h, normed, down = norm_kernel.add_norm(x, y, norm, (t, b, 1.5), a)
    want_h, want_normed, none = norm_kernel.add_norm(x, lora_kernel.up(y, t, b, 1.5), norm)
    assert none is None
    want_down = lora_kernel.down(want_normed, a)
    assert np.array_equal(np.array(h.astype(mx.float32)), np.array(want_h.astype(mx.float32)))
    assert np.array_equal(np.array(normed.astype(mx.float32)), np.array(want_normed.astype(mx.float32)))
    assert np.array_equal(np.array(down), np.array(want_down))
    x_o, a_o = normal(rows, 2 * hidden).astype(dtype), 0.3 * normal(2 * hidden, rank)  # up's t made from o's input
    t_o = lora_kernel.down(x_o, a_o)
    got = norm_kernel.add_norm(x, y, norm, (t_o, b, 1.5), a, (x_o, a_o))
    for g, w in zip(got, norm_kernel.add_norm(x, y, norm, (t_o, b, 1.5), a)):
        assert np.array_equal(np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32)))
    g, bg, ad = normal(rows, width).astype(dtype), 0.3 * normal(rank, width), 0.3 * normal(width // 2, rank)
    out, down = swiglu_kernel.swiglu(g, (t, bg, 0.5), ad)
    want = mx.compile(lambda z: swiglu(*mx.split(z, 2, axis=-1)))(lora_kernel.up(g, t, bg, 0.5))
    assert np.array_equal(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)))
    assert np.array_equal(np.array(down), np.array(lora_kernel.down(want, ad)))
    plain = swiglu(*mx.split(g, 2, axis=-1))
    out, none = swiglu_kernel.swiglu(g)
    assert none is None and np.array_equal(np.array(out.astype(mx.float32)), np.array(plain.astype(mx.float32)))


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 32), (8, 128)])
def test_the_embedding_kernel_looks_up_what_mlx_does(dtype, bits, group_size):
    """embed_kernel.lookup gives nn.QuantizedEmbedding's own rows, bit for bit, 2-D or as the
    tokens' shape."""
    embed = nn.Embedding(300, 256)
    embed.weight = mx.random.normal((300, 256), key=mx.random.key(2)).astype(dtype)
    embed = nn.QuantizedEmbedding.from_embedding(embed, group_size=group_size, bits=bits)
    tokens = mx.array([[0], [299], [17], [17], [150]], dtype=mx.int32)
    assert embed_kernel.available(tokens, embed)
    want = np.array(embed(tokens).astype(mx.float32))
    got = embed_kernel.lookup(tokens, embed, flat=True)
    assert got.shape == (5, 256) and got.dtype == dtype and np.array_equal(np.array(got.astype(mx.float32)), want[:, 0])
    assert np.array_equal(np.array(embed_kernel.lookup(tokens, embed).astype(mx.float32)), want)


@pytest.mark.skipif(attention_kernel.cuda(), reason="counts on a CPU (on CUDA the kernels run: the tests above)")
def test_a_lora_block_runs_one_kernel_more_than_a_plain_one(tiny_model, tmp_path):
    """The decode step's graph as a CUDA GPU builds it (bench/decode.py's count on a CPU, each
    kernel a stand-in primitive): in a LoRA block the kernels around each projection group make
    its LoRA products (the norm before it x @ A, the add or activation after it the rest; the
    add after o also makes o's x @ A), all but the q/k/v group's up (lora_kernel.up, whose
    output the attention kernel reads split). The tiny model's two blocks (LoRA on the last):
    attention, two residual adds with their norms and the MLP activation each, and q/k/v's up:
    9 kernels (float32: its projections are MLX's matmuls). At 4 bits also each quantized
    matmul (4 a block, and the output head) and the embedding's lookup: one kernel where
    nn.QuantizedEmbedding's gathers were three."""
    quantized = make_model(tmp_path / "tiny-4bit", size="tiny", quantize=4)
    for path, kernels in ((tiny_model, 9), (quantized, 9 + 9 + 1)):  # 4-bit: 9 matmuls and the embedding's lookup too
        out = tmp_path / "count.json"
        subprocess.run([sys.executable, "bench/decode.py", str(path), "--rows", "4", "--tokens", "4",
                        "--group-size", "2", "--count-only", "--ours-only", "--lora-layers", "1", "--json", str(out)],
                       cwd=ROOT, env={**os.environ, "MTQ_OPENBLAS": "0"}, check=True, timeout=300)
        by_type = json.loads(out.read_text())[0]["primitives_gpu_by_type"]
        assert by_type["CumMax"] == kernels, by_type
        assert ("Gather" in by_type) == (path is tiny_model), by_type  # a plain embedding's one gather stays


def test_every_row_count_a_decode_reaches_calls_the_same_kernel_modules(quantized_lora_model, monkeypatch):
    """A decode drops its finished rows, so one job's steps run every row count from its batch's
    down to 1. On CUDA each distinct kernel module is a compile (seconds each on a cold cache), so
    none may be specialised on the row count: tracing the first step of 1 to
    quantized_kernel.MAX_ROWS rows, as a CUDA GPU runs it (each kernel a recorded stand-in), names
    the same modules (ptx_cache.mlx_source: the name and source MLX compiles) for each, the
    4-bit model's quantized matmuls among them."""
    def stand_in(name, input_names, output_names, source, contiguous=True, header=""):
        def call(*, inputs, output_shapes, output_dtypes, template=None, **kwargs):
            inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
            calls.append(ptx_cache.mlx_source(name, input_names, output_names, source, header, inputs, output_dtypes,
                                              template))
            made = [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
            return [mx.depends([m], [a for a in inputs])[0] for m in made]
        return call

    for module in (attention_kernel, embed_kernel, lora_kernel, norm_kernel, quantized_kernel, swiglu_kernel):
        monkeypatch.setattr(module, "cuda", lambda: True)
        monkeypatch.setattr(module, "kernel", stand_in)
    p = SamplingParams(max_tokens=4, temperature=1.0)
    modules = {}
    for rows in range(1, quantized_kernel.MAX_ROWS + 1):
        calls = []
        step = make_decode_step(quantized_lora_model, p, [], PAD)
        sample(quantized_lora_model, step, [[1, 2, 3, 4]] * rows, 1, p, [], mx.random.key(0))
        modules[rows] = set(calls)
    names = {name for name, _ in modules[1]}
    assert any(n.startswith("custom_kernel_mtq_quantized_matmul") for n in names), names
    assert all(modules[rows] == modules[1] for rows in modules), {r: sorted(n for n, _ in m)
                                                                   for r, m in modules.items()}


def test_a_model_that_attends_otherwise_keeps_mlx_attention(tiny_model, monkeypatch):
    """kernel_fits and the kernel's form, on a CPU made to look like CUDA (the trace is never
    evaluated): mlx_lm's Qwen3 attention runs whole in the kernel, its q/k norms and RoPE too;
    with another RoPE (here a traditional one) the kernel stands in for
    mx.fast.scaled_dot_product_attention after MLX's norms and RoPE; a model that hands that
    anything but its cache's own buffers (here: the keys times one) keeps MLX's attention, as
    does one that never calls it."""
    monkeypatch.setattr(attention_kernel, "cuda", lambda: True)
    monkeypatch.setattr(attention_kernel, "available", lambda q, k: True)
    calls = []
    monkeypatch.setattr(attention_kernel, "attend", lambda q, *a, **kw: calls.append(kw) or q)  # cuda_kernel needs CUDA
    model = mlx_lm.load(str(tiny_model))[0]
    assert kernel_fits(model)
    assert [kw.get("rope") for kw in calls] == [layer.self_attn.rope for layer in model.layers]
    for layer in model.layers:
        rope = layer.self_attn.rope
        layer.self_attn.rope = nn.RoPE(rope.dims, traditional=True, base=rope.base)
    calls.clear()
    assert kernel_fits(model)
    assert calls == [{}] * len(model.layers)
    attention = type(model.layers[0].self_attn)
    original = attention.__call__
    for changed in (lambda sdpa, q, k, v, **kw: sdpa(q, k * 1, v, **kw), lambda sdpa, q, k, v, **kw: q):
        def call(self, x, mask=None, cache=None):
            saved = mx.fast.scaled_dot_product_attention  # kernel_fits' own, while it traces
            mx.fast.scaled_dot_product_attention = lambda q, k, v, **kw: changed(saved, q, k, v, **kw)
            try:
                return original(self, x, mask, cache)
            finally:
                mx.fast.scaled_dot_product_attention = saved
        monkeypatch.setattr(attention, "__call__", call)
        assert not kernel_fits(model)
