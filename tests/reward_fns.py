"""Reward functions for tests/test_rewards.py, named there as python sources ("reward_fns:...")."""


def answer_length_match(prompts, completions, answer, **fields):
    """1.0 where the completion is as long as the item's answer; None for items without one."""
    return [None if a is None else float(len(c) == len(str(a))) for c, a in zip(completions, answer)]


def echo_inputs(prompts, completions, **fields):
    """Records what it was called with, so a test can check the TRL-style arguments."""
    echo_inputs.calls.append({"prompts": prompts, "completions": completions, **fields})
    return [0.5] * len(completions)


echo_inputs.calls = []


def raises(prompts, completions, **fields):
    raise ZeroDivisionError("division by zero")


def too_few(prompts, completions, **fields):
    return [1.0] * (len(completions) - 1)


def not_numbers(prompts, completions, **fields):
    return ["good"] * len(completions)


def share_of_e(prompts, completions, **fields):
    """The share of the letter 'e' among a completion's characters (0 for an empty one): a
    toy task the tiny random-weight model learns in tens of GRPO steps (tests/test_trainer.py)."""
    return [c.count("e") / len(c) if c else 0.0 for c in completions]


def length_plus_answer(prompts, completions, answer, **fields):
    """A tenth of the completion's length plus the item's answer (0 where it has none), so an
    end-to-end test can recompute it and see that item fields reach the function."""
    return [len(c) / 10 + (a or 0) for c, a in zip(completions, answer)]


def exit_process(prompts, completions, **fields):
    """Ends the process that calls it, like a native crash would (tests/test_lifecycle.py)."""
    import os

    os._exit(1)


def sleep_forever(prompts, completions, **fields):
    """Python that never returns: the reward time limit (config.reward_timeout) interrupts it."""
    import time

    time.sleep(1e9)


def native_hang(prompts, completions, **fields):
    """Native code that never returns to Python (signal handlers cannot run): only the worker's
    supervisor can end it."""
    import hashlib

    while True:  # about six minutes per call, in C
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2**31 - 1)
