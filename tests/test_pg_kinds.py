"""RLOO and REINFORCE with a KL penalty (worker/kinds/rloo.py, worker/kinds/reinforce.py): their
math against NumPy written from TRL's RLOOTrainer and mlx-lm-lora's rlhf_reinforce formulas, then
jobs of both kinds through the real stack (HTTP, Redis, a worker and its training process, the
tiny model): each learns against an lr-0 control, each resumes after kill -9 of its
worker with every step once, and a REINFORCE job starts from the RLOO job's adapter.

The learning jobs sample at temperature 0.1 (the tiny model's bounded logits: tests/test_trainer.py)
and so their log-probs, and the summed log-ratio to the base model, are 10x those at temperature 1:
beta 0.002 makes the KL penalty about as large as the reward's spread once the policy moves.
Measured (seed 0, 12 steps, lr 1e-2): RLOO reward 0.11 -> 0.33 from the 4th step on, REINFORCE
0.11 -> 0.32 from the 7th; lr 0: 0.11 0.06 0.09 0.10 0.08 0.13 0.08 0.10 0.06 0.06 0.10 0.03.
"""


import mlx.core as mx
import numpy as np
import pytest
from conftest import Stack, kill_when, read_events, running, wait_done
from pydantic import ValidationError

from shared.reinforce_specs import ReinforceJobCreate, RLOOJobCreate
from worker.kinds.reinforce import reinforce_advantages, reinforce_loss
from worker.kinds.rloo import rloo_advantages, rloo_loss, sequence_kl

RLOO, REINFORCE = "/admin/api/fine-tune/rloo/jobs", "/admin/api/fine-tune/reinforce/jobs"
PROMPTS = ["What is 2+2?", "Say hello.", "Count to five.", "Name a color.", "Write a word.", "Tell me a story."]
SHARE_OF_E = [{"type": "python", "function": "tests.reward_fns:share_of_e"}]
LEARN = dict(group_size=8, batch_size=2, iters=12, learning_rate=1e-2, lora_layers=-1, lora_rank=8, lora_alpha=2.0,
             max_completion_len=16, temperature=0.1, seed=0, use_chat_template=True, beta=0.002)


# --------------------------------------------------------------------------- the math, against NumPy


def rloo_reference(rewards: np.ndarray, normalize: bool) -> np.ndarray:
    """TRL's leave-one-out advantages, one completion at a time."""
    out = np.full(rewards.shape, np.nan)
    for b, group in enumerate(rewards):
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i and not np.isnan(x)]
            if not np.isnan(r) and others:
                out[b, i] = r - np.mean(others)
    if normalize:
        valid = out[~np.isnan(out)]
        out = (out - valid.mean()) / (valid.std(ddof=1) + 1e-4)
    return np.nan_to_num(out)


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages_are_trls_leave_one_out(normalize):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(4, 5))
    rewards[0, 1] = rewards[2, :4] = np.nan  # unscorable; group 2 has one scorable completion
    got = rloo_advantages(rewards, normalize)
    np.testing.assert_allclose(got, rloo_reference(rewards, normalize), rtol=1e-5, atol=1e-6)
    assert got[2].tolist() == [0.0] * 5 and got[0, 1] == 0.0
    if not normalize:  # a fully scorable group's advantages sum to 0
        np.testing.assert_allclose(got[[1, 3]].sum(axis=1), 0.0, atol=1e-5)


def test_sequence_kl_sums_the_first_order_log_ratio_over_completion_tokens():
    rng = np.random.default_rng(1)
    old, ref = rng.normal(size=(3, 6)), rng.normal(size=(3, 6))
    mask = np.arange(6)[None, :] < np.array([[6], [2], [0]])
    expected = [sum(old[i, t] - ref[i, t] for t in range(6) if mask[i, t]) for i in range(3)]
    np.testing.assert_allclose(sequence_kl(old, ref, mask), expected, rtol=1e-6)


