"""Reward sources end to end: REST -> Redis/rq -> a real worker process -> a real reward
server on 127.0.0.1 (started here, in a thread) -> the job's events and status.

One worker serves the whole module (a job that fails leaves it ready for the next one);
the scorer-level details are in tests/test_rewards.py.
"""

import json
import re2
import time

import numpy as np
import pytest

from reward_server import closed_port_url, serving

JOBS = "/admin/api/fine-tune/grpo/jobs"
ITERS, B, G = 2, 2, 2
PROMPTS = ["What is 2+2?", "Say hello."]
CONFIG = {"iters": ITERS, "batch_size": B, "group_size": G, "max_completion_len": 8,
          "lora_layers": 2, "lora_rank": 4, "lora_alpha": 8.0, "temperature": 1.0}


# ----------------------------------------------------------------------------------------
# A real reward server
# ----------------------------------------------------------------------------------------


def distinct(body: dict, k: int) -> dict:
    """Distinct rewards: request k, completion i -> k + i/8 (exact in float32), in either protocol."""
    if "groups" in body:
        return {"rewards": [[k + (g * G + i) / 8 for i in range(len(grp["completions"]))]
                            for g, grp in enumerate(body["groups"])]}
    return {"rewards": [k + i / 8 for i in range(len(body["completions"]))]}


def answered(server) -> list[dict]:
    """The requests that the worker got an answer to (not the delayed ones)."""
    return [r for r in server.requests if not r["delayed"]]


@pytest.fixture
def server():
    with serving(distinct) as s:
        yield s


# ----------------------------------------------------------------------------------------
# Jobs
# ----------------------------------------------------------------------------------------


def run_job(stack, worker, prompts=PROMPTS, reward=None, **config) -> tuple[dict, list[dict]]:
    body = {"model_id": stack.tiny_model.name, "prompts": prompts, "config": {**CONFIG, **config}}
    if reward is not None:
        body["reward"] = reward
    with stack.client() as c:
        created = c.post(JOBS, json=body)
    assert created.status_code == 200, created.text
    job = stack.wait_job(created.json()["job_id"], timeout=120)
    assert worker.poll() is None, stack.logs("worker")
    return job, events_of(stack, job["job_id"])


def events_of(stack, job_id) -> list[dict]:
    from conftest import read_events
    return [e for _, e in read_events(stack.redis, job_id, count=10_000)]


def of_type(events, kind) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def check_steps(job, events) -> tuple[list[dict], list[dict]]:
    """The grpo_step and samples events of a completed job, one of each per iter, in order."""
    assert job["status"] == "completed", job["error"]
    steps, samples = of_type(events, "grpo_step"), of_type(events, "samples")
    assert [e["iter"] for e in steps] == [e["iter"] for e in samples] == list(range(ITERS))  # 0-based, as the seed server
    for s in samples:
        assert len(s["completions"]) == len(s["rewards"]) == len(s["prompt_indices"]) == B
        assert all(len(g) == G and all(isinstance(c, str) for c in g) for g in s["completions"])
        assert all(len(g) == G for g in s["rewards"])
    return steps, samples


def prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt["prompt"]


def endpoint(url: str, **options) -> dict:
    return {"type": "endpoint", "url": url, "backoff_s": 0.01, **options}


# ----------------------------------------------------------------------------------------
# Endpoints
# ----------------------------------------------------------------------------------------


