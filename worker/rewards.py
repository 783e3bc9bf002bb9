"""Reward sources of a GRPO job: resolved once at job start, asked for rewards every step.

Where the sources come from (build_scorer):
  1. `JobCreate.reward` if given (see shared/reward_specs.py for every type and option);
  2. else `config.reward_endpoint` if set: the seed server's protocol,
     POST {prompt, completions} -> {rewards}, one request per prompt group;
  3. else the completion's length in characters (the seed server's fallback).

Every source gives one value per completion: a float, or None meaning "does not apply"
(TRL's convention, e.g. exact_match on a prompt item without an `answer`). A completion's
reward is the weighted sum over the sources, a None counting as 0; a completion for which
every source returns None has reward NaN (TRL: unscorable; the trainer leaves it out of its
group's statistics and gives it advantage 0).

Metrics: for each source, `rewards/<name>/mean` and `rewards/<name>/std` (population std)
over the values that apply. When no value of a source applies in a step, both are left
out of that step's metrics: no NaN, and no made-up 0 that would drag a chart down.

Errors a user can fix (a reward endpoint that is down, a reward function that raises or
returns garbage, a module that does not import) are RewardError; the job fails with its
message. Mistakes of the caller (mismatched shapes, missing token counts) are ValueError.

This module must not import mlx: plain Python, numpy, httpx and jsonschema, so it can be
tested without a model.
"""

import importlib
import json
import math
import numbers
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import jsonschema
import numpy as np
from pydantic import ValidationError

from shared.reward_specs import (
    ContainsReward,
    EndpointReward,
    ExactMatchReward,
    JsonValidReward,
    LengthReward,
    MathAnswerReward,
    PythonReward,
    RegexReward,
)
from shared.schemas import JobCreate, PromptItem

# Retry waits double from the source's backoff_s up to this, so a long outage of the
# reward server fails the job in bounded time instead of sleeping for minutes.
MAX_BACKOFF_S = 5.0

# HTTP answers worth another attempt: server-side trouble and rate limiting. Any other
# 4xx means the request itself is wrong, and sending it again would not help.
RETRYABLE_STATUS = frozenset({429}) | frozenset(range(500, 600))

Reward = float | None  # None: the source does not apply to this completion


class RewardError(Exception):
    """User-facing message; the job fails with str(err)."""


# ----------------------------------------------------------------------------------------
# Built-in reward functions. Each takes the step's completions as one flat list and
# returns one reward per completion, so each can be tested on hand-made strings.
# ----------------------------------------------------------------------------------------


def length_rewards(
    completions: list[str], unit: str = "chars", target: int | None = None,
    token_counts: list[int] | None = None,
) -> list[float]:
    """The completion's length in characters or tokens; with a target, -|length - target|."""
    if unit == "tokens":
        if token_counts is None:
            raise ValueError("a length reward in tokens needs token_counts (generated tokens per completion)")
        lengths = token_counts
    else:
        lengths = [len(c) for c in completions]
    if target is None:
        return [float(n) for n in lengths]
    return [-float(abs(n - target)) for n in lengths]


def regex_rewards(completions: list[str], pattern: re.Pattern, mode: str = "search") -> list[float]:
    """1.0 where the compiled pattern matches (anywhere, or the whole text for 'fullmatch')."""
    matches = pattern.fullmatch if mode == "fullmatch" else pattern.search
    return [1.0 if matches(c) else 0.0 for c in completions]


def _score_against_references(
    completions: list[str], references: list[Any], score_one: Callable[[str, Any], Reward],
) -> list[Reward]:
    """score_one(completion, reference) for each completion; None where there is no reference."""
    return [None if ref is None else score_one(c, ref) for c, ref in zip(completions, references, strict=True)]


def _normalise_text(text: str, strip: bool, case_sensitive: bool) -> str:
    text = text.strip() if strip else text
    return text if case_sensitive else text.casefold()


def exact_match_rewards(
    completions: list[str], references: list[Any], strip: bool = True, case_sensitive: bool = True,
) -> list[Reward]:
    """1.0 where the completion equals the reference; None where the item has no reference."""
    def score_one(completion: str, reference: Any) -> float:
        same = _normalise_text(completion, strip, case_sensitive) == _normalise_text(str(reference), strip, case_sensitive)
        return 1.0 if same else 0.0

    return _score_against_references(completions, references, score_one)


