"""The tool of docs/agentic.md's example: a lookup table the model consults, because the reward
needs the word it returns. An operator allows it with MTQ_TOOL_MODULES=examples.agentic.lookup_tools
(the repository's root on PYTHONPATH)."""

COLORS = {"apple": "red", "sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow"}


def lookup(key: str) -> str:
    """Look up the color of a thing.

    Args:
        key: The thing whose color to look up, e.g. "apple".
    """
    return COLORS.get(key.strip().lower(), "unknown")
