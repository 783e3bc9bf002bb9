"""CPO / SimPO jobs and DPO's other loss types through the real stack: HTTP, Redis, a worker
process (its training process), the tiny model. Their math is checked against NumPy in
tests/test_preference_math.py and against TRL 1.16 by bench/parity.py --losses.

Learning is seeded; each learning test runs a zero-learning-rate control of the same job. The
batches are 8 of 16 pairs, so two steps are an epoch: a mean over two steps is over every pair.
"""


import pytest
from conftest import kill_when, wait_done, wait_for
from test_train_kinds import events, keyword_pairs, submit

DPO, CPO = "/admin/api/fine-tune/dpo/jobs", "/admin/api/fine-tune/cpo/jobs"
PREF_CONFIG = dict(lora_layers=-1, lora_rank=8, lora_alpha=4, learning_rate=1e-2, batch_size=8, iters=20,
                   steps_per_report=1)
PAIRS = keyword_pairs(16, 0)


def epoch_margin(steps: list[dict]) -> float:
    """rewards/margins over an epoch: the mean of two steps' (each a mean over 8 pairs)."""
    return (steps[0]["rewards/margins"] + steps[1]["rewards/margins"]) / 2


def run(stack, client, path: str, config: dict) -> tuple[list[dict], list[dict]]:
    """The step events of the job with `config`, and of its lr-0 control (one epoch)."""
    kind = path.split("/")[-2]
    learned = submit(client, path, {"model_id": "tiny", "preference_pairs": PAIRS, "config": {**PREF_CONFIG, **config}})
    frozen = submit(client, path, {"model_id": "tiny", "preference_pairs": PAIRS,
                                   "config": {**PREF_CONFIG, **config, "iters": 2, "learning_rate": 0.0}})
    wait_done(stack, path, learned["job_id"])
    wait_done(stack, path, frozen["job_id"])
    return events(stack, learned["job_id"], f"{kind}_step"), events(stack, frozen["job_id"], f"{kind}_step")


@pytest.mark.parametrize("config", [
    {"loss_type": "sigmoid", "cpo_alpha": 1.0},
    {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}], ids=["cpo", "simpo"])
def test_cpo_and_simpo_raise_their_margin_and_a_zero_lr_control_does_not(stack, client, worker, config):
    """Reference-free: the margin starts where the base model puts it (not 0), the control's
    stays there, the trained job's rises above it."""
    steps, control = run(stack, client, CPO, config)
    print(f"\nCPO {config}: rewards/margins by step", [round(e["rewards/margins"], 3) for e in steps],
          f"lr 0: {[round(e['rewards/margins'], 3) for e in control]}")
    assert [e["iter"] for e in steps] == list(range(1, 21))
    assert steps[0]["rewards/margins"] == control[0]["rewards/margins"] != 0  # the same first batch, the same weights
    assert epoch_margin(steps[-2:]) > epoch_margin(control) + 0.05
    assert {"nll_loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
            "logps/rejected"} <= set(steps[-1])


def test_dpo_loss_types_mixed_with_loss_weights_raise_the_margin_and_a_zero_lr_control_does_not(stack, client, worker):
    """At the first step the policy is the reference (LoRA B = 0): c = r = 0, so sppo_hard's loss
    is 2 (1 / (2 beta))^2 = 50 and apo_zero's 1, weighted 0.5 and 2: 27."""
    steps, control = run(stack, client, DPO, {"loss_type": ["sppo_hard", "apo_zero"], "loss_weights": [0.5, 2.0], "iters": 10})
    print("\nDPO sppo_hard + apo_zero: rewards/margins, loss by step",
          [(round(e["rewards/margins"], 3), round(e["loss"], 2)) for e in steps])
    # Up to rounding: the reference's log-probs come from a plain forward, the policy's from the
    # compiled step (tests/test_train_kinds.py's DPO test says more).
    assert steps[0]["loss"] == pytest.approx(27.0, rel=1e-5) and abs(steps[0]["rewards/margins"]) < 1e-5
    assert all(abs(e["rewards/margins"]) < 1e-5 and e["loss"] == pytest.approx(27.0, rel=1e-5) for e in control)
    assert epoch_margin(steps[-2:]) > 0.1 and steps[-1]["loss"] < 26


@pytest.mark.parametrize("body,error", [
    ({"config": {"loss_type": "aot"}}, "loss_type"),
    ({"config": {"loss_type": ["sigmoid", "hinge"], "loss_weights": [1.0]}}, "one weight"),
    ({"config": {"loss_type": "exo_pair"}}, "needs label_smoothing > 0"),
    ({"config": {"loss_type": [], "loss_weights": []}}, "a list of 1 to"),
    ({"config": {"loss_type": "robust", "label_smoothing": 0.5}}, "label_smoothing"),
    ({"config": {"loss_weights": [1e9]}}, "one weight"),
    ({"cpo": True, "config": {"workers": 2}}, "cpo_alpha > 0 runs on one worker"),
    ({"cpo": True, "config": {"loss_type": "sppo_hard"}}, "loss_type"),
    ({"cpo": True, "config": {"simpo_gamma": -1}}, "simpo_gamma"),
], ids=["aot", "weights-length", "exo-without-eps", "no-type", "eps-0.5", "weight-bound", "cpo-gang", "cpo-type",
        "cpo-gamma"])
def test_invalid_loss_configs_are_a_clear_400(client, body, error):
    path = CPO if body.pop("cpo", False) else DPO
    res = client.post(path, json={"model_id": "tiny", "preference_pairs": PAIRS, **body})
    assert res.status_code == 400 and error in res.json()["detail"], res.text


def test_cpo_is_a_kind_with_its_routes_curves_and_gang_rule(client):
    kinds = {k["name"]: k for k in client.get("/admin/api/kinds").json()}
    assert kinds["cpo"]["prefix"] == CPO and kinds["cpo"]["step_event"] == "cpo_step"
    assert ["nll_loss", "val_nll_loss"] in [c["metrics"] for c in kinds["cpo"]["charts"]]
    gang = client.post(CPO, json={"model_id": "tiny", "preference_pairs": PAIRS,
                                  "config": {"loss_type": "simpo", "cpo_alpha": 0.0, "workers": 2}})
    assert gang.status_code == 200, gang.text  # SimPO without the NLL: a mean over pairs, which a gang can share
    assert client.post(f"{CPO}/{gang.json()['job_id']}/cancel").status_code == 200


def test_cpo_resumes_after_kill_9_of_its_training_process_with_every_step_once(stack, client, worker):
    job = submit(client, CPO, {"model_id": "tiny", "preference_pairs": PAIRS, "config": {
        "lora_layers": -1, "learning_rate": 1e-3, "batch_size": 2, "iters": 30, "steps_per_save": 4,
        "steps_per_report": 30}})
    child = wait_for(lambda: events(stack, job["job_id"], "started"), 120, "the start")[-1]["pid"]
    kill_when(lambda: (client.get(f"{CPO}/{job['job_id']}").json()["checkpoint_step"] or 0) >= 8, child, "a checkpoint")
    done = wait_done(stack, CPO, job["job_id"], timeout=180)
    assert done["progress"]["iter"] == 30 and done["failed_attempts"] == 1 and done["resumed_from"] >= 8
    assert "killed by SIGKILL" in events(stack, job["job_id"], "requeued")[0]["reason"]
    history = client.get(f"{CPO}/{job['job_id']}/history").json()["history"]
    assert [h["step"] for h in history] == list(range(1, 31))  # every step once
    assert worker.poll() is None
