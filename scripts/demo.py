"""The main job, end to end, as a user would run it (see scripts/demo.sh).

Starts `mtq up` (private redis-server, API, one worker) with its state under .mtq/demo,
generates the `small` random-weight model, posts the seed bug report's GRPO job over HTTP
(only model_id changed), follows it live with `mtq watch` (server-sent events), prints the final job,
checks that mlx_lm loads the adapter and generates with it, and stops the stack.

Ends with one summary line (`demo: ...`: job id, steps, final reward, adapter path, the first
step's time and the whole run's); exits 0 only when the job completed and mlx_lm loaded the
adapter and generated with it. `.ci/run` runs it on an empty MLX kernel cache (MTQ_KERNEL_CACHE).
"""

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cli.client import ApiClient

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / ".mtq" / "demo"
JOBS = "/admin/api/fine-tune/grpo/jobs"
# The seed bug report's request body (only model_id is changed below).
SEED_BODY = json.loads((ROOT / "examples" / "seed_job.json").read_text())


def free_ports(n: int) -> list[int]:
    """n distinct free ports: the sockets are held together, so that no two draws give the same port
    (the API's and redis-server's: `mtq up` drawing redis-server's port alone once drew the API's)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def stream_seconds(event_id: str) -> float:
    return int(event_id.split("-")[0]) / 1000


def summary(client: ApiClient, job: dict, t0: float, generated: bool) -> str:
    """The run in one line; the first step's time runs from the job's start on the worker to
    its first step event (on a cold kernel cache, mostly kernel compilation)."""
    events = list(client.events(job["job_id"], follow=False))
    started = next((stream_seconds(i) for i, e in events if e["type"] == "started"), None)
    first = next((stream_seconds(i) for i, e in events if e["type"] == "grpo_step"), None)
    progress = job.get("progress") or {}
    first_step = f"{first - started:.1f} s" if started and first else "-"
    reward = progress.get("mean_reward")
    return (f"demo: job {job['job_id']} {job['status']}, {progress.get('iter', 0)}/{job['config']['iters']} steps, "
            f"final reward {'-' if reward is None else f'{reward:.4f}'}, adapter {job['adapter_path']}, "
            f"{'generated with it' if generated else 'NOT generated'}, first step {first_step}, "
            f"{time.monotonic() - t0:.1f} s in all")


def main() -> int:
    t0 = time.monotonic()
    api_port, redis_port = free_ports(2)
    env = dict(os.environ, MTQ_HOME=str(HOME), MTQ_API_TOKEN=os.environ.get("MTQ_API_TOKEN") or secrets.token_urlsafe(16),
               MTQ_API_PORT=str(api_port), MTQ_REDIS_PORT=str(redis_port), PYTHONUNBUFFERED="1")
    env.pop("REDIS_URL", None)  # `mtq up` starts its own redis-server
    env.pop("MTQ_MODELS_DIR", None)
    mtq = [sys.executable, "-m", "cli.main"]
    model_dir = HOME / "models" / "demo-small"
    subprocess.run([*mtq, "make-model", str(model_dir), "--size", "small"], check=True, env=env, cwd=ROOT)

    log_path = HOME / "stack.log"
    print(f"starting the stack (redis-server, API, 1 worker); its logs go to {log_path}")
    stack = subprocess.Popen([*mtq, "up", "--workers", "1"], env=env, cwd=ROOT,
                             stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{env['MTQ_API_PORT']}"
    try:
        client = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {env['MTQ_API_TOKEN']}"}, timeout=30)
        deadline = time.monotonic() + 120
        while True:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if stack.poll() is not None or time.monotonic() > deadline:
                print(f"the stack did not come up; see {log_path}", file=sys.stderr)
                return 1
            time.sleep(0.2)

        body = dict(SEED_BODY, model_id=model_dir.name)  # found under $MTQ_HOME/models
        created = client.post(JOBS, json=body)
        created.raise_for_status()
        job_id = created.json()["job_id"]
        print(f"submitted job {job_id}: POST {base_url}{JOBS}")
        # The live progress bar: `mtq watch`, the client command, over the same API.
        watch_env = dict(env, MTQ_API_URL=base_url)
        watched = subprocess.run([*mtq, "watch", job_id], env=watch_env, cwd=ROOT)
        job = client.get(f"{JOBS}/{job_id}").json()
        print(json.dumps(job, indent=2))
        generated = False
        if job["status"] == "completed":
            import mlx_lm

            model, tokenizer = mlx_lm.load(str(model_dir), adapter_path=job["adapter_path"])
            text = mlx_lm.generate(model, tokenizer, "What is 2+2?", max_tokens=12)
            print(f"mlx_lm.load(..., adapter_path={job['adapter_path']!r}) generates: {text!r}")
            generated = isinstance(text, str)
        print(summary(ApiClient(base_url, env["MTQ_API_TOKEN"]), job, t0, generated))
        return 0 if generated and watched.returncode == 0 else 1
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.wait(60)
        print("stopped the stack")


if __name__ == "__main__":
    sys.exit(main())
