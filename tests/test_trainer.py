"""The GRPO trainer (worker/kinds/grpo.py) on a real model: the tiny random-weight Qwen3 of
conftest's `tiny_model`, loaded with mlx_lm in this process, with a fresh LoRA attached
the way worker/jobs.py does it (mx.random.seed(cfg.seed), attach_lora, build_scorer,
GRPOTrainer). Nothing is mocked. The last test runs real jobs in a real worker process.

About the learning test's temperature: the tiny model's lm_head is its (tied) embedding,
Normal(0, 0.02) over 64 dims, applied after the final RMSNorm (weight 1, not trained by
LoRA). So whatever LoRA does, |logit| <= |h| * |e_t| = 8 * 0.16 ~ 1.3: at temperature 1 the
sampling distribution stays within a factor ~e^2.6 of uniform over 1024 tokens and no
reward can rise visibly (measured: flat for lr up to 5e-2). At temperature 0.1 (the loss
uses logits / T too) the reachable logit range is 10x larger and the model learns in
tens of steps.
"""

import gc
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from shared.schemas import JobCreate, PromptItem
from worker.kinds.grpo import Batch, GRPOTrainer, completion_text
from worker.rewards.scorer import build_scorer
from worker.runtime.adapter_layers import attach_adapter as attach_lora
from worker.runtime.logprobs import prompt_token_ids
from worker.runtime.train_core import Cancelled, TrainState

PROMPTS = ["What is 2+2?", "Say hello.", "Count to five.", "Name a color.", "Write a word.", "Tell me a story."]
SHARE_OF_E = [{"type": "python", "function": "reward_fns:share_of_e"}]
# The chat template and a LoRA scale of 2 (lora_alpha is the scale itself): the setting these
# tests' measured figures were taken with (the job defaults are raw text and scale 16).
BASE = dict(group_size=8, batch_size=2, iters=3, learning_rate=5e-2, lora_layers=-1, lora_rank=8, lora_alpha=2.0,
            max_completion_len=16, temperature=1.0, seed=0, use_chat_template=True)
TIMING = ("step_time", "tokens_per_second", "peak_memory_gb")  # vary run to run


@pytest.fixture(scope="module")
def lm(tiny_model):
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


def make_trainer(lm, prompts=PROMPTS, reward=None, validation_prompts=None, **config) -> GRPOTrainer:
    """What worker/jobs.py does for a job: seed, fresh LoRA, scorer, trainer."""
    model, tokenizer = lm
    spec = JobCreate(model_id="tiny", prompts=prompts, config={**BASE, **config}, reward=reward,
                     validation_prompts=validation_prompts)
    mx.random.seed(spec.config.seed)
    attach_lora(model, spec.config)
    return GRPOTrainer(model, tokenizer, spec, build_scorer(spec, "test-job"))


def run_steps(trainer: GRPOTrainer, n: int) -> list[tuple[dict, dict]]:
    state = TrainState()
    return [trainer.step(state, lambda: False) for _ in range(n)]


def flat(samples: dict) -> list[str]:
    return [c for group in samples["completions"] for c in group]


# ----------------------------------------------------------------------------------------
# 1. It learns
# ----------------------------------------------------------------------------------------

LEARN = dict(iters=20, learning_rate=5e-2, temperature=0.1, group_size=8, batch_size=2, max_completion_len=16, seed=0)


def test_learns_a_toy_task_and_does_not_without_a_learning_rate(lm):
    """Reward = share of the letter 'e' in the completion. With lr 5e-2 the mean reward of
    the last 5 steps is far above that of the first 5; with lr 0 (same job otherwise) it is not.
    Measured (seed 0): lr 5e-2 first5 0.11 -> last5 0.32; lr 0 0.09 -> 0.09."""
    curves = {}
    for lr in (LEARN["learning_rate"], 0.0):
        trainer = make_trainer(lm, reward=SHARE_OF_E, **dict(LEARN, learning_rate=lr))
        curves[lr] = np.array([m["reward"] for m, _ in run_steps(trainer, LEARN["iters"])])
    for lr, curve in curves.items():
        print(f"\nreward curve lr={lr}: " + " ".join(f"{r:.3f}" for r in curve)
              + f"  (first 5: {curve[:5].mean():.3f}, last 5: {curve[-5:].mean():.3f})")

    # Margins from seeds 0-6 with this config: the rise was 0.12-0.28 (seed 0: 0.21), the
    # drift with lr 0 at most 0.033 either way.
    learned, frozen = curves[LEARN["learning_rate"]], curves[0.0]
    assert learned[-5:].mean() > learned[:5].mean() + 0.1
    assert abs(frozen[-5:].mean() - frozen[:5].mean()) < 0.05  # noise only
    assert learned[-5:].mean() > frozen[-5:].mean() + 0.1


# ----------------------------------------------------------------------------------------
# 2. Reproducible
# ----------------------------------------------------------------------------------------


def test_same_seed_same_metrics_other_seed_other_completions(lm):
    config = dict(beta=0.04, lora_dropout=0.1, group_size=4)  # dropout: the update's randomness too

    def run(seed, steps=3, prompts=PROMPTS):
        trainer = make_trainer(lm, prompts=prompts, reward=SHARE_OF_E, seed=seed, **config)
        return run_steps(trainer, steps)

    first, again = run(0), run(0)
    for (m1, s1), (m2, s2) in zip(first, again):
        assert {k: v for k, v in m1.items() if k not in TIMING} == {k: v for k, v in m2.items() if k not in TIMING}
        assert s1 == s2
    for key in ("loss", "reward", "entropy", "kl", "mean_ratio", "grad_norm"):
        assert key in first[-1][0]
    assert first[-1][0]["kl"] > 0  # the weights did change, so equal metrics mean equal training
    # Another seed samples other completions, also for the very same prompt and weights (one
    # prompt: the seed's choice of prompts plays no part; step 1: the LoRA is still zero).
    for prompts in (PROMPTS, ["Say hello."]):
        assert flat(run(1, 1, prompts)[0][1]) != flat(run(0, 1, prompts)[0][1])


