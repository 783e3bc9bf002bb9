"""What a sandboxed child process does to itself before it runs code it does not trust: an audit
hook refusing sockets, new processes, ctypes, and writes outside its working directory, and
rlimits. Python graders (shared/grader_sandbox.py) and tools (worker/agentic/tool_sandbox.py)
run behind it.

A grader's child is `python -I` without this repository on its path, so it runs this module's
source before the grader's: keep the module to the standard library.
"""

import os
import resource
import sys

# Audit events refused (prefixes), and modules that may not be imported once the hook is in.
BLOCKED_EVENTS = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                  "os.kill", "ctypes.", "pty.", "_posixsubprocess")
BLOCKED_IMPORTS = ("ctypes", "_ctypes", "socket", "_socket")


def install_audit_hook(who: str) -> None:
    """From now on this process refuses (PermissionError naming `who`) what BLOCKED_EVENTS
    name, importing BLOCKED_IMPORTS, and opening a file for writing outside its current
    directory. Audit hooks cannot be removed."""
    here = os.path.realpath(os.getcwd())

    def hook(event, args):
        if event == "import" and args[0] in BLOCKED_IMPORTS:
            raise PermissionError(f"importing {args[0]} is not allowed in {who}")
        if event.startswith(BLOCKED_EVENTS):
            raise PermissionError(f"{event} is not allowed in {who}")
        if event == "open":
            path, mode, flags = args
            writes = (any(c in mode for c in "wax+") if isinstance(mode, str)
                      else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC)))
            if writes and not isinstance(path, int) and not os.path.realpath(os.fspath(path)).startswith(here + os.sep):
                raise PermissionError(f"{who} may write only inside its directory, not {path!r}")

    sys.addaudithook(hook)


def set_limit(which: int, value: int) -> None:
    """The rlimit's soft and hard values, where the OS allows it: macOS refuses to lower
    RLIMIT_AS (there the parent's wall-time limit still bounds the child)."""
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):
        pass


def forbid_processes() -> None:
    """No new processes (nor threads: Linux counts them against RLIMIT_NPROC). Root ignores
    RLIMIT_NPROC; the audit hook refuses new processes anyway."""
    if os.geteuid() != 0:
        set_limit(resource.RLIMIT_NPROC, 0)
