"""SFT's loss types and the supervised kinds' optimizers (worker/kinds/sft_job.py,
worker/runtime/train_core.py make_optimizer): the losses on the tiny model in this process, against
nll's and a NumPy reading of TRL 1.16's DFT; each optimizer through the real stack, a job killed
(kill -9 of its training process) at a checkpoint and resumed against one left alone."""


import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import kill_when, wait_done, wait_for
from mlx.utils import tree_flatten
from test_train_kinds import SFT, events, submit

from shared.memory_estimate import (GB, OPTIMIZER_STATES, ModelShape, block_bytes, need_bytes, supervised_checkpointing,
                                    trained_bytes)
from shared.routing import step_of
from shared.train_specs import SFTJobCreate
from worker.kinds.sft_job import SFTTrainer, masked_mean, token_losses
from worker.runtime.adapter_layers import attach_adapter, remove_adapter_layers
from worker.runtime.logprobs import token_logps
from worker.runtime.memory_plan import model_shape
from worker.runtime.train_core import TrainState, make_optimizer

ROWS = [{"text": "the cat reads a book quickly and the dog runs to the river " * (3 + i)} for i in range(4)]
BASE = dict(lora_layers=-1, lora_rank=4, lora_alpha=4, learning_rate=1e-2, batch_size=4, iters=3)


@pytest.fixture(scope="module")
def lm(tiny_model):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model))
    yield model, tokenizer
    remove_adapter_layers(model)


def trainer(lm, **config) -> SFTTrainer:
    model, tokenizer = lm
    spec = SFTJobCreate(model_id="tiny", dataset=ROWS, config={**BASE, **config})
    mx.random.seed(0)
    attach_adapter(model, spec.config, "lora")
    # LoRA B = 0 gives A no gradient: random B so that every adapter weight has one.
    for _, layer in model.named_modules():
        if hasattr(layer, "lora_b"):
            layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.05
    return SFTTrainer(model, tokenizer, spec, ROWS, None)


def loss_and_grads(t: SFTTrainer):
    (arrays, _) = t.arrays(list(range(len(ROWS))), t.train_rows)
    (loss, stats), grads = nn.value_and_grad(t.module, t.loss)(t.module, *arrays)
    return float(loss.item()), float(stats["mean_token_accuracy"].item()), dict(tree_flatten(grads))


def test_chunked_nll_has_nlls_loss_and_gradients(lm):
    """Chunks of 16 positions: several per row, and chunks across rows."""
    plain = loss_and_grads(trainer(lm))
    chunked_trainer = trainer(lm, loss_type="chunked_nll")
    chunked_trainer.chunk = 16
    assert chunked_trainer.head is not None
    chunked = loss_and_grads(chunked_trainer)
    assert chunked[0] == pytest.approx(plain[0], rel=1e-6) and chunked[1] == plain[1]
    assert plain[2].keys() == chunked[2].keys() and len(plain[2]) > 4
    for name, g in plain[2].items():
        assert float(mx.abs(g).max().item()) > 0, name
        np.testing.assert_allclose(np.array(chunked[2][name]), np.array(g), rtol=1e-4, atol=1e-7)
    # The compiled step (the job's) too. Trainers share the model: each steps before the next is made.
    a = trainer(lm).step(TrainState())
    chunked_step = trainer(lm, loss_type="chunked_nll")
    chunked_step.chunk = 16
    b = chunked_step.step(TrainState())
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def numpy_dft(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> tuple[float, np.ndarray]:
    """TRL 1.16's DFT (SFTTrainer.compute_loss): per_token_loss = -log_probs * exp(log_probs).detach(),
    summed over the label tokens / their count; and its gradient in the logits, -p_y (onehot_y - softmax)
    per token over the count (the weight p_y held constant)."""
    z = logits.astype(np.float64)
    logsm = z - z.max(-1, keepdims=True)
    logsm = logsm - np.log(np.exp(logsm).sum(-1, keepdims=True))
    logp = np.take_along_axis(logsm, targets[..., None], -1)[..., 0]
    n = max(mask.sum(), 1)
    loss = (-logp * np.exp(logp) * mask).sum() / n
    onehot = np.eye(z.shape[-1])[targets]
    grad = -(np.exp(logp) * mask / n)[..., None] * (onehot - np.exp(logsm))
    return loss, grad


def test_dft_is_trls_formula():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, 7, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (3, 7))
    mask = (rng.random((3, 7)) < 0.7).astype(np.float32)
    want, want_grad = numpy_dft(logits, targets, mask)

    def dft(z):
        return masked_mean(token_losses(token_logps(z, mx.array(targets)), "dft"), mx.array(mask))

    loss, grad = mx.value_and_grad(dft)(mx.array(logits))
    assert loss.item() == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(np.array(grad), want_grad, rtol=1e-4, atol=1e-7)