# ----------------------------------------------------------------------------------------
# 3. KL against the base model
# ----------------------------------------------------------------------------------------


def test_beta_reports_kl_and_costs_little_memory(lm):
    peaks, runs = {}, {}
    for beta in (0.0, 0.1):
        gc.collect()
        trainer = make_trainer(lm, beta=beta, max_completion_len=32)
        runs[beta] = run_steps(trainer, 3)
        peaks[beta] = max(m["peak_memory_gb"] for m, _ in runs[beta])
        del trainer

    with_kl = [m for m, _ in runs[0.1]]
    # Step 1 is computed with the LoRA still at zero (lora_b starts at 0): policy == reference.
    assert with_kl[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert with_kl[1]["kl"] > 1e-3 and with_kl[2]["kl"] > 1e-3
    assert all("kl" not in m for m, _ in runs[0.0])
    print(f"\npeak memory: beta 0 {peaks[0.0] * 1e3:.2f} MB, beta 0.1 {peaks[0.1] * 1e3:.2f} MB")
    # The reference pass (LoRA off) must not add its forward pass to the training step's
    # peak: ref_logp is needed, the reference logits are not.
    assert peaks[0.1] <= 1.10 * peaks[0.0], f"peak with beta > 0 is {peaks[0.1] / peaks[0.0] - 1:.0%} higher"


# ----------------------------------------------------------------------------------------
# 4. num_iterations (mu)
# ----------------------------------------------------------------------------------------


def test_second_update_on_a_batch_sees_a_ratio_off_one(lm):
    # Metrics are those of the last update of the step. With mu=1 it is the first update on
    # freshly sampled data: the ratio is exactly 1 (TRL's detached log-probs). With mu=2 the
    # ratio is against sampling's log-probs: with a zero learning rate the weights do not
    # move, so it is 1 up to float noise (sampling's log-probs match the loss's forward pass,
    # at step 2 with a trained LoRA too); the second update sees weights the first changed.
    single = [m for m, _ in run_steps(make_trainer(lm, learning_rate=0.1, num_iterations=1, iters=2), 2)]
    for m in single:
        assert m["mean_ratio"] == 1.0 and m["clip_ratio/region_mean"] == 0.0
    trained = make_trainer(lm, learning_rate=0.1, num_iterations=2, iters=2)
    state = TrainState()
    trained.step(state, lambda: False)
    trained.optimizer.learning_rate = 0.0
    frozen, _ = trained.step(state, lambda: False)
    assert abs(frozen["mean_ratio"] - 1.0) < 1e-3 and frozen["clip_ratio/region_mean"] == 0.0

    def second_update(**config):
        return run_steps(make_trainer(lm, learning_rate=0.1, num_iterations=2, iters=1, **config), 1)[0][0]

    double = second_update()
    assert abs(double["mean_ratio"] - 1.0) > 1e-3, double
    assert double["clip_ratio/low_mean"] > 0 and double["clip_ratio/high_mean"] > 0

    # The same second update (same samples, same first update) under other knobs that only
    # matter once the ratio is off 1: clip-higher and sequence-level ratios (GSPO).
    wide = second_update(epsilon_high=5.0)
    assert wide["clip_ratio/high_mean"] == 0.0 and wide["clip_ratio/low_mean"] == double["clip_ratio/low_mean"]
    sequence = second_update(importance_sampling_level="sequence")
    assert abs(sequence["mean_ratio"] - double["mean_ratio"]) > 1e-3


def test_first_update_is_on_policy_under_lora_dropout(lm):
    # mu = 1: the ratio is exactly 1 on every token although sampling runs without dropout
    # and the loss with it (TRL's detached current log-probs). With a zero clip range any
    # token whose ratio were off 1 on its advantage's side would count as clipped.
    for m, _ in run_steps(make_trainer(lm, lora_dropout=0.3, clip_ratio=0.0, epsilon_high=0.0, iters=2), 2):
        assert m["mean_ratio"] == 1.0
        assert m["clip_ratio/region_mean"] == 0.0


def test_resume_from_a_checkpoint_continues_exactly(lm):
    # The optimizer state now holds AdamW's step count for its bias correction: a job
    # resumed from the checkpoint of step 2 must take the same step 3 as one that never stopped.
    from worker.runtime import checkpoints

    config = dict(iters=3, lora_dropout=0.1, weight_decay=0.1, lr_scheduler="cosine", warmup_steps=1)
    straight = [m for m, _ in run_steps(make_trainer(lm, **config), 3)]
    first = make_trainer(lm, **config)
    state = TrainState()
    for _ in range(2):
        first.step(state, lambda: False)
    blobs = {k.encode(): v for k, v in checkpoints.to_blobs(checkpoints.snapshot(first.model, first.optimizer, state)).items()}
    resumed = make_trainer(lm, **config)
    state = checkpoints.restore(resumed.model, resumed.optimizer, blobs)
    assert state.step == 2 and resumed.optimizer.step.item() == 2
    third, _ = resumed.step(state, lambda: False)
    assert {k: v for k, v in third.items() if k not in TIMING} == {k: v for k, v in straight[2].items() if k not in TIMING}


VALIDATION = ["Spell a long word.", "Name three trees.", {"prompt": "Say yes.", "answer": "yes"}]


def test_evaluation_scores_the_validation_prompts_and_training_is_the_same_as_without_it(lm, monkeypatch):
    """Evaluations as the job loop runs them (before the first step and after every step here):
    eval_samples completions of every validation prompt, 2 prompts a decode (B*G = 8 rows), scored
    by the job's reward; the policy trained is the one trained without them, bit for bit (LoRA
    dropout on: the update draws random numbers too), and evaluations at the same weights agree."""
    config = dict(group_size=4, batch_size=2, iters=3, lora_dropout=0.1, eval_samples=3)

    def train(evaluate: bool):
        trainer = make_trainer(lm, reward=SHARE_OF_E, validation_prompts=VALIDATION, **config)
        scored = []
        score = trainer.scorer.score
        monkeypatch.setattr(trainer.scorer, "score", lambda step, items, completions, **kw: (
            scored.append((step, items, completions)), score(step, items, completions, **kw))[1])
        state, evals = TrainState(), []
        for _ in range(config["iters"]):
            if evaluate:
                evals.append(trainer.evaluate(state.step, lambda: False))
            trainer.step(state, lambda: False)
        if evaluate:
            evals += [trainer.evaluate(state.step, lambda: False) for _ in range(2)]
        weights = {k: np.array(v) for k, v in tree_flatten(trainer.model.trainable_parameters())}
        return weights, evals, [s for s in scored if s[1] == trainer.val_items]

    plain, _, none = train(False)
    weights, evals, scored = train(True)
    print("\nvalidation reward per evaluation: " + " ".join(f"{e['val_reward']:.4f}" for e in evals))
    assert none == [] and plain.keys() == weights.keys()
    assert all(np.array_equal(plain[k], weights[k]) for k in plain)
    assert [step for step, _, _ in scored] == [0, 1, 2, 3, 3]
    assert all([len(g) for g in completions] == [3, 3, 3] for _, _, completions in scored)
    assert [it.prompt for it in scored[0][1]] == ["Spell a long word.", "Name three trees.", "Say yes."]
    for e in evals:
        assert e.keys() == {"val_reward", "val_rewards/python/mean", "val_rewards/python/std"}
        assert e["val_reward"] == pytest.approx(e["val_rewards/python/mean"])
    assert evals[-1] == evals[-2]  # its own key: the same draws at the same weights
    assert scored[0][2] != scored[-1][2]  # ... and other completions once the policy changed


def test_reward_text_has_no_special_tokens(lm):
    _, tok = lm
    ids = tok.encode("hello") + [tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode(" world")
    ids += [tok.convert_tokens_to_ids("<|im_end|>")]
    assert "<|im_start|>" in tok.decode(ids)
    assert completion_text(tok, ids) == tok.decode(tok.encode("hello")) + tok.decode(tok.encode(" world"))


# ----------------------------------------------------------------------------------------
# 4b. Memory: micro-batches and gradient checkpointing change nothing but memory
# ----------------------------------------------------------------------------------------


def test_samples_event_texts_are_cut_to_fit_its_size_bound(lm, monkeypatch):
    """The per-step samples event lives in Redis: each completion is cut to SAMPLE_TEXT_CHARS, and
    to fewer when rows x SAMPLE_TEXT_CHARS would pass SAMPLES_EVENT_CHARS; rewards saw the whole text."""
    import worker.kinds.grpo as grpo

    seen = []
    trainer = make_trainer(lm, group_size=4, batch_size=2, max_completion_len=24, temperature=1.0)
    score = trainer.scorer.score
    monkeypatch.setattr(trainer.scorer, "score", lambda step, items, completions, **kw: (
        seen.extend(c for g in completions for c in g), score(step, items, completions, **kw))[1])
    monkeypatch.setattr(grpo, "SAMPLES_EVENT_CHARS", 8 * 5)  # 8 rows: 5 characters each
    _, samples = run_steps(trainer, 1)[0]
    assert max(len(t) for t in seen) > 5
    assert flat(samples) == [t[:5] for t in seen]


def test_gradient_checkpointing_is_planned_and_refuses_dropout(lm):
    from pydantic import ValidationError

    from shared.schemas import GRPOConfig

    assert GRPOConfig().use_gradient_checkpointing is None  # the memory plan decides
    assert GRPOConfig(lora_dropout=0.1).use_gradient_checkpointing is False  # recomputing would redraw the masks
    # Checkpointing where it buys a larger micro-batch: in a deep model with long rows, not in
    # the 2-layer tiny model (its recomputation would save nothing).
    from mlx_lm.models import qwen3

    from worker.runtime.memory_plan import plan_memory

    assert make_trainer(lm, group_size=16, batch_size=4, max_completion_len=256).memory.gradient_checkpointing is False
    deep = qwen3.Model(qwen3.ModelArgs.from_dict({**vars(lm[0].args), "num_hidden_layers": 16}))
    auto, plain = (plan_memory(deep, 64, 276, c, None, None) for c in (None, False))
    assert auto.gradient_checkpointing and auto.micro_batch_size > plain.micro_batch_size
    with pytest.raises(ValidationError, match="gradient_checkpointing needs lora_dropout = 0"):
        GRPOConfig(lora_dropout=0.1, gradient_checkpointing=True)


def memory_variant_results(lm, batch, loss_type, level, micro_batch_size, checkpointing):
    trainer = make_trainer(lm, loss_type=loss_type, importance_sampling_level=level, micro_batch_size=micro_batch_size,
                           gradient_checkpointing=checkpointing, num_iterations=2, beta=0.04, max_grad_norm=None,
                           group_size=4, batch_size=2)
    mx.random.seed(1)  # LoRA weights off zero, the same for every variant
    trainer.model.update(tree_map(lambda p: 0.05 * mx.random.normal(p.shape), trainer.model.trainable_parameters()))
    trainer.model.train()
    loss, stats, _, grads = trainer.loss_and_grads(batch, batch.old_logp + 0.1)
    assert trainer.memory.micro_batch_size == micro_batch_size
    return loss.item(), {k: v.item() for k, v in stats.items()}, {k: np.array(v) for k, v in tree_flatten(grads)}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_micro_batches_and_checkpointing_give_the_unbatched_loss_and_gradients(lm, loss_type, level):
    rng = np.random.default_rng(0)
    rows, P, L = 8, 5, 16
    inputs = rng.integers(3, 1000, (rows, P + L))
    lengths = np.array([16, 3, 0, 9, 12, 1, 16, 7])  # rows of every length, one fully masked
    batch = Batch(
        inputs=mx.array(inputs, dtype=mx.int32), left_pad=mx.array(rng.integers(0, 3, rows), dtype=mx.int32),
        completion=mx.array(inputs[:, P:], dtype=mx.int32), mask=mx.array(np.arange(L)[None] < lengths[:, None]),
        old_logp=mx.array(-rng.uniform(6.0, 8.0, (rows, L)).astype(np.float32)),
        advantages=mx.array(rng.normal(size=rows).astype(np.float32)),
    )
    loss0, stats0, grads0 = memory_variant_results(lm, batch, loss_type, level, rows, False)
    assert any(np.abs(g).max() > 0 for g in grads0.values())
    for micro_batch_size, checkpointing in ((2, False), (rows, True), (1, True)):
        loss, stats, grads = memory_variant_results(lm, batch, loss_type, level, micro_batch_size, checkpointing)
        assert loss == pytest.approx(loss0, rel=1e-5)
        assert stats == pytest.approx(stats0, rel=1e-5, abs=1e-7)
        for k, g in grads.items():
            assert np.abs(g - grads0[k]).max() <= 1e-5 * np.abs(grads0[k]).max(), (k, micro_batch_size, checkpointing)


def test_a_budget_that_fits_them_buys_dense_decode_weights_on_cuda(lm, monkeypatch):
    """On CUDA (worker/runtime/memory_plan.py cuda(), set here: a CPU never decodes dense) a quantized model's
    budget that fits dense copies of its weights beside the plan decodes with them (the
    trainer's decode step: worker/decode/graph_patches.py dequantized), from DENSE_DECODE_ROWS rows on;
    memory first, a small budget, few rows or an unquantized model do not."""
    from mlx_lm.models import qwen3

    from worker.runtime import memory_plan as memory

    monkeypatch.setattr(memory, "cuda", lambda: True)
    model = qwen3.Model(qwen3.ModelArgs.from_dict({**vars(lm[0].args), "num_hidden_layers": 4}))
    assert memory.plan_memory(model, 32, 160, None, None, 16.0).dense_decode_gb == 0  # not quantized
    nn.quantize(model, group_size=64, bits=4)
    dense = memory.dense_decode_bytes(model) / memory.GB
    s = memory.model_shape(model)
    assert dense == pytest.approx(s.act_bytes * (s.layers * s.hidden * (2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim
                                                                 + 3 * s.intermediate) + s.vocab * s.hidden) / memory.GB)
    spent = memory.plan_memory(model, 32, 160, None, None, 16.0)
    assert spent.dense_decode_gb == pytest.approx(dense) and "dense copies" in spent.reason
    assert spent.peak_gb == pytest.approx(spent.weights_gb + dense + max(spent.sampling_gb, spent.loss_gb))
    fewest = memory.DENSE_DECODE_ROWS
    assert memory.plan_memory(model, fewest, 160, None, None, 16.0).dense_decode_gb == pytest.approx(dense)
    assert memory.plan_memory(model, fewest - 1, 160, None, None, 16.0).dense_decode_gb == 0
    tight = memory.plan_memory(model, 32, 160, None, None, spent.peak_gb - dense / 2)
    assert tight.dense_decode_gb == 0 and "do not fit" in tight.reason


def test_on_cuda_a_job_without_a_budget_spends_the_gpus_free_memory_on_speed(lm, monkeypatch):
    """On CUDA (set here, as above; the device's memory set too) a job without max_memory_gb plans as
    one whose budget is CUDA_BUDGET_SHARE of the memory MLX holds for nothing but the job's model:
    the micro-batch, checkpointing and dense decode weights of that budget, the reason saying so.
    What another loaded model holds is not the job's; where that budget cannot fit even one row,
    the plan is memory first within all the device's memory, as on a Mac."""
    from mlx_lm.models import qwen3

    from worker.runtime import memory_plan as memory

    monkeypatch.setattr(memory, "cuda", lambda: True)
    monkeypatch.setattr(memory, "device_kind", lambda: "gpu")
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 20 * memory.GB)
    model = qwen3.Model(qwen3.ModelArgs.from_dict({**vars(lm[0].args), "num_hidden_layers": 16}))
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    budget = memory.cuda_budget_gb(model)
    other = mx.zeros((256, 1024, 1024), dtype=mx.uint8)  # another model's 0.27 GB
    mx.eval(other)
    assert memory.cuda_budget_gb(model) == pytest.approx(budget - memory.CUDA_BUDGET_SHARE * other.nbytes / memory.GB, abs=1e-3)
    del other

    default, spent = (memory.plan_memory(model, 64, 276, None, None, b) for b in (None, memory.cuda_budget_gb(model)))
    assert (default.micro_batch_size, default.gradient_checkpointing, default.dense_decode_gb, default.memory_limit_gb) == (
        spent.micro_batch_size, spent.gradient_checkpointing, spent.dense_decode_gb, spent.memory_limit_gb)
    assert default.budget and default.dense_decode_gb > 0 and not default.gradient_checkpointing
    assert "75% of the GPU's free memory" in default.reason and "no max_memory_gb" in default.reason
    with monkeypatch.context() as m:
        m.setattr(memory, "cuda", lambda: False)
        first = memory.plan_memory(model, 64, 276, None, None, None)
    assert "memory first" in first.reason and first.gradient_checkpointing and first.dense_decode_gb == 0
    assert default.micro_batch_size > first.micro_batch_size

    need = memory.plan_memory(model, 64, 276, None, 1, 20.0).peak_gb * memory.GB  # one row at a time
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 1.05 * need)  # 0.75 of it does not fit one row
    small = memory.plan_memory(model, 64, 276, None, None, None)
    assert not small.budget and "memory first" in small.reason and small.limit_gb * memory.GB == pytest.approx(1.05 * need)
    assert small.dense_decode_gb == 0


