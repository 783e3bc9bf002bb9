"""Online DPO and XPO (worker/kinds/online_dpo.py): their loss against NumPy written from TRL's
OnlineDPOTrainer / XPOTrainer, then jobs through the real stack (HTTP, Redis, a worker process,
the tiny model): learning against a zero-learning-rate control, judged by a reward model of this
project (its owner's only) and by a reward endpoint, resuming after kill -9.

The tiny model's logits are bounded (tests/test_trainer.py), so the learning jobs sample at
temperature 0.1, where a small change of the logits changes what is sampled; their judge is the
share of the letter 'e' (tests/reward_fns.py)."""


import mlx.core as mx
import numpy as np
import pytest
from conftest import REWARD_PORT, TOKEN, Stack, kill_when, read_events, running, wait_done
from reward_server import serving

from shared.kinds import KINDS
from worker.kinds.online_dpo import judge_pairs, pair_loss
from worker.runtime.logprobs import sequence_logps

ONLINE, XPO = KINDS["online_dpo"].prefix, KINDS["xpo"].prefix
REWARD = "/admin/api/fine-tune/reward/jobs"
ALICE, BOB = "alice-token-online-0123456789", "bob-token-online-0123456789"
PROMPTS = ["What is 2+2?", "Say hello.", "Count to five.", "Name a color."]
SHARE_OF_E = [{"type": "python", "function": "tests.reward_fns:share_of_e"}]
SMALL = dict(batch_size=2, iters=2, lora_layers=-1, max_completion_len=8)
LEARN = dict(lora_layers=-1, max_completion_len=16, temperature=0.1, learning_rate=5e-2, seed=0)

# --------------------------------------------------------------------------- the math against NumPy

rng = np.random.default_rng(0)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=np.float64)  # 3 pairs, 4 positions


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def trl_loss(pa, pb, ra, rb, a_chosen, beta, loss_type, alpha=None):
    """TRL's, per token log-probs (N, T) masked: OnlineDPOTrainer.training_step (chosen/rejected
    index arithmetic) and, with alpha, XPOTrainer._compute_losses (b: the reference's sample)."""
    n = len(a_chosen)
    logprobs, ref = np.concatenate([pa, pb]), np.concatenate([ra, rb])  # first half a, second b
    mask = np.concatenate([MASK, MASK])
    chosen_idx = np.arange(n) + (~a_chosen) * n
    rejected_idx = np.arange(n) + a_chosen * n
    s, r = (logprobs * mask).sum(1), (ref * mask).sum(1)
    logits = (s[chosen_idx] - s[rejected_idx]) - (r[chosen_idx] - r[rejected_idx])
    losses = -log_sigmoid(beta * logits) if loss_type == "sigmoid" else (logits - 1 / (2 * beta)) ** 2
    if alpha is not None:
        losses = losses + alpha * (pb * MASK).sum(1)
    margins = beta * logits
    return losses.mean(), {"rewards/margins": margins.mean(), "rewards/accuracies": (margins > 0).mean(),
                           "rewards/chosen": beta * (s[chosen_idx] - r[chosen_idx]).mean(),
                           "objective/kl": (s - r).mean(), "objective/entropy": -s.mean()}


@pytest.mark.parametrize("loss_type,alpha", [("sigmoid", None), ("ipo", None), ("sigmoid", 0.3), ("ipo", 0.05)])
def test_pair_loss_is_trls_with_its_gradient(loss_type, alpha):
    pa, pb, ra, rb = (-rng.uniform(0.05, 3.0, size=MASK.shape) for _ in range(4))
    a_chosen = np.array([True, False, True])
    beta = 0.2

    def ours(pa_, pb_):
        seq = [sequence_logps(mx.array(x, dtype=mx.float32), mx.array(MASK, dtype=mx.float32)) for x in (pa_, pb_, ra, rb)]
        return pair_loss(*seq, mx.array(a_chosen), beta=beta, loss_type=loss_type, alpha=alpha)

    loss, stats = ours(pa, pb)
    want, want_stats = trl_loss(pa, pb, ra, rb, a_chosen, beta, loss_type, alpha)
    np.testing.assert_allclose(loss.item(), want, rtol=1e-5)
    for k, v in want_stats.items():
        np.testing.assert_allclose(stats[k].item(), v, rtol=1e-4, atol=1e-6, err_msg=k)
    if alpha is not None:
        np.testing.assert_allclose(stats["loss/xpo"].item(), alpha * (pb * MASK).sum(1).mean(), rtol=1e-5)
    grads = mx.grad(lambda x, y: ours(x, y)[0], argnums=(0, 1))(mx.array(pa, dtype=mx.float32), mx.array(pb, dtype=mx.float32))
    for i, g in enumerate(grads):  # central differences of the NumPy loss, float64
        x = (pa, pb)[i]
        numeric = np.zeros_like(x)
        for j in np.ndindex(x.shape):
            up, down = x.copy(), x.copy()
            up[j] += 1e-6
            down[j] -= 1e-6
            args = [(up, pb), (pa, up)][i], [(down, pb), (pa, down)][i]
            numeric[j] = (trl_loss(*args[0], ra, rb, a_chosen, beta, loss_type, alpha)[0]
                          - trl_loss(*args[1], ra, rb, a_chosen, beta, loss_type, alpha)[0]) / 2e-6
        np.testing.assert_allclose(np.array(g), numeric, rtol=1e-3, atol=1e-5)


