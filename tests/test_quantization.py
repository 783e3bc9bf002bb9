"""Quantized bases and quantization-aware training (docs/quantization.md).

In this process on the tiny model: a QAT step's forward is the fused, quantized model's (mlx_lm's
fuse and quantize_model), its gradient straight through, on the schedule of qat_start_step and
qat_interval, for SFT, DPO, ORPO and KTO. Through the stack (one worker for the module): 6-bit and
MXFP4 bases, a 3-bit QLoRA and the seed's mxfp8 train and save adapters mlx_lm loads; a QAT job's
export is quantized to its bits; impossible combinations are refused.
"""

import json
import re
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from conftest import ROOT, TOKEN, Stack, running, wait_done
from test_export import download_adapter, load
from shared.kinds import KINDS
from shared.memory_estimate import ModelShape, dense_bytes, need_bytes
from shared.train_specs import DPOJobCreate, KTOJobCreate, ORPOJobCreate, SFTJobCreate
from worker.kinds.dpo_job import DPOTrainer
from worker.kinds.kto_job import KTOTrainer
from worker.kinds.sft_job import SFTTrainer
from worker.runtime.adapter_layers import attach_adapter, remove_adapter_layers
from worker.runtime.qat import qat_loss
from worker.runtime.train_core import TrainState

SFT = KINDS["sft"].prefix
EXPORTS = KINDS["export"].prefix
ROWS = [{"prompt": f"Tell me about {w}.", "completion": f"{w} is green and round and good"}
        for w in ("apples", "rivers", "stones", "clouds")]
PAIRS = [{"prompt": f"Tell me about {w}.", "chosen": f"{w} are good", "rejected": f"{w} are bad"} for w in ("apples", "rivers")]
KTO_ROWS = [{"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"} for p in PAIRS for k in ("chosen", "rejected")]
BASE = dict(lora_layers=-1, lora_rank=4, lora_alpha=4, learning_rate=1e-2, batch_size=2, iters=4)
QAT = dict(qat_enable=True, qat_bits=3, qat_start_step=1, qat_interval=2)  # steps 1 and 3 (0-based) are QAT's


# --------------------------------------------------------------------------- in this process


@pytest.fixture(scope="module")
def lm(tiny_model):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model))
    yield model, tokenizer
    remove_adapter_layers(model)


def trainer(lm, spec_class, trainer_class, rows, fine_tune_type="lora", **config):
    model, tokenizer = lm
    data = {"preference_pairs": rows} if spec_class in (DPOJobCreate, ORPOJobCreate) else {"dataset": rows}
    spec = spec_class(model_id="tiny", **data, config={**BASE, **config})
    mx.random.seed(0)
    attach_adapter(model, spec.config, fine_tune_type)
    return trainer_class(model, tokenizer, spec, rows, rows)


