"""The seed's RL loop through a bridge, on one worker (docs/seed-contract.md): a reward job, then a
GRPO job whose reward endpoint is the caller's own server (tests/reward_server.py) forwarding each
group to this service's POST .../reward/score. The only worker is inside that job's step, waiting
on the server, when the reward/score request reaches its queue: the training process answers it
meanwhile (worker/runtime/request_loop.py while_serving), so the job completes.

The scoring in the middle of a step must leave the training as it was: a control job that scores
with the same reward model in its own process (a reward_model source, no HTTP) samples, rewards
and trains bit for bit the same.
"""

import io
import tarfile

import pytest
from conftest import Stack, read_events, running, wait_done
from reward_server import serving
from test_train_kinds import RM_CONFIG, keyword_pairs

API = "/admin/api/fine-tune"
GRPO, REWARD, SCORE = f"{API}/grpo/jobs", f"{API}/reward/jobs", f"{API}/reward/score"
# One prompt a step: the bridge's one reward/score call is then the very call the control's
# reward_model source makes ([prompt] * G), so the two jobs' rewards are the same floats. LoRA
# dropout: the update draws random numbers and runs in train mode, which the scoring must not change.
GRPO_CONFIG = dict(iters=4, learning_rate=5e-2, temperature=1.0, group_size=4, batch_size=1, max_completion_len=8,
                   lora_layers=-1, lora_dropout=0.1, use_chat_template=False, seed=3)
PROMPTS = ["Say something about red.", "Say something about tree.", "Say something about moon."]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """One worker; reward/score waits 5 s at most before its 202 (a worker that cannot answer
    while it waits on the bridge fails the job in seconds, not minutes)."""
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    s.env.update(MTQ_SCORE_WAIT_S="5")
    for started in running(s):
        s.worker = s.start_worker()
        yield started


def steps(stack, job_id: str, kind: str) -> list[dict]:
    return [e for _, e in read_events(stack.redis, job_id, count=100_000) if e["type"] == kind]


def adapter_weights(client, job_id: str) -> bytes:
    res = client.get(f"{GRPO}/{job_id}/adapter")
    assert res.status_code == 200, res.text
    with tarfile.open(fileobj=io.BytesIO(res.content)) as tar:
        return tar.extractfile("adapters.safetensors").read()


def test_a_grpo_job_bridged_to_reward_score_completes_on_one_worker(stack):
    client = stack.client()
    rm = client.post(REWARD, json={"model_id": "tiny", "preference_pairs": keyword_pairs(16, 0), "adapter_name": "rm",
                                   "config": {**RM_CONFIG, "iters": 10, "learning_rate": 1e-2}})
    assert rm.status_code == 200, rm.text
    wait_done(stack, REWARD, rm.json()["job_id"])

    statuses: list[int] = []

    def bridge(body: dict, k: int) -> dict:
        """The caller's bridge: the group to reward/score with the reward model, its rewards back."""
        res = client.post(SCORE, params={"model_id": "tiny", "adapter_name": "rm"},
                          json={"prompt": body["prompt"], "completions": body["completions"]})
        statuses.append(res.status_code)
        return res.json()  # not 200: no `rewards` field, and the job fails saying so

    with serving(bridge) as server:
        bridged = client.post(GRPO, json={"model_id": "tiny", "prompts": PROMPTS, "config": GRPO_CONFIG, "reward": [
            {"type": "endpoint", "url": server.url, "retries": 0, "name": "judge"}]})
        assert bridged.status_code == 200, bridged.text
        bridged = wait_done(stack, GRPO, bridged.json()["job_id"], timeout=180)
    assert len(server.requests) == GRPO_CONFIG["iters"] and statuses == [200] * GRPO_CONFIG["iters"], statuses

    control = client.post(GRPO, json={"model_id": "tiny", "prompts": PROMPTS, "config": GRPO_CONFIG, "reward": [
        {"type": "reward_model", "model_id": "tiny", "adapter_name": "rm", "name": "judge"}]})
    assert control.status_code == 200, control.text
    control = wait_done(stack, GRPO, control.json()["job_id"], timeout=180)

    samples = {job["job_id"]: steps(stack, job["job_id"], "samples") for job in (bridged, control)}
    ours, theirs = samples[bridged["job_id"]], samples[control["job_id"]]
    assert len(ours) == GRPO_CONFIG["iters"] and ours == theirs
    rewards = [r for s in ours for group in s["rewards"] for r in group]
    assert len(set(rewards)) > 1, rewards  # the reward model tells completions apart: the updates move the policy
    assert [r["body"]["completions"] for r in server.requests] == [s["completions"][0] for s in ours]
    assert adapter_weights(client, bridged["job_id"]) == adapter_weights(client, control["job_id"])
    client.close()

