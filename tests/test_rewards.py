"""Reward sources (worker/rewards/): built-ins on hand-made completions, python sources,
and HTTP endpoints against a real reward server on 127.0.0.1 (no mocks)."""

import time
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from reward_server import closed_port_url, serving
from shared.schemas import JobCreate, PromptItem
from worker.rewards.batch import RewardError
from worker.rewards.functions import (
    contains_rewards,
    exact_match_rewards,
    extract_math_answer,
    json_valid_rewards,
    length_rewards,
    make_json_validator,
    math_answer_rewards,
    regex_rewards,
)
from worker.rewards.scorer import build_scorer

TESTS_DIR = Path(__file__).resolve().parent
JOB_ID = "job-123"


def make_spec(reward: list[dict] | None = None, **config) -> JobCreate:
    return JobCreate.model_validate({"model_id": "tiny", "prompts": ["p"], "reward": reward, "config": config})


def item(prompt="What is 2+2?", **fields) -> PromptItem:
    return PromptItem(prompt=prompt, **fields)


# ----------------------------------------------------------------------------------------
# A real reward server
# ----------------------------------------------------------------------------------------


def lengths(body: dict, k: int) -> dict:
    """By default each completion is rewarded with its length, in both protocols."""
    if "groups" in body:
        return {"rewards": [[len(c) for c in g["completions"]] for g in body["groups"]]}
    return {"rewards": [len(c) for c in body["completions"]]}


@pytest.fixture
def server():
    with serving(lengths) as s:
        yield s


def endpoint(url: str, **options) -> dict:
    # Short waits keep the retry tests fast.
    return {"type": "endpoint", "url": url, "backoff_s": 0.01, **options}


# ----------------------------------------------------------------------------------------
# Which sources a job gets
# ----------------------------------------------------------------------------------------


def test_default_is_length_in_chars():
    with build_scorer(make_spec(), JOB_ID) as scorer:
        assert [s.metric_name for s in scorer.sources] == ["length"]
        rewards, metrics = scorer.score(0, [item(), item("other")], [["a", "abc"], ["", "abcd"]])
    assert rewards.dtype == np.float32 and rewards.shape == (2, 2)
    assert rewards.tolist() == [[1, 3], [0, 4]]
    assert metrics == {"rewards/length/mean": 2.0, "rewards/length/std": pytest.approx(np.std([1, 3, 0, 4]))}


def test_reward_list_wins_over_reward_endpoint():
    spec = make_spec([{"type": "regex", "pattern": "x"}], reward_endpoint="http://127.0.0.1:1/")
    with build_scorer(spec, JOB_ID) as scorer:
        assert [s.type for s in scorer.sources] == ["regex"]


def test_duplicate_names_are_made_unique():
    spec = make_spec([{"type": "regex", "pattern": "a"}, {"type": "regex", "pattern": "b"}, {"type": "length"}])
    with build_scorer(spec, JOB_ID) as scorer:
        assert [s.metric_name for s in scorer.sources] == ["regex", "regex_2", "length"]
        _, metrics = scorer.score(0, [item()], [["a", "b"]])
    assert set(metrics) == {f"rewards/{n}/{m}" for n in ("regex", "regex_2", "length") for m in ("mean", "std")}


def test_weighted_mix_of_two_sources():
    spec = make_spec([
        {"type": "length", "weight": 0.5, "name": "len"},
        {"type": "regex", "pattern": r"^\d+$", "mode": "fullmatch", "weight": -2.0},
    ])
    completions = [["12", "abc"], ["7", "x1"]]
    with build_scorer(spec, JOB_ID) as scorer:
        rewards, metrics = scorer.score(3, [item(), item()], completions)
    # By hand: 0.5 * length - 2 * (all digits)
    assert rewards == pytest.approx(np.array([[0.5 * 2 - 2, 0.5 * 3], [0.5 * 1 - 2, 0.5 * 2]]))
    assert metrics["rewards/len/mean"] == pytest.approx(2.0)
    assert metrics["rewards/len/std"] == pytest.approx(np.std([2, 3, 1, 2]))
    assert metrics["rewards/regex/mean"] == pytest.approx(0.5)
    assert metrics["rewards/regex/std"] == pytest.approx(0.5)


