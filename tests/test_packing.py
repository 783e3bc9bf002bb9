"""SFT's packing (worker/runtime/packing.py): rows of mixed length packed end to end give each row
the logits it has alone (llama, qwen2, qwen3), so a packed step's loss and gradients are the
padded step's; rows longer than max_seq_length are cut as unpacked; a job with packing on trains
as the same job unpacked, step by step, through the real stack."""

import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import read_events, wait_done
from mlx.utils import tree_flatten
from mlx_lm.models import llama, mamba, qwen2, qwen3

from shared.train_specs import SFTJobCreate
from worker.kinds.sft_job import SFTTrainer
from worker.runtime.adapter_layers import attach_adapter, remove_adapter_layers
from worker.runtime.models import UnsupportedBase
from worker.runtime.packing import best_fit_decreasing, check_packable, pack_rows, packed_logits, per_token_rope
from worker.runtime.train_core import Rows, TrainState

SFT = "/admin/api/fine-tune/jobs"
WORDS = "red blue green stone river cloud apple tree house car road sun moon star bird fish".split()
CONFIG = dict(lora_layers=-1, lora_rank=8, lora_alpha=4, learning_rate=1e-2, batch_size=6, iters=4, mask_prompt=True,
              max_seq_length=64)


def mixed_rows(n: int, seed: int) -> list[dict]:
    """Prompt/completion rows of 1 to 40 words: lengths from a few tokens to past max_seq_length."""
    rnd = random.Random(seed)
    return [{"prompt": f"Q{i}: {rnd.choice(WORDS)}?", "completion": " ".join(rnd.choices(WORDS, k=rnd.choice([1, 3, 8, 20, 40])))}
            for i in range(n)]


def test_best_fit_decreasing_puts_each_item_once_into_the_fullest_bin_it_fits():
    sizes = [5, 7, 0, 3, 9, 2, 6, 10]
    bins = best_fit_decreasing(sizes, 10)
    assert sorted(i for b in bins for i in b) == [i for i, s in enumerate(sizes) if s]
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins)
    # largest first: 10 | 9 | 7 | 6 (no room left for it) | 5 (none) | 3 into 7's bin (room 3, the least that fits)
    # | 2 into 6's (room 4) rather than 5's (room 5)
    assert bins == [[7], [4], [1, 3], [6, 5], [0]]


def tiny(family) -> nn.Module:
    common = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-6, vocab_size=256, rope_theta=10000.0, tie_word_embeddings=False)
    if family is qwen3:
        common.update(head_dim=16, max_position_embeddings=512)
    mx.random.seed(1)
    model = family.Model(family.ModelArgs(model_type=family.__name__.rsplit(".", 1)[1], **common))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("family", [llama, qwen2, qwen3], ids=lambda f: f.__name__.rsplit(".", 1)[1])
def test_a_packed_row_gets_the_logits_it_gets_alone(family):
    model = tiny(family)
    check_packable(model)
    rnd = np.random.RandomState(0)
    rows = Rows([[int(t) for t in rnd.randint(1, 256, n)] for n in (5, 40, 17, 3, 60, 9, 2)], [1] * 7)
    sizes = [len(t) - 1 for t in rows.tokens]
    packed = pack_rows(rows, 64)
    assert packed.inputs.shape == (3, 64)  # 7 rows in 3 sequences
    positions, segments = np.array(packed.positions), np.array(packed.segments)
    for b in range(len(positions)):  # each row's positions from 0
        starts = np.flatnonzero(np.diff(segments[b], prepend=-1))
        assert (positions[b, starts] == 0).all()
    together = np.array(packed_logits(model, packed.inputs, packed.positions, packed.segments))
    for b, items in enumerate(best_fit_decreasing(sizes, 64)):
        col = 0
        for i in items:
            alone = np.array(model(mx.array(rows.tokens[i][:-1])[None]))[0]
            np.testing.assert_allclose(together[b, col:col + sizes[i]], alone, rtol=1e-5, atol=1e-5)
            col += sizes[i]
    # the same tokens under one causal mask (no segments) would not give these logits
    plain = np.array(model(packed.inputs))
    assert np.abs(plain - together)[np.array(packed.mask) > 0].max() > 1e-2


def test_per_token_rope_rotates_each_token_by_its_own_position():
    """Bit for bit as mx.fast.rope rotates the token alone at its position (a restart at 0 and a
    position in the thousands, where the bin's positions instead would miss: RoPE is relative
    only up to rounding)."""
    x = mx.random.normal((2, 4, 6, 16), key=mx.random.key(0))
    positions = mx.array([[0, 1, 2, 0, 1, 0], [0, 1, 3000, 3001, 3002, 0]])
    calls = [0]
    rope = nn.RoPE(16, base=10000.0)
    with per_token_rope(positions, calls):
        out = rope(x, offset=positions)
        assert np.array_equal(np.array(rope(x, offset=2)), np.array(nn.RoPE(16, base=10000.0)(x, offset=2)))  # others as before
    assert calls[0] == 1
    for b in range(2):
        for t in range(6):
            alone = rope(x[b:b + 1, :, t:t + 1], offset=positions[b, t].item())
            assert np.array_equal(np.array(out[b:b + 1, :, t:t + 1]), np.array(alone)), (b, t)


