"""Tool calls run in child processes, never in the training process: ToolProcess is one warm child
(the tools' modules imported once) answering one call at a time, within a wall-time limit past
which the parent kills it. worker/agentic/tools.py keeps a pool of them.

The child is `python -I` (no site directories, no PYTHON* variables; the parent's module path is
sent to it) in an empty temporary directory, with a small environment (no secret of the worker's
reaches a tool). Before the first call it limits itself: an address space of MEMORY_BYTES (where
the OS allows it), FILE_BYTES per file, OPEN_FILES, no new processes, and shared/sandbox.py's
audit hook (no sockets, subprocesses, ctypes, nor writes outside its directory). What a tool
prints goes to /dev/null (nothing buffers it); its result comes back as text of at most
`cap` characters. The child dies with its parent: on Linux the kernel kills it
(PR_SET_PDEATHSIG, which fires when the parent's thread that started it ends: the pool
starts children on its own threads, which live until the pool closes); elsewhere a thread of
the child's polls its parent id.
"""

import importlib
import inspect
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from shared import sandbox
from worker.agentic.episode import EpisodeFailed

MEMORY_BYTES = 1 << 30
FILE_BYTES = 1 << 20
OPEN_FILES = 64
START_TIMEOUT_S = 60.0  # importing the tools' modules (and, in the child that describes them, transformers)
KILL_WAIT_S = 5.0  # a killed child in uninterruptible sleep is left to the kernel after this
ERROR_CHARS = 500  # an exception's message in an error answer
PARENT_POLL_S = 0.5
# JSON's longest escape of one character (an astral one as two \uXXXX): an answer line of a
# child holding to its cap is at most this many bytes per character, plus its fields.
LINE_BYTES_PER_CHAR = 12
# With -I the child has neither this repository nor the virtual environment on its path: the
# first line it reads names the parent's.
BOOT = ("import json, sys; setup = json.loads(sys.stdin.buffer.readline()); sys.path[:] = setup['path']; "
        "from worker.agentic.tool_sandbox import serve; serve(setup)")


def cut(text: str, cap: int) -> str:
    """At most `cap` characters and a marker saying so; lone surrogates (which no tokenizer can
    encode) as '?'."""
    if len(text) > cap:
        text = text[:cap] + f"\n[output cut to {cap} characters]"
    return text.encode("utf-8", "replace").decode("utf-8")


def as_text(value: Any, cap: int) -> str:
    """A tool's result as the model reads it: a str as it is, bytes decoded as UTF-8 (invalid
    bytes replaced), anything else as JSON, else its repr; cut to `cap` characters."""
    if isinstance(value, str):
        return cut(value, cap)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return cut(bytes(value[:4 * cap + 4]).decode("utf-8", "replace"), cap)  # UTF-8: at most 4 bytes a character
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # not JSON (or circular, or nested too deep)
        text = repr(value)
    return cut(text, cap)


def short(error: BaseException) -> str:
    try:
        message = str(error)
    except Exception:  # an exception whose __str__ raises
        message = ""
    return f"{type(error).__name__}: {message}"[:ERROR_CHARS] if message else type(error).__name__


class _TimedOut(Exception):
    pass


class _Broken(Exception):
    """The child's pipe ended or carried something other than an answer."""


class ToolProcess:
    """One child process with the tools' modules imported. `call` is for one thread at a time;
    `signal_kill` may come from any thread."""

    def __init__(self, tools: dict[str, str], cap: int, describe: bool = False):
        """Start the child (it imports the tools in the background: `ready` waits for it).
        tools: name -> 'module:function'; describe: the child reads the tools' JSON schemas."""
        self.cap, self.schemas = cap, None
        self.workdir = tempfile.mkdtemp(prefix="mtq-tool-")
        env = {"PATH": "/usr/bin:/bin", "HOME": self.workdir, "TMPDIR": self.workdir, "LANG": "C.UTF-8",
               # a call runs on one thread; BLAS pools of one thread per core would not fit MEMORY_BYTES
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, cwd=self.workdir, env=env)
        # Both pipes are waited on with the call's deadline: a child that stops reading (a
        # thread of its tool's holding the GIL) cannot block a large request's write either.
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.readable, self.writable = selectors.DefaultSelector(), selectors.DefaultSelector()
        self.readable.register(self.proc.stdout, selectors.EVENT_READ)
        self.writable.register(self.proc.stdin, selectors.EVENT_WRITE)
        self.buffer = bytearray()
        self.max_line = cap * LINE_BYTES_PER_CHAR + 4 * ERROR_CHARS + 1024
        self.setup = {"path": [os.path.abspath(p) for p in sys.path], "parent": os.getpid(), "tools": tools,
                      "describe": describe, "cap": cap}

    def ready(self) -> None:
        """Wait until the child has imported the tools (and read their schemas); EpisodeFailed
        saying why it could not."""
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            self._send(self.setup, deadline)
            answer = json.loads(self._line(deadline))
        except _TimedOut:
            self.kill()
            raise EpisodeFailed(f"tools: the tool process did not import {', '.join(self.setup['tools'].values())} "
                                f"within {START_TIMEOUT_S:g} s") from None
        except (OSError, ValueError, _Broken):
            raise EpisodeFailed(f"tools: the tool process {self.kill()} before it was ready") from None
        if not isinstance(answer, dict) or "error" in answer:
            self.kill()
            raise EpisodeFailed(str(answer.get("error") if isinstance(answer, dict) else answer)[:ERROR_CHARS])
        self.schemas = answer.get("schemas")

    def call(self, name: str, arguments: dict, timeout: float) -> tuple[str, bool]:
        """(the text that answers the call, whether it is an error): the tool's result, cut to
        the cap, or why there is none ("<name> raised ValueError: ..."). Past `timeout` seconds,
        or when the child dies or answers nonsense, the child is killed (alive() turns False)."""
        deadline = time.monotonic() + timeout
        try:
            self._send({"name": name, "arguments": arguments}, deadline)
            answer = json.loads(self._line(deadline))
            ok, text = answer["ok"], answer["text"] if answer["ok"] else answer["error"]
            if not isinstance(text, str) or self.buffer:  # the child writes one line per request, no more
                raise ValueError("not one answer")
        except _TimedOut:
            self.kill()
            return f"{name} timed out after {timeout:g} s (config.tool_timeout_s)", True
        except (OSError, ValueError, KeyError, TypeError, _Broken):  # a pipe closed, or not an answer
            return f"{name} failed: its process {self.kill()}", True
        return (cut(text, self.cap), False) if ok else (f"{name} {text}"[:ERROR_CHARS + 100], True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_kill(self) -> None:
        """SIGKILL, from any thread: a call waiting on this child sees its pipe end."""
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    def kill(self) -> str:
        """End the child and remove its directory; how it ended, in words."""
        self.signal_kill()
        try:
            self.proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        self.readable.close()
        self.writable.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a write still buffered for a child that is gone
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)
        code = self.proc.returncode
        if code is None:
            return "did not end when killed"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:  # a real-time signal: no name
                return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def _send(self, message: dict, deadline: float) -> None:
        data = memoryview(json.dumps(message).encode() + b"\n")
        while data:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _TimedOut()
            if self.writable.select(left):
                try:
                    data = data[os.write(self.proc.stdin.fileno(), data):]
                except BlockingIOError:  # the pipe filled again between the select and the write
                    pass

    def _line(self, deadline: float) -> bytes:
        """The child's next line, read until the deadline (_TimedOut), at most max_line bytes."""
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _TimedOut()
            if not self.readable.select(left):
                continue
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise _Broken()
            self.buffer += chunk
            if len(self.buffer) > self.max_line:
                raise _Broken()
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer = bytearray(rest)
        return line