def test_the_judge_ranks_by_score_ties_to_a_unscorable_last_and_penalises_a_missing_eos():
    scores = np.array([[0.5, 0.2], [0.1, 0.1], [np.nan, -5.0], [np.nan, np.nan], [1.0, 0.5]])
    ended = np.array([[1, 1], [1, 1], [1, 1], [1, 1], [0, 1]], dtype=bool)
    penalised, a_chosen = judge_pairs(scores, ended, 1.0)
    assert a_chosen.tolist() == [True, True, False, True, False]
    assert penalised[4].tolist() == [0.0, 0.5]
    assert judge_pairs(scores, ended, None)[1][4]


# --------------------------------------------------------------------------- jobs


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """Two trainer tokens (a reward model is its owner's) and a short lease (for kill -9)."""
    s = Stack(tmp_path_factory.mktemp("online"), tiny_model)
    s.use_tokens([{"name": "alice", "token": ALICE, "role": "trainer"}, {"name": "bob", "token": BOB, "role": "trainer"}])
    s.env.update(MTQ_LEASE_TTL="3")
    for started in running(s):
        s.worker = s.start_worker()
        yield started


def submit(client, path: str, body: dict) -> str:
    res = client.post(path, json=body)
    assert res.status_code == 200, res.text
    return res.json()["job_id"]


def steps(stack, job_id: str, kind: str) -> list[dict]:
    return [e for _, e in read_events(stack.redis, job_id, count=100_000) if e["type"] == f"{kind}_step"]


def mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize("kind,batch,iters", [("online_dpo", 4, 20), ("xpo", 16, 12)])
def test_the_judges_score_rises_through_a_kill_9_and_a_zero_lr_control_does_not(stack, client, kind, batch, iters):
    """The learning job's worker is killed (-9) after its first checkpoint: the job resumes from
    it with the step seeds it had, learns on, and keeps every step once."""
    path, headline = KINDS[kind].prefix, KINDS[kind].headline
    body = {"model_id": "tiny", "prompts": PROMPTS, "reward": SHARE_OF_E,
            "config": {**LEARN, "batch_size": batch, "iters": iters, "checkpoint_every": 4}}
    learned = submit(client, path, body)
    kill_when(lambda: (client.get(f"{path}/{learned}").json()["checkpoint_step"] or 0) >= 4, stack.worker.pid,
              "a checkpoint", group=True)
    stack.worker.wait(10)
    stack.worker = stack.start_worker()
    frozen = submit(client, path, {**body, "config": {**body["config"], "iters": 5, "learning_rate": 0.0}})
    done = wait_done(stack, path, learned, timeout=300)
    assert done["progress"]["iter"] == iters and done["failed_attempts"] == 1 and done["resumed_from"] >= 4
    history = client.get(f"{path}/{learned}/history").json()["history"]
    assert [h["step"] for h in history] == list(range(1, iters + 1))  # every step once
    wait_done(stack, path, frozen, timeout=300)

    by_step = {e["iter"]: e for e in steps(stack, learned, kind)}  # a step run again after the kill: its last event
    curve, control = [by_step[i][headline] for i in sorted(by_step)], [e[headline] for e in steps(stack, frozen, kind)]
    print(f"\n{kind} {headline}: lr 5e-2 {[round(x, 3) for x in curve]}; lr 0 {[round(x, 3) for x in control]}")
    # Measured (seed 0): online_dpo 0.07 -> 0.49 over 20 steps; xpo (batch 16) 0.12 -> 0.32 over 12; lr 0 about 0.1.
    assert len(curve) == iters
    assert mean(curve[-5:]) > mean(control) + 0.1 and mean(curve[-5:]) > mean(curve[:5]) + 0.1
    trl = {"loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected", "objective/kl", "objective/entropy", "objective/scores_margin", "beta"}
    trl |= ({"alpha", "loss/dpo", "loss/xpo", "objective/model_scores", "objective/ref_scores"} if kind == "xpo" else
            {"objective/scores", "objective/rlhf_reward", "objective/non_score_reward", "val/contain_eos_token"})
    assert trl <= set(by_step[iters]), trl - set(by_step[iters])