def test_a_memory_budget_is_spent_on_speed_with_the_same_loss_and_gradients(lm):
    """Without max_memory_gb the plan is memory-first (the loss step within sampling's memory);
    an explicit budget above its need buys a larger micro-batch, no checkpointing where it fits
    (a deep model with long rows), MLX's memory limit at the budget, and the plan says why. The
    loss and gradients stay those of the memory-first plan."""
    from mlx_lm.models import qwen3

    from worker.runtime.memory_plan import GB, plan_memory

    deep = qwen3.Model(qwen3.ModelArgs.from_dict({**vars(lm[0].args), "num_hidden_layers": 16}))
    first, spent = plan_memory(deep, 64, 276, None, None, None), plan_memory(deep, 64, 276, None, None, 16.0)
    assert first.gradient_checkpointing and not spent.gradient_checkpointing
    assert spent.micro_batch_size >= first.micro_batch_size and spent.peak_gb > first.peak_gb  # no recompute, on a CPU capped at 8192 tokens
    assert "memory first" in first.reason and "max_memory_gb 16 spent on speed" in spent.reason
    assert spent.as_record()["memory_limit_gb"] == 16.0 and first.as_record()["memory_limit_gb"] == round(first.peak_gb, 4)

    rng = np.random.default_rng(0)
    rows, P, L = 16, 5, 16
    inputs = rng.integers(3, 1000, (rows, P + L))
    batch = Batch(inputs=mx.array(inputs, dtype=mx.int32), left_pad=mx.zeros((rows,), dtype=mx.int32),
                  completion=mx.array(inputs[:, P:], dtype=mx.int32), mask=mx.array(np.arange(L)[None] < rng.integers(1, L + 1, (rows, 1))),
                  old_logp=mx.array(-rng.uniform(6.0, 8.0, (rows, L)).astype(np.float32)),
                  advantages=mx.array(rng.normal(size=rows).astype(np.float32)))
    results = []
    for budget in (None, 4.0):  # 16 rows of 128-token completions: memory first takes 4 rows at a time
        trainer = make_trainer(lm, group_size=8, batch_size=2, max_completion_len=128, max_memory_gb=budget,
                               num_iterations=2, max_grad_norm=None)
        assert mx.get_memory_limit() == int(trainer.memory.memory_limit_gb * GB)
        mx.random.seed(1)
        trainer.model.update(tree_map(lambda p: 0.05 * mx.random.normal(p.shape), trainer.model.trainable_parameters()))
        loss, _, _, grads = trainer.loss_and_grads(batch, batch.old_logp + 0.1)
        results.append((trainer.memory, loss.item(), {k: np.array(v) for k, v in tree_flatten(grads)}))
    (plan0, loss0, grads0), (plan1, loss1, grads1) = results
    assert plan0.micro_batch_size == 4 and plan1.micro_batch_size == 16 and plan1.memory_limit_gb == pytest.approx(4.0)
    assert loss1 == pytest.approx(loss0, rel=1e-5)
    for k, g in grads1.items():
        assert np.abs(g - grads0[k]).max() <= 1e-5 * np.abs(grads0[k]).max(), k