# ------------------------------------------------------------------ the child's side


class _SetupError(Exception):
    pass


def serve(setup: dict) -> None:
    """The child's main: import the tools, sandbox itself, then answer calls until its stdin ends."""
    _die_with_parent(setup["parent"])
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    _discard_standard_streams()
    for which, value in ((resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_FSIZE, FILE_BYTES),
                         (resource.RLIMIT_NOFILE, OPEN_FILES)):
        sandbox.set_limit(which, value)
    try:
        tools = {name: _load(path) for name, path in setup["tools"].items()}
        schemas = _describe(tools, setup["tools"]) if setup["describe"] else None
    except _SetupError as e:
        _answer(answers, {"error": str(e)})
        return
    sandbox.forbid_processes()  # after the imports: a library may start its threads as it loads
    sandbox.install_audit_hook("a tool")
    _answer(answers, {"ready": True, "schemas": schemas})
    for line in requests:
        request = json.loads(line)
        _answer(answers, _call(tools[request["name"]], request["arguments"], setup["cap"]))


def _die_with_parent(parent: int) -> None:
    if sys.platform == "linux":
        import ctypes  # its calls are refused once the audit hook is in

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the kernel was asked
            os._exit(1)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _discard_standard_streams() -> None:
    """fds 0-2 and sys.std* on /dev/null: what a tool prints goes nowhere (at the speed of a
    write to /dev/null), and a tool reading stdin cannot take the parent's requests."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    sys.stdin, sys.stdout, sys.stderr = open(os.devnull), open(os.devnull, "w"), open(os.devnull, "w")


def _load(path: str) -> tuple[Callable, inspect.Signature | None]:
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except BaseException as e:  # ImportError, but also whatever the module raises (SystemExit too) as it loads
        raise _SetupError(f"tool {path}: cannot import module {module_name!r} ({short(e)})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise _SetupError(f"tool {path}: module {module_name!r} has no function {function_name!r}")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have none: the call itself says what is wrong
        signature = None
    return function, signature


def _describe(tools: dict[str, tuple[Callable, Any]], paths: dict[str, str]) -> list[dict]:
    """Each tool's OpenAI-style schema, from its signature and docstring (transformers' reading
    of them, as chat templates get them), named as the job names it."""
    from transformers.utils import get_json_schema  # one child per job imports it (a second)

    schemas = []
    for name, (function, _) in tools.items():
        try:
            schema = get_json_schema(function)
        except Exception as e:
            raise _SetupError(f"tool {paths[name]}: its JSON schema cannot be read from it ({short(e)}); a tool needs "
                              "a type hint on every argument and a docstring describing each (an 'Args:' section)") from None
        schema["function"]["name"] = name
        schemas.append(schema)
    return schemas


def _call(tool: tuple[Callable, inspect.Signature | None], arguments: dict, cap: int) -> dict:
    function, signature = tool
    if signature is not None:
        try:
            signature.bind(**arguments)
        except TypeError as e:
            return {"ok": False, "error": f"was called with bad arguments ({short(e)})"}
    try:
        value = function(**arguments)
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: they are the tool's, not this process's
        return {"ok": False, "error": f"raised {short(e)}"}
    try:
        return {"ok": True, "text": as_text(value, cap)}
    except Exception as e:  # a repr that raises, an int too long for a string
        return {"ok": False, "error": f"returned a value that cannot be shown as text ({short(e)})"}


def _answer(answers, message: dict) -> None:
    answers.write(json.dumps(message).encode() + b"\n")  # ASCII JSON: one line
    answers.flush()