def contains_rewards(
    completions: list[str], references: list[Any], strip: bool = True, case_sensitive: bool = True,
) -> list[Reward]:
    """1.0 where the completion contains the reference; None where the item has no reference."""
    def score_one(completion: str, reference: Any) -> float:
        needle = _normalise_text(str(reference), strip, case_sensitive)
        return 1.0 if needle in _normalise_text(completion, False, case_sensitive) else 0.0

    return _score_against_references(completions, references, score_one)


# A number as people and LaTeX write it: optional sign, thousands separators, decimals.
# A '-' or '+' right after a word, digit or closing bracket is an operator ("10-3"), not a sign.
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
_SIGNED = rf"(?:(?<![\w.)}}])[-+\u2212])?{_UNSIGNED}"
_NUMBER_RE = re.compile(
    rf"\\[dt]?frac\s*\{{\s*(?P<frac_num>{_SIGNED})\s*\}}\s*\{{\s*(?P<frac_den>{_SIGNED})\s*\}}"  # \frac{3}{4}
    rf"|(?P<num>{_SIGNED})\s*/\s*(?P<den>{_UNSIGNED})"  # 3/4
    rf"|(?P<value>{_SIGNED})"  # 1,000.5
)
_BOXED_RE = re.compile(r"\\boxed\s*\{")


def _last_boxed_content(text: str) -> str | None:
    """What is inside the last \\boxed{...} (braces may nest); None if there is none or it is unclosed."""
    starts = list(_BOXED_RE.finditer(text))
    if not starts:
        return None
    depth = 1
    begin = starts[-1].end()
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None


def _to_float(number: str) -> float:
    return float(number.replace(",", "").replace("\u2212", "-"))


def _number_value(match: re.Match) -> float | None:
    if match["frac_num"] is not None:
        numerator, denominator = _to_float(match["frac_num"]), _to_float(match["frac_den"])
    elif match["num"] is not None:
        numerator, denominator = _to_float(match["num"]), _to_float(match["den"])
    else:
        return _to_float(match["value"])
    return None if denominator == 0 else numerator / denominator


def extract_math_answer(text: str) -> float | None:
    """The final answer of a worked solution: the last number inside the last \\boxed{...}
    if there is one, else the last number of the text. None when there is no number.

    Formatting is ignored: '$', '%', thousands separators ('1,000', LaTeX '1{,}000' and
    '1\\,000'), a leading '+', '4.0' vs '4'; '3/4' and '\\frac{3}{4}' are read as 0.75.
    """
    boxed = _last_boxed_content(text)
    text = text if boxed is None else boxed
    text = text.replace("{,}", ",").replace("\\,", "").replace("\\!", "").replace("$", "")
    matches = list(_NUMBER_RE.finditer(text))
    return _number_value(matches[-1]) if matches else None


def _reference_number(reference: Any) -> float | None:
    """The expected answer as a float: a JSON number, or a string read like a completion."""
    if isinstance(reference, bool):
        return None
    if isinstance(reference, numbers.Real):
        return float(reference)
    if isinstance(reference, str):
        return extract_math_answer(reference)
    return None


def math_answer_rewards(completions: list[str], references: list[Any], tolerance: float = 1e-6) -> list[Reward]:
    """1.0 where the completion's final number equals the reference within tolerance, else 0.0
    (also when it has no number). None where the item has no usable numeric reference."""
    def score_one(completion: str, reference: Any) -> Reward:
        expected = _reference_number(reference)
        if expected is None:
            return None
        got = extract_math_answer(completion)
        return 1.0 if got is not None and math.isclose(got, expected, rel_tol=tolerance, abs_tol=tolerance) else 0.0

    return _score_against_references(completions, references, score_one)


_CODE_FENCE_RE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


def make_json_validator(schema: dict | None) -> jsonschema.protocols.Validator | None:
    """A validator for the schema's own draft (checked at submission, see reward_specs)."""
    return None if schema is None else jsonschema.validators.validator_for(schema)(schema)


