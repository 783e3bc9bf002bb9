"""Real parts for the tests: a redis-server on a free port, the API over HTTP, worker processes.

Each test module gets its own redis-server and API (module-scoped `stack`); workers are
started per test with `stack.start_worker()` and stopped when the test ends.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import redis

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token"
JOBS = "/admin/api/fine-tune/grpo/jobs"
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS_DIR") or ROOT / "test-artifacts")  # screenshots
# Every test's workers share one kernel cache (worker/supervisor/kernel_cache.py), the temp directory's, as
# MLX's default: each stack's own $MTQ_HOME/kernel-cache would compile the kernels again.
os.environ.setdefault("MTQ_KERNEL_CACHE", tempfile.gettempdir())
# ... and share none of them through Redis (worker/supervisor/kernel_share.py): each module's Redis would
# otherwise take the hundreds of kernels in that cache. tests/test_kernel_share.py turns it on.
os.environ.setdefault("MTQ_KERNEL_SHARE_MB", "0")


def read_events(r, job_id: str, after_id: str = "0-0", count: int = 100) -> list[tuple[str, dict]]:
    """A job's events after `after_id` (a stream id), as (id, event) pairs."""
    from shared.events import decode_events
    from shared.keys import events_key

    return decode_events(r.xread({events_key(job_id): after_id}, count=count))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The tests' own reward functions are on the operator allow-list (the API's and the workers',
# which inherit this environment); tests/test_security.py checks that nothing else is.
os.environ.setdefault("MTQ_REWARD_MODULES", "reward_fns,tests.reward_fns")
# Reward servers on this host are reached only at an exact host:port of MTQ_REWARD_HOSTS: the
# tests' reward servers listen on REWARD_PORT (tests/reward_server.py), and nothing listens on
# CLOSED_PORT (a server that is down). Set, not defaulted: a pytest process started by another
# (pytest-xdist's) inherits its environment but has ports of its own.
REWARD_PORT, CLOSED_PORT = free_port(), free_port()
os.environ["MTQ_REWARD_HOSTS"] = f"127.0.0.1:{REWARD_PORT},127.0.0.1:{CLOSED_PORT}"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def kill_when(predicate, pid: int, what: str, group: bool = False, timeout: float = 120):
    """SIGKILL `pid` (with `group`, its process group: a worker and its training process) once
    `predicate()` holds. It is stopped (SIGSTOP) while each check runs: a job of fast steps would
    otherwise finish between a check that saw its checkpoint and the kill."""
    send = os.killpg if group else os.kill
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        send(pid, signal.SIGSTOP)
        if predicate():
            send(pid, signal.SIGKILL)
            return
        send(pid, signal.SIGCONT)
        time.sleep(0.01)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


@contextlib.contextmanager
def openenv_servers(modes, logs: Path):
    """{mode: port}: a tests/openenv_server.py of each mode, started together (each takes seconds
    to import openenv-core), with the repository's root on its path (its colors mode reads examples/)."""
    ports = {mode: free_port() for mode in modes}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    procs = {mode: subprocess.Popen([sys.executable, str(ROOT / "tests" / "openenv_server.py"), "--port", str(port),
                                     "--mode", mode], stdout=(logs / f"{mode}.log").open("w"), stderr=subprocess.STDOUT,
                                    env=env)
             for mode, port in ports.items()}

    def up(port: int) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success
        except httpx.TransportError:
            return False

    try:
        for mode, port in ports.items():
            wait_for(lambda: procs[mode].poll() is not None or up(port), 60, f"the {mode} server")
            assert procs[mode].poll() is None, (logs / f"{mode}.log").read_text()
        yield ports
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


class RedisServer:
    def __init__(self, workdir: Path, bind: str = "127.0.0.1", args: tuple[str, ...] = ()):
        self.bind = bind  # addresses, space-separated (besides loopback: tests/test_netns.py)
        self.args = args  # more redis-server options (e.g. --maxmemory: tests/test_redis_trouble.py)
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self):
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed (scripts/test.sh installs it)"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", *self.bind.split(), "--dir", str(self.dir),
             "--appendonly", "yes", "--save", "", "--daemonize", "no",
             "--protected-mode", "yes" if self.bind == "127.0.0.1" else "no", *self.args],
            stdout=open(self.dir / "redis.log", "ab"), stderr=subprocess.STDOUT,
        )
        client = redis.Redis.from_url(self.url)
        wait_for(lambda: _pings(client), 10, "redis-server")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _pings(client) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


