"""`lookup` tools that misbehave, named as the real one (examples/agentic/lookup_tools.py) so
that a model taught to call `lookup` calls them (tests/test_agentic.py)."""

import time


def lookup(key: str) -> str:
    """Look up the color of a thing, never answering.

    Args:
        key: The thing whose color to look up.
    """
    while True:
        time.sleep(1)