def json_valid_rewards(completions: list[str], validator: jsonschema.protocols.Validator | None = None) -> list[float]:
    """1.0 where the completion (or its first ``` code fence) is JSON that the validator accepts."""
    def score_one(completion: str) -> float:
        fenced = _CODE_FENCE_RE.search(completion)
        text = fenced.group(1) if fenced else completion
        try:
            value = json.loads(text)
        except ValueError:
            return 0.0
        return 1.0 if validator is None or validator.is_valid(value) else 0.0

    return [score_one(c) for c in completions]


# ----------------------------------------------------------------------------------------
# Rewards from outside: a Python function (TRL's convention) and an HTTP endpoint.
# ----------------------------------------------------------------------------------------


def check_rewards(values: Any, expected_count: int, who: str) -> list[Reward]:
    """Rewards from user code or a server, as floats/None; else a RewardError naming `who`."""
    if isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"{who} returned {type(values).__name__} instead of a list of {expected_count} rewards")
    if len(values) != expected_count:
        raise RewardError(f"{who} returned {len(values)} rewards for {expected_count} completions")
    checked: list[Reward] = []
    for i, value in enumerate(values):
        # bool is an int to Python, but True as a reward is almost surely a bug.
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)):
            raise RewardError(f"{who} returned a non-number reward at index {i}: {value!r:.100}")
        checked.append(None if value is None else float(value))
    return checked


