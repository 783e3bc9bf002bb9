"""A job's LoRA layers that read one input (q/k/v, gate/up) computed together while training
(worker/runtime/adapter_layers.py SharedInput): what each layer alone gives (outputs, losses,
gradients, QAT's rounding), with fewer matmuls, on the tiny model in this process."""

import collections
import gc
import re
import tempfile
import weakref

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_sft_losses import BASE, ROWS
from test_sft_losses import trainer as attach  # a LoRA SFT job's layers, B drawn (the products count)

from shared.train_specs import SFTJobCreate, quantization
from worker.kinds.online_dpo import reference_sampling
from worker.runtime.adapter_layers import (InputDtypeLoRALinear, PairedLoRALinear, SharedInput, adapter_swapped,
                                           adapter_weights, attach_adapter, by_layer, lora_disabled,
                                           remove_adapter_layers, without_adapters)
from worker.runtime.models import prepare_private
from worker.runtime.projection_groups import PAIR, fuse_shared_inputs
from worker.runtime.train_core import TrainState


@pytest.fixture(scope="module", params=["fused", "unfused"])
def lm(request, tiny_model):
    """The tiny model, its q/k/v and gate/up fused as a worker loads a shared model, or not (as a
    group runs without fused weights: a QAT job's, or projections that cannot fuse)."""
    model, tokenizer = mlx_lm.load(str(tiny_model))
    if request.param == "fused":
        assert fuse_shared_inputs(model) == 2 * len(model.layers)
    yield model, tokenizer
    remove_adapter_layers(model)


def groups(model) -> list[SharedInput]:
    found = {id(m.shared_input): m.shared_input for _, m in model.named_modules()
             if isinstance(m, InputDtypeLoRALinear) and m.shared_input is not None}
    return list(found.values())


def each_alone(model, trainer=None) -> None:
    """Each layer computes alone, with its own lora_a and lora_b (a paired group's blocks of its
    pair); the trainer's optimizer gets state for them."""
    layers = [m for _, m in model.named_modules() if isinstance(m, InputDtypeLoRALinear)]
    matrices = [(m.lora_a, m.lora_b) for m in layers]
    for m, (a, b) in zip(layers, matrices):
        for key in (*PAIR, "_pair_mask"):
            m.pop(key, None)
        m.__class__, m.shared_input = InputDtypeLoRALinear, None
        m.lora_a, m.lora_b = a, b
    if trainer is not None:
        trainer.optimizer.init(model.trainable_parameters())