def test_rloo_loss_clips_the_sequence_ratio():
    rng = np.random.default_rng(2)
    rows, T, eps_low, eps_high = 16, 5, 0.2, 0.28
    logp, old, ref = (rng.normal(scale=0.3, size=(rows, T)) - 1 for _ in range(3))
    mask = np.arange(T)[None, :] < rng.integers(1, T + 1, size=(rows, 1))
    A = rng.normal(size=rows)
    ratio = np.exp(((logp - old) * mask).sum(1))
    expected = np.mean(-np.minimum(ratio * A, np.clip(ratio, 1 - eps_low, 1 + eps_high) * A))
    low, high = (ratio < 1 - eps_low) & (A < 0), (ratio > 1 + eps_high) & (A > 0)
    assert low.any() and high.any()  # the draw exercises both sides
    loss, stats = rloo_loss(*(mx.array(x, dtype=mx.float32) for x in (logp, old, ref, A, mask)),
                            epsilon_low=eps_low, epsilon_high=eps_high)
    np.testing.assert_allclose(loss.item(), expected, rtol=1e-5)
    np.testing.assert_allclose(stats["clip_ratio/low_mean"].item(), low.mean(), rtol=1e-6)
    np.testing.assert_allclose(stats["clip_ratio/high_mean"].item(), high.mean(), rtol=1e-6)
    np.testing.assert_allclose(stats["clip_ratio/region_mean"].item(), (low | high).mean(), rtol=1e-6)
    np.testing.assert_allclose(stats["kl"].item(), ((old - ref) * mask).sum() / mask.sum(), rtol=1e-5)


def test_reinforce_advantage_and_loss_are_reward_minus_kl_times_the_log_likelihood():
    rng = np.random.default_rng(3)
    rows, T, beta = 5, 4, 0.1
    logp, ref = rng.normal(size=(rows, T)) - 1, rng.normal(size=(rows, T)) - 1
    mask = np.arange(T)[None, :] < rng.integers(1, T + 1, size=(rows, 1))
    rewards = rng.normal(size=rows)
    rewards[1] = np.nan
    kl = ((logp - ref) * mask).sum(1)
    A = reinforce_advantages(rewards, kl, beta)
    np.testing.assert_allclose(A, np.where(np.isnan(rewards), 0.0, rewards - beta * kl), rtol=1e-6)

    def loss_of(lp):
        return reinforce_loss(lp, mx.array(ref, dtype=mx.float32), mx.array(A), mx.array(mask))[0]

    lp = mx.array(logp, dtype=mx.float32)
    np.testing.assert_allclose(loss_of(lp).item(), -(A * (logp * mask).sum(1)).sum() / mask.sum(), rtol=1e-5)
    # The gradient is REINFORCE's: -A_i for each completion token, over the step's tokens (kl_i a constant).
    np.testing.assert_allclose(np.array(mx.grad(loss_of)(lp)), -A[:, None] * mask / mask.sum(), rtol=1e-5)


def test_specs_refuse_what_their_loss_does_not_use():
    base = {"model_id": "tiny", "prompts": ["a"]}
    assert RLOOJobCreate(**base).config.beta == 0.05 and ReinforceJobCreate(**base).config.beta == 0.1
    for spec, config, words in ((RLOOJobCreate, {"loss_type": "grpo"}, "loss_type: GRPO's, not used by RLOO"),
                                (RLOOJobCreate, {"group_size": 1}, "greater than or equal to 2"),
                                (ReinforceJobCreate, {"clip_ratio": 0.3}, "clip_ratio: GRPO's, not used by REINFORCE"),
                                (ReinforceJobCreate, {"num_iterations": 2}, "less than or equal to 1")):
        with pytest.raises(ValidationError, match=words):
            spec(**base, config=config)


# --------------------------------------------------------------------------- jobs on the real stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """The stack and its worker, with a short lease (for kill -9)."""
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    s.env.update(MTQ_LEASE_TTL="3")
    for started in running(s):
        s.worker = s.start_worker()
        yield started


def step_events(stack, job_id: str, kind: str) -> list[dict]:
    return [e for _, e in read_events(stack.redis, job_id, count=100_000) if e["type"] == f"{kind}_step"]


