"""`mtq up` and `mtq api` as real processes: what they start, and that nothing outlives them."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis
from rq import Worker

from conftest import free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
JOBS = "/admin/api/fine-tune/grpo/jobs"


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children of all its threads, recursively)."""
    found: set[int] = set()
    for children_file in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children = [int(p) for p in children_file.read_text().split()]
        except FileNotFoundError:
            continue
        for child in children:
            found |= {child} | descendants(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited already


def answers_http(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


class MtqUp:
    """`mtq up` in the background, with its output in a file."""

    def __init__(self, tmp_path: Path, *args: str):
        self.port = free_port()
        self.redis_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.home = tmp_path / "home"
        self.log = tmp_path / "up.log"
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MTQ_API_TOKEN")}
        env.update(
            MTQ_HOME=str(self.home), MTQ_MODELS_DIR=str(tmp_path / "models"), MTQ_REDIS_PORT=str(self.redis_port),
            MTQ_API_HOST="127.0.0.1", PYTHONUNBUFFERED="1",
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "up", "--port", str(self.port), *args],
            cwd=ROOT, env=env, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self):
        def ready():
            assert self.proc.poll() is None, f"mtq up exited with {self.proc.returncode}:\n{self.output()}"
            return "docs: " in self.output() and answers_http(self.base_url + "/healthz") == 200
        wait_for(ready, 90, "mtq up to be ready")

    def started(self) -> dict[str, int]:
        """{name: pid} of the children it says it started."""
        return {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", self.output())}

    def kill_leftovers(self, pids):
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def mtq_up(tmp_path):
    started: list[tuple[MtqUp, set[int]]] = []

    def start(*args: str) -> MtqUp:
        up = MtqUp(tmp_path, *args)
        started.append(up)
        return up

    yield start
    for up in started:  # if a test failed half-way: leave nothing running
        pids = descendants(up.proc.pid) | set(up.started().values())
        if up.proc.poll() is None:
            os.kill(up.proc.pid, signal.SIGKILL)
            up.proc.wait()
        up.kill_leftovers(pids)


def test_up_runs_redis_api_and_a_worker_and_sigterm_stops_everything(mtq_up):
    up = mtq_up("--workers", "1")
    up.wait_ready()

    started = up.started()
    assert set(started) == {"redis-server", "api", "worker-1"}, up.output()
    # Its own redis-server, with the data under $MTQ_HOME/redis, holding the worker's registration.
    r = redis.Redis(port=up.redis_port, decode_responses=True)
    assert r.config_get("appendonly") == {"appendonly": "yes"}
    assert Path(r.config_get("dir")["dir"]) == up.home / "redis"
    wait_for(lambda: len(Worker.all(connection=r)) == 1, 60, f"the worker to register:\n{up.output()}")
    r.close()

    # The generated token is printed, and the API accepts it.
    token = re.search(r"MTQ_API_TOKEN=(\S+)", up.output()).group(1)
    res = httpx.get(up.base_url + JOBS, headers={"Authorization": f"Bearer {token}"})
    assert res.status_code == 200, res.text
    # The token in a URL (the seed's ?key=, from loopback), accepted or refused, never reaches the
    # access log, under any name (api/main.py without_query_tokens).
    codes = {name: httpx.get(f"{up.base_url}{JOBS}?limit=1&{name}={token}").status_code
             for name in ("key", "KEY", "Key", "api_key", "token", "foo")}
    assert codes == {"key": 200, "KEY": 401, "Key": 401, "api_key": 200, "token": 401, "foo": 401}, codes
    wait_for(lambda: "foo=<redacted>" in up.output(), 10, "the access log's lines")

    pids = descendants(up.proc.pid)
    assert set(started.values()) <= pids
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(30) == 0, up.output()
    assert [pid for pid in pids if alive(pid)] == [], f"left running:\n{up.output()}"
    assert answers_http(up.base_url + "/healthz") is None
    assert [line for line in up.output().splitlines() if token in line] == [
        f"[mtq up] generated MTQ_API_TOKEN={token} (set MTQ_API_TOKEN to choose your own)"]


def test_up_starts_a_dead_worker_again(mtq_up):
    up = mtq_up("--workers", "1")
    up.wait_ready()
    first = up.started()["worker-1"]
    r = redis.Redis(port=up.redis_port)
    wait_for(lambda: len(Worker.all(connection=r)) == 1, 60, f"the worker to register:\n{up.output()}")
    before = {w.name for w in Worker.all(connection=r)}
    os.killpg(first, signal.SIGKILL)  # the worker and its training process, as the OOM killer might
    wait_for(lambda: up.started().get("worker-1", first) != first, 30, f"a new worker-1:\n{up.output()}")
    assert "worker-1 (pid" in up.output() and "exited with code -9" in up.output()
    assert up.proc.poll() is None  # the stack goes on
    wait_for(lambda: {w.name for w in Worker.all(connection=r)} - before, 60,
             f"the new worker to register:\n{up.output()}")
    r.close()


def test_up_stops_everything_and_fails_when_a_child_dies(mtq_up):
    up = mtq_up("--workers", "0")
    up.wait_ready()
    started = up.started()
    assert set(started) == {"redis-server", "api"}, up.output()
    pids = descendants(up.proc.pid)

    os.kill(started["api"], signal.SIGKILL)
    assert up.proc.wait(30) == 1, up.output()
    assert "api" in up.output() and "exited unexpectedly" in up.output()
    assert [pid for pid in pids if alive(pid)] == [], f"left running:\n{up.output()}"


def test_api_starts_without_redis_and_without_a_token(tmp_path):
    port = free_port()
    env = dict(
        os.environ, REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", MTQ_API_TOKEN="", MTQ_API_PORT=str(port),
        MTQ_API_HOST="127.0.0.1", MTQ_HOME=str(tmp_path), PYTHONPATH=str(ROOT),
    )
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "api"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers_http(base_url + "/healthz"), 30, "mtq api")
        res = httpx.get(base_url + "/healthz")
        assert res.status_code == 503
        assert res.json()["redis"] is False and res.json()["status"] == "unavailable"

        # No MTQ_API_TOKEN on the server: /admin is refused whatever the client sends.
        for headers in ({}, {"Authorization": "Bearer anything"}):
            res = httpx.get(base_url + JOBS, headers=headers)
            assert res.status_code == 401
            assert "no API token configured" in res.json()["detail"]
    finally:
        proc.terminate()
        proc.wait(15)
