"""A `lookup` tool that prints 100 MB and answers with invalid UTF-8 (tests/test_agentic.py)."""

import sys


def lookup(key: str) -> bytes:
    """Look up the color of a thing, noisily.

    Args:
        key: The thing whose color to look up.
    """
    for _ in range(100):
        sys.stdout.write("x" * (1 << 20))
    return b"red \xff\xfe"
