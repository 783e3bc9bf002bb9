"""worker/agentic/tools.py with real child processes: schemas, the allow-list (worker and API),
calls, hostile tools (tests/tool_fns.py), malformed and excessive calls, threads, and children
that end with the Toolbox and with their parent."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from fastapi.exceptions import RequestValidationError

from api.auth import Principal
from api.submission import check_spec, spec_errors
from conftest import ROOT, wait_for
from shared.agentic_specs import PythonTool, tool_error
from shared.schemas import GRPOConfig, JobCreate
from shared.settings import load_settings
from worker.agentic.episode import EpisodeFailed
from worker.agentic.tools import CHARS_PER_TOKEN, Toolbox

ALLOWED = dataclasses.replace(load_settings(), tool_modules=("tests.tool_fns",))
HOSTILE = ("add", "echo", "stats", "sleep", "hang", "fail", "leave", "chatter", "huge", "bad_bytes", "lone_surrogate",
           "unprintable", "connect", "write_file", "spawn", "allocate")
CFG = GRPOConfig(tool_timeout_s=1.0, max_tool_calls=8, max_tool_output_tokens=16, tool_parallelism=4)
CAP = CFG.max_tool_output_tokens * CHARS_PER_TOKEN


def tools(*names: str) -> list[PythonTool]:
    return [PythonTool(function=f"tests.tool_fns:{name}") for name in names]


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def child_pids() -> set[int]:
    """This process's children (Linux: /proc), by each of its threads. A thread that ends while
    they are read is skipped: its children pass to another thread of the process, read too."""
    pids = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(pid) for pid in (task / "children").read_text().split())
        except FileNotFoundError:
            continue
    return pids


@pytest.fixture(scope="module")
def strangers() -> set[int]:
    """Children this process had before the module's toolbox: another module's redis-server, say."""
    return child_pids()


@pytest.fixture(scope="module")
def box(strangers):
    toolbox = Toolbox(tools(*HOSTILE), ALLOWED, CFG, None)
    yield toolbox
    toolbox.close()


def answer(box: Toolbox, text: str) -> list[str]:
    return [m["content"] for m in box.episode().after_turn(text).messages]


def test_schemas(box):
    add = box.schemas[0]
    assert add == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "required": ["a"], "properties": {
            "a": {"type": "integer", "description": "The first."}, "b": {"type": "integer", "description": "The second."}}},
        "return": {"type": "integer"}}}
    assert [s["function"]["name"] for s in box.schemas] == list(HOSTILE)
    assert box.schemas[2]["function"]["parameters"]["properties"]["values"] == {
        "type": "array", "items": {"type": "number"}, "description": "The numbers."}


@pytest.mark.parametrize("name, why", [
    ("untyped", "missing a type hint"), ("undocumented", "no docstring"),
    ("absent", "has no function 'absent'"),
])
def test_undescribable_tool_fails_the_start(name, why):
    with pytest.raises(EpisodeFailed, match=f"tests.tool_fns:{name}.*{why}"):
        Toolbox(tools("add", name), ALLOWED, CFG, None)


def test_module_that_does_not_import():
    settings = dataclasses.replace(ALLOWED, tool_modules=("tests",))
    with pytest.raises(EpisodeFailed, match=r"tests.no_such_module:f: cannot import module 'tests.no_such_module'"):
        Toolbox([PythonTool(function="tests.no_such_module:f")], settings, CFG, None)


def test_allow_list():
    assert tool_error("tests.tool_fns:add", ("tests.tool_fns",)) is None
    assert tool_error("tests.tool_fns:add", ("tests",)) is None  # a package prefix
    error = tool_error("tests.tool_fns:add", ("tests.tool",))
    assert "'tests.tool_fns:add'" in error and "MTQ_TOOL_MODULES" in error and "mtq.tools" in error
    started = child_pids()
    with pytest.raises(EpisodeFailed, match="MTQ_TOOL_MODULES"):  # the worker's own check: nothing is started
        Toolbox(tools("add"), dataclasses.replace(ALLOWED, tool_modules=()), CFG, None)
    assert child_pids() == started


def test_api_refuses_a_tool_off_the_allow_list():
    spec = JobCreate(model_id="tiny", adapter_name="a", prompts=["p"], config={"max_turns": 2},
                     tools=[{"function": "os:system"}, {"function": "tests.tool_fns:add"}])
    who = Principal("admin", "admin")
    errors = spec_errors(None, spec, ALLOWED, who)
    assert [e for e in errors if "tool" in e] == [
        "tool 'os:system': module 'os' is not allowed (register the function under the 'mtq.tools' entry point "
        "group, or add the module to MTQ_TOOL_MODULES)"]
    with pytest.raises(RequestValidationError, match="os:system"):  # the app answers it with 400
        check_spec(None, spec, ALLOWED, who)


def test_calls(box):
    assert box.episode().after_turn("no call here").done
    assert answer(box, call("add", a=1)) == ["3"]
    assert answer(box, call("stats", values=[1, 2.5])) == ['{"count": 2, "sum": 3.5}']
    reply = box.episode().after_turn("Let me add. " + call("add", a=1, b=1) + call("echo", text="hé\n") + " done")
    assert (reply.done, reply.tool_calls, reply.tool_errors) == (False, 2, 0)
    assert reply.messages == [{"role": "tool", "name": "add", "content": "2"},
                              {"role": "tool", "name": "echo", "content": "hé\n"}]


def test_hang_is_killed_and_the_next_call_works(box):
    before = child_pids()
    started = time.monotonic()
    reply = box.episode().after_turn(call("hang"))
    assert time.monotonic() - started < CFG.tool_timeout_s + 2
    assert reply.messages[0]["content"] == "error: hang timed out after 1 s (config.tool_timeout_s)"
    assert reply.tool_errors == 1
    assert len(before - child_pids()) == 1  # the hung child is gone (reaped), not left running
    assert answer(box, call("add", a=40)) == ["42"]


@pytest.mark.parametrize("text, expected", [
    (call("fail", message="boom"), "error: fail raised ValueError: boom"),
    (call("leave"), "error: leave raised SystemExit: 3"),
    (call("chatter", megabytes=100), "printed"),
    (call("huge", chars=10**8), "y" * CAP + f"\n[output cut to {CAP} characters]"),
    (call("echo", text="z" * (CAP + 1)), "z" * CAP + f"\n[output cut to {CAP} characters]"),
    (call("echo", text="z" * 10**6), "z" * CAP + f"\n[output cut to {CAP} characters]"),  # a request larger than a pipe
    (call("bad_bytes"), "ok \ufffd\ufffd \ufffd"),
    (call("lone_surrogate"), "a?b"),
    (call("unprintable"), "error: unprintable returned a value that cannot be shown as text (RuntimeError: no repr)"),
    (call("spawn"), "error: spawn raised PermissionError: subprocess.Popen is not allowed in a tool"),
    (call("write_file", path="/tmp/mtq-tool-escape"),
     "error: write_file raised PermissionError: a tool may write only inside its directory, not '/tmp/mtq-tool-escape'"),
    (call("write_file", path="scratch.txt"), "written"),  # its own directory
    (call("allocate", megabytes=2048), "error: allocate raised MemoryError"),  # RLIMIT_AS
])
def test_hostile_tools(box, text, expected):
    started = time.monotonic()
    assert answer(box, text) == [expected]
    assert time.monotonic() - started < CFG.tool_timeout_s


def test_no_network(box):
    with socket.socket() as server:  # something to connect to: the refusal is the sandbox's
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert answer(box, call("connect", port=port)) == [
            "error: connect raised PermissionError: socket.getaddrinfo is not allowed in a tool"]


@pytest.mark.parametrize("text, expected", [
    ("<tool_call>{not json</tool_call>", "error: the tool call could not be read (JSONDecodeError: "),
    ('<tool_call>{"arguments": {}}</tool_call>', 'error: a tool call needs a "name" (a string)'),
    ('<tool_call>[]</tool_call>', "error: the tool call block holds no call"),
    (call("nope", a=1), "error: unknown tool 'nope' (the tools: add, echo, stats, "),
    (call("add", c=1), "error: add was called with bad arguments (TypeError: missing a required argument: 'a')"),
    (call("add", a=1, c=1), "error: add was called with bad arguments (TypeError: got an unexpected keyword argument 'c')"),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "error: add: the arguments must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>', "7"),  # arguments as JSON text
    ('<tool_call>{"name": "add", "arguments": "{5"}</tool_call>', "error: add: the arguments are not JSON"),
    ('I will call <tool_call>{"name": "add", "arguments": {"a"', "error: a <tool_call> block was not closed with </tool_call>"),
])
def test_malformed_calls(box, text, expected):
    reply = box.episode().after_turn(text)
    assert (reply.done, reply.tool_calls, reply.tool_errors) == (False, 1, 0 if expected == "7" else 1)
    assert reply.messages[0]["content"].startswith(expected)


def test_malformed_and_good_calls_in_one_turn(box):
    reply = box.episode().after_turn(call("add", a=1) + "<tool_call>oops</tool_call>" + call("add", a=2) + "<tool_call>")
    assert [m["content"][:12] for m in reply.messages] == ["3", "error: the t", "4", "error: a <to"]
    assert (reply.tool_calls, reply.tool_errors) == (4, 2)


def test_ten_thousand_calls_in_a_turn(box):
    episode = box.episode()
    started = time.monotonic()
    reply = episode.after_turn(call("add", a=1) * 10_000)
    assert time.monotonic() - started < 2.0
    limit = CFG.max_tool_calls + 1
    assert [m["content"] for m in reply.messages] == ["3"] * CFG.max_tool_calls + [
        "error: tool call budget exhausted (config.max_tool_calls=8 per episode)",
        f"error: {10_000 - limit} more tool calls in this turn were not read (at most {limit} a turn)"]
    assert (reply.tool_calls, reply.tool_errors) == (10_000, 10_000 - CFG.max_tool_calls)
    again = episode.after_turn(call("add", a=1) + call("nope"))  # the budget is the episode's
    assert [m["content"] for m in again.messages] == ["error: tool call budget exhausted (config.max_tool_calls=8 per episode)"] * 2
    assert (again.tool_calls, again.tool_errors) == (2, 2)
    assert answer(box, call("add", a=1)) == ["3"]  # another episode has its own


def test_calls_of_a_turn_run_in_parallel(box):
    started = time.monotonic()
    assert answer(box, call("sleep", seconds=0.5) * 4) == ["slept 0.5"] * 4
    assert time.monotonic() - started < 1.5


def test_episodes_from_many_threads(box, strangers):
    results: dict[int, list[str]] = {}

    def run(i: int) -> None:
        episode = box.episode()
        results[i] = [m["content"] for turn in range(3)
                      for m in episode.after_turn(call("echo", text=f"{i}-{turn}") + call("sleep", seconds=0.2)).messages]

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: [x for turn in range(3) for x in (f"{i}-{turn}", "slept 0.2")] for i in range(12)}
    # 36 sleeps of 0.2 s on tool_parallelism=4 children: about 1.8 s, never all at once
    assert 1.7 < time.monotonic() - started < 8
    assert len(child_pids() - strangers) <= CFG.tool_parallelism


def test_tokenizers_own_syntax(tiny_model):
    from mlx_lm.tokenizer_utils import TokenizerWrapper, load
    from mlx_lm.tool_parsers import pythonic

    qwen = load(tiny_model)  # its chat template: mlx_lm reads json_tools from it
    assert qwen.has_tool_calling and qwen.tool_call_start == "<tool_call>"
    box = Toolbox(tools("add"), ALLOWED, CFG, qwen)
    try:
        assert answer(box, call("add", a=2)) == ["4"]
    finally:
        box.close()
    other = TokenizerWrapper(qwen._tokenizer, tool_parser=pythonic.parse_tool_call,
                             tool_call_start=pythonic.tool_call_start, tool_call_end=pythonic.tool_call_end)
    box = Toolbox(tools("add"), ALLOWED, CFG, other)
    try:
        assert answer(box, "<|tool_call_start|>[add(a=1, b=5), add(a=2)]<|tool_call_end|>") == ["6", "4"]
        assert answer(box, call("add", a=2)) == []  # not this model's syntax: no call
    finally:
        box.close()


def test_close_ends_the_children_and_their_calls():
    before = child_pids()
    box = Toolbox(tools("sleep"), ALLOWED, CFG.model_copy(update={"tool_timeout_s": 30.0}), None)
    replies = []
    waiting = threading.Thread(target=lambda: replies.append(box.episode().after_turn(call("sleep", seconds=20))))
    waiting.start()
    wait_for(lambda: len(child_pids() - before) >= 1, 5, "the tool's child")
    time.sleep(0.2)
    started = time.monotonic()
    box.close()
    waiting.join(5)
    assert time.monotonic() - started < 5
    assert replies[0].messages[0]["content"].startswith("error: sleep failed: its process was killed by SIGKILL")
    assert child_pids() == before
    with pytest.raises(EpisodeFailed, match="closed"):
        box.episode().after_turn(call("sleep", seconds=0))


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_with_their_parent(tmp_path):
    """A training process killed with SIGKILL (close() never runs) takes its tools' children with it
    (their temporary directories stay: in tmp_path here)."""
    script = textwrap.dedent(f"""
        import dataclasses, sys
        from pathlib import Path
        from shared.agentic_specs import PythonTool
        from shared.schemas import GRPOConfig
        from shared.settings import load_settings
        from worker.agentic.tools import Toolbox
        box = Toolbox([PythonTool(function="tests.tool_fns:hang")],
                      dataclasses.replace(load_settings(), tool_modules=("tests.tool_fns",)), GRPOConfig(), None)
        pids = [p for t in Path("/proc/self/task").iterdir() for p in (t / "children").read_text().split()]
        print(" ".join(pids), flush=True)
        box.episode().after_turn('<tool_call>{{"name": "hang", "arguments": {{}}}}</tool_call>')
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert pids
    time.sleep(0.3)  # the hang is running
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def gone() -> bool:
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            if state != "Z":  # a zombie is dead (its parent, pytest's init, reaps it)
                return False
        return True

    try:
        wait_for(gone, 5, "the tool children to end")
    except TimeoutError:  # leave none behind (they are still running: their pids are theirs)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        raise
