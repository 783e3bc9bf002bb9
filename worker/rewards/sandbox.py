"""Python reward functions (TRL's convention: f(prompts=..., completions=..., **fields)): imported
only from the operator's allow-list, called with the prompt items' fields they name, for at most
the job's reward_timeout (`within`, which also bounds the JSON-schema reward), their answers
checked."""

import contextlib
import importlib
import inspect
import signal
import threading
from typing import Callable

from shared.reward_specs import python_reward_error
from worker.rewards.batch import Reward, RewardError, check_rewards

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


@contextlib.contextmanager
def within(seconds: float, what: str):
    """The reward's time limit (config.reward_timeout): a RewardError naming `what` past it."""
    try:
        with time_limit(seconds):
            yield
    except _TimedOut:
        raise RewardError(f"{what} timed out after {seconds:g}s (config.reward_timeout)") from None


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
        with within(timeout, f"reward function {path}"):
            values = function(prompts=prompts, completions=completions, **declared_fields(function, fields))
    except RewardError:
        raise
    except Exception as e:
        raise RewardError(f"reward function {path} raised {type(e).__name__}: {e}") from e
    return check_rewards(values, len(completions), f"reward function {path}")

