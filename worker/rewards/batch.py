"""What a reward source is given and what it gives back: one step's completions (ScoringBatch),
one Reward per completion (a float, or None: "does not apply"), checked by check_rewards, and
how a source fails (RewardError: the job fails with its message; RewardStopped: the job was
cancelled while a reward was computed)."""

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from shared.schemas import PromptItem

Reward = float | None  # None: the source does not apply to this completion


class RewardError(Exception):
    """User-facing message; the job fails with str(err)."""


class RewardStopped(Exception):
    """The job was cancelled (should_stop) while a reward was being computed."""


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
