"""A job's OpenEnv environment server as Episodes (worker/agentic/episode.py). Each episode is one
session of the server's WebSocket protocol (/ws: its HTTP /reset and /step are stateless, so
they cannot carry an episode): a reset with the spec's keyword arguments and the row's seed,
then a step per model turn, its action {action_field: the turn's text}.

The client is this module's, on `websockets`, not openenv-core's GenericEnvClient: importing
that loads gradio and fastmcp (4 s and 160 MB in every training process); it sets NO_PROXY in
os.environ while it connects (process-wide, from many threads at once); and the connection is
websockets' own, through any proxy the environment names, to whatever DNS answers. Here the
reward calls' CallGuard (worker/rewards/guard.py) makes the TCP connection, to an address
MTQ_REWARD_HOSTS allows, within timeout_s, and the WebSocket handshake runs on that socket (no
proxy; websockets follows no redirect on a socket it was given).

The rollout's threads run an Environment's coroutines on its one event loop thread; close()
ends that thread and every session still open.
"""

import asyncio
import concurrent.futures
import json
import math
import socket
import threading
from typing import Any, Coroutine

import httpcore
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.frames import CloseCode

from shared.agentic_specs import OpenEnvEnvironment
from shared.reward_specs import parse_reward_url, url_port
from shared.schemas import GRPOConfig
from shared.settings import Settings
from worker.agentic.episode import CHARS_PER_TOKEN, EpisodeFailed, Reply
from worker.rewards.batch import RewardError
from worker.rewards.guard import CallGuard, Resolver, resolve_host

# An observation's text is cut to max_tool_output_tokens times this many characters: there is
# no tokenizer here, so the bound is generous (the decode counts the real tokens); it keeps a
# server's megabytes of observation out of the conversation.
# How long closing a session waits for the server's close frame: a server that never sends it
# must not hold up the end of a step for a whole timeout_s.
CLOSE_TIMEOUT_S = 2.0
# An observation's fields that are the step's result rather than what the model is shown
# (openenv-core's servers leave them out of the observation already; another server may not).
RESULT_FIELDS = ("reward", "done", "metadata")
# Errors of talking to the server; any other is a bug here and is raised as it is.
SERVER_ERRORS = (asyncio.TimeoutError, OSError, ValueError, WebSocketException)