def test_none_counts_as_zero_and_is_left_out_of_metrics():
    spec = make_spec([{"type": "exact_match", "weight": 2.0}, {"type": "length", "weight": 1.0}])
    items = [item(answer="4"), item("no reference here")]
    with build_scorer(spec, JOB_ID) as scorer:
        rewards, metrics = scorer.score(0, items, [["4", "5"], ["4", "44"]])
        assert rewards.tolist() == [[2 + 1, 0 + 1], [0 + 1, 0 + 2]]
        assert metrics["rewards/exact_match/mean"] == 0.5  # over the first group only
        # A step in which the source applies nowhere: its metrics are left out (not NaN).
        _, metrics = scorer.score(1, [item("no reference")], [["4", "5"]])
    assert "rewards/exact_match/mean" not in metrics and "rewards/exact_match/std" not in metrics
    assert metrics["rewards/length/mean"] == 1.0


def test_length_in_tokens_needs_token_counts():
    spec = make_spec([{"type": "length", "unit": "tokens", "target": 3}])
    with build_scorer(spec, JOB_ID) as scorer:
        rewards, _ = scorer.score(0, [item()], [["a", "b"]], token_counts=[[5, 3]])
        assert rewards.tolist() == [[-2, 0]]
        with pytest.raises(ValueError, match="token_counts"):
            scorer.score(0, [item()], [["a", "b"]])


# ----------------------------------------------------------------------------------------
# Built-ins on hand-made completions
# ----------------------------------------------------------------------------------------


def test_length_rewards():
    assert length_rewards(["", "ab", "abcd"]) == [0.0, 2.0, 4.0]
    assert length_rewards(["", "ab", "abcd"], target=2) == [-2.0, 0.0, -2.0]
    assert length_rewards(["ab", "c"], unit="tokens", token_counts=[7, 1]) == [7.0, 1.0]


def test_regex_rewards():
    import re

    pattern = re.compile(r"\d+")
    assert regex_rewards(["abc 12", "12", "none"], pattern) == [1.0, 1.0, 0.0]
    assert regex_rewards(["abc 12", "12", "none"], pattern, mode="fullmatch") == [0.0, 1.0, 0.0]


def test_exact_match_rewards():
    completions = ["  Paris\n", "paris", "Paris", "Lyon"]
    assert exact_match_rewards(completions, ["Paris", "Paris", None, "Paris"]) == [1.0, 0.0, None, 0.0]
    assert exact_match_rewards(completions, ["Paris"] * 4, case_sensitive=False) == [1.0, 1.0, 1.0, 0.0]
    assert exact_match_rewards(completions, ["Paris"] * 4, strip=False) == [0.0, 0.0, 1.0, 0.0]
    assert exact_match_rewards(["42"], [42]) == [1.0]  # a JSON number as the reference


def test_contains_rewards():
    completions = ["I think it is Paris.", "PARIS!", "Lyon"]
    assert contains_rewards(completions, ["Paris"] * 3) == [1.0, 0.0, 0.0]
    assert contains_rewards(completions, [" paris "] * 3, case_sensitive=False) == [1.0, 1.0, 0.0]
    assert contains_rewards(completions, [None, "Paris", "Lyon"]) == [None, 0.0, 1.0]


@pytest.mark.parametrize("completion, answer, expected", [
    (r"So the total is \boxed{42}.", 42, 1.0),
    ("The answer is 1,000.", 1000, 1.0),
    ("4.0", "4", 1.0),
    ("The answer is +4", 4, 1.0),
    ("It costs $1,250.50 in total", "1250.5", 1.0),
    ("That is 50%", 50, 1.0),
    (r"\boxed{\frac{3}{4}}", 0.75, 1.0),
    ("3/4 of them", "0.75", 1.0),
    (r"\boxed{-7} and then 12 more words 3", -7, 1.0),  # the box wins over later numbers
    ("10-3 = 7", 7, 1.0),
    ("The answer is 41.", 42, 0.0),
    ("I do not know.", 42, 0.0),
    ("answer: 72", "Natalia sold 48/2 = 24 clips... #### 72", 1.0),  # a GSM8K-style reference
])
def test_math_answer(completion, answer, expected):
    assert math_answer_rewards([completion], [answer]) == [expected]