def loss_graph(model, tokens: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
    """The loss and its gradients by name, not evaluated."""
    def loss(module):
        return nn.losses.cross_entropy(module(tokens[:, :-1]), tokens[:, 1:]).mean()
    value, grads = nn.value_and_grad(model, loss)(model)
    return value, by_layer(model, dict(tree_flatten(grads)))


def loss_and_grads(model, tokens: mx.array) -> tuple[float, dict[str, np.ndarray]]:
    value, grads = loss_graph(model, tokens)
    mx.eval(value, grads)
    return value.item(), {k: np.array(v) for k, v in grads.items()}


def matmuls(*arrays: mx.array) -> int:
    """The Matmul primitives of the arrays' graph (mx.export_to_dot)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return collections.Counter(re.findall(r'label ="([A-Za-z]+)"', f.read()))["Matmul"]


def test_grouped_layers_give_what_each_layer_gives_alone(lm):
    model, _ = lm
    attach(lm)
    made = groups(model)
    assert len(made) == 2 * len(model.layers)  # q/k/v and gate/up of every block
    assert all((g.fused is not None) == hasattr(model.layers[0].self_attn, "fused_inputs") for g in made)
    tokens = mx.random.randint(0, 200, (2, 12))
    loss, grads = loss_and_grads(model, tokens)
    assert all(g.x is None and not g.outputs for g in made)  # no array of the step kept past it
    x = mx.random.normal((2, 3, model.layers[0].self_attn.q_proj.lora_a.shape[0]))
    attn = model.layers[0].self_attn
    together = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    each_alone(model)
    alone = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    for a, b in zip(together, alone):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-7)
    loss_alone, grads_alone = loss_and_grads(model, tokens)
    assert loss == pytest.approx(loss_alone, rel=1e-6)
    assert grads.keys() == grads_alone.keys() and len(grads) == 7 * 2 * len(model.layers)
    for k in grads:
        np.testing.assert_allclose(grads[k], grads_alone[k], rtol=1e-4, atol=1e-7, err_msg=k)


def test_grouped_layers_take_fewer_matmuls(lm):
    """Per block, forward and backward: q/k/v alone 24 matmuls (each 8: x W, x A, (x A) B; the
    input's gradient through W and through A, the gradients of x A, of B and of A), gate/up 16;
    together 8 each where the worker fused the base weights (one base matmul each way), else 12
    and 10 (each base its own). Nothing needs the first block's q/k/v input gradient (the
    embeddings are frozen): alone 6 matmuls fewer there, together 2 (fused) or 4."""
    model, _ = lm
    attach(lm)
    fused = hasattr(model.layers[0].self_attn, "fused_inputs")
    tokens = mx.random.randint(0, 200, (2, 12))
    value, grads = loss_graph(model, tokens)
    together = matmuls(value, *grads.values())
    each_alone(model)
    value, grads = loss_graph(model, tokens)
    saved = len(model.layers) * (24 if fused else 18) - (6 - (2 if fused else 4))
    assert matmuls(value, *grads.values()) - together == saved


@pytest.mark.parametrize("together", [True, False])
def test_a_reference_forward_runs_the_base_alone(lm, together):
    """lora_disabled (the reference policy of DPO, KTO and GRPO's KL term) gives the base model's
    outputs without the LoRA products' matmuls: 2 a group or a layer alone (8 a block together,
    14 alone)."""
    model, _ = lm
    attach(lm)
    if not together:
        each_alone(model)
    tokens = mx.random.randint(0, 200, (2, 12))
    with lora_disabled(model):
        off = model(tokens)
        without = matmuls(off)
    assert matmuls(model(tokens)) - without == len(model.layers) * (8 if together else 14)
    with without_adapters(model):
        base = model(tokens)
    np.testing.assert_allclose(np.array(off), np.array(base), rtol=1e-6, atol=1e-6)


def test_a_job_trains_as_with_each_layer_alone(lm):
    """Three compiled SFT steps: the same losses and the same moves of every weight. SGD, whose
    move is the gradient's: Adam's first moves are about the learning rate times each gradient's
    sign, so a gradient near 0 summed in another order (a fused matmul on CUDA) would move its
    weight the other way, in a job as right as the other."""
    model, _ = lm
    runs = []
    for alone in (False, True):
        trainer = attach(lm, optimizer="sgd")
        if alone:
            each_alone(model, trainer)
        assert any(isinstance(m, PairedLoRALinear) for _, m in model.named_modules()) != alone  # SGD pairs them
        before = {k: np.array(v) for k, v in adapter_weights(model).items()}
        state = TrainState()
        losses = [trainer.step(state)["loss"] for _ in range(3)]
        runs.append((losses, {k: np.array(v) - before[k] for k, v in adapter_weights(model).items()}))
    (losses, moves), (losses_alone, moves_alone) = runs
    np.testing.assert_allclose(losses, losses_alone, rtol=1e-5)
    assert losses[2] < losses[0]  # it trained
    for k in moves:
        size = np.abs(moves_alone[k]).max()
        assert size > 0, k
        np.testing.assert_allclose(moves[k], moves_alone[k], rtol=0, atol=1e-3 * size, err_msg=k)


def test_qat_trains_each_base_through_its_rounding(lm):
    """QAT swaps each layer's base weight for its fake-quantized one during a step: a group then
    multiplies by those, not by the worker's fused (unrounded) weights. 2-bit rounding, from the
    first step: the loss differs from an unrounded step's, and equals each layer's alone."""
    model, _ = lm
    qat = dict(qat_enable=True, qat_bits=2, qat_group_size=32, qat_start_step=0)
    trainer = attach(lm, **qat)
    assert groups(model) and all(g.fused is None for g in groups(model))
    loss = trainer.step(TrainState())["loss"]
    trainer = attach(lm, **qat)
    each_alone(model, trainer)
    assert loss == pytest.approx(trainer.step(TrainState())["loss"], rel=1e-6)
    assert loss != pytest.approx(attach(lm).step(TrainState())["loss"], rel=1e-5)


def test_layers_with_dropout_stay_alone(lm):
    """One dropout mask would serve every layer of a group: with lora_dropout each draws its own."""
    model, _ = lm
    attach(lm, lora_dropout=0.1)
    assert not groups(model)


def test_a_job_s_layers_keep_their_groups_between_its_steps_and_go_with_it(lm):
    """A scoring request between a job's steps swaps the job's layers out and back in
    (adapter_swapped): they come back with their groups. Taken out at the job's end, they go at
    once, not at Python's next cycle collection (a group refers to its layers weakly)."""
    model, _ = lm
    spec = SFTJobCreate(model_id="tiny", dataset=ROWS, config=BASE)
    gc.disable()
    try:
        attach_adapter(model, spec.config, "lora")
        made = groups(model)
        with adapter_swapped(model, None):
            assert not groups(model)
        assert groups(model) == made and len(made) == 2 * len(model.layers)
        layer = weakref.ref(model.layers[0].self_attn.q_proj)
        remove_adapter_layers(model)
        assert layer() is None
    finally:
        gc.enable()


def test_a_qlora_copy_runs_each_group_on_its_fused_quantized_weights(tiny_model):
    """A qlora job's private copy never changes once quantized (prepare_private), so it is fused
    as a shared model is: each group one quantized matmul, the same loss as each layer alone.
    Groups of 32: MLX 0.32.4's sm90 kernel, which Hopper GPUs run for a product of several rows
    whose input is one group wide (the tiny model's 64 in groups of 64), gives wrong sums, NaN
    among them (bench/quantized_paths.py on an H100; a real model's input is 512 wide or more)."""
    model, tokenizer, config = mlx_lm.load(str(tiny_model), lazy=True, return_config=True)
    prepare_private(model, config, "tiny", "qlora", {**quantization(4, "affine"), "group_size": 32}, max_gb=1.0)
    lm = (model, tokenizer)
    trainer = attach(lm, fine_tune_type="qlora")
    made = groups(model)
    assert len(made) == 2 * len(model.layers)
    assert all(type(g.fused) is nn.QuantizedLinear and g.fused.group_size == 32 for g in made)
    loss = trainer.step(TrainState())["loss"]
    trainer = attach(lm, fine_tune_type="qlora")
    each_alone(model, trainer)
    assert loss == pytest.approx(trainer.step(TrainState())["loss"], rel=1e-6)


def test_a_paired_group_trains_only_its_blocks_and_keeps_mlx_lm_s_names(lm):
    """AdamW with weight decay, three steps: B's off-diagonal blocks of each pair stay exactly
    zero (masked gradient, zero moments, decay of zero), the adapter's weights keep mlx_lm's
    names (each layer's lora_a, lora_b), and a layer's lora_b writes its block alone."""
    model, _ = lm
    trainer = attach(lm, optimizer="adamw", weight_decay=0.1)
    firsts = [m for _, m in model.named_modules() if PAIR[0] in m]
    assert len(firsts) == 2 * len(model.layers)
    state = TrainState()
    for _ in range(3):
        trainer.step(state)
    for m in firsts:
        assert np.abs(np.array(mx.where(m._pair_mask, 0.0, m.pair_b))).max() == 0
        assert np.abs(np.array(mx.where(m._pair_mask, m.pair_b, 0.0))).max() > 0
    weights = adapter_weights(model)
    assert len(weights) == 7 * 2 * len(model.layers) and not any(PAIR[0] in k or PAIR[1] in k for k in weights)
    attn = model.layers[0].self_attn
    assert weights["model.layers.0.self_attn.k_proj.lora_b"].shape == (4, attn.k_proj.linear.weight.shape[0])  # rank 4
    before = {k: np.array(v) for k, v in weights.items()}
    attn.k_proj.lora_b = mx.ones_like(attn.k_proj.lora_b)
    after = {k: np.array(v) for k, v in adapter_weights(model).items()}
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert changed == ["model.layers.0.self_attn.k_proj.lora_b"] and (after[changed[0]] == 1).all()


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_matrix_optimizers_keep_each_layer_s_own_matrices(lm, optimizer):
    """Muon and Adafactor update a matrix as a whole: a pair would change their math, so a group
    builds its pair from its layers' matrices at each step."""
    model, _ = lm
    attach(lm, optimizer=optimizer)
    assert groups(model) and not any(isinstance(m, PairedLoRALinear) for _, m in model.named_modules())


def test_the_reference_samples_with_every_b_zero_and_the_weights_come_back(lm):
    """Online DPO's and XPO's reference samples with every LoRA B zero (reference_sampling): a
    paired group's whole B at once. It computes the base model; after it, every weight is back."""
    model, _ = lm
    attach(lm)
    assert any(isinstance(m, PairedLoRALinear) for _, m in model.named_modules())
    tokens = mx.random.randint(0, 200, (2, 12))
    before = {k: np.array(v) for k, v in adapter_weights(model).items()}
    with lora_disabled(model):
        base = np.array(model(tokens))
    with reference_sampling(model):
        np.testing.assert_allclose(np.array(model(tokens)), base, rtol=1e-6, atol=1e-6)
    after = adapter_weights(model)
    assert after.keys() == before.keys() and all(np.array_equal(before[k], np.array(v)) for k, v in after.items())
    assert not np.allclose(np.array(model(tokens)), base, atol=1e-4)  # B drawn: the policy is not the reference
