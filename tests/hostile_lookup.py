"""A `lookup` tool that never answers, described as the real one (examples/agentic/lookup_tools.py):
the same schema, so the prompt is the one SFT taught the model to call it in (tests/test_agentic.py)."""

import time

from examples.agentic.lookup_tools import lookup as described


def lookup(key: str) -> str:
    while True:
        time.sleep(1)


lookup.__doc__ = described.__doc__