def test_seed_reward_endpoint_one_request_per_group(stack, worker, server):
    job, events = run_job(stack, worker, reward_endpoint=server.url)
    steps, samples = check_steps(job, events)

    # One request per group per step, with the seed's fields plus job_id and step.
    requests = server.requests
    assert len(requests) == ITERS * B
    for r in requests:
        assert set(r["body"]) == {"prompt", "completions", "job_id", "step"}
        assert r["body"]["job_id"] == job["job_id"] == r["headers"]["x-mtq-job-id"]
        assert len(r["body"]["completions"]) == G and all(isinstance(c, str) for c in r["body"]["completions"])
    assert [r["body"]["step"] for r in requests] == [s for s in range(ITERS) for _ in range(B)]

    for step, sample, event in zip(range(ITERS), samples, steps):
        group_requests = requests[step * B:(step + 1) * B]
        # The server was asked about the very completions (and prompts) the step trained on...
        assert [r["body"]["completions"] for r in group_requests] == sample["completions"]
        assert [r["body"]["prompt"] for r in group_requests] == [PROMPTS[i] for i in sample["prompt_indices"]]
        # ...and its answers are the step's rewards.
        answers = [r["answer"] for r in group_requests]
        assert sample["rewards"] == answers
        assert event["reward"] == pytest.approx(np.mean(answers), rel=1e-5)
        assert event["mean_reward"] == event["reward"]
        assert event["rewards/endpoint/mean"] == pytest.approx(np.mean(answers), rel=1e-5)
        assert event["rewards/endpoint/std"] == pytest.approx(np.std(answers), rel=1e-5)
    last = [r["answer"] for r in requests[-B:]]
    assert job["progress"]["reward"] == pytest.approx(np.mean(last), rel=1e-5)


def test_batch_protocol_one_request_per_step_with_item_fields(stack, worker, server):
    prompts = [{"prompt": PROMPTS[0], "answer": 4}, {"prompt": PROMPTS[1], "lang": "en"}]
    job, events = run_job(stack, worker, prompts, reward=[endpoint(server.url, protocol="batch", name="judge")])
    steps, samples = check_steps(job, events)

    requests = server.requests
    assert [r["body"]["step"] for r in requests] == list(range(ITERS))  # one per step, numbered as the step events
    for r, sample, event in zip(requests, samples, steps):
        body = r["body"]
        assert set(body) == {"job_id", "step", "groups"} and body["job_id"] == job["job_id"]
        expected_groups = [
            {**prompts[i], "completions": completions}
            for i, completions in zip(sample["prompt_indices"], sample["completions"])
        ]
        assert body["groups"] == expected_groups  # prompt, completions and the items' extra fields
        assert sample["rewards"] == r["answer"]
        assert event["reward"] == pytest.approx(np.mean(r["answer"]), rel=1e-5)
        assert event["rewards/judge/mean"] == pytest.approx(np.mean(r["answer"]), rel=1e-5)


def test_timeout_then_answer_job_completes(stack, worker, server):
    server.replies = [{"delay": 4.0}]  # the first request outlives its 1 s timeout (the retry's answer, a loaded CI's)
    started = time.monotonic()
    job, events = run_job(stack, worker, reward=[endpoint(server.url, timeout=1.0, retries=2, backoff_s=0.05)])
    steps, samples = check_steps(job, events)
    requests = server.requests
    assert requests[0]["delayed"] and requests[1]["body"] == requests[0]["body"]  # the same request, again
    # Each group was answered once (a spurious retry under load would only repeat a body).
    answers = answered(server)
    bodies = [json.dumps(r["body"], sort_keys=True) for r in answers]
    assert len(set(bodies)) == ITERS * B
    assert samples[0]["rewards"][0] == answers[0]["answer"]
    assert time.monotonic() - started < 30


def test_endpoint_that_stays_down_fails_the_job_naming_the_url(stack, worker):
    url = closed_port_url()
    job, events = run_job(stack, worker, reward=[endpoint(url, retries=1, timeout=2.0)])
    assert job["status"] == "failed"
    assert job["error"].startswith(f"reward endpoint {url} failed after 2 attempts: ConnectError"), job["error"]
    assert job["started_at"] > 0 and job["finished_at"] > 0
    assert not of_type(events, "grpo_step")
    assert of_type(events, "failed") == [{"type": "failed", "error": job["error"]}]


