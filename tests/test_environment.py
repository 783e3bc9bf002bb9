"""worker/agentic/environment.py against real OpenEnv servers (tests/openenv_server.py, processes on
free ports of 127.0.0.1): episodes of the lookup game, many at once from threads; servers that
are down, slow, answer nonsense or sit on a host MTQ_REWARD_HOSTS does not allow fail the
episode with EpisodeFailed, in bounded time; the API refuses such a host at submission."""

import dataclasses
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from api.submission import spec_errors
from conftest import free_port, openenv_servers, wait_for
from shared.agentic_specs import OpenEnvEnvironment
from shared.schemas import GRPOConfig, JobCreate
from shared.settings import load_settings
from worker.agentic.environment import Environment
from worker.agentic.episode import EpisodeFailed

MODES = ("lookup", "slow", "nonsense")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{mode: port}: one server of each mode."""
    with openenv_servers(MODES, tmp_path_factory.mktemp("openenv")) as ports:
        yield ports


def open_env(port: int, *, hosts: tuple[str, ...] | None = None, tokens: int = 256, max_bytes: int | None = None,
             resolver=None, host: str = "127.0.0.1", url_path: str = "", **spec) -> Environment:
    settings = dataclasses.replace(load_settings(), reward_hosts=(f"127.0.0.1:{port}",) if hosts is None else hosts)
    if max_bytes is not None:
        settings = dataclasses.replace(settings, max_reward_response_bytes=max_bytes)
    cfg = GRPOConfig(max_tool_output_tokens=tokens)
    spec = OpenEnvEnvironment(url=f"http://{host}:{port}{url_path}", **{"timeout_s": 10.0, **spec})
    return Environment(spec, settings, cfg) if resolver is None else Environment(spec, settings, cfg, resolver)


def answer_of(prompt: str) -> str:
    """The word the lookup game asks for."""
    table = dict(re.findall(r"(\w+)=(\w+)", prompt))
    return table[re.search(r"the word for key (\w+)\?", prompt).group(1)]


def failure(episode_step, within_s: float) -> str:
    """The EpisodeFailed message of the call, which must come within within_s seconds."""
    started = time.monotonic()
    with pytest.raises(EpisodeFailed) as failed:
        episode_step()
    assert time.monotonic() - started < within_s
    return str(failed.value)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_an_episode_resets_with_the_seed_steps_and_closes(servers):
    env = open_env(servers["lookup"], observation_field="prompt", reset={"padding": 3})
    try:
        first, again, other = env.episode(seed=7), env.episode(seed=7), env.episode(seed=8)
        [shown] = first.start()
        assert shown["role"] == "user" and "What is the word for key" in shown["content"]
        assert shown["content"].endswith("?xxx")  # the spec's reset arguments go with the seed
        assert again.start() == [shown] and other.start() != [shown]  # the seed picks the game
        reply = first.after_turn(f"It is {answer_of(shown['content'])}.")
        assert (reply.done, reply.reward, reply.messages) == (True, 1.0, [])
        assert again.after_turn("no idea").reward == 0.0
        for episode in (first, again, other):
            episode.close()
            episode.close()  # idempotent
    finally:
        env.close()
        env.close()


def test_the_observation_as_json_in_a_tool_message(servers):
    env = open_env(servers["lookup"], role="tool")  # no observation_field: its fields as JSON
    try:
        episode = env.episode(seed=1)
        [shown] = episode.start()
        assert shown["role"] == "tool" and shown["content"].startswith('{"prompt":"Table: ')
        episode.close()
    finally:
        env.close()


def test_many_episodes_at_once_from_threads_leave_no_thread_or_socket(servers):
    threads, fds = threading.active_count(), open_fds()
    env = open_env(servers["lookup"], observation_field="prompt")

    def play(seed: int) -> float:
        episode = env.episode(seed)
        try:
            [shown] = episode.start()
            return episode.after_turn(answer_of(shown["content"])).reward
        finally:
            episode.close()

    try:
        with ThreadPoolExecutor(16) as pool:
            assert list(pool.map(play, range(64))) == [1.0] * 64
        open_episodes = [env.episode(seed) for seed in range(8)]  # left open: Environment.close() ends them
        for episode in open_episodes:
            episode.start()
    finally:
        env.close()
    assert threading.active_count() == threads
    # A closed websocket's descriptor may go a moment after close() returns (CI once saw 17 for 16).
    wait_for(lambda: open_fds() == fds, 5, f"the episodes' sockets to close (the {fds} descriptors open before)")


def test_an_observation_too_large_is_cut(servers):
    env = open_env(servers["lookup"], tokens=16, observation_field="prompt", reset={"padding": 200_000})
    try:
        episode = env.episode(seed=1)
        [shown] = episode.start()
        assert len(shown["content"]) == 16 * 8 and shown["content"].startswith("Table: ")
        episode.close()
    finally:
        env.close()


def test_a_message_past_the_size_cap_fails(servers):
    env = open_env(servers["lookup"], max_bytes=1000, reset={"padding": 5000})
    try:
        message = failure(env.episode(seed=1).start, 10)
        assert message.startswith(f"environment http://127.0.0.1:{servers['lookup']}: reset: ")
        assert "exceeds limit of 1000 bytes" in message and message.endswith("(MTQ_MAX_REWARD_RESPONSE_BYTES)")
    finally:
        env.close()


def test_a_server_that_is_down(servers):
    port = free_port()  # nothing listens there
    env = open_env(port)
    try:
        message = failure(env.episode(seed=1).start, 5)
        assert message.startswith(f"environment http://127.0.0.1:{port}: connect: ") and "refused" in message
    finally:
        env.close()


def test_a_server_that_is_not_an_openenv_server(servers):
    env = open_env(servers["lookup"], url_path="/elsewhere")  # no /elsewhere/ws: starlette refuses the upgrade
    try:
        message = failure(env.episode(seed=1).start, 5)
        assert message.endswith("connect: InvalidStatus: server rejected WebSocket connection: HTTP 403")
    finally:
        env.close()


def test_a_server_that_never_answers_the_handshake():
    with socket.socket() as listener:  # the kernel accepts the connection; nobody reads it
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        env = open_env(listener.getsockname()[1], timeout_s=1.0)
        try:
            message = failure(env.episode(seed=1).start, 5)
            assert "connect: no answer within timeout_s=1s" in message
        finally:
            env.close()


def test_a_slow_server(servers):
    env = open_env(servers["slow"], timeout_s=1.0)
    try:
        episode = env.episode(seed=1)
        episode.start()  # its resets are quick
        message = failure(lambda: episode.after_turn("apple"), 5)
        assert message == f"environment http://127.0.0.1:{servers['slow']}: step: no answer within timeout_s=1s"
        started = time.monotonic()
        episode.close()
        assert time.monotonic() - started < 5
    finally:
        env.close()


def test_closing_the_environment_fails_an_episode_waiting_on_it(servers):
    env = open_env(servers["slow"], timeout_s=600.0)
    episode = env.episode(seed=1)
    episode.start()
    failed: list[str] = []

    def step():
        try:
            episode.after_turn("apple")
        except EpisodeFailed as e:
            failed.append(str(e))

    waiting = threading.Thread(target=step)
    waiting.start()
    time.sleep(0.5)
    started = time.monotonic()
    env.close()
    waiting.join(10)
    assert time.monotonic() - started < 10 and not waiting.is_alive()
    assert failed and failed[0].endswith("step: the job's environment was closed")
    assert "closed" in failure(episode.start, 1)


@pytest.mark.parametrize("answer,at,says", [
    ("text", "step", "answered non-JSON: 'this is not JSON {'"),
    ("text", "reset", "reset: answered non-JSON"),
    ("list", "step", "answered something other than an observation: [1, 2, 3]"),
    ("shape", "step", "answered something other than an observation"),
    ("error", "step", "answered an error: the environment broke (EXECUTION_ERROR)"),
    ("reward", "step", 'answered a reward that is not a finite number: "lots"'),
    ("nan", "step", "answered a reward that is not a finite number: NaN"),
    ("done", "step", 'answered a done that is not true or false: "maybe"'),
    ("binary", "step", "answered a binary message of 2 bytes"),
])
def test_a_server_that_answers_nonsense(servers, answer, at, says):
    env = open_env(servers["nonsense"], reset={"answer": answer, "at": at})
    try:
        episode = env.episode(seed=1)
        message = failure(lambda: (episode.start(), episode.after_turn("apple")), 5)
        assert message.startswith(f"environment http://127.0.0.1:{servers['nonsense']}: {at}: ") and says in message
        episode.close()
    finally:
        env.close()


def test_a_missing_observation_field(servers):
    env = open_env(servers["lookup"], observation_field="text")
    try:
        message = failure(env.episode(seed=1).start, 5)
        assert "observation: no field 'text' (observation_field); its fields: prompt" in message
    finally:
        env.close()


def test_a_host_not_allowed(servers):
    port = servers["lookup"]
    for hosts in ((), (f"127.0.0.1:{port + 1}",), ("127.0.0.0/8",), ("*",)):  # loopback only as an exact host:port
        env = open_env(port, hosts=hosts)
        try:
            message = failure(env.episode(seed=1).start, 5)
            assert message.startswith(f"environment http://127.0.0.1:{port}: connect: ") and "MTQ_REWARD_HOSTS" in message
        finally:
            env.close()
    # A name that is allowed but resolves to this host (DNS rebinding): the address decides.
    env = open_env(port, hosts=("env.example",), host="env.example", resolver=lambda host, p: ["127.0.0.1"])
    try:
        assert "resolves to 127.0.0.1, which MTQ_REWARD_HOSTS does not allow" in failure(env.episode(seed=1).start, 5)
    finally:
        env.close()


def test_the_api_refuses_an_environment_host_not_allowed():
    def errors(url: str, hosts: tuple[str, ...]) -> list[str]:
        spec = JobCreate(model_id="tiny", prompts=["hi"], environment={"url": url})
        settings = dataclasses.replace(load_settings(), reward_hosts=hosts)
        return [e for e in spec_errors(None, spec, settings, None) if e.startswith("environment")]

    assert errors("http://env.example:8000", ("env.example",)) == []
    assert errors("http://127.0.0.1:8000", ("127.0.0.1:8000",)) == []
    assert errors("http://10.1.2.3/", ("10.0.0.0/8",)) == []
    [refused] = errors("http://127.0.0.1:8000", ("*",))
    assert refused.startswith("environment: reward endpoint 127.0.0.1:8000 is not allowed (MTQ_REWARD_HOSTS=*;")
    assert errors("https://other.example", ("env.example",)) == [
        "environment: reward endpoint other.example:443 is not allowed (MTQ_REWARD_HOSTS=env.example; "
        "this host's own addresses only as an exact host:port)"]