# ----------------------------------------------------------------------------------------
# 5. Chat messages and prompt items with extra fields
# ----------------------------------------------------------------------------------------

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


def test_text_prompts_are_raw_text_unless_asked_and_chat_messages_use_the_template(lm):
    _, tok = lm
    assert tok.chat_template
    assistant = tok.encode("<|im_start|>assistant\n")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert assistant[0] == im_start and len(assistant) >= 2

    text = PromptItem(prompt="Say hello.")
    assert prompt_token_ids(tok, text, use_chat_template=False) == tok.encode("Say hello.")  # the seed server's encoding
    assert JobCreate(model_id="tiny", prompts=["x"]).config.use_chat_template is False  # ...and the default
    templated = prompt_token_ids(tok, text, use_chat_template=True)
    assert templated[-len(assistant):] == assistant and im_start in templated[:1]  # the generation prompt

    # Chat messages have no text of their own: they always go through the template.
    for flag in (True, False):
        assert tok.decode(prompt_token_ids(tok, PromptItem(prompt=CHAT), flag)) == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
        )


def test_chat_prompts_and_items_with_fields_train(lm):
    import reward_fns

    prompts = [
        "Plain text.",
        CHAT,
        {"prompt": "What letter?", "answer": "x"},
        {"prompt": [{"role": "user", "content": "Pick a letter."}], "answer": "e"},
    ]
    reward = [{"type": "python", "function": "reward_fns:echo_inputs"},
              {"type": "contains", "field": "answer", "case_sensitive": False}]
    reward_fns.echo_inputs.calls.clear()
    # batch_size = all four prompts, so one step sees every kind.
    trainer = make_trainer(lm, prompts=prompts, reward=reward, batch_size=4, group_size=2, iters=1)
    chat_ids = trainer.prompt_ids[1]
    assert chat_ids[-len(lm[1].encode("<|im_start|>assistant\n")):] == lm[1].encode("<|im_start|>assistant\n")
    (metrics, samples), = run_steps(trainer, 1)

    assert math.isfinite(metrics["loss"])
    assert sorted(samples["prompt_indices"]) == [0, 1, 2, 3]
    call, = reward_fns.echo_inputs.calls
    by_prompt = {str(p): a for p, a in zip(call["prompts"], call["answer"])}
    assert by_prompt == {
        "Plain text.": None,
        str(CHAT): None,
        "What letter?": "x",
        str([{"role": "user", "content": "Pick a letter."}]): "e",
    }
    assert len(call["completions"]) == 8 and call["completions"] == flat(samples)
    assert "rewards/contains/mean" in metrics  # the items with an answer were scored