def test_a_dft_job_step_is_trls_loss_on_the_models_logits(lm):
    t = trainer(lm, loss_type="dft")
    arrays, _ = t.arrays(list(range(len(ROWS))), t.train_rows)
    inputs, targets, mask = arrays
    want, _ = numpy_dft(np.array(t.module(inputs)), np.array(targets), np.array(mask))
    assert t.step(TrainState())["loss"] == pytest.approx(want, rel=1e-5)


# --------------------------------------------------------------------------- optimizers, through the stack

# Each optimizer's state matters to its next update (SGD's through its momentum).
OPTIMIZERS = {"adamw": {"weight_decay": 0.01}, "adam": {}, "muon": {"learning_rate": 2e-2}, "sgd": {"momentum": 0.9, "learning_rate": 0.5},
              "adafactor": {}}
TEXT_ROWS = [{"text": f"{i} the cat reads a book and the dog runs to the river " * 4} for i in range(8)]
RESUME = dict(lora_layers=-1, lora_rank=4, lora_alpha=4, learning_rate=1e-2, batch_size=4, iters=30, steps_per_save=4,
              steps_per_report=30, max_grad_norm=None)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_each_optimizer_resumes_bit_exactly_after_kill_9_at_a_checkpoint(stack, client, worker, optimizer):
    """The same job twice: one killed (kill -9 of its training process) once it has a checkpoint
    and resumed from it, one left alone; their loss curves are equal, bit for bit."""
    body = {"model_id": "tiny", "dataset": TEXT_ROWS, "config": {**RESUME, "optimizer": optimizer, **OPTIMIZERS[optimizer]}}
    killed, alone = submit(client, SFT, body), submit(client, SFT, body)
    child = wait_for(lambda: events(stack, killed["job_id"], "started"), 120, "the start")[-1]["pid"]
    kill_when(lambda: (client.get(f"{SFT}/{killed['job_id']}").json()["checkpoint_step"] or 0) >= 4, child,
              "a checkpoint")
    done = wait_done(stack, SFT, killed["job_id"], timeout=180)
    assert done["failed_attempts"] == 1 and done["resumed_from"] >= 4 and done["config"]["optimizer"] == optimizer
    wait_done(stack, SFT, alone["job_id"], timeout=180)
    curves = [client.get(f"{SFT}/{job['job_id']}/history").json()["history"] for job in (killed, alone)]
    assert [h["step"] for h in curves[0]] == list(range(1, 31))  # every step once
    losses = [[h["loss"] for h in curve] for curve in curves]
    print(f"\n{optimizer}: loss by step", [round(v, 3) for v in losses[1][::5]], "resumed from", done["resumed_from"])
    assert losses[0] == losses[1]
    assert losses[1][-1] < losses[1][0] - 0.05  # it trains: its state has something to carry


@pytest.mark.parametrize("config,error", [
    ({"optimizer": "lion"}, "optimizer"),
    ({"momentum": 0.9}, "momentum applies to optimizer sgd or muon, not adamw"),
    ({"optimizer": "sgd", "momentum": 1.0}, "momentum"),
    ({"loss_type": "focal"}, "loss_type"),
], ids=["unknown-optimizer", "momentum-of-adamw", "momentum-1", "unknown-loss"])
def test_optimizer_and_loss_fields_out_of_bounds_are_a_clear_400(client, config, error):
    res = client.post(SFT, json={"model_id": "tiny", "dataset": TEXT_ROWS, "config": config})
    assert res.status_code == 400 and error in res.json()["detail"], res.text