def test_a_recurrent_model_is_refused():
    model = mamba.Model(mamba.ModelArgs(model_type="mamba", vocab_size=64, hidden_size=16, intermediate_size=32,
                                        state_size=4, num_hidden_layers=1, conv_kernel=4, use_bias=False,
                                        use_conv_bias=True, time_step_rank=4))
    with pytest.raises(UnsupportedBase, match="packing"):
        check_packable(model)


@pytest.fixture(scope="module")
def lm(tiny_model):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model))
    yield model, tokenizer
    remove_adapter_layers(model)


def trainer(lm, rows, **config) -> SFTTrainer:
    model, tokenizer = lm
    spec = SFTJobCreate(model_id="tiny", dataset=rows, config={**CONFIG, **config})
    mx.random.seed(0)
    attach_adapter(model, spec.config, "lora")
    return SFTTrainer(model, tokenizer, spec, rows, rows)


def loss_and_grads(t: SFTTrainer, ids: list[int]):
    arrays, tokens = t.arrays(ids, t.train_rows)
    (loss, stats), grads = nn.value_and_grad(t.module, t.loss)(t.module, *arrays)
    return float(loss.item()), float(stats["mean_token_accuracy"].item()), dict(tree_flatten(grads)), tokens, arrays[0].shape


@pytest.mark.parametrize("loss_type", ["nll", "chunked_nll"])
def test_packed_loss_and_gradients_equal_the_padded_batch(lm, loss_type):
    rows = mixed_rows(12, 0)
    padded, packed = trainer(lm, rows), trainer(lm, rows, packing=True, loss_type=loss_type)
    assert padded.truncated == packed.truncated > 0  # the 40-word rows are cut to max_seq_length, packed as unpacked
    ids = list(range(12))
    loss, accuracy, grads, tokens, shape = loss_and_grads(padded, ids)
    p_loss, p_accuracy, p_grads, p_tokens, p_shape = loss_and_grads(packed, ids)
    assert p_shape[0] < shape[0] and p_shape[1] <= CONFIG["max_seq_length"]
    assert p_tokens == tokens  # the same trained tokens: the same weight of the micro-batch
    assert p_loss == pytest.approx(loss, rel=1e-5) and p_accuracy == pytest.approx(accuracy, abs=1e-6)
    assert grads.keys() == p_grads.keys()
    for name, g in grads.items():
        np.testing.assert_allclose(np.array(p_grads[name]), np.array(g), rtol=1e-4, atol=1e-6, err_msg=name)
    assert any(float(mx.abs(g).max().item()) > 1e-4 for g in grads.values())


def test_packed_steps_follow_the_padded_steps(lm):
    """Compiled steps, gradient accumulation and checkpointing of the blocks: the same curve."""
    rows = mixed_rows(12, 1)
    curves = []
    for packing in (False, True):
        t = trainer(lm, rows, packing=packing, batch_size=3, grad_accumulation_steps=2, gradient_checkpointing=True)
        state = TrainState()
        curves.append([t.step(state) for _ in range(3)] + [t.evaluate()])
    for plain, packed in zip(*curves):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in plain:
                assert packed[key] == pytest.approx(plain[key], rel=1e-4), key


def sft_losses(stack, job_id: str) -> list[float]:
    return [e["loss"] for _, e in read_events(stack.redis, job_id, count=100_000) if e["type"] == "sft_step"]


def test_an_sft_job_with_packing_trains_as_the_same_job_unpacked(stack, client, worker):
    rows = mixed_rows(16, 2)
    body = {"model_id": "tiny", "dataset": rows, "config": {**CONFIG, "iters": 5, "steps_per_report": 1}}
    ids = {}
    for packing in (False, True):
        res = client.post(SFT, json={**body, "adapter_name": f"packing-{packing}",
                                     "config": {**body["config"], "packing": packing}})
        assert res.status_code == 200, res.text
        ids[packing] = res.json()["job_id"]
    for job_id in ids.values():
        wait_done(stack, SFT, job_id)
    plain, packed = sft_losses(stack, ids[False]), sft_losses(stack, ids[True])
    print(f"\nSFT losses unpacked {plain}\n           packed   {packed}")
    assert len(plain) == len(packed) == 5 and plain[-1] < plain[0]
    assert packed == pytest.approx(plain, rel=1e-4)