# ----------------------------------------------------------------------------------------
# 6. Stop strings
# ----------------------------------------------------------------------------------------


def test_stop_strings_cut_completions_before_them(lm):
    # 'e' is the tiny model's most frequent character. Step 1 samples the same tokens with
    # or without stop strings (same seed, LoRA still zero), so each completion with the stop
    # string must be the one without, cut just before the stop string's first occurrence.
    config = dict(iters=1, max_completion_len=16, learning_rate=0.0)
    (m_free, s_free), = run_steps(make_trainer(lm, **config), 1)
    (m_stop, s_stop), = run_steps(make_trainer(lm, stop=["e", "zzz-never"], **config), 1)

    free, stopped = flat(s_free), flat(s_stop)
    cut = [t[: t.index("e")] if "e" in t else t for t in free]
    assert stopped == cut
    assert sum("e" in t for t in free) >= len(free) // 2  # the stop string was actually hit
    assert not any("e" in t for t in stopped)
    # Token counts and 'ended' follow the cut: stopped rows are not truncated ones.
    assert m_stop["completions/mean_length"] < m_free["completions/mean_length"]
    assert m_stop["completions/clipped_ratio"] < m_free["completions/clipped_ratio"]


def test_stop_strings_keep_eos_text_out_of_completions(lm):
    # Seed 12: two of the 16 completions end with EOS (<|im_end|>) at step 1. Without stop
    # strings the EOS token is not part of the text; with a stop string that never occurs
    # the text must be the same.
    config = dict(iters=1, max_completion_len=16, learning_rate=0.0, seed=12)
    (m_free, s_free), = run_steps(make_trainer(lm, **config), 1)
    (m_stop, s_stop), = run_steps(make_trainer(lm, stop=["zzz-never"], **config), 1)
    assert m_free["completions/clipped_ratio"] < 1  # some rows did end with EOS
    assert not any("<|im_end|>" in t for t in flat(s_free))
    assert flat(s_stop) == flat(s_free)