def test_judged_by_an_owners_reward_model_and_by_a_reward_endpoint(stack):
    """A reward model trained by this project judges on the job's own worker; another trainer's
    job cannot name it (the same 400 as a missing one, as GRPO's). A reward endpoint judges too."""
    pairs = [{"prompt": f"Say {w}.", "chosen": f"{w} is good", "rejected": f"{w} is bad"} for w in ("red", "sun", "tree")]
    with stack.client(ALICE) as alice, stack.client(BOB) as bob:
        rm = submit(alice, REWARD, {"model_id": "tiny", "preference_pairs": pairs, "adapter_name": "alice-rm",
                                    "config": {"iters": 3, "batch_size": 2, "lora_layers": -1}})
        wait_done(stack, REWARD, rm, timeout=180)
        source = {"type": "reward_model", "model_id": "tiny", "adapter_name": "alice-rm"}
        body = {"model_id": "tiny", "prompts": PROMPTS, "reward": [source], "config": {**SMALL, "learning_rate": 1e-2}}
        stolen, missing = (bob.post(ONLINE, json={**body, "reward": [s]}) for s in (source, {**source, "adapter_name": "nope"}))
        assert stolen.status_code == missing.status_code == 400, stolen.text
        assert stolen.json()["detail"] == missing.json()["detail"].replace("nope", "alice-rm")
        judged = submit(alice, ONLINE, {**body, "validation_prompts": ["Name a river."]})
        wait_done(stack, ONLINE, judged, timeout=180)
        assert all("rewards/reward_model/mean" in e for e in steps(stack, judged, "online_dpo"))
        evals = [e for _, e in read_events(stack.redis, judged) if e["type"] == "eval"]
        assert [e["iter"] for e in evals] == [0, 1, 2] and all("val_reward" in e for e in evals)  # GRPO's evaluations

    calls = []

    def by_length(request: dict, k: int) -> dict:
        calls.append(request)
        return {"rewards": [float(len(c)) for c in request["completions"]]}

    # XPO, judged by an endpoint, starting from the Online DPO job's adapter: unlike a fresh LoRA
    # (B = 0: the policy is the reference), it differs from the reference at its first step.
    with serving(by_length), stack.client(TOKEN) as admin:
        endpoint = submit(admin, XPO, {"model_id": "tiny", "prompts": PROMPTS, "init_adapter": {"job_id": judged},
                                       "config": {**SMALL, "reward_endpoint": f"http://127.0.0.1:{REWARD_PORT}/reward"}})
        wait_done(stack, XPO, endpoint, timeout=180)
    assert calls and all(len(c["completions"]) == 2 for c in calls)  # a prompt's pair: the policy's, the reference's
    xpo = steps(stack, endpoint, "xpo")
    assert abs(xpo[0]["objective/kl"]) > 1e-3, xpo[0]
    for e in xpo:
        assert e["objective/scores_margin"] == pytest.approx(e["objective/model_scores"] - e["objective/ref_scores"])


def test_grpo_knobs_tools_and_other_group_sizes_are_400(client):
    body = {"model_id": "tiny", "prompts": PROMPTS}
    for path, config in ((ONLINE, {"clip_ratio": 0.3}), (ONLINE, {"group_size": 4}), (XPO, {"group_size": 2}),
                         (XPO, {"scale_rewards": "batch"}), (XPO, {"num_iterations": 2}), (ONLINE, {"beta": 0})):
        res = client.post(path, json={**body, "config": config})
        assert res.status_code == 400, (config, res.text)
    tool = [{"function": "tests.tool_fns:add"}]
    res = client.post(ONLINE, json={**body, "tools": tool, "config": {"max_turns": 2}})
    assert res.status_code == 400, res.text
