"""Tools for tests/test_tools.py: well-behaved ones, and hostile ones the sandbox must contain."""

import socket
import time


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def echo(text: str) -> str:
    """Say the text back.

    Args:
        text: What to say.
    """
    return text


def stats(values: list[float]) -> dict:
    """The count and sum of some numbers.

    Args:
        values: The numbers.
    """
    return {"count": len(values), "sum": sum(values)}


def sleep(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def hang() -> str:
    """Never return."""
    while True:
        pass


def fail(message: str) -> str:
    """Raise ValueError.

    Args:
        message: Its message.
    """
    raise ValueError(message)


def leave() -> str:
    """Exit the process (SystemExit: the sandbox answers it as the tool's error)."""
    raise SystemExit(3)


def chatter(megabytes: int) -> str:
    """Print a lot, return a little.

    Args:
        megabytes: How much to print.
    """
    line = "x" * (1 << 20)
    for _ in range(megabytes):
        print(line)
    return "printed"


def huge(chars: int) -> str:
    """A long string.

    Args:
        chars: Its length.
    """
    return "y" * chars


def bad_bytes() -> bytes:
    """Bytes that are not UTF-8."""
    return b"ok \xff\xfe \xc3"


def lone_surrogate() -> str:
    """A string no UTF-8 encoder takes."""
    return "a\ud800b"


def unprintable() -> object:
    """An object whose repr raises."""

    class Bad:
        def __repr__(self):
            raise RuntimeError("no repr")

    return Bad()


def connect(port: int) -> str:
    """Open a TCP connection (socket is imported at module level, before the sandbox closes).

    Args:
        port: The port on 127.0.0.1.
    """
    socket.create_connection(("127.0.0.1", port), timeout=1).close()
    return "connected"


def write_file(path: str) -> str:
    """Write a file.

    Args:
        path: Where.
    """
    with open(path, "w") as f:
        f.write("x")
    return "written"


def spawn() -> str:
    """Start a process."""
    import subprocess

    return subprocess.run(["true"]).stdout


def allocate(megabytes: int) -> int:
    """Allocate memory.

    Args:
        megabytes: How much.
    """
    return len(bytearray(megabytes << 20))


def untyped(a):
    """No type hint.

    Args:
        a: Something.
    """
    return a


def undocumented(a: int) -> int:
    return a