# --------------------------------------------------------------------------- long rows


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd", "muon", "adafactor"])
def test_full_fine_tuning_counts_its_gradients_and_the_optimizers_state(lm, optimizer):
    """A full fine-tune holds a gradient of every trained weight and its optimizer's state of it
    beside the weights: what mlx.optimizers keep for the blocks attach_adapter trains (every
    block, the tiny model) is OPTIMIZER_STATES arrays of each (Adafactor's factored rows and
    columns: under a tenth), and the routing's estimate of such a job (step_of, need_bytes) is
    the same job's with LoRA plus one gradient and that state of each block's weights."""
    model, _ = lm
    config = {**BASE, "fine_tune_type": "full", "optimizer": optimizer}
    spec = SFTJobCreate(model_id="tiny", dataset=ROWS, config=config)
    attach_adapter(model, spec.config, "full")
    trained = model.trainable_parameters()
    opt = make_optimizer(spec.config, 3, optimizer)
    opt.init(trained)
    state = sum(v.nbytes for _, v in tree_flatten(opt.state) if v.ndim)  # not the step's scalars
    trained = sum(v.nbytes for _, v in tree_flatten(trained))
    s = model_shape(model)
    assert trained == pytest.approx(s.layers * block_bytes(s), rel=0.01)  # the projections; the norms are small
    if OPTIMIZER_STATES[optimizer]:
        assert state == OPTIMIZER_STATES[optimizer] * trained
    else:
        assert state < trained / 10
    full = step_of(spec)
    lora = step_of(SFTJobCreate(model_id="tiny", dataset=ROWS, config={**BASE, "optimizer": optimizer}))
    assert full["full_layers"] == -1 and lora["full_layers"] == 0
    assert (need_bytes("sft", s, 10**6, **full, device="cpu") - need_bytes("sft", s, 10**6, **lora, device="cpu")
            == (1 + OPTIMIZER_STATES[optimizer]) * s.layers * block_bytes(s))
    half = step_of(SFTJobCreate(model_id="tiny", dataset=ROWS, config={**BASE, "fine_tune_type": "full",
                                                                       "lora_layers": 1, "optimizer": optimizer}))
    one_block = trained_bytes(s, half["full_layers"], half["optimizer_states"])
    assert one_block == (1 + OPTIMIZER_STATES[optimizer]) * block_bytes(s)


def test_long_rows_plan_gradient_checkpointing_where_the_memory_needs_it():
    """worker/kinds/supervised_trainer.py planned_checkpointing's rule on the estimate the routing uses:
    a 28-block model (Qwen3-0.6B's shapes) at one row of 8,192 tokens needs several times less with
    checkpointing; the tiny model's 2 blocks gain nothing (attention's probabilities dominate)."""
    qwen = ModelShape(layers=28, hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, vocab=151_936,
                      act_bytes=2)
    weights = int(1.2 * GB)
    without, with_it = (need_bytes("sft", qwen, weights, 1, 8192, c, "gpu") for c in (False, True))
    assert with_it < without / 4
    on, reason = supervised_checkpointing(qwen, weights, 1, 8192, "gpu", (with_it + without) / 2)
    assert on and reason.startswith("gradient checkpointing on: the step needs about")
    assert supervised_checkpointing(qwen, weights, 1, 8192, "gpu", without * 1.01) == (False, "")
    tiny = ModelShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=1024, act_bytes=4)
    on, reason = supervised_checkpointing(tiny, 10**6, 1, 16384, "cpu", 1 * GB)
    assert not on and "would not lower it" in reason
    # The routing counts a job that does not ask for it at the lower need: a worker that fits it with
    # checkpointing takes it, and plans it.
    step = step_of(SFTJobCreate(model_id="tiny", dataset=ROWS, config={"max_seq_length": 8192, "batch_size": 1}))
    assert step["checkpointing"] is None and need_bytes("sft", qwen, weights, **step, device="gpu") == with_it
