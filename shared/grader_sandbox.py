"""Python graders (`grade(sample, item) -> float`, OpenAI's contract) in a subprocess of their own,
only where the operator sets MTQ_PYTHON_GRADERS=1 (Settings.python_graders; the callers check).

The child is `python -I` (no site, no environment, no user directory) in an empty temporary
directory that it may write to, with OpenAI's bounds as rlimits: CPU seconds, address space,
bytes per file written, open files, and no new processes; the parent kills it past its wall time
(MTQ_PYTHON_GRADER_TIMEOUT_S). An audit hook installed before the source is compiled refuses
sockets, new processes, ctypes, and opening a file for writing outside its directory (audit
hooks cannot be removed). Whatever goes wrong in the child (an exception, a limit, a non-number)
scores 0, as OpenAI scores it; the reason is returned for graders/run's metadata.
"""

import functools
import inspect
import json
import math
import resource
import signal
import subprocess
import sys
import tempfile

from shared import sandbox

MEMORY_BYTES = 1 << 30
FILE_BYTES = 1 << 20
MAX_OUTPUT = 1 << 16

# The child runs shared/sandbox.py's source first: it is `python -I`, without this repository on its path.
CHILD = inspect.getsource(sandbox) + r"""
import json
task = json.loads(sys.stdin.read())
install_audit_hook("a python grader")
namespace = {}
exec(compile(task["source"], "<grader>", "exec"), namespace)
value = namespace["grade"](task["sample"], task["item"])
sys.stdout.write("\n" + json.dumps(float(value)))
"""


def _limits(cpu: int) -> None:
    for which, value in [(resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, MEMORY_BYTES),
                         (resource.RLIMIT_FSIZE, FILE_BYTES), (resource.RLIMIT_NOFILE, 64)]:
        sandbox.set_limit(which, value)
    sandbox.forbid_processes()


def run_grader(source: str, sample: dict, item: dict, limit: float) -> tuple[float, str | None]:
    """(score, why it is 0 or None): the source's grade(sample, item) run in the sandbox for at
    most `limit` seconds."""
    task = json.dumps({"source": source, "sample": sample, "item": item})
    with tempfile.TemporaryDirectory(prefix="mtq-grader-") as workdir:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", CHILD], input=task, capture_output=True, text=True,
                                  cwd=workdir, timeout=limit,
                                  preexec_fn=functools.partial(_limits, max(1, math.ceil(limit))), env={"PATH": "/usr/bin:/bin"})
        except subprocess.TimeoutExpired:
            return 0.0, f"the grader ran past its time limit ({limit:g} s, MTQ_PYTHON_GRADER_TIMEOUT_S)"
    if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # RLIMIT_CPU: on a loaded machine it can come first
        return 0.0, f"the grader ran past its time limit ({limit:g} s of CPU, MTQ_PYTHON_GRADER_TIMEOUT_S)"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return 0.0, last[:500]
    try:
        value = float(json.loads(done.stdout[-MAX_OUTPUT:].rsplit("\n", 1)[-1]))
    except (ValueError, IndexError):
        return 0.0, "grade() did not return a number"
    return (value, None) if value == value and abs(value) != float("inf") else (0.0, "grade() returned a non-finite number")