def test_math_answer_without_reference_does_not_apply():
    assert math_answer_rewards(["42", "42"], [None, "no number"]) == [None, None]


def test_extract_math_answer():
    assert extract_math_answer(r"\boxed{1{,}000}") == 1000
    assert extract_math_answer(r"x = \boxed{\dfrac{1}{2}}") == 0.5
    assert extract_math_answer("nested \\boxed{2^{3} = 8}") == 8
    assert extract_math_answer("-.5") == -0.5
    assert extract_math_answer("nothing") is None


def test_json_valid_rewards():
    completions = ['{"a": 1}', '```json\n{"a": "x"}\n```', "Here:\n```\n[1, 2]\n```\nDone.", "{a: 1}", ""]
    assert json_valid_rewards(completions) == [1.0, 1.0, 1.0, 0.0, 0.0]
    validator = make_json_validator({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert json_valid_rewards(completions, validator) == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_json_valid_source_with_schema_alias():
    spec = make_spec([{"type": "json_valid", "schema": {"type": "array"}}])
    with build_scorer(spec, JOB_ID) as scorer:
        rewards, _ = scorer.score(0, [item()], [["[1]", "{}"]])
    assert rewards.tolist() == [[1.0, 0.0]]


# ----------------------------------------------------------------------------------------
# Validation at submission (a 400 from the API)
# ----------------------------------------------------------------------------------------


def test_invalid_regex_is_rejected():
    with pytest.raises(ValidationError, match="invalid regular expression"):
        make_spec([{"type": "regex", "pattern": "(unclosed"}])


def test_invalid_json_schema_is_rejected():
    with pytest.raises(ValidationError, match="invalid JSON schema"):
        make_spec([{"type": "json_valid", "schema": {"type": "no-such-type"}}])


def test_bad_function_path_and_metric_name_are_rejected():
    with pytest.raises(ValidationError):
        make_spec([{"type": "python", "function": "no_colon_here"}])
    with pytest.raises(ValidationError):
        make_spec([{"type": "length", "name": "has/slash"}])


# ----------------------------------------------------------------------------------------
# Python sources (TRL's reward function convention)
# ----------------------------------------------------------------------------------------


@pytest.fixture
def reward_fns(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    import reward_fns

    reward_fns.echo_inputs.calls.clear()
    return reward_fns


def test_python_source_gets_trl_style_arguments(reward_fns):
    spec = make_spec([{"type": "python", "function": "reward_fns:echo_inputs"}])
    items = [item("p1", answer=4), item([{"role": "user", "content": "p2"}], topic="math")]
    with build_scorer(spec, JOB_ID) as scorer:
        rewards, _ = scorer.score(0, items, [["a", "b"], ["c", "d"]])
    assert rewards.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    chat = [{"role": "user", "content": "p2"}]
    assert reward_fns.echo_inputs.calls == [{
        "prompts": ["p1", "p1", chat, chat],  # each prompt once per completion of its group
        "completions": ["a", "b", "c", "d"],
        "answer": [4, 4, None, None],
        "topic": [None, None, "math", "math"],
    }]


def test_python_source_rewards(reward_fns):
    spec = make_spec([{"type": "python", "function": "reward_fns:answer_length_match", "name": "len_match"}])
    with build_scorer(spec, JOB_ID) as scorer:
        rewards, metrics = scorer.score(0, [item(answer="abc"), item()], [["xyz", "x"], ["a", "b"]])
    assert rewards[0].tolist() == [1.0, 0.0]
    assert np.isnan(rewards[1]).all()  # the function returned None for both: unscorable (TRL's NaN)
    assert metrics == {"rewards/len_match/mean": 0.5, "rewards/len_match/std": 0.5}


def test_misspelt_module_fails_at_build(reward_fns):
    spec = make_spec([{"type": "python", "function": "reward_fnz:answer_length_match"}])
    with pytest.raises(RewardError, match="reward_fnz"):
        build_scorer(spec, JOB_ID)
    spec = make_spec([{"type": "python", "function": "reward_fns:no_such_function"}])
    with pytest.raises(RewardError, match="no_such_function"):
        build_scorer(spec, JOB_ID)


@pytest.mark.parametrize("function, message", [
    ("raises", "reward function reward_fns:raises raised ZeroDivisionError: division by zero"),
    ("too_few", "reward function reward_fns:too_few returned 1 rewards for 2 completions"),
    ("not_numbers", "reward function reward_fns:not_numbers returned a non-number reward at index 0: 'good'"),
])
def test_python_source_errors(reward_fns, function, message):
    spec = make_spec([{"type": "python", "function": f"reward_fns:{function}"}])
    with build_scorer(spec, JOB_ID) as scorer:
        with pytest.raises(RewardError) as err:
            scorer.score(0, [item()], [["a", "b"]])
    assert str(err.value) == message


# ----------------------------------------------------------------------------------------
# Endpoints, against the real server above
# ----------------------------------------------------------------------------------------


def test_seed_protocol_from_config_reward_endpoint(server):
    spec = make_spec(reward_endpoint=server.url)
    items = [item("Say hi"), item([{"role": "user", "content": "Say bye"}])]
    with build_scorer(spec, JOB_ID) as scorer:
        assert [s.metric_name for s in scorer.sources] == ["endpoint"]
        rewards, metrics = scorer.score(7, items, [["hi", "hello"], ["bye", "goodbye"]])
    assert rewards.tolist() == [[2, 5], [3, 7]]
    assert metrics["rewards/endpoint/mean"] == pytest.approx(17 / 4)
    # One request per group, with the seed's fields plus job_id and step.
    assert [r["body"] for r in server.requests] == [
        {"prompt": "Say hi", "completions": ["hi", "hello"], "job_id": JOB_ID, "step": 7},
        {"prompt": [{"role": "user", "content": "Say bye"}], "completions": ["bye", "goodbye"], "job_id": JOB_ID, "step": 7},
    ]
    for request in server.requests:
        assert request["path"] == "/reward"
        assert request["headers"]["x-mtq-job-id"] == JOB_ID
        assert request["headers"]["x-mtq-step"] == "7"


def test_batch_protocol_sends_one_request_with_item_fields(server):
    spec = make_spec([endpoint(server.url, protocol="batch")])
    items = [item("q1", answer=4, difficulty="easy"), item("q2")]
    with build_scorer(spec, JOB_ID) as scorer:
        rewards, _ = scorer.score(2, items, [["a", "bb"], ["ccc", ""]])
    assert rewards.tolist() == [[1, 2], [3, 0]]
    assert len(server.requests) == 1
    assert server.requests[0]["body"] == {
        "job_id": JOB_ID,
        "step": 2,
        "groups": [
            {"prompt": "q1", "completions": ["a", "bb"], "answer": 4, "difficulty": "easy"},
            {"prompt": "q2", "completions": ["ccc", ""]},
        ],
    }
    assert server.requests[0]["headers"]["x-mtq-step"] == "2"


def test_batch_protocol_checks_each_group(server):
    server.replies = [{"json": {"rewards": [[1, 2], [3]]}}]
    spec = make_spec([endpoint(server.url, protocol="batch")])
    with build_scorer(spec, JOB_ID) as scorer, pytest.raises(RewardError) as err:
        scorer.score(0, [item(), item()], [["a", "b"], ["c", "d"]])
    assert str(err.value) == f"reward endpoint {server.url} (group 1) returned 1 rewards for 2 completions"


def test_timeout_then_success_on_retry(server):
    # longer than the timeout; the next request is answered at once (within 1 s even on a loaded CI)
    server.replies = [{"delay": 4.0}]
    spec = make_spec([endpoint(server.url, timeout=1.0, retries=2)])
    started = time.monotonic()
    with build_scorer(spec, JOB_ID) as scorer:
        rewards, _ = scorer.score(0, [item()], [["ab", "abc"]])
    assert rewards.tolist() == [[2, 3]]
    assert len(server.requests) == 2
    assert time.monotonic() - started < 4.0  # the retry did not wait for the first answer


def test_config_reward_timeout_is_the_default(server):
    """Without the config's 0.2 s the call would wait out the 1 s reply and succeed. On a loaded
    machine the deadline can pass while it connects (a cold CI run's once did)."""
    server.replies = [{"delay": 1.0}]
    spec = make_spec([endpoint(server.url, retries=0)], reward_timeout=0.2)
    with (build_scorer(spec, JOB_ID) as scorer,
          pytest.raises(RewardError, match="failed after 1 attempts: (Read|Connect)Timeout")):
        scorer.score(0, [item()], [["a"]])


def test_server_error_then_success(server):
    server.replies = [{"status": 500, "raw": "boom"}, {"status": 503, "raw": "busy"}]
    spec = make_spec([endpoint(server.url, retries=2)])
    with build_scorer(spec, JOB_ID) as scorer:
        rewards, _ = scorer.score(0, [item()], [["abcd"]])
    assert rewards.tolist() == [[4]]
    assert len(server.requests) == 3


def test_client_error_is_not_retried(server):
    server.replies = [{"status": 400, "raw": "bad prompt"}]
    spec = make_spec([endpoint(server.url, retries=3)])
    with build_scorer(spec, JOB_ID) as scorer, pytest.raises(RewardError) as err:
        scorer.score(0, [item()], [["a"]])
    assert str(err.value) == f"reward endpoint {server.url} rejected the request with HTTP 400: bad prompt"
    assert len(server.requests) == 1


def test_server_that_stays_down():
    url = closed_port_url()
    spec = make_spec([endpoint(url, retries=2, timeout=1.0)])
    with build_scorer(spec, JOB_ID) as scorer, pytest.raises(RewardError) as err:
        scorer.score(0, [item()], [["a"]])
    assert str(err.value).startswith(f"reward endpoint {url} failed after 3 attempts: ConnectError")


def test_server_errors_until_retries_run_out(server):
    server.replies = [{"status": 502, "raw": "bad gateway"}] * 2
    spec = make_spec([endpoint(server.url, retries=1)])
    with build_scorer(spec, JOB_ID) as scorer, pytest.raises(RewardError) as err:
        scorer.score(0, [item()], [["a"]])
    assert str(err.value) == f"reward endpoint {server.url} failed after 2 attempts: HTTP 502: bad gateway"


@pytest.mark.parametrize("reply, message", [
    ({"json": {"rewards": [1, 2, 3]}}, "returned 3 rewards for 4 completions"),
    ({"json": {"rewards": [1, "high", 3, 4]}}, "returned a non-number reward at index 1: 'high'"),
    ({"json": {"rewards": [1, True, 3, 4]}}, "returned a non-number reward at index 1: True"),
    ({"json": {"scores": [1, 2, 3, 4]}}, "returned JSON without a 'rewards' field"),
    ({"json": {"rewards": 4}}, "returned int instead of a list of 4 rewards"),
    ({"raw": "<html>oops</html>"}, "returned non-JSON: '<html>oops</html>'"),
])
def test_bad_answers_are_clear_errors(server, reply, message):
    server.replies = [reply]
    spec = make_spec([endpoint(server.url)])
    with build_scorer(spec, JOB_ID) as scorer, pytest.raises(RewardError) as err:
        scorer.score(0, [item()], [["a", "b", "c", "d"]])
    assert str(err.value).startswith(f"reward endpoint {server.url} {message}")
    assert len(server.requests) == 1  # a bad answer is not retried


def test_endpoint_none_means_does_not_apply(server):
    server.replies = [{"json": {"rewards": [1, None, 3]}}]
    spec = make_spec([endpoint(server.url, name="judge", weight=2.0)])
    with build_scorer(spec, JOB_ID) as scorer:
        rewards, metrics = scorer.score(0, [item()], [["a", "b", "c"]])
    # The middle completion has no reward from any source: NaN (TRL's "unscorable").
    assert rewards[0, [0, 2]].tolist() == [2.0, 6.0] and np.isnan(rewards[0, 1])
    assert metrics == {"rewards/judge/mean": 2.0, "rewards/judge/std": 1.0}


def test_invalid_config_reward_endpoint_is_a_reward_error():
    with pytest.raises(RewardError, match="not a valid http"):
        build_scorer(make_spec(reward_endpoint="not a url"), JOB_ID)