def quantized_loss(tiny_model, made: SFTTrainer, bits: int) -> float:
    """The trainer's loss on its first batch, computed by another copy of the model with the
    trainer's adapter fused in and quantized as mlx_lm does it (fuse, quantize_model)."""
    import mlx_lm
    from mlx_lm.utils import quantize_model

    model, _, config = mlx_lm.load(str(tiny_model), return_config=True)
    attach_adapter(model, made.cfg, "lora")
    model.update(tree_unflatten(tree_flatten(made.module.trainable_parameters())))
    model.update_modules(tree_unflatten([(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]))
    quantize_model(model, config, group_size=64, bits=bits, mode="affine")
    arrays, _ = made.arrays([0, 1], made.train_rows)
    return made.loss(model, *arrays)[0].item()


def test_a_qat_step_computes_the_fused_quantized_model_on_its_schedule(lm, tiny_model):
    """Steps 0 and 2 are plain; steps 1 and 3 compute the loss the adapter fused into the base and
    quantized to 3 bits gives (the model the export writes), and still train the adapter."""
    plain = trainer(lm, SFTJobCreate, SFTTrainer, ROWS[:2])
    plain_loss = plain.step(TrainState())["loss"]
    made = trainer(lm, SFTJobCreate, SFTTrainer, ROWS[:2], **QAT)
    state = TrainState()
    for step in range(4):
        before = {k: np.array(v) for k, v in tree_flatten(made.module.trainable_parameters())}
        expected = quantized_loss(tiny_model, made, 3) if step % 2 else None
        loss = made.step(state)["loss"]
        if step == 0:
            assert loss == pytest.approx(plain_loss, rel=1e-6)
        if expected is not None:
            assert loss == pytest.approx(expected, rel=1e-4), step
        after = dict(tree_flatten(made.module.trainable_parameters()))
        assert any(not np.allclose(np.array(after[k]), v) for k, v in before.items()), step  # it trained


def test_full_fine_tuning_qat_has_the_rounded_weights_gradient(lm):
    """Straight through: the gradient at w is the plain gradient at round(w)."""
    made = trainer(lm, SFTJobCreate, SFTTrainer, ROWS[:2], fine_tune_type="full", lora_layers=1, **QAT)
    model, cfg = made.module, made.cfg
    arrays, _ = made.arrays([0, 1], made.train_rows)
    (_, _), qat_grads = nn.value_and_grad(model, qat_loss(made.loss, cfg.qat))(model, *arrays)
    weights = dict(tree_flatten(model.parameters()))  # every matrix is rounded, the frozen ones and the embedding too
    rounded = {k: mx.dequantize(*mx.quantize(w, **cfg.qat), **cfg.qat) if w.ndim == 2 else w for k, w in weights.items()}
    model.update(tree_unflatten(list(rounded.items())))
    (_, _), grads = nn.value_and_grad(model, made.loss)(model, *arrays)
    model.update(tree_unflatten(list(weights.items())))
    qat_grads, grads = dict(tree_flatten(qat_grads)), dict(tree_flatten(grads))
    assert any(g.ndim == 2 for g in grads.values())
    for k in grads:
        np.testing.assert_allclose(np.array(qat_grads[k]), np.array(grads[k]), rtol=1e-4, atol=1e-6)


def test_qat_needs_the_rounded_weights_beside_the_weights_and_the_estimate_counts_them(lm, tiny_model):
    """The backward keeps each layer's rounded weight: a LoRA step's peak memory grows by about
    the unquantized weights, the term the memory estimate adds for QAT (shared/memory_estimate.py)."""
    peaks = []
    for qat in (False, True):
        made = trainer(lm, SFTJobCreate, SFTTrainer, ROWS[:2], qat_enable=qat, qat_bits=4, qat_start_step=0)
        state = TrainState()
        peaks.append(max(made.step(state)["peak_memory_gb"] for _ in range(3)) * 1e9)
    config = json.loads((tiny_model / "config.json").read_text())
    shape = ModelShape(config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
                       config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
                       config["vocab_size"], 4)
    step = dict(rows=2, width=32, checkpointing=False, device="cpu")
    added = need_bytes("sft", shape, 0, **step, qat=True) - need_bytes("sft", shape, 0, **step)
    assert added == dense_bytes(shape)
    assert 0.5 * added < peaks[1] - peaks[0] < 1.5 * added, (peaks, added)


@pytest.mark.parametrize("spec_class, trainer_class, rows", [(DPOJobCreate, DPOTrainer, PAIRS),
                                                             (ORPOJobCreate, DPOTrainer, PAIRS),
                                                             (KTOJobCreate, KTOTrainer, KTO_ROWS)])
def test_dpo_orpo_and_kto_train_through_fake_quantization(lm, spec_class, trainer_class, rows):
    """The first step (before qat_start_step) is the plain one; from the start step the loss is
    another (2-bit rounding moves it), and the adapter trains."""
    plain = trainer(lm, spec_class, trainer_class, rows)
    plain_losses = [plain.step(s := TrainState())["loss"], plain.step(s)["loss"]]
    made = trainer(lm, spec_class, trainer_class, rows, **{**QAT, "qat_bits": 2})
    losses = [made.step(s := TrainState())["loss"], made.step(s)["loss"]]
    assert losses[0] == pytest.approx(plain_losses[0], rel=1e-6)
    assert np.isfinite(losses[1]) and abs(losses[1] - plain_losses[1]) > 1e-3


# --------------------------------------------------------------------------- through the stack


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from worker.runtime.make_model import make_model

    root = tmp_path_factory.mktemp("quant-models")
    make_model(root / "tiny", final_norm=16.0)
    make_model(root / "tiny-q6", quantize=6, final_norm=16.0)
    make_model(root / "tiny-mxfp4", quantize=4, quantize_mode="mxfp4", final_norm=16.0)
    return root


@pytest.fixture(scope="module")
def stack(tmp_path_factory, models):
    yield from running(Stack(tmp_path_factory.mktemp("quant"), models / "tiny"))


JOB = {"iters": 5, "batch_size": 4, "learning_rate": 5e-3, "lora_layers": -1, "lora_rank": 8, "lora_alpha": 16.0,
       "steps_per_report": 1, "steps_per_eval": 100, "steps_per_save": 100}
JOBS = {"q6": ("tiny-q6", {}), "mxfp4": ("tiny-mxfp4", {}), "qlora3": ("tiny", {"fine_tune_type": "qlora", "quant_bits": 3}),
        "mxfp8": ("tiny", {"mxfp8": True}), "qat": ("tiny", {"qat_enable": True, "qat_bits": 4, "qat_start_step": 0})}


@pytest.fixture(scope="module")
def jobs(stack, worker):
    with stack.client() as c:
        ids = {name: c.post(SFT, json={"model_id": model, "dataset": ROWS, "config": {**JOB, **cfg}}).json()["job_id"]
               for name, (model, cfg) in JOBS.items()}
    return {name: wait_done(stack, SFT, job_id, timeout=240) for name, job_id in ids.items()}


def logits(loaded) -> mx.array:
    model, tokenizer = loaded
    return model(mx.array([tokenizer.encode(ROWS[0]["prompt"] + " " + ROWS[0]["completion"])]))


@pytest.mark.parametrize("name, bits, mode", [("q6", 6, "affine"), ("mxfp4", 4, "mxfp4"), ("qlora3", 3, "affine"),
                                              ("mxfp8", 8, "mxfp8")])
def test_quantized_bases_train_and_save_adapters_mlx_lm_loads(stack, models, jobs, tmp_path, name, bits, mode):
    job = jobs[name]
    model_id = JOBS[name][0]
    with stack.client() as c:
        losses = [h["loss"] for h in c.get(f"{SFT}/{job['job_id']}/history").json()["history"]]
    assert losses[-1] < losses[0] - 0.1, losses
    adapter = download_adapter(stack, job["job_id"], tmp_path / "adapter", TOKEN)
    quantization = json.loads((adapter / "adapter_config.json").read_text()).get("quantization")
    if model_id == "tiny":  # a private copy quantized by the job, as its adapter_config.json says
        assert quantization == {"group_size": 32 if mode != "affine" else 64, "bits": bits, "mode": mode}
    else:
        assert quantization is None
    base, tuned = load(models / model_id, None, quantization), load(models / model_id, adapter, quantization)
    layers = [m for _, m in tuned[0].named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and all((m.bits, m.mode) == (bits, mode) for m in layers)
    assert mx.abs(logits(tuned) - logits(base)).max().item() > 0.1  # the adapter is there


def test_a_qat_job_exports_its_model_quantized_to_the_trained_bits(stack, models, jobs, tmp_path):
    job_id = jobs["qat"]["job_id"]
    adapter = download_adapter(stack, job_id, tmp_path / "adapter", TOKEN)
    assert json.loads((adapter / "adapter_config.json").read_text())["qat"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    out = tmp_path / "exported"
    env = {k: v for k, v in stack.env.items() if k not in ("REDIS_URL", "MTQ_API_PORT")}
    done = subprocess.run([sys.executable, "-m", "cli.main", "export", job_id, str(out), "--quantize"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240,
                          env=dict(env, MTQ_API_URL=stack.base_url, COLUMNS="120"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    export_id = re.search(r"submitted export job ([0-9a-f]{32})", done.stdout).group(1)
    assert [e for _, e in stack.events(export_id) if e["type"] == "exported"][0]["quantization"]["bits"] == 4

    # What the job trained through: its adapter fused into tiny, then quantized (the QAT step's forward).
    import mlx_lm
    from mlx_lm.utils import quantize_model

    reference, tokenizer, config = mlx_lm.load(str(models / "tiny"), return_config=True)
    from mlx_lm.tuner.utils import load_adapters

    load_adapters(reference, str(adapter))
    reference.update_modules(tree_unflatten([(n, m.fuse()) for n, m in reference.named_modules() if hasattr(m, "fuse")]))
    quantize_model(reference, config, group_size=64, bits=4, mode="affine")
    exported = mlx_lm.load(str(out))
    assert mx.abs(logits(exported) - logits((reference, tokenizer))).max().item() < 1e-3


@pytest.mark.parametrize("config, error", [
    ({"quant_mode": "mxfp4"}, "give fine_tune_type qlora or quantize_base"),
    ({"mxfp8": True, "fine_tune_type": "full"}, "fine_tune_type 'full' does not apply"),
    ({"mxfp8": True, "quant_mode": "mxfp4"}, "mxfp8 is quant_mode mxfp8"),
    ({"quant_bits": 7, "fine_tune_type": "qlora"}, "quant_bits"),
    ({"qat_enable": True, "fine_tune_type": "qlora"}, "a quantized base"),
    ({"qat_enable": True, "qat_group_size": 48}, "qat_group_size"),
    ({"qat_enable": True, "qat_interval": 0}, "qat_interval"),
])
def test_impossible_combinations_are_refused(stack, config, error):
    with stack.client() as c:
        resp = c.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "config": config})
    assert resp.status_code == 400 and error in resp.text, resp.text  # the seed routes answer a bad config 400


def test_exporting_quantized_a_job_without_qat_needs_its_bits(stack, jobs):
    with stack.client() as c:
        resp = c.post(EXPORTS, json={"source": jobs["q6"]["job_id"], "quantize": True})
        assert resp.status_code == 400 and "did not train with QAT" in resp.text, resp.text
        resp = c.post(EXPORTS, json={"source": jobs["q6"]["job_id"], "quant_bits": 4})
        assert resp.status_code == 400 and "give quantize: true" in resp.text, resp.text


def test_qat_on_a_quantized_model_directory_fails_the_job_saying_why(stack, jobs):
    with stack.client() as c:
        job_id = c.post(SFT, json={"model_id": "tiny-q6", "dataset": ROWS,
                                   "config": {**JOB, "qat_enable": True, "max_attempts": 1}}).json()["job_id"]
    job = wait_done(stack, SFT, job_id, timeout=120, status="failed")
    assert "no unquantized linear layer" in job["error"], job["error"]
