"""A `lookup` tool that prints 100 MB and answers with invalid UTF-8, described as the real one
(examples/agentic/lookup_tools.py): the same schema, so the prompt is the one SFT taught the model
to call it in (tests/test_agentic.py)."""

import sys

from examples.agentic.lookup_tools import lookup as described


def lookup(key: str) -> str:
    for _ in range(100):
        sys.stdout.write("x" * (1 << 20))
    return b"red \xff\xfe"  # bytes, though described as str: what a careless tool returns


lookup.__doc__ = described.__doc__
