"""worker/runtime/scalars.py: a job's numbers are inputs of the functions it compiles, so a job
that differs from an earlier one only in its numbers compiles no kernel of its own.

A real training process's setup (tests/compiled_numbers.py, its own kernel cache) runs a step of
each kind's job and then of one that changes every number: the LoRA scale (lora_alpha), the
learning rate, gradient clip and Adam's betas, epsilon and weight decay, and the kind's own
(GRPO's temperature, top_p, min_p, clip range and beta; DPO's, ORPO's, KTO's and CPO's betas,
weights and label smoothing), and the batch size.
Before this, the second job of each kind compiled 1 to 14 kernels of its own (GRPO 14): seconds
each on CUDA; with only the batch size changed (2 to 3), DPO 3 and CPO 1 (mx.mean's 1/count)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import pytest
from mlx_lm.tuner.dora import DoRALinear

from worker.runtime.adapter_layers import attach_adapter
from worker.runtime.scalars import mean
from worker.runtime.train_core import AdamW

CHILD = Path(__file__).with_name("compiled_numbers.py")


def test_a_job_that_changes_only_numbers_compiles_no_kernel(tiny_model, tmp_path):
    out = subprocess.run([sys.executable, str(CHILD), str(tiny_model), str(tmp_path / "kernel-cache")],
                         capture_output=True, text=True, timeout=900,
                         env={k: v for k, v in os.environ.items() if k != "CUDA_CACHE_PATH"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [line["kind"] for line in lines] == ["grpo", "sft", "dora", "dpo", "orpo", "kto", "cpo"]
    assert lines[0]["first"] > 0  # the cache is the process's own: its first job compiled into it
    assert {line["kind"]: line["new"] for line in lines} == {line["kind"]: [] for line in lines}


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_a_lora_layer_scales_its_product_by_lora_alpha_on_a_quantized_base(tiny_model, mode):
    """The layer's scale array (worker/runtime/adapter_layers.py _scale) is in its product's dtype,
    or float32 where the base's scales are not floating (MXFP4's are uint8): lora_alpha 2.5 stays 2.5."""
    model, _ = mlx_lm.load(str(tiny_model))
    nn.quantize(model, group_size=32, bits=4, mode=mode)
    attach_adapter(model, SimpleNamespace(lora_layers=-1, lora_rank=4, lora_alpha=2.5, lora_dropout=0.0))
    layer = model.layers[0].self_attn.o_proj
    layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(0))
    x = mx.random.normal((2, 3, layer.lora_a.shape[0]), key=mx.random.key(1))
    want = layer.linear(x) + 2.5 * ((x @ layer.lora_a) @ layer.lora_b)
    assert mx.allclose(layer(x), want, atol=1e-4).item()


def test_a_dora_layer_computes_mlx_lms_dora_with_its_scale_an_input(tiny_model):
    """InputScaleDoRALinear (attach_adapter's DoRA layers) gives mlx_lm's DoRALinear's output to
    the bit, with trained A, B and magnitude, eager and in a compiled function; lora_disabled (scale
    0) too."""
    model, _ = mlx_lm.load(str(tiny_model))
    attach_adapter(model, SimpleNamespace(lora_layers=-1, lora_rank=4, lora_alpha=2.5, lora_dropout=0.0), "dora")
    layer = model.layers[0].self_attn.o_proj
    assert type(layer).__name__ == "InputScaleDoRALinear" and layer.scale == 2.5
    layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(0))
    layer.m = layer.m * (1 + 0.1 * mx.random.normal(layer.m.shape, key=mx.random.key(2)))
    x = mx.random.normal((2, 3, layer.lora_a.shape[0]), key=mx.random.key(1))
    for scale in (2.5, 0.0):
        layer.scale = scale  # a number the compiled function is traced with (0: another graph)
        compiled = mx.compile(lambda x: layer(x), inputs=[layer.state])
        want = DoRALinear.__call__(layer, x)
        assert mx.array_equal(layer(x), want).item() and mx.allclose(compiled(x), want, atol=1e-6).item(), scale


def test_mean_is_mx_means_float32_value_without_a_constant_of_the_count():
    """scalars.mean: the losses' mean over a batch, whose count is summed on the device (mx.mean's
    1/count is a constant MLX compiles into the kernels: a job of another batch size compiled its
    loss's again), is mx.mean's value to the bit, eager and compiled, over all of x or an axis."""
    compiled = mx.compile(lambda x: (mean(x), mean(x, axis=0)))
    mx.random.seed(0)
    for n in range(1, 2000):
        x = mx.random.normal((n,))
        assert mx.array_equal(mean(x), x.mean()).item(), n
        if n % 97 == 1:
            rows = mx.random.normal((n, 3))
            whole, columns = compiled(rows)
            assert mx.array_equal(whole, rows.mean()).item() and mx.array_equal(columns, rows.mean(axis=0)).item(), n


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adamw_with_its_numbers_as_inputs_updates_as_mlxs(dtype, bias_correction):
    """train_core.AdamW (betas, eps and weight decay in its state: inputs of a compiled step) gives
    mlx's AdamW's weights and moments to the bit over several steps, eager and compiled, in float32
    (LoRA's weights) and bfloat16 (full fine-tuning's), with a learning-rate schedule."""
    numbers = dict(betas=[0.85, 0.995], eps=1e-6, weight_decay=0.03, bias_correction=bias_correction)
    mx.random.seed(0)
    weights = {"w": mx.random.normal((8, 16)).astype(dtype), "b": mx.random.normal((16,)).astype(dtype)}
    grads = [{k: mx.random.normal(v.shape).astype(dtype) for k, v in weights.items()} for _ in range(4)]
    for compile_it in (False, True):
        theirs, ours = (cls(learning_rate=optim.linear_schedule(1e-2, 1e-3, 4), **numbers)
                        for cls in (optim.AdamW, AdamW))
        params = {}
        for name, opt in (("theirs", theirs), ("ours", ours)):
            params[name] = dict(weights)
            opt.init(params[name])

            def update(g, p, opt=opt):
                return opt.apply_gradients(g, p)

            step = mx.compile(update, inputs=[opt.state], outputs=[opt.state]) if compile_it else update
            for g in grads:
                params[name] = step(g, params[name])
                mx.eval(params[name], opt.state)
        for k in weights:
            assert mx.array_equal(params["ours"][k], params["theirs"][k]).item(), (k, compile_it)
            assert mx.array_equal(ours.state[k]["v"], theirs.state[k]["v"]).item(), (k, compile_it)