class Stack:
    """A redis-server, the API, and workers started on demand; all real processes."""

    def __init__(self, workdir: Path, tiny_model: Path, redis_bind: str = "127.0.0.1", redis_args: tuple[str, ...] = ()):
        self.workdir = workdir
        self.tiny_model = tiny_model
        self.redis_server = RedisServer(workdir / "redis", redis_bind, redis_args)
        self.api_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.api_port}"
        self.procs: list[subprocess.Popen] = []
        self.env = dict(
            os.environ,
            REDIS_URL=self.redis_server.url,
            MTQ_API_TOKEN=TOKEN,
            MTQ_HOME=str(workdir / "home"),
            MTQ_MODELS_DIR=str(tiny_model.parent),
            MTQ_MODEL_ROOTS=str(tiny_model.parent),
            MTQ_API_HOST="127.0.0.1",
            MTQ_API_PORT=str(self.api_port),
            PYTHONUNBUFFERED="1",
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        self.redis = redis.Redis.from_url(self.redis_server.url)

    def use_tokens(self, tokens: list[dict]) -> None:
        """Named tokens with roles (MTQ_TOKENS_FILE), besides MTQ_API_TOKEN: call before start_api."""
        import yaml

        path = self.workdir / "tokens.yaml"
        path.write_text(yaml.safe_dump({"tokens": tokens}))
        self.env["MTQ_TOKENS_FILE"] = str(path)

    def spawn(self, name: str, *args: str, env: dict | None = None, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        """`mtq ARGS`; prefix: a command to run it under (e.g. `ip netns exec NS`)."""
        log = open(self.workdir / f"{name}-{len(self.procs)}.log", "ab")
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env or self.env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def start_api(self):
        self.api = self.spawn("api", "api")
        wait_for(self._api_up, 30, "the API")

    def _api_up(self) -> bool:
        try:
            return httpx.get(self.base_url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def start_worker(self, *args: str, env: dict | None = None, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        """Start `mtq worker` and wait until it has registered with rq."""
        from rq import Worker

        before = {w.name for w in Worker.all(connection=self.redis)}
        proc = self.spawn("worker", "worker", *args, env=env, prefix=prefix)

        def registered():
            assert proc.poll() is None, f"worker exited with {proc.returncode}: {self.logs('worker')}"
            return {w.name for w in Worker.all(connection=self.redis)} - before

        wait_for(registered, 60, "the worker to register")
        return proc

    def rq_queue(self, job_id: str):
        """The rq queue a queued job waits on (shared/routing.py routes it by model, memory and lane)."""
        from rq import Queue

        return Queue(self.redis.hget(f"mtq:job:{job_id}", "queue").decode(), connection=self.redis)

    def rq_jobs_queued(self) -> int:
        """rq jobs waiting on any queue."""
        from rq import Queue

        return sum(q.count for q in Queue.all(connection=self.redis))

    def logs(self, prefix: str, tail: int | None = 4000) -> str:
        """The logs of the processes named `prefix`, the last `tail` characters of each (None: all)."""
        return "\n".join(p.read_text(errors="replace")[-tail if tail else 0:]
                         for p in sorted(self.workdir.glob(f"{prefix}-*.log")))

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30)

    def submit(self, spec: dict) -> str:
        """POST a GRPO job; its id."""
        with self.client() as c:
            resp = c.post(JOBS, json=spec)
        assert resp.status_code == 200, resp.text
        return resp.json()["job_id"]

    def get_job(self, job_id: str) -> dict:
        with self.client() as c:
            return c.get(f"{JOBS}/{job_id}").json()

    def events(self, job_id: str) -> list[tuple[float, dict]]:
        """(unix time, event) of every event in the job's Redis stream."""

        return [(int(eid.split("-")[0]) / 1000, e) for eid, e in read_events(self.redis, job_id, count=100_000)]

    def metrics(self, **kwargs) -> dict:
        """/metrics parsed by prometheus-client: {sample name + labels (JSON): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        res = httpx.get(self.base_url + "/metrics", **kwargs)
        assert res.status_code == 200, res.text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for family in text_string_to_metric_families(res.text) for s in family.samples}

    def wait_job(self, job_id: str, statuses=("completed", "failed", "cancelled"), timeout: float = 240,
                 path: str = JOBS) -> dict:
        """The job once it reaches one of `statuses`; path: its kind's routes (default GRPO's)."""
        with self.client() as c:
            def done():
                job = c.get(f"{path}/{job_id}").json()
                return job if job["status"] in statuses else None
            try:
                return wait_for(done, timeout, f"job {job_id} to reach {statuses}", interval=0.2)
            except TimeoutError as e:
                raise TimeoutError(f"{e}\nworker logs:\n{self.logs('worker')}") from None

    def stop_proc(self, proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 20):
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def stop_all(self):
        for proc in reversed(self.procs):
            self.stop_proc(proc)
        self.redis_server.stop()


def wait_done(stack: Stack, path: str, job_id: str, timeout: float = 300, status: str = "completed") -> dict:
    """The job once finished (Stack.wait_job), which must be in `status`."""
    job = stack.wait_job(job_id, timeout=timeout, path=path)
    assert job["status"] == status, f"{job['error']}\n{stack.logs('worker')}"
    return job


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random-weight tiny model directory, made once per test session."""
    from worker.runtime.make_model import make_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    make_model(out, size="tiny", seed=0)
    return out


def running(s: Stack):
    """A module's stack fixture body: its redis-server and API up, everything stopped after."""
    s.redis_server.start()
    s.start_api()
    yield s
    s.stop_all()


@pytest.fixture(scope="module")
def worker_env(stack) -> dict:
    """The environment of the module's `worker` (a module may override this fixture)."""
    return stack.env


@pytest.fixture(scope="module")
def worker(stack, worker_env):
    """The module's worker, from the first test that uses it on (in a module whose every test
    does, from its first): jobs that earlier tests left queued on purpose are cancelled, so the
    worker runs only what the tests that use it submit. Its environment: worker_env."""
    from shared import lifecycle
    from shared.keys import JOBS_INDEX

    for job_id in stack.redis.zrange(JOBS_INDEX, 0, -1):
        lifecycle.cancel(stack.redis, job_id.decode())
    proc = stack.start_worker(env=worker_env)
    yield proc
    stack.stop_proc(proc)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    yield from running(Stack(tmp_path_factory.mktemp("stack"), tiny_model))


@pytest.fixture(scope="module")
def client(stack):
    """An HTTP client of the module's stack, with the admin token."""
    with stack.client() as c:
        yield c


@pytest.fixture
def workers(stack):
    """Workers started in a test are stopped when it ends."""
    started: list[subprocess.Popen] = []

    def start(*args, env=None):
        proc = stack.start_worker(*args, env=env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stack.stop_proc(proc)