def test_wrong_number_of_rewards_fails_the_job(stack, worker, server):
    server.replies = [{"json": {"rewards": [1.0]}}]
    job, events = run_job(stack, worker, reward_endpoint=server.url)
    assert job["status"] == "failed"
    assert job["error"] == f"reward endpoint {server.url} returned 1 rewards for {G} completions"
    assert len(server.requests) == 1  # a bad answer is not retried
    assert not of_type(events, "grpo_step")


# ----------------------------------------------------------------------------------------
# Built-ins and python sources
# ----------------------------------------------------------------------------------------

PATTERN = r"(?s)\A(?:..)*\z"  # RE2 syntax (\z: end of text); an even number of characters: true of about half of any completions


def test_weighted_mix_of_length_and_regex(stack, worker):
    reward = [{"type": "length", "weight": 0.5}, {"type": "regex", "pattern": PATTERN, "weight": 2.0}]
    job, events = run_job(stack, worker, reward=reward)
    steps, samples = check_steps(job, events)
    matches_seen = set()
    for event, sample in zip(steps, samples):
        completions = [c for g in sample["completions"] for c in g]
        lengths = [len(c) for c in completions]
        matches = [1.0 if re2.search(PATTERN, c) else 0.0 for c in completions]
        matches_seen.update(matches)
        expected = [[0.5 * len(c) + 2.0 * bool(re2.search(PATTERN, c)) for c in g] for g in sample["completions"]]
        np.testing.assert_allclose(sample["rewards"], expected, rtol=1e-5)
        assert event["reward"] == pytest.approx(np.mean(expected), rel=1e-5)
        assert event["rewards/length/mean"] == pytest.approx(np.mean(lengths), rel=1e-5)
        assert event["rewards/length/std"] == pytest.approx(np.std(lengths), rel=1e-5, abs=1e-6)
        assert event["rewards/regex/mean"] == pytest.approx(np.mean(matches), rel=1e-5)
        assert event["rewards/regex/std"] == pytest.approx(np.std(matches), rel=1e-5, abs=1e-6)
    # The regex both matched and missed somewhere, so its weight was really exercised.
    assert matches_seen == {0.0, 1.0}, [s["completions"] for s in samples]


def test_python_reward_function(stack, worker):
    prompts = [{"prompt": PROMPTS[0], "answer": 4}, PROMPTS[1]]
    reward = [{"type": "python", "function": "tests.reward_fns:length_plus_answer", "name": "py"}]
    job, events = run_job(stack, worker, prompts, reward=reward)
    steps, samples = check_steps(job, events)
    for event, sample in zip(steps, samples):
        answers = [prompts[i].get("answer", 0) if isinstance(prompts[i], dict) else 0 for i in sample["prompt_indices"]]
        expected = [[len(c) / 10 + a for c in g] for g, a in zip(sample["completions"], answers)]
        np.testing.assert_allclose(sample["rewards"], expected, rtol=1e-5)
        assert event["rewards/py/mean"] == pytest.approx(np.mean(expected), rel=1e-5)
        assert event["reward"] == pytest.approx(np.mean(expected), rel=1e-5)
    assert any(a == 4 for s in samples for a in [prompts[i].get("answer") if isinstance(prompts[i], dict) else None
                                                   for i in s["prompt_indices"]])


@pytest.mark.parametrize("function, names", [
    ("tests.reward_fns.no_such_module:fn", ["cannot import module", "'tests.reward_fns.no_such_module'"]),  # allowed, absent
    ("tests.reward_fns:no_such_fn", ["has no function", "'no_such_fn'"]),
])
def test_python_reward_that_does_not_load_fails_at_start(stack, worker, function, names):
    job, events = run_job(stack, worker, reward=[{"type": "python", "function": function}])
    assert job["status"] == "failed"
    assert job["error"].startswith(f"reward function {function}: "), job["error"]
    for name in names:
        assert name in job["error"], job["error"]
    assert of_type(events, "started") and not of_type(events, "grpo_step") and not of_type(events, "samples")

# Submitting a job whose endpoint host is not allowed (400) is covered in tests/test_api.py
# (test_disallowed_reward_host_is_400).
