"""A job's python tools (JobCreate.tools) as Episodes (worker/agentic/episode.py): the calls in a
model turn are read with the tokenizer's own tool-call syntax (mlx_lm's TokenizerWrapper; Hermes
/ Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` when it has none), run in
child processes (worker/agentic/tool_sandbox.py), and answered with `tool` messages.

Whatever the model writes, a turn has a bounded answer: a call that does not parse, names no
tool of the job's, has arguments the function does not take, raises, hangs past
config.tool_timeout_s or kills its process is answered with a short error text (a tool error),
never an exception out of the job. Every call counts against config.max_tool_calls per
episode, parsed or not; past it a call is answered "tool call budget exhausted" without being
read, and past max_tool_calls + 1 calls in one turn the rest share one message.

What fails the job's start instead (EpisodeFailed, naming the tool): a tool MTQ_TOOL_MODULES
(or an `mtq.tools` entry point) does not allow, a module that does not import, a function
transformers' get_json_schema cannot describe (untyped arguments, no docstring).
"""

import json
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from mlx_lm.tool_parsers import json_tools

from shared.agentic_specs import PythonTool, tool_error
from shared.schemas import GRPOConfig
from shared.settings import Settings
from worker.agentic.episode import CHARS_PER_TOKEN, EpisodeFailed, Reply
from worker.agentic.tool_sandbox import ToolProcess, short

# A result's text is cut to max_tool_output_tokens times this many characters (there is no
# tokenizer in the child; the conversation cuts to the real token count).
NAME_CHARS = 64  # of a name the model wrote, in an error message


@dataclass(frozen=True)
class CallSyntax:
    """How a model writes tool calls: blocks between start and end, each read by parse(block, tools)
    into {"name", "arguments"} (or a list of them)."""

    start: str
    end: str
    parse: Callable[[str, Any], Any]


def call_syntax(tokenizer) -> CallSyntax:
    if getattr(tokenizer, "has_tool_calling", False):
        return CallSyntax(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)
    return CallSyntax(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call)


def find_blocks(text: str, syntax: CallSyntax, limit: int) -> tuple[list[str | None], int]:
    """The insides of the turn's first `limit` call blocks (None: a block the turn left open),
    and how many more blocks start after them (counted, not read)."""
    blocks: list[str | None] = []
    pos = 0
    while len(blocks) < limit:
        start = text.find(syntax.start, pos)
        if start < 0:
            return blocks, 0
        inside = start + len(syntax.start)
        end = text.find(syntax.end, inside)
        if end < 0:
            return blocks + [None], 0
        blocks.append(text[inside:end])
        pos = end + len(syntax.end)
    return blocks, text.count(syntax.start, pos)


