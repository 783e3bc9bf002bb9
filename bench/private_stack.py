"""A private stack for the benchmarks that go through HTTP: `mtq up` (its own redis-server,
the API and workers) in a temporary MTQ_HOME, with MODEL_DIR's parent as the models directory."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def private_stack(model_dir: Path, workers: int = 1, **settings: str):
    """Yields (the `mtq up` process, an authorised client of its API, the log file's path).
    settings: more of its environment (e.g. MTQ_DATA_ROOTS), or in place of its own (MTQ_REDIS_PORT)."""
    port = free_port()
    home = tempfile.mkdtemp(prefix="mtq-bench-")
    env = {**os.environ, "MTQ_HOME": home, "MTQ_MODELS_DIR": str(model_dir.parent), "MTQ_API_TOKEN": TOKEN,
           "MTQ_API_PORT": str(port), "PYTHONPATH": str(ROOT), "MTQ_REDIS_PORT": str(free_port()), **settings}
    env.pop("REDIS_URL", None)
    log = Path(home) / "stack.log"
    stack = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--port", str(port), "--workers", str(workers)],
                             cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield stack, httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"},
                                  timeout=300), log
    finally:
        os.killpg(stack.pid, signal.SIGTERM)
        stack.wait(60)


def wait_for_workers(client: httpx.Client, stack: subprocess.Popen, log: Path, count: int = 1,
                     timeout_s: float = 300) -> None:
    """Until `count` workers advertise their memory (their training processes are up); the
    stack's log tail if it dies or takes over timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            live = client.get("/admin/api/workers").json()
            if len(live) >= count and all(w.get("memory_gb") for w in live):
                return
        except (httpx.HTTPError, ValueError):
            pass
        assert time.monotonic() < deadline and stack.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