def _snippet(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _finite(value: Any) -> float | None:
    """A JSON number as a float (true/false as 1/0, as openenv-core's Observation allows); None if
    it is not a finite number."""
    if not isinstance(value, (bool, int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return number if math.isfinite(number) else None


def parse_answer(raw: str | bytes) -> tuple[dict, float | None, bool]:
    """The observation, reward and done of the server's answer to a reset or a step
    ({"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}); ValueError
    saying what is wrong with it."""
    if isinstance(raw, bytes):
        raise ValueError(f"answered a binary message of {len(raw)} bytes")
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError(f"answered non-JSON: {_snippet(raw)!r}") from None
    data = answer.get("data") if isinstance(answer, dict) else None
    if isinstance(answer, dict) and answer.get("type") == "error":
        detail = data if not isinstance(data, dict) else f"{data.get('message')} ({data.get('code')})"
        raise ValueError(f"answered an error: {_snippet(str(detail))}")
    if (not isinstance(answer, dict) or answer.get("type") != "observation" or not isinstance(data, dict)
            or not isinstance(data.get("observation", {}), dict)):
        raise ValueError(f"answered something other than an observation: {_snippet(raw)}")
    reward, done = data.get("reward"), data.get("done", False)
    if reward is not None and _finite(reward) is None:
        raise ValueError(f"answered a reward that is not a finite number: {_snippet(json.dumps(reward))}")
    if not isinstance(done, bool):
        raise ValueError(f"answered a done that is not true or false: {_snippet(json.dumps(done))}")
    return data.get("observation", {}), None if reward is None else _finite(reward), done


class Environment:
    """The job's OpenEnv server: `episode(seed)` for each row of a step, `close()` when the job ends."""

    def __init__(self, spec: OpenEnvEnvironment, settings: Settings, cfg: GRPOConfig,
                 resolver: Resolver = resolve_host):
        self.spec = spec
        url = parse_reward_url(spec.url)  # the parser the API checked the URL with
        self.host, self.port = url.host, url_port(url)
        self.ws_url = str(url.copy_with(scheme="wss" if url.scheme == "https" else "ws",
                                        path=url.path.rstrip("/") + "/ws"))
        # Its deadline stays unset: each connect passes timeout_s, so threads can share it.
        self.guard = CallGuard(settings.reward_hosts, resolver)
        self.max_bytes = settings.max_reward_response_bytes  # one message of the server's, at most
        self.max_chars = cfg.max_tool_output_tokens * CHARS_PER_TOKEN
        self.sessions: set[ClientConnection] = set()  # the open ones; touched on the loop only
        self.lock = threading.Lock()  # `closed` and a submission to the loop go together
        self.closed = False
        self.loop = asyncio.new_event_loop()
        # A daemon: an Environment left open (a bug) must not keep the worker's process alive.
        self.thread = threading.Thread(target=self.loop.run_forever, name="openenv-session-loop", daemon=True)
        self.thread.start()

    def episode(self, seed: int) -> "EnvironmentEpisode":
        return EnvironmentEpisode(self, seed)

    def close(self) -> None:
        """End every session and the loop thread (idempotent). An episode still waiting on the
        server fails with EpisodeFailed."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    # ------------------------------------------------------------------ called from episodes' threads

    def failed(self, what: str, error: BaseException | str) -> EpisodeFailed:
        if isinstance(error, str):
            cause = error
        elif isinstance(error, (asyncio.TimeoutError, httpcore.TimeoutException)):
            cause = f"no answer within timeout_s={self.spec.timeout_s:g}s"
        else:  # some errors (a connection closed) have no message: the class says what happened
            cause = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if isinstance(error, ConnectionClosed) and error.sent and error.sent.code == CloseCode.MESSAGE_TOO_BIG:
            cause += " (MTQ_MAX_REWARD_RESPONSE_BYTES)"
        return EpisodeFailed(f"environment {self.spec.url}: {what}: {cause}")

    def run(self, coroutine: Coroutine, what: str) -> Any:
        """The coroutine's result, run on the loop; a server's failure as EpisodeFailed."""
        with self.lock:
            if self.closed:
                coroutine.close()
                raise self.failed(what, "the job's environment is closed")
            future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise self.failed(what, "the job's environment was closed") from None
        except SERVER_ERRORS as e:
            raise self.failed(what, e) from None

    def connect_socket(self) -> socket.socket:
        """A TCP connection to the server, made in the calling thread by the guard: resolved
        once, each address checked against MTQ_REWARD_HOSTS, within timeout_s."""
        try:
            stream = self.guard.connect_tcp(self.host, self.port, timeout=self.spec.timeout_s)
        except RewardError as e:  # a host MTQ_REWARD_HOSTS does not allow
            raise self.failed("connect", str(e)) from None
        except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
            raise self.failed("connect", e) from None
        return stream.get_extra_info("socket")

    def end_session(self, ws: ClientConnection) -> None:
        with self.lock:
            if self.closed:
                return  # close() ended every session
            future = asyncio.run_coroutine_threadsafe(self._close_session(ws), self.loop)
        try:
            future.result()
        except concurrent.futures.CancelledError:
            pass  # close() came meanwhile, and ends the session

    def message(self, observation: dict) -> dict:
        """The observation as the message the model is shown."""
        field = self.spec.observation_field
        if field is None:
            value: Any = {k: v for k, v in observation.items() if k not in RESULT_FIELDS}
        elif field in observation:
            value = observation[field]
        else:
            raise self.failed("observation", f"no field {field!r} (observation_field); its fields: "
                                             f"{_snippet(', '.join(map(str, observation)))}")
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return {"role": self.spec.role, "content": text[: self.max_chars]}

    # ------------------------------------------------------------------ coroutines, on the loop

    async def open_session(self, sock: socket.socket) -> ClientConnection:
        ws = await connect(
            self.ws_url, sock=sock, proxy=None, compression=None, max_size=self.max_bytes,
            open_timeout=self.spec.timeout_s, close_timeout=CLOSE_TIMEOUT_S,
        )
        self.sessions.add(ws)
        return ws

    async def ask(self, ws: ClientConnection, message: dict) -> str | bytes:
        """Send one message of the protocol and read the server's answer, within timeout_s."""
        async def exchange() -> str | bytes:
            await ws.send(json.dumps(message))
            return await ws.recv()

        return await asyncio.wait_for(exchange(), self.spec.timeout_s)

    async def _close_session(self, ws: ClientConnection) -> None:
        # A close frame ends the server's session (openenv-core's server destroys it on the
        # disconnect), so no {"type": "close"} message first. Waits at most CLOSE_TIMEOUT_S.
        self.sessions.discard(ws)
        await ws.close()

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not me]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(self._close_session(ws) for ws in list(self.sessions)), return_exceptions=True)


class EnvironmentEpisode:
    """One row's episode: a session of the server, opened by start() and ended by close()."""

    def __init__(self, env: Environment, seed: int):
        self.env, self.seed = env, seed
        self.ws: ClientConnection | None = None

    def start(self) -> list[dict]:
        sock = self.env.connect_socket()
        try:
            self.ws = self.env.run(self.env.open_session(sock), "connect")
        except BaseException:
            sock.close()  # never handed to a connection (or its failed handshake closed it already)
            raise
        observation, _, _ = self._ask("reset", {**self.env.spec.reset, "seed": self.seed})
        return [self.env.message(observation)]

    def after_turn(self, text: str) -> Reply:
        observation, reward, done = self._ask("step", {self.env.spec.action_field: text})
        return Reply(messages=[] if done else [self.env.message(observation)], done=done, reward=reward)

    def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            self.env.end_session(ws)

    def _ask(self, kind: str, data: dict) -> tuple[dict, float | None, bool]:
        if self.ws is None:
            raise self.env.failed(kind, "the episode's session is not open (start() not called, or closed)")
        raw = self.env.run(self.env.ask(self.ws, {"type": kind, "data": data}), kind)
        try:
            return parse_answer(raw)
        except ValueError as e:
            raise self.env.failed(kind, str(e)) from None
