"""The reward endpoint protocol: POST a step's completions to a reward server, with retries,
and read its rewards (at most MTQ_MAX_REWARD_RESPONSE_BYTES of answer)."""

import json
import math
import time
from typing import Any, Callable

import httpx

from shared.metrics import recorder
from shared.reward_specs import EndpointReward, parse_reward_url
from worker.rewards.batch import Reward, RewardError, RewardStopped, ScoringBatch, check_rewards, prompt_as_json
from worker.rewards.guard import STOP_POLL_S, CallGuard

# Retry waits double from the source's backoff_s up to this, so a long outage of the
# reward server fails the job in bounded time instead of sleeping for minutes.
MAX_BACKOFF_S = 5.0

# HTTP answers worth another attempt: server-side trouble and rate limiting. Any other
# 4xx means the request itself is wrong, and sending it again would not help.
RETRYABLE_STATUS = frozenset({429}) | frozenset(range(500, 600))


def _snippet(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(error: Exception) -> str:
    # Some httpx errors (e.g. timeouts) have an empty message; the class name still says what happened.
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


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