# ----------------------------------------------------------------------------------------
# 7. The other knobs: each runs, and does what it says where a step can show it
# ----------------------------------------------------------------------------------------

SMOKE = dict(iters=2, group_size=4, batch_size=2, max_completion_len=8, learning_rate=1e-2)
KNOBS = [
    {"loss_type": "grpo"}, {"loss_type": "bnpo"}, {"loss_type": "dr_grpo"}, {"loss_type": "dapo"},
    {"importance_sampling_level": "sequence"},
    {"scale_rewards": "batch"}, {"scale_rewards": "none"},
    {"mask_truncated_completions": True},
    {"lr_scheduler": "cosine", "warmup_steps": 1}, {"lr_scheduler": "linear"},
    {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.05},
    {"temperature": 0.0}, {"top_k": 1}, {"top_p": 1e-4}, {"min_p": 0.99},
    {"epsilon_high": 0.28}, {"max_grad_norm": None}, {"weight_decay": 0.1}, {"lora_dropout": 0.1},
    {"num_iterations": 2, "beta": 0.04, "importance_sampling_level": "sequence", "loss_type": "grpo"},
]
GREEDY = ({"temperature": 0.0}, {"top_k": 1}, {"top_p": 1e-4}, {"min_p": 0.99})  # leave one token


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_knob_runs_with_finite_loss(lm, knob):
    steps = run_steps(make_trainer(lm, **dict(SMOKE, **knob)), SMOKE["iters"])
    for m, s in steps:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert m["n_samples"] == SMOKE["group_size"] * SMOKE["batch_size"]
    m, s = steps[0]
    if knob in GREEDY:  # one token to choose from: a group's completions are all the same
        assert all(len(set(group)) == 1 for group in s["completions"])
        assert m["frac_reward_zero_std"] == 1.0
    elif knob.get("temperature", 1.0) > 0:
        assert all(len(set(group)) > 1 for group in s["completions"])
    if knob == {"mask_truncated_completions": True} and m["completions/clipped_ratio"] == 1.0:
        # Every completion was cut at max_completion_len: nothing is left to learn from.
        assert m["loss"] == 0.0 and m["grad_norm"] == 0.0


def test_without_masking_truncated_completions_there_is_a_gradient(lm):
    # The control for the mask_truncated_completions case above.
    m, _ = run_steps(make_trainer(lm, **SMOKE), 1)[0]
    assert m["completions/clipped_ratio"] == 1.0 and m["grad_norm"] > 0