def run(stack, client, path: str, kind: str, **config) -> tuple[dict, np.ndarray, list[dict]]:
    res = client.post(path, json={"model_id": "tiny", "prompts": PROMPTS, "reward": SHARE_OF_E,
                                  "config": {**LEARN, **config}})
    assert res.status_code == 200, res.text
    job = wait_done(stack, path, res.json()["job_id"], timeout=240)
    steps = step_events(stack, job["job_id"], kind)
    return job, np.array([e["reward"] for e in steps]), steps


@pytest.mark.parametrize("path,kind", [(RLOO, "rloo"), (REINFORCE, "reinforce")])
def test_learns_against_an_lr_0_control(stack, client, path, kind):
    job, learned, steps = run(stack, client, path, kind)
    _, frozen, _ = run(stack, client, path, kind, learning_rate=0.0)
    print(f"\n{kind} reward: " + " ".join(f"{r:.2f}" for r in learned) + "\nlr 0: " + " ".join(f"{r:.2f}" for r in frozen))
    assert job["kind"] == kind and job["config"]["beta"] == LEARN["beta"]
    assert [e["iter"] for e in steps] == list(range(LEARN["iters"]))
    assert learned[-4:].mean() > learned[:4].mean() + 0.1
    assert learned[-4:].mean() > frozen[-4:].mean() + 0.1
    assert abs(frozen[-4:].mean() - frozen[:4].mean()) < 0.05  # noise only
    assert steps[-1]["kl"] > 0 and steps[0]["kl"] == pytest.approx(0, abs=1e-3)  # LoRA B = 0: the base model at first
    assert {"entropy", "completions/mean_length", "clip_ratio/region_mean" if kind == "rloo" else "grad_norm"} <= set(steps[0])


def killed_and_resumed(stack, client, path: str, job_id: str, iters: int, checkpoint: int) -> dict:
    """kill -9 of the worker once the job has a checkpoint at `checkpoint` or later, a new worker,
    the job completed: each of its steps once in its history."""
    kill_when(lambda: (client.get(f"{path}/{job_id}").json()["checkpoint_step"] or 0) >= checkpoint, stack.worker.pid,
              "a checkpoint", group=True)
    stack.worker.wait(10)
    stack.worker = stack.start_worker()
    done = wait_done(stack, path, job_id, timeout=240)
    assert done["progress"]["iter"] == iters and done["failed_attempts"] == 1 and done["resumed_from"] >= checkpoint
    history = client.get(f"{path}/{job_id}/history").json()["history"]
    assert [h["step"] for h in history] == list(range(1, iters + 1))  # every step once
    return {**done, "history": history}


def test_each_resumes_after_kill_9_with_every_step_once_and_reinforce_starts_from_an_adapter(stack, client):
    res = client.post(RLOO, json={"model_id": "tiny", "prompts": PROMPTS, "reward": SHARE_OF_E,
                                  "config": {**LEARN, "iters": 24, "checkpoint_every": 4}})
    assert res.status_code == 200, res.text
    job_id = res.json()["job_id"]
    history = killed_and_resumed(stack, client, RLOO, job_id, 24, 8)["history"]
    trained = np.mean([h["reward"] for h in history[-4:]])

    # Its adapter as a REINFORCE job's start (lr 0: the policy stays the trained one), killed too.
    res = client.post(REINFORCE, json={"model_id": "tiny", "prompts": PROMPTS, "reward": SHARE_OF_E,
                                       "init_adapter": {"job_id": job_id},
                                       "config": {**LEARN, "iters": 12, "checkpoint_every": 4, "learning_rate": 0.0}})
    assert res.status_code == 200, res.text
    started = killed_and_resumed(stack, client, REINFORCE, res.json()["job_id"], 12, 4)
    assert started["init_adapter"]["job_id"] == job_id
    first = step_events(stack, started["job_id"], "reinforce")[0]
    assert first["reward"] > 0.2 and trained > 0.2  # the lr-0 policy of a fresh LoRA: about 0.1
    assert first["kl"] > 0  # the reference is the base model, not the adapter it started from


def test_a_grpo_knob_is_a_clear_400(stack, client):
    res = client.post(RLOO, json={"model_id": "tiny", "prompts": PROMPTS, "config": {"scale_rewards": "batch"}})
    assert res.status_code == 400 and "scale_rewards: GRPO's, not used by RLOO" in res.json()["detail"]