def load_reward_function(path: str) -> Callable:
    """Import 'module:function'; a RewardError naming what is missing if that fails."""
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, but also whatever the module raises while loading
        raise RewardError(f"reward function {path}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RewardError(f"reward function {path}: module {module_name!r} has no function {function_name!r}")
    return function


def call_reward_function(
    function: Callable, path: str, prompts: list, completions: list[str], fields: dict[str, list],
) -> list[Reward]:
    """Call it the way TRL calls reward functions: f(prompts=..., completions=..., **fields)."""
    try:
        values = function(prompts=prompts, completions=completions, **fields)
    except Exception as e:
        raise RewardError(f"reward function {path} raised {type(e).__name__}: {e}") from e
    return check_rewards(values, len(completions), f"reward function {path}")


def _snippet(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(error: Exception) -> str:
    # Some httpx errors (e.g. timeouts) have an empty message; the class name still says what happened.
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class EndpointCaller:
    """Asks a reward server for the rewards of one step, with retries."""

    def __init__(self, source: EndpointReward, client: httpx.Client, timeout: float):
        self.source = source
        self.client = client
        self.timeout = timeout
        self.url = str(source.url)
        self.who = f"reward endpoint {self.url}"

    def rewards(self, batch: "ScoringBatch") -> list[Reward]:
        if self.source.protocol == "batch":
            return self._one_request_per_step(batch)
        return self._one_request_per_group(batch)

    def _one_request_per_group(self, batch: "ScoringBatch") -> list[Reward]:
        """The seed server's protocol: {prompt, completions} -> {rewards: [G numbers]}."""
        rewards: list[Reward] = []
        for item, group in zip(batch.items, batch.completions):
            body = {"prompt": prompt_as_json(item), "completions": group, "job_id": batch.job_id, "step": batch.step}
            rewards += check_rewards(self._post(body, batch), len(group), self.who)
        return rewards

    def _one_request_per_step(self, batch: "ScoringBatch") -> list[Reward]:
        """{job_id, step, groups: [{prompt, completions, <item fields>}]} -> {rewards: [[G numbers] per group]}."""
        # prompt/completions are written last so an item field of the same name cannot replace them.
        groups = [
            {**(item.model_extra or {}), "prompt": prompt_as_json(item), "completions": group}
            for item, group in zip(batch.items, batch.completions)
        ]
        answer = self._post({"job_id": batch.job_id, "step": batch.step, "groups": groups}, batch)
        if not isinstance(answer, list) or len(answer) != len(groups):
            count = len(answer) if isinstance(answer, list) else type(answer).__name__
            raise RewardError(f"{self.who} returned {count} reward lists for {len(groups)} groups")
        rewards: list[Reward] = []
        for i, (group_rewards, group) in enumerate(zip(answer, batch.completions)):
            rewards += check_rewards(group_rewards, len(group), f"{self.who} (group {i})")
        return rewards

    def _post(self, body: dict, batch: "ScoringBatch") -> Any:
        """POST the body; return the answer's `rewards` value (not yet checked)."""
        headers = {"X-MTQ-Job-Id": batch.job_id, "X-MTQ-Step": str(batch.step)}
        attempts = self.source.retries + 1
        cause = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(self.source.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                response = self.client.post(self.url, json=body, headers=headers, timeout=self.timeout)
            except httpx.TransportError as e:  # refused, unreachable, timed out, connection dropped
                cause = _describe(e)
                continue
            if response.status_code in RETRYABLE_STATUS:
                cause = f"HTTP {response.status_code}: {_snippet(response.text)}"
                continue
            if not response.is_success:  # other 4xx, and 3xx: redirects are not followed
                raise RewardError(f"{self.who} rejected the request with HTTP {response.status_code}: {_snippet(response.text)}")
            return self._rewards_field(response)
        raise RewardError(f"{self.who} failed after {attempts} attempts: {cause}")

    def _rewards_field(self, response: httpx.Response) -> Any:
        try:
            answer = response.json()
        except ValueError:
            raise RewardError(f"{self.who} returned non-JSON: {_snippet(response.text)!r}") from None
        if not isinstance(answer, dict) or "rewards" not in answer:
            raise RewardError(f"{self.who} returned JSON without a 'rewards' field: {_snippet(response.text)}")
        return answer["rewards"]


# ----------------------------------------------------------------------------------------
# One step's data, and the scorer that combines the sources.
# ----------------------------------------------------------------------------------------


def prompt_as_json(item: PromptItem) -> str | list[dict]:
    """The prompt as the user gave it: a string, or a list of {role, content} messages."""
    return item.prompt if isinstance(item.prompt, str) else [m.model_dump() for m in item.prompt]


@dataclass
class ScoringBatch:
    """One step's B prompt items and their B groups of G completions, flattened on demand
    (flat lists have B*G entries, group by group, as TRL passes them)."""

    job_id: str
    step: int
    items: list[PromptItem]
    completions: list[list[str]]
    token_counts: list[list[int]] | None = None

    def per_completion(self, per_group: list) -> list:
        """Repeat each group's value once per completion of that group."""
        return [value for value, group in zip(per_group, self.completions) for _ in group]

    def flat_completions(self) -> list[str]:
        return [c for group in self.completions for c in group]

    def flat_prompts(self) -> list:
        return self.per_completion([prompt_as_json(item) for item in self.items])

    def flat_field(self, name: str) -> list:
        """An extra field of the prompt items (e.g. `answer`), None where an item lacks it."""
        return self.per_completion([(item.model_extra or {}).get(name) for item in self.items])

    def flat_fields(self) -> dict[str, list]:
        """Every extra field that any item has (TRL's dataset columns)."""
        names = dict.fromkeys(name for item in self.items for name in item.model_extra or {})
        return {name: self.flat_field(name) for name in names}

    def flat_token_counts(self) -> list[int] | None:
        return None if self.token_counts is None else [n for group in self.token_counts for n in group]


RewardFn = Callable[[ScoringBatch], list[Reward]]


def _bind(source, client: httpx.Client | None, default_timeout: float) -> RewardFn:
    """The function that computes this source's flat rewards for a step. Anything that can
    be done once (compile a regex, import a module) is done here, at job start."""
    if isinstance(source, LengthReward):
        return lambda b: length_rewards(b.flat_completions(), source.unit, source.target, b.flat_token_counts())
    if isinstance(source, RegexReward):
        pattern = re.compile(source.pattern)
        return lambda b: regex_rewards(b.flat_completions(), pattern, source.mode)
    if isinstance(source, ExactMatchReward):
        return lambda b: exact_match_rewards(b.flat_completions(), b.flat_field(source.field), source.strip, source.case_sensitive)
    if isinstance(source, ContainsReward):
        return lambda b: contains_rewards(b.flat_completions(), b.flat_field(source.field), source.strip, source.case_sensitive)
    if isinstance(source, MathAnswerReward):
        return lambda b: math_answer_rewards(b.flat_completions(), b.flat_field(source.field), source.tolerance)
    if isinstance(source, JsonValidReward):
        validator = make_json_validator(source.json_schema)
        return lambda b: json_valid_rewards(b.flat_completions(), validator)
    if isinstance(source, PythonReward):
        function = load_reward_function(source.function)
        return lambda b: call_reward_function(function, source.function, b.flat_prompts(), b.flat_completions(), b.flat_fields())
    if isinstance(source, EndpointReward):
        return EndpointCaller(source, client, timeout=source.timeout or default_timeout).rewards
    raise TypeError(f"unknown reward source {type(source).__name__}")


def _with_unique_names(sources: list) -> list:
    """Copies of the sources whose metric names are unique: a second 'regex' becomes 'regex_2'."""
    taken: set[str] = set()
    unique = []
    for source in sources:
        name, n = source.metric_name, 1
        while name in taken:
            n += 1
            name = f"{source.metric_name}_{n}"
        taken.add(name)
        unique.append(source if name == source.metric_name else source.model_copy(update={"name": name}))
    return unique


def _check_shapes(items: list, completions: list[list[str]], token_counts: list[list[int]] | None) -> None:
    if not items or len(items) != len(completions):
        raise ValueError(f"need one group of completions per prompt item: {len(items)} items, {len(completions)} groups")
    if token_counts is not None and [len(g) for g in token_counts] != [len(g) for g in completions]:
        raise ValueError("token_counts must have the same shape as completions")
    if len({len(g) for g in completions}) != 1:
        raise ValueError("every group must have the same number of completions")


class RewardScorer:
    """Computes a step's rewards from the job's sources. Close it (or use `with`) when the job ends."""

    def __init__(self, sources: list, job_id: str, default_timeout: float = 30.0):
        self.sources = _with_unique_names(sources)
        self.job_id = job_id
        needs_http = any(isinstance(s, EndpointReward) for s in self.sources)
        self._client = httpx.Client() if needs_http else None
        try:
            self._reward_fns = [_bind(s, self._client, default_timeout) for s in self.sources]
        except BaseException:
            self.close()
            raise

    def score(
        self, step: int, items: list[PromptItem], completions: list[list[str]],
        *, token_counts: list[list[int]] | None = None,
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Rewards of shape (B, G) as float32 (weighted sum over sources, None counting as 0;
        NaN where every source returned None) and per-source metrics {"rewards/<name>/mean", "rewards/<name>/std"} over the values
        that apply (left out when none does). token_counts: generated tokens per completion,
        needed by length sources with unit 'tokens'."""
        _check_shapes(items, completions, token_counts)
        batch = ScoringBatch(self.job_id, step, items, completions, token_counts)
        total = np.zeros(sum(len(g) for g in completions), dtype=np.float64)
        scored = np.zeros(total.shape, dtype=bool)
        metrics: dict[str, float] = {}
        for source, reward_fn in zip(self.sources, self._reward_fns):
            values = reward_fn(batch)
            total += source.weight * np.array([0.0 if v is None else v for v in values], dtype=np.float64)
            scored |= np.array([v is not None for v in values])
            applied = [v for v in values if v is not None]
            if applied:
                metrics[f"rewards/{source.metric_name}/mean"] = float(np.mean(applied))
                metrics[f"rewards/{source.metric_name}/std"] = float(np.std(applied))
        total[~scored] = np.nan
        return total.reshape(len(completions), -1).astype(np.float32), metrics

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_scorer(spec: JobCreate, job_id: str) -> RewardScorer:
    """Resolve the job's reward sources (spec.reward; else config.reward_endpoint; else length
    in characters) and prepare them: python sources are imported here, so that a misspelt
    module fails the job at start with a RewardError naming it."""
    if spec.reward:
        sources = list(spec.reward)
    elif spec.config.reward_endpoint:
        try:
            sources = [EndpointReward(url=spec.config.reward_endpoint, name="endpoint")]
        except ValidationError:
            raise RewardError(f"config.reward_endpoint {spec.config.reward_endpoint!r} is not a valid http(s) URL") from None
    else:
        sources = [LengthReward(name="length")]
    return RewardScorer(sources, job_id, default_timeout=spec.config.reward_timeout)
