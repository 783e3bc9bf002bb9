"""An episode's host side, one per row of a step: what answers each of the model's turns.

The rollout (worker/decode/episodes.py) calls `start()` once before the first turn, then
`after_turn(text)` with each turn's text (its EOS left out, special tokens kept), from a pool
of tool_parallelism threads, so an Episode's methods block and never touch MLX. `close()` is
called once the step's rollout ends, also when it is cancelled or fails.
"""

from dataclasses import dataclass, field
from typing import Protocol

CHARS_PER_TOKEN = 8  # what a tool's output or an observation is cut to before it is tokenised: max_tool_output_tokens of these


@dataclass
class Reply:
    """What answers one model turn."""

    messages: list[dict] = field(default_factory=list)  # appended to the conversation ({role: tool|user, content})
    done: bool = True  # the episode ends here: no further model turn
    reward: float | None = None  # the environment's reward for this turn (None: it gave none)
    tool_calls: int = 0  # tool calls the turn made (well-formed or not)
    tool_errors: int = 0  # of them, those answered with an error message (malformed, unknown, raised, timed out)


class EpisodeFailed(Exception):
    """The episode cannot go on and the job must fail (an environment down or answering
    nonsense); the message names what failed. A tool's own failure is a Reply, never this."""


class Episode(Protocol):
    def start(self) -> list[dict]:
        """Messages appended to the prompt before the first turn (an environment's first
        observation); [] for none."""

    def after_turn(self, text: str) -> Reply:
        """The answer to the model's turn."""

    def close(self) -> None:
        """Release what the episode holds (an environment session)."""