class Toolbox:
    """The job's tools, for the whole job: their schemas (`schemas`, the chat template's `tools=`)
    and a pool of at most config.tool_parallelism warm child processes running their calls.
    Thread-safe: the rollout's threads run episodes' turns at once. close() ends the children."""

    def __init__(self, specs: list[PythonTool], settings: Settings, cfg: GRPOConfig, tokenizer):
        for spec in specs:  # the API checked already; this is the worker's own check
            if error := tool_error(spec.function, settings.tool_modules):
                raise EpisodeFailed(error)
        self.functions = {spec.function.rpartition(":")[2]: spec.function for spec in specs}  # name -> module:function
        self.cfg, self.syntax = cfg, call_syntax(tokenizer)
        self.cap = cfg.max_tool_output_tokens * CHARS_PER_TOKEN
        self._lock = threading.Lock()
        self._idle: list[ToolProcess] = []
        self._children: set[ToolProcess] = set()
        self._closed = False
        # The calls run on these threads, which also start the children: a child dies with the
        # thread that started it (tool_sandbox.py), and these live until close().
        self._pool = ThreadPoolExecutor(cfg.tool_parallelism, thread_name_prefix="mtq-tool")
        try:
            first = self._pool.submit(self._start, True).result()
        except BaseException:
            self.close()
            raise
        self.schemas: list[dict] = first.schemas
        self._put_back(first)

    def episode(self) -> "ToolEpisode":
        return ToolEpisode(self)

    def close(self) -> None:
        """End every child (a call running in one is answered with an error) and the pool."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = self._children - set(idle)
            self._children = set(busy)
        for child in busy:  # their calls' threads see the pipe end and put them back: ended there
            child.signal_kill()
        for child in idle:
            child.kill()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, name: str, arguments: dict) -> Future:
        """The call, run on the pool: a future of (text, is_error)."""
        try:
            return self._pool.submit(self._run, name, arguments)
        except RuntimeError:  # the pool is shut down
            raise EpisodeFailed("tools: the job's tools are closed") from None

    def _run(self, name: str, arguments: dict) -> tuple[str, bool]:
        child = self._take()
        try:
            return child.call(name, arguments, self.cfg.tool_timeout_s)
        finally:
            self._put_back(child)

    def _start(self, describe: bool = False) -> ToolProcess:
        child = ToolProcess(self.functions, self.cap, describe)
        with self._lock:
            closed = self._closed
            if not closed:
                self._children.add(child)
        if closed:
            child.kill()
            raise EpisodeFailed("tools: the job's tools are closed")
        try:
            child.ready()
        except BaseException:
            self._drop(child)
            raise
        return child

    def _take(self) -> ToolProcess:
        """An idle warm child, or a new one (a call's thread holds at most one: the pool's size
        bounds the children)."""
        while True:
            with self._lock:
                if self._closed:
                    raise EpisodeFailed("tools: the job's tools are closed")
                child = self._idle.pop() if self._idle else None
            if child is None:
                return self._start()
            if child.alive():
                return child
            self._drop(child)  # it died idle (the kernel's OOM killer): replaced

    def _put_back(self, child: ToolProcess) -> None:
        with self._lock:
            keep = not self._closed and child.alive()
            if keep:
                self._idle.append(child)
        if not keep:
            self._drop(child)

    def _drop(self, child: ToolProcess) -> None:
        with self._lock:
            self._children.discard(child)
        child.kill()

    def read_calls(self, block: str | None) -> list[tuple[str, dict | str]]:
        """A block's calls as (name, arguments), or (name or "", why it cannot run) for each
        that cannot."""
        if block is None:
            return [("", f"a {self.syntax.start} block was not closed with {self.syntax.end}")]
        try:
            parsed = self.syntax.parse(block, self.schemas)
        except Exception as e:  # each parser has its own failures (JSON, Python syntax, regexes)
            return [("", f"the tool call could not be read ({short(e)})")]
        calls = parsed if isinstance(parsed, list) else [parsed]
        return [self._checked(call) for call in calls] or [("", "the tool call block holds no call")]

    def _checked(self, call: Any) -> tuple[str, dict | str]:
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str):
            return "", 'a tool call needs a "name" (a string)'
        if name not in self.functions:
            return name[:NAME_CHARS], f"unknown tool {name[:NAME_CHARS]!r} (the tools: {', '.join(self.functions)})"
        arguments = call.get("arguments")
        if isinstance(arguments, str):  # some parsers leave the arguments' JSON as text
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return name, f"{name}: the arguments are not JSON"
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return name, f"{name}: the arguments must be a JSON object"
        try:
            json.dumps(arguments)  # what the child is sent (a parser reading Python literals may give a set)
        except (TypeError, ValueError, RecursionError):
            return name, f"{name}: the arguments are not JSON values"
        return name, arguments


class ToolEpisode:
    """One row's tool calls: what is left of its max_tool_calls. Its turns come one at a time."""

    def __init__(self, box: Toolbox):
        self.box = box
        self.calls_left = box.cfg.max_tool_calls

    def start(self) -> list[dict]:
        return []

    def after_turn(self, text: str) -> Reply:
        box = self.box
        limit = box.cfg.max_tool_calls + 1  # every call the budget allows, and one told it is spent
        blocks, more = find_blocks(text, box.syntax, limit)
        if not blocks:
            return Reply(done=True)
        answers: list[tuple[str, Future | str]] = []  # (name, a running call or an error text)
        for block in blocks:
            calls = box.read_calls(block) if self.calls_left > 0 else [("", None)]  # past the budget: not read
            for name, arguments in calls:
                if self.calls_left <= 0:
                    answers.append((name, f"tool call budget exhausted (config.max_tool_calls={box.cfg.max_tool_calls} "
                                          "per episode)"))
                    continue
                self.calls_left -= 1
                answers.append((name, box.submit(name, arguments) if isinstance(arguments, dict) else arguments))
        more += max(0, len(answers) - limit)  # a block may hold several calls
        messages, errors = [], 0
        for name, answer in answers[:limit]:
            content, error = (answer, True) if isinstance(answer, str) else _result(answer)
            errors += error
            messages.append({"role": "tool", "name": name, "content": f"error: {content}" if error else content})
        if more:
            messages.append({"role": "tool", "name": "",
                             "content": f"error: {more} more tool calls in this turn were not read (at most {limit} a turn)"})
        return Reply(messages=messages, done=False, tool_calls=len(messages) - bool(more) + more, tool_errors=errors + more)

    def close(self) -> None:
        """Nothing to release: the child processes are the Toolbox's."""


def _result(future: Future) -> tuple[str, bool]:
    try:
        return future.result()
    except CancelledError:  # the Toolbox closed before the call ran
        return "the job's tools are closed", True
