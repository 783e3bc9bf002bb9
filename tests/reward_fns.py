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
