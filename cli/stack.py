"""`mtq up`: the whole stack on one machine, in the foreground.

Starts a private redis-server (only when REDIS_URL is unset), the API and N workers as
child processes, each in its own process group, and supervises them: Ctrl-C / SIGTERM /
SIGHUP stops them all. A worker that dies is started again (with a growing pause if it keeps
dying at once); if Redis or the API dies the rest are stopped and `mtq up` exits 1. Nothing it
started is left running when it returns.
"""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from shared.settings import load_settings

STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL for whatever is still running after this long
REDIS_START_TIMEOUT_S = 15.0
API_START_TIMEOUT_S = 60.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StackError(Exception):
    """Something went wrong starting or running the stack; everything gets stopped."""


def say(message: str) -> None:
    print(f"[mtq up] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    argv: list[str]
    started_at: float = 0.0
    restart_delay: float = 0.0  # grows while the child keeps dying soon after starting
    restart_at: float | None = None  # set while a dead worker waits to be started again


class LocalStack:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self.stop_signal: int | None = None
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    def on_signal(self, signum: int, frame) -> None:
        # Only note it: the main loop stops the children. Raising here could leave a
        # half-started child behind.
        self.stop_signal = signum

    def start(self, name: str, argv: list[str]) -> Child:
        # start_new_session: own process group, so (1) Ctrl-C in the terminal reaches only
        # `mtq up`, which then stops the children in order, and (2) a signal to the group
        # also reaches anything a child started.
        child = Child(name, self._spawn(argv), argv, time.monotonic())
        self.children.append(child)
        say(f"started {name} (pid {child.proc.pid})")
        return child

    def _spawn(self, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, env=self.env, start_new_session=True)

    def check_children(self) -> None:
        for child in self.children:
            code = child.proc.poll()
            if code is None:
                continue
            if not child.name.startswith("worker"):
                raise StackError(f"{child.name} (pid {child.proc.pid}) exited unexpectedly with code {code}")
            # A worker's jobs survive its death (they are re-queued); the worker is started again.
            now = time.monotonic()
            if child.restart_at is None:
                quick = now - child.started_at < 30
                child.restart_delay = min(max(child.restart_delay * 2, 1.0), 30.0) if quick else 0.0
                child.restart_at = now + child.restart_delay
                say(f"{child.name} (pid {child.proc.pid}) exited with code {code}; "
                    f"starting it again in {child.restart_delay:.0f}s")
            elif now >= child.restart_at:
                _signal_group(child, signal.SIGKILL)  # whatever it left behind
                child.proc, child.started_at, child.restart_at = self._spawn(child.argv), now, None
                say(f"started {child.name} (pid {child.proc.pid})")

    def wait_until(self, predicate, timeout: float, what: str) -> bool:
        """True once predicate() holds; False if a stop was requested meanwhile."""
        deadline = time.monotonic() + timeout
        while self.stop_signal is None:
            self.check_children()
            if predicate():
                return True
            if time.monotonic() > deadline:
                raise StackError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.1)
        return False

    def start_redis(self, data_dir: Path) -> str:
        exe = shutil.which("redis-server")
        if not exe:
            raise StackError("redis-server is not installed: install it, or set REDIS_URL to a running Redis")
        port = int(os.environ.get("MTQ_REDIS_PORT") or free_port())
        data_dir.mkdir(parents=True, exist_ok=True)
        self.start("redis-server", [
            exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
            "--appendonly", "yes", "--daemonize", "no",
        ])
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        try:
            self.wait_until(lambda: _answers_ping(client), REDIS_START_TIMEOUT_S, "redis-server")
        finally:
            client.close()
        say(f"redis-server on {url} (data in {data_dir})")
        return url

    def run(self, port: int, workers: int, dashboard_port: int | None = None) -> int:
        settings = load_settings()
        if not os.environ.get("REDIS_URL"):
            self.env["REDIS_URL"] = self.start_redis(settings.home / "redis")
        if not self.env.get("MTQ_API_TOKEN"):
            self.env["MTQ_API_TOKEN"] = secrets.token_urlsafe(24)
            say(f"generated MTQ_API_TOKEN={self.env['MTQ_API_TOKEN']} (set MTQ_API_TOKEN to choose your own)")

        mtq = [sys.executable, "-m", "cli.main"]
        self.start("api", [*mtq, "api", "--port", str(port)])
        for i in range(workers):
            self.start(f"worker-{i + 1}", [*mtq, "worker"])
        if dashboard_port is not None:
            self.start("dashboard", [*mtq, "dashboard", "--port", str(dashboard_port)])

        host = "127.0.0.1" if settings.api_host in ("0.0.0.0", "::", "") else settings.api_host
        base_url = f"http://{host}:{port}"
        if not self.wait_until(lambda: _answers_http(base_url + "/healthz"), API_START_TIMEOUT_S, "the API"):
            return 0
        say(f"API: {base_url}  docs: {base_url}/docs  (Ctrl-C stops everything)")
        if dashboard_port is not None:
            say(f"rq-dashboard: http://127.0.0.1:{dashboard_port} (user mtq, password MTQ_API_TOKEN)")

        while self.stop_signal is None:
            self.check_children()
            time.sleep(0.2)
        say(f"received {signal.Signals(self.stop_signal).name}; stopping")
        return 0

    def stop_all(self) -> None:
        # Workers and API first, Redis last: while stopping they may still write job state.
        self._stop([c for c in self.children if c.name != "redis-server"])
        self._stop([c for c in self.children if c.name == "redis-server"])

    def _stop(self, children: list[Child]) -> None:
        for child in children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{child.name} (pid {child.proc.pid}) did not stop within {STOP_GRACE_S:.0f}s; killing it")
            # Also whatever the child started and left behind in its group.
            _signal_group(child, signal.SIGKILL)
            child.proc.wait()


def _signal_group(child: Child, sig: int) -> None:
    try:
        os.killpg(child.proc.pid, sig)
    except ProcessLookupError:
        pass  # the whole group is gone already


def _answers_ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _answers_http(url: str) -> bool:
    # Any answer counts: /healthz says 503 while Redis is unreachable, but the API is up.
    try:
        httpx.get(url, timeout=1)
        return True
    except httpx.HTTPError:
        return False


def run_stack(port: int, workers: int, dashboard_port: int | None = None) -> int:
    stack = LocalStack()
    previous = {sig: signal.signal(sig, stack.on_signal) for sig in STOP_SIGNALS}
    try:
        return stack.run(port, workers, dashboard_port)
    except StackError as exc:
        say(f"{exc}; stopping the stack")
        return 1
    finally:
        stack.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        say("stopped")
