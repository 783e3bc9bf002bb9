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

Hostile specs are contained here: regexes run on RE2 (linear time), JSON schemas never
fetch a `$ref`, python functions run only from the operator's allow-list, and a reward
server is reached only at addresses MTQ_REWARD_HOSTS allows (checked on the resolved
address the socket then connects to), within a deadline per call, reading at most
MTQ_MAX_REWARD_RESPONSE_BYTES, and stopping when the job is cancelled.

This module must not import mlx: plain Python, numpy, httpx and jsonschema, so it can be
tested without a model.
"""

import contextlib
import importlib
import inspect
import json
import math
import numbers
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpcore
import httpx
import jsonschema
import numpy as np
import referencing
import referencing.exceptions
from pydantic import ValidationError

from shared.metrics import recorder
from shared.reward_specs import (
    ContainsReward,
    EndpointReward,
    ExactMatchReward,
    JsonValidReward,
    LengthReward,
    MathAnswerReward,
    PythonReward,
    RegexReward,
    RewardModelReward,
    address_allowed,
    compile_regex,
    parse_reward_url,
    python_reward_error,
)
from shared.schemas import JobCreate, PromptItem
from shared.settings import Settings, load_settings

# Retry waits double from the source's backoff_s up to this, so a long outage of the
# reward server fails the job in bounded time instead of sleeping for minutes.
MAX_BACKOFF_S = 5.0

# HTTP answers worth another attempt: server-side trouble and rate limiting. Any other
# 4xx means the request itself is wrong, and sending it again would not help.
RETRYABLE_STATUS = frozenset({429}) | frozenset(range(500, 600))

# While waiting on a reward server, the job's cancel flag is looked at this often.
STOP_POLL_S = 0.25

Reward = float | None  # None: the source does not apply to this completion
Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP addresses


class RewardError(Exception):
    """User-facing message; the job fails with str(err)."""


class RewardStopped(Exception):
    """The job was cancelled (should_stop) while a reward was being computed."""


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


def regex_rewards(completions: list[str], pattern: Any, mode: str = "search") -> list[float]:
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


def _refuse_retrieval(uri: str):
    raise referencing.exceptions.NoSuchResource(ref=uri)


def make_json_validator(schema: dict | None) -> jsonschema.protocols.Validator | None:
    """A validator for the schema's own draft (checked at submission, see reward_specs).
    Its registry retrieves nothing: a `$ref` resolves only inside the schema, never by
    fetching a URL (jsonschema's default would)."""
    if schema is None:
        return None
    return jsonschema.validators.validator_for(schema)(schema, registry=referencing.Registry(retrieve=_refuse_retrieval))


def json_valid_rewards(completions: list[str], validator: jsonschema.protocols.Validator | None = None) -> list[float]:
    """1.0 where the completion (or its first ``` code fence) is JSON that the validator accepts."""
    def score_one(completion: str) -> float:
        fenced = _CODE_FENCE_RE.search(completion)
        text = fenced.group(1) if fenced else completion
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return 0.0
        try:
            return 1.0 if validator is None or validator.is_valid(value) else 0.0
        except referencing.exceptions.Unresolvable as e:
            raise RewardError(f"json_valid reward: the schema's reference {e.ref!r} does not resolve inside the schema") from None

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


def load_reward_function(path: str, allowed_modules: tuple[str, ...]) -> Callable:
    """Import 'module:function' if the operator allows it (an `mtq.rewards` entry point or
    MTQ_REWARD_MODULES; the API checked already, this is the worker's own check); a
    RewardError naming what is wrong otherwise."""
    error = python_reward_error(path, allowed_modules)
    if error:
        raise RewardError(error)
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # ImportError, but also whatever the module raises while loading
        raise RewardError(f"reward function {path}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RewardError(f"reward function {path}: module {module_name!r} has no function {function_name!r}")
    return function


class _TimedOut(BaseException):
    """Raised into a reward function that ran past its time (a BaseException: `except Exception` in
    the function does not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Interrupt Python code running longer than `seconds` (SIGALRM; the job runs on the main
    thread). Native code that never returns to Python is caught by the worker's supervisor."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _TimedOut()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def declared_fields(function: Callable, fields: dict[str, list]) -> dict[str, list]:
    """The prompt-item fields the function receives: those it names as parameters, and all
    of them if it takes **kwargs (TRL's convention). `prompts` and `completions` are never
    taken from the items, so an item cannot replace them."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): fields stay out
        return {}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in fields.items() if k not in ("prompts", "completions") and (takes_any or k in named)}


def call_reward_function(
    function: Callable, path: str, prompts: list, completions: list[str], fields: dict[str, list],
    timeout: float = 30.0,
) -> list[Reward]:
    """Call it the way TRL calls reward functions: f(prompts=..., completions=..., **fields),
    for at most `timeout` seconds."""
    try:
        with time_limit(timeout):
            values = function(prompts=prompts, completions=completions, **declared_fields(function, fields))
    except _TimedOut:
        raise RewardError(f"reward function {path} timed out after {timeout:g}s (config.reward_timeout)") from None
    except Exception as e:
        raise RewardError(f"reward function {path} raised {type(e).__name__}: {e}") from e
    return check_rewards(values, len(completions), f"reward function {path}")


def _snippet(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(error: Exception) -> str:
    # Some httpx errors (e.g. timeouts) have an empty message; the class name still says what happened.
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def resolve_host(host: str, port: int) -> list[str]:
    """The host's IP addresses (an IP literal resolves to itself)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


class CallGuard(httpcore.SyncBackend):
    """httpcore's network backend for reward calls. It resolves the host itself, checks
    every address against MTQ_REWARD_HOSTS, and connects the socket to a checked address,
    so DNS cannot answer one thing to the check and another to the connection (rebinding).
    Every read and write honours the current call's deadline (connect + all reads: a
    server trickling bytes cannot stretch it) and stops when should_stop() says so."""

    def __init__(self, allowed_hosts: tuple[str, ...], resolver: Resolver):
        self.allowed_hosts = allowed_hosts
        self.resolver = resolver
        self.deadline = math.inf
        self.should_stop: Callable[[], bool] = lambda: False

    def time_left(self, timeout: float | None) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ReadTimeout("the reward call's deadline passed")
        if self.should_stop():
            raise RewardStopped()
        return min(left, STOP_POLL_S) if timeout is None else min(left, STOP_POLL_S, timeout)

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        try:
            addresses = self.resolver(host, port)
        except OSError as e:
            raise httpcore.ConnectError(f"cannot resolve {host}: {e}") from e
        refused = [a for a in addresses if not address_allowed(a, self.allowed_hosts)]
        if refused or not addresses:
            raise RewardError(
                f"reward host {host!r} resolves to {refused[0] if refused else 'no address'}, which MTQ_REWARD_HOSTS "
                f"does not allow ({','.join(self.allowed_hosts)})"
            )
        connect_timeout = min(self.deadline - time.monotonic(), timeout or math.inf)
        if connect_timeout <= 0:
            raise httpcore.ConnectTimeout("the reward call's deadline passed")
        error: Exception | None = None
        for address in addresses:
            try:
                stream = super().connect_tcp(address, port, connect_timeout, local_address, socket_options)
                return GuardedStream(stream, self)
            except httpcore.ConnectError as e:
                error = e
        raise error  # type: ignore[misc]


class GuardedStream(httpcore.NetworkStream):
    """A connection whose reads wait in short slices, so the call's deadline and the job's
    cancel are looked at while a server keeps us waiting."""

    def __init__(self, stream: httpcore.NetworkStream, guard: CallGuard):
        self.stream, self.guard = stream, guard

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        started = time.monotonic()
        while True:
            try:
                return self.stream.read(max_bytes, self.guard.time_left(timeout))
            except httpcore.ReadTimeout:
                if timeout is not None and time.monotonic() - started >= timeout:
                    raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        left = self.guard.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.WriteTimeout("the reward call's deadline passed")
        self.stream.write(buffer, left if timeout is None else min(left, timeout))

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> "GuardedStream":
        left = max(self.guard.deadline - time.monotonic(), 0.001)
        return GuardedStream(self.stream.start_tls(ssl_context, server_hostname, left if timeout is None else min(left, timeout)), self.guard)

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


def guarded_client(guard: CallGuard) -> httpx.Client:
    """An httpx client whose connections all go through the guard. No proxies from the
    environment (a proxy would resolve the host itself), no redirects."""
    transport = httpx.HTTPTransport(trust_env=False)
    # httpx has no option for httpcore's network backend, so its pool is made again with one.
    transport._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(), network_backend=guard)
    return httpx.Client(transport=transport, trust_env=False, follow_redirects=False)


class EndpointCaller:
    """Asks a reward server for the rewards of one step, with retries."""

    def __init__(self, source: EndpointReward, client: httpx.Client, guard: CallGuard, timeout: float, max_bytes: int):
        self.source = source
        self.client = client
        self.guard = guard
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.url = parse_reward_url(source.url)  # the same parser the API checked it with
        self.who = f"reward endpoint {source.url}"

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
        """POST the body; return the answer's `rewards` value (not yet checked). Each attempt
        has `timeout` seconds in all; waits between attempts end early on cancel."""
        headers = {"X-MTQ-Job-Id": batch.job_id, "X-MTQ-Step": str(batch.step), "Accept-Encoding": "identity"}
        attempts = self.source.retries + 1
        cause = ""
        for attempt in range(attempts):
            if attempt:
                self._wait(min(self.source.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S), batch.should_stop)
            self.guard.deadline = time.monotonic() + self.timeout
            self.guard.should_stop = batch.should_stop
            started = time.perf_counter()
            try:
                with self.client.stream("POST", self.url, json=body, headers=headers, timeout=self.timeout) as response:
                    content = self._read_capped(response)
            except httpx.TransportError as e:  # refused, unreachable, timed out, connection dropped
                cause = _describe(e)
                recorder.count("mtq_reward_endpoint_errors_total")
                continue
            finally:
                self.guard.deadline = math.inf
                recorder.observe("mtq_reward_endpoint_seconds", time.perf_counter() - started)
            text = content.decode(errors="replace")
            if response.status_code in RETRYABLE_STATUS:
                cause = f"HTTP {response.status_code}: {_snippet(text)}"
                recorder.count("mtq_reward_endpoint_errors_total")
                continue
            if not response.is_success:  # other 4xx, and 3xx: redirects are not followed
                recorder.count("mtq_reward_endpoint_errors_total")
                raise RewardError(f"{self.who} rejected the request with HTTP {response.status_code}: {_snippet(text)}")
            try:
                return self._rewards_field(content)
            except RewardError:
                recorder.count("mtq_reward_endpoint_errors_total")
                raise
        raise RewardError(f"{self.who} failed after {attempts} attempts: {cause}")

    def _read_capped(self, response: httpx.Response) -> bytes:
        if response.headers.get("content-encoding", "identity") != "identity":
            raise RewardError(f"{self.who} answered with content-encoding {response.headers['content-encoding']!r}; send identity")
        chunks, size = [], 0
        for chunk in response.iter_raw():
            size += len(chunk)
            if size > self.max_bytes:
                raise RewardError(f"{self.who} answered more than {self.max_bytes} bytes (MTQ_MAX_REWARD_RESPONSE_BYTES)")
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _wait(seconds: float, should_stop: Callable[[], bool]) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if should_stop():
                raise RewardStopped()
            time.sleep(min(left, STOP_POLL_S))

    def _rewards_field(self, content: bytes) -> Any:
        text = content.decode(errors="replace")
        try:
            answer = json.loads(content)
        except (ValueError, RecursionError):
            raise RewardError(f"{self.who} returned non-JSON: {_snippet(text)!r}") from None
        if not isinstance(answer, dict) or "rewards" not in answer:
            raise RewardError(f"{self.who} returned JSON without a 'rewards' field: {_snippet(text)}")
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
    should_stop: Callable[[], bool] = lambda: False

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


def _bind(source, scorer: "RewardScorer") -> RewardFn:
    """The function that computes this source's flat rewards for a step. Anything that can
    be done once (compile a regex, import a module) is done here, at job start."""
    if isinstance(source, LengthReward):
        return lambda b: length_rewards(b.flat_completions(), source.unit, source.target, b.flat_token_counts())
    if isinstance(source, RegexReward):
        try:
            pattern = compile_regex(source.pattern)
        except ValueError as e:
            raise RewardError(str(e)) from None
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
        function = load_reward_function(source.function, scorer.settings.reward_modules)
        return lambda b: call_reward_function(
            function, source.function, b.flat_prompts(), b.flat_completions(), b.flat_fields(), scorer.default_timeout)
    if isinstance(source, EndpointReward):
        timeout = source.timeout or scorer.default_timeout
        return EndpointCaller(source, scorer.client(), scorer.guard, timeout, scorer.settings.max_reward_response_bytes).rewards
    if isinstance(source, RewardModelReward):
        from worker.scoring import reward_model_rewards  # MLX: only in the training process

        def reward_model(b: ScoringBatch) -> list[Reward]:
            prompts = [p if isinstance(p, str) else "\n".join(m["content"] for m in p) for p in b.flat_prompts()]
            return reward_model_rewards(scorer.settings, source.model_id, source.adapter_name, prompts, b.flat_completions())

        return reward_model
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

    def __init__(
        self, sources: list, job_id: str, default_timeout: float = 30.0,
        settings: Settings | None = None, resolver: Resolver = resolve_host,
    ):
        self.sources = _with_unique_names(sources)
        self.job_id = job_id
        self.default_timeout = default_timeout
        self.settings = settings or load_settings()
        self.guard = CallGuard(self.settings.reward_hosts, resolver)
        self._client: httpx.Client | None = None
        try:
            self._reward_fns = [_bind(s, self) for s in self.sources]
        except BaseException:
            self.close()
            raise

    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = guarded_client(self.guard)
        return self._client

    def score(
        self, step: int, items: list[PromptItem], completions: list[list[str]],
        *, token_counts: list[list[int]] | None = None, should_stop: Callable[[], bool] = lambda: False,
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Rewards of shape (B, G) as float32 (weighted sum over sources, None counting as 0;
        NaN where every source returned None) and per-source metrics {"rewards/<name>/mean", "rewards/<name>/std"} over the values
        that apply (left out when none does). token_counts: generated tokens per completion,
        needed by length sources with unit 'tokens'. should_stop: the job's cancel flag,
        looked at while waiting on a reward server (RewardStopped when it is set)."""
        _check_shapes(items, completions, token_counts)
        batch = ScoringBatch(self.job_id, step, items, completions, token_counts, should_stop)
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


def build_scorer(spec: JobCreate, job_id: str, settings: Settings | None = None, resolver: Resolver = resolve_host) -> RewardScorer:
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
    return RewardScorer(sources, job_id, default_timeout=spec.config.reward_timeout, settings=settings, resolver=resolver)