def test_loss_types_normalise_the_same_batch_differently(lm):
    # Step 1 samples the same batch whatever the loss type, and pi_theta == pi_old, so
    # per-token loss = -A_i. With stop strings the rows have different lengths n_i and
    # (length reward) A correlates with n:  dapo = bnpo = -sum A n / sum n,
    # dr_grpo = -sum A n / (rows * max_completion_len), grpo = mean_i(-A_i) = 0.
    config = dict(iters=1, max_completion_len=16, stop=["e"], learning_rate=0.0)
    loss, mean_length = {}, {}
    for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
        m, _ = run_steps(make_trainer(lm, loss_type=loss_type, **config), 1)[0]
        loss[loss_type], mean_length[loss_type] = m["loss"], m["completions/mean_length"]
    assert len(set(mean_length.values())) == 1
    assert abs(loss["dapo"]) > 1e-2
    assert loss["grpo"] == pytest.approx(0.0, abs=1e-5)
    assert loss["bnpo"] == pytest.approx(loss["dapo"], rel=1e-4)
    assert loss["dr_grpo"] == pytest.approx(loss["dapo"] * mean_length["dapo"] / 16, rel=1e-3)

    # scale_rewards changes the advantages' scale, hence the loss.
    none, _ = run_steps(make_trainer(lm, loss_type="dapo", scale_rewards="none", **config), 1)[0]
    assert abs(none["loss"]) > 2 * abs(loss["dapo"])  # rewards are lengths in characters: std >> 1


def test_learning_rate_follows_warmup_then_cosine(lm):
    lr, iters, warmup = 1e-2, 5, 2
    trainer = make_trainer(lm, **dict(SMOKE, iters=iters, learning_rate=lr, lr_scheduler="cosine", warmup_steps=warmup))
    got = [m["learning_rate"] for m, _ in run_steps(trainer, iters)]
    # The learning rate each update used (0-based update s), as Hugging Face's
    # get_cosine_schedule_with_warmup computes it: linear from 0, then half a cosine to 0.
    expected = [lr * s / warmup if s < warmup else lr * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (iters - warmup)))
                for s in range(iters)]
    assert got == pytest.approx(expected, abs=1e-7)
    assert expected == pytest.approx([0.0, 0.005, 0.01, 0.0075, 0.0025])


# ----------------------------------------------------------------------------------------
# 9. Cancelling while sampling
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop_at_call", [1, 2])
def test_cancel_during_sampling_raises_cancelled(lm, stop_at_call):
    # max_completion_len 64 = four chunks of sampling, so should_stop is asked several times
    # while sampling; the step gives up at the first True, before scoring or updating.
    import reward_fns

    trainer = make_trainer(lm, max_completion_len=64, reward=[{"type": "python", "function": "reward_fns:echo_inputs"}])
    reward_fns.echo_inputs.calls.clear()
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) >= stop_at_call

    state = TrainState()
    before = {k: np.array(v) for k, v in tree_flatten(trainer.model.trainable_parameters())}
    with pytest.raises(Cancelled):
        trainer.step(state, should_stop)
    assert len(calls) == stop_at_call
    assert state.step == 0 and state.num_tokens == 0
    assert reward_fns.echo_inputs.calls == []  # never got to scoring
    after = dict(tree_flatten(trainer.model.trainable_parameters()))
    assert all(np.array_equal(before[k], np.array(after[k])) for k in before)  # no update

    # The same trainer still runs a step when not asked to stop.
    metrics, _ = trainer.step(state, lambda: False)
    assert state.step == 1 and math.isfinite(metrics["loss"])


# ----------------------------------------------------------------------------------------
# 8. End to end: the model stays loaded between jobs on one worker (the module's, new here)
# ----------------------------------------------------------------------------------------

JOBS = "/admin/api/fine-tune/grpo/jobs"


def test_second_job_on_a_worker_reuses_the_loaded_model(stack, worker):
    from conftest import read_events

    body = {"model_id": stack.tiny_model.name, "prompts": ["What is 2+2?", "Say hello."],
            "config": {"iters": 1, "group_size": 2, "batch_size": 1, "max_completion_len": 8,
                       "lora_layers": 2, "lora_rank": 4}}
    ready = []
    for name, budget in (("first", None), ("second", 4.0)):
        with stack.client() as c:
            created = c.post(JOBS, json=dict(body, adapter_name=f"cache-{name}",
                                             config={**body["config"], "max_memory_gb": budget}))
            assert created.status_code == 200, created.text
            job_id = created.json()["job_id"]
        job = stack.wait_job(job_id)
        assert job["status"] == "completed", job["error"]
        plan = job["memory_plan"]  # the plan the worker chose, and why
        assert plan["micro_batch_size"] == 2 and plan["budget"] == (budget is not None), plan
        assert ("spent on speed" if budget else "memory first") in plan["reason"]
        assert plan["memory_limit_gb"] == (4.0 if budget else plan["estimated_peak_gb"])
        events = [e for _, e in read_events(stack.redis, job_id)]
        ready += [e for e in events if e["type"] == "model_ready"]
        samples = [e for e in events if e["type"] == "samples"]
        assert len(samples) == 1 and samples[0]["iter"] == 0
        assert len(samples[0]["completions"]) == 1 and len(samples[0]["completions"][0]) == 2
    assert [e["cached"] for e in ready] == [False, True]
    assert ready[1]["load_s"] < ready[0]["load_s"]


def test_a_job_with_validation_prompts_has_a_validation_reward_curve_and_bounds_them(stack, worker):
    """eval events (iter: completed steps) before the first step, after it, every eval_interval
    and after the last, with the job's reward per source; its step events carry them too, and the
    kind's reward chart draws val_reward. Out-of-bounds validation input is a 400."""
    from conftest import read_events

    body = {"model_id": stack.tiny_model.name, "prompts": ["What is 2+2?", "Say hello."],
            "validation_prompts": ["Name a tree.", {"prompt": "Say yes.", "answer": "yes"}],
            "config": {"iters": 4, "group_size": 2, "batch_size": 1, "max_completion_len": 8, "lora_layers": 2,
                       "lora_rank": 4, "eval_interval": 3, "eval_samples": 2}}
    with stack.client() as c:
        refused = {
            "too many": {**body, "validation_prompts": ["x"] * 1025},
            "empty": {**body, "validation_prompts": [" "]},
            "too long": {**body, "validation_prompts": ["x" * 40_000]},
            "eval_samples": {**body, "config": {**body["config"], "eval_samples": 65}},
            "eval_interval": {**body, "config": {**body["config"], "eval_interval": 0}},
            "multi-turn": {**body, "tools": [{"function": "examples.agentic.lookup_tools:lookup"}],
                           "config": {**body["config"], "max_turns": 2}},
        }
        for why, bad in refused.items():
            res = c.post(JOBS, json=bad)
            assert res.status_code == 400, (why, res.text)
            assert "validation_prompts" in res.text or "eval_" in res.text, (why, res.text)
        res = c.post(JOBS, json={**body, "validation_prompts": ["ok", 3]})
        assert res.json()["detail"] == "validation_prompts[1] must be a string, a list of chat messages or an item {prompt, ...}"
        created = c.post(JOBS, json=body)
        assert created.status_code == 200, created.text
        job_id = created.json()["job_id"]
        assert created.json()["validation_prompts"] == body["validation_prompts"]
        charts = {k["name"]: k for k in c.get("/admin/api/kinds").json()}["grpo"]["charts"]
        assert {"title": "reward", "metrics": ["reward", "val_reward"]} in charts
    job = stack.wait_job(job_id)
    assert job["status"] == "completed", job["error"]
    events = [e for _, e in read_events(stack.redis, job_id, count=1000)]
    evals = [e for e in events if e["type"] == "eval"]
    assert [e["iter"] for e in evals] == [0, 1, 3, 4]
    for e in evals:
        assert e["val_reward"] == pytest.approx(e["val_rewards/length/mean"]) and e["val_reward"] > 0
    steps = [e for e in events if e["type"] == "grpo_step"]
    assert [e.get("val_reward") for e in steps] == [evals[1]["val_reward"], None, evals[2]["val_reward"],
                                                    evals[3]["val_reward"]]
    assert job["progress"]["val_reward"] == evals[-1]["val_reward"]


def test_job_that_cannot_fit_one_row_fails_at_start_with_the_estimate(stack, worker):
    body = {"model_id": stack.tiny_model.name, "prompts": ["Say hello."],
            "config": {"iters": 1, "group_size": 2, "batch_size": 1, "max_completion_len": 8, "max_memory_gb": 1e-4}}
    with stack.client() as c:
        created = c.post(JOBS, json=body)
        assert created.status_code == 200, created.text
    job = stack.wait_job(created.json()["job_id"])
    assert job["status"] == "failed"
    assert job["error"].startswith("this job needs about ") and "max_memory_gb is 0.00" in job["error"]
    assert "Traceback" not in job["error"] and job["progress"].get("iter", 0) == 0


def test_the_step_phases_benchmark_runs_each_asked_configuration(tiny_model):
    """bench/step_phases.py (docs/performance.md's sampling figures and loss-phase table) times sampling under
    the plan's limit and without one, and the loss under the memory choices it is given, not the
    plan's: each line reports the limit, micro-batch, checkpointing and logits chunk it was asked for."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    out = subprocess.run(
        [sys.executable, "bench/step_phases.py", str(tiny_model), "2,2,16", "--reps", "2", "--sampling",
         "--configs", "plan", "ckpt:2:16", "full:4:64@none", "ckpt:1:8@0.5"],
        cwd=ROOT, env={**os.environ, "MTQ_OPENBLAS": "0"}, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(line["phase"], line["limit"]) for line in lines[:2]] == [("sampling", "plan"), ("sampling", "none")]
    asked = [(line["config"], line["micro_batch_size"], line["gradient_checkpointing"], line["logits_chunk_tokens"], line["limit"])
             for line in lines[3:]]
    assert asked == [("ckpt:2:16", 2, True, 16, "plan"), ("full:4:64@none", 4, False, 64, "none"), ("ckpt:1:8@0.5", 1, True, 8, "0.5")]
    assert lines[2]["config"] == "plan" and all(len(line["seconds"]) == 2 and line["peak_memory_gb"] > 0 for line in lines)


def test_a_failure_while_a_compiled_function_traces_breaks_no_later_job(tiny_model, tmp_path):
    """An exception while mx.compile traces a function that captures the model's weights leaves
    placeholders in their place (every later use fails); the training process forgets its kept
    models after a failed job (worker/runtime/training_process.py), and the next get_model loads
    a working one."""
    import dataclasses

    from shared.settings import load_settings
    from worker.runtime import models

    settings = dataclasses.replace(load_settings(), models_dir=tiny_model.parent)
    model, _, _ = models.get_model(tiny_model.name, settings)

    def failing(tokens):
        model(tokens)
        raise TypeError("a bug found while tracing")

    with pytest.raises(TypeError):
        mx.compile(failing, inputs=[model.state], outputs=[model.state])(mx.array([[1, 2]]))
    with pytest.raises(RuntimeError, match="without a primitive"):
        mx.eval(model(mx.array([[1, 2]])))
    models.forget_loaded()
    fresh, _, cached = models.get_model(tiny_model.name, settings)
    assert not cached and fresh is not model
    mx.eval(fresh(mx.array([[1, 2]])))
