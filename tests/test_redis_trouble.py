"""Redis trouble is a 503 (issue 23, finding 14): a Redis at its maxmemory, or one that stops
answering (paused with SIGSTOP), gets a quick JSON 503 from every route that needs it (never a
500 or a reset connection), /healthz says so, and a worker waits instead of exiting; all of it
recovers when Redis does. Its own module: its Redis has a small maxmemory."""

import concurrent.futures
import os
import signal
import threading
import time

import httpx
import pytest
import redis

from conftest import Stack, running, wait_for

API = "/admin/api/fine-tune"
JOBS = f"{API}/grpo/jobs"
ALICE = "alice-redis-trouble-token-0123"
MAXMEMORY = 48 * 2**20  # the module's Redis
SMALL = {"iters": 1, "batch_size": 1, "group_size": 2, "max_completion_len": 8, "lora_layers": 1, "lora_rank": 2}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("redis-trouble"), tiny_model,
              redis_args=("--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "noeviction"))
    s.use_tokens([{"name": "alice", "token": ALICE, "role": "trainer"}])
    yield from running(s)


def job_body(stack, **fields) -> dict:
    return {"model_id": stack.tiny_model.name, "prompts": ["What is 2+2?"], "config": dict(SMALL), **fields}


def every_route(stack, jobs: dict) -> list[tuple[str, str, dict]]:
    """(method, path, request arguments) of a request to every kind of route."""
    queued, done = jobs["queued"], jobs["completed"]
    return [
        ("POST", JOBS, {"json": job_body(stack)}),
        ("GET", JOBS, {}), ("GET", JOBS, {"params": {"view": "summary"}}),
        ("GET", f"{JOBS}/{queued}", {}),
        ("POST", f"{JOBS}/{queued}/cancel", {}),
        ("POST", f"{JOBS}/{done}/resume", {}),
        ("GET", f"{JOBS}/{done}/history", {}), ("GET", f"{JOBS}/{done}/adapter", {}),
        ("GET", f"{JOBS}/{done}/stream", {}),
        ("POST", f"{API}/jobs", {"json": {"model_id": "tiny", "dataset": [{"text": "x"}]}}),
        ("POST", f"{API}/files", {"content": b'{"text": "x"}\n'}),
        ("POST", f"{API}/logprob", {"json": {"model_id": stack.tiny_model.name, "prompt": "p", "completion": " c"}}),
        ("POST", f"{API}/reward/score", {"json": {"model_id": "tiny", "adapter_name": "x", "prompt": "p", "completions": ["c"]}}),
        ("GET", f"{API}/adapters", {}),
        ("GET", f"{API}/models", {}), ("GET", "/admin/api/workers", {}),
        ("GET", "/metrics", {}),
        ("DELETE", f"{JOBS}/{done}", {}),
    ]


def ask(stack, method: str, path: str, kwargs: dict) -> tuple[httpx.Response | str, float]:
    t0 = time.monotonic()
    try:
        with stack.client(ALICE) as c:
            with c.stream(method, path, timeout=30, **kwargs) as res:
                if res.status_code != 200 or not path.endswith("/stream"):  # an open stream stays unread
                    res.read()
                return res, time.monotonic() - t0
    except httpx.HTTPError as e:  # a reset connection, a timeout
        return f"{type(e).__name__}: {e}", time.monotonic() - t0


def all_routes(stack, jobs) -> list[tuple[str, httpx.Response | str, float]]:
    """Every route at once (a paused Redis makes each wait its timeout: together, not in turn)."""
    routes = every_route(stack, jobs)
    with concurrent.futures.ThreadPoolExecutor(len(routes)) as pool:
        answers = list(pool.map(lambda r: ask(stack, *r), routes))
    return [(f"{m} {p}", res, took) for (m, p, _), (res, took) in zip(routes, answers)]


def assert_503_or_fine(answers, must_503: tuple[str, ...], words: str) -> None:
    for what, res, _ in answers:
        assert not isinstance(res, str), (what, res)
        assert res.status_code < 500 or res.status_code == 503, (what, res.status_code, res.text[:300])
        if res.status_code == 503:
            assert res.headers["content-type"].startswith("application/json"), (what, res.text[:300])
            assert words in res.json()["detail"], (what, res.text[:300])
    refused = {what for what, res, _ in answers if res.status_code == 503}
    assert set(must_503) <= refused, (set(must_503) - refused, [(w, r.status_code) for w, r, _ in answers])


@pytest.fixture(scope="module")
def jobs(stack):
    """A completed job and a queued one (for a model nobody has) to act upon."""
    worker = stack.start_worker()
    with stack.client(ALICE) as c:
        done = c.post(JOBS, json=job_body(stack)).json()["job_id"]
        queued = c.post(JOBS, json=job_body(stack, model_id="nobody-has-it")).json()["job_id"]
        wait_for(lambda: c.get(f"{JOBS}/{done}").json()["status"] == "completed", 120, "the job")
    yield {"completed": done, "queued": queued, "worker": worker}
    stack.stop_proc(worker)


def fill(r: redis.Redis) -> int:
    """Write values until Redis refuses (maxmemory): how many it took. Its use then wobbles
    (buffers freed: once, in CI, by more than 4 MiB, so that nothing was refused), so the limit
    is then set well under it, to stay full."""
    n = 0
    while True:
        try:
            r.set(f"junk:{n}", b"x" * 2**20)
            n += 1
        except redis.exceptions.OutOfMemoryError:
            break
    r.config_set("maxmemory", r.info("memory")["used_memory"] - 32 * 2**20)
    return n


def empty(r: redis.Redis, n: int) -> None:
    r.delete(*(f"junk:{i}" for i in range(n)))
    r.config_set("maxmemory", MAXMEMORY)


def test_redis_out_of_memory_is_a_json_503_and_the_worker_waits(stack, jobs):
    r = stack.redis
    logged = len(stack.logs("worker", tail=None))
    n = fill(r)
    try:
        answers = all_routes(stack, jobs)
        assert_503_or_fine(answers, must_503=(f"POST {JOBS}", f"POST {API}/files", f"POST {API}/logprob",
                                              f"POST {JOBS}/{jobs['queued']}/cancel"), words="out of memory")
        health = httpx.get(stack.base_url + "/healthz", timeout=10)
        assert health.status_code == 503 and "out of memory" in health.json()["detail"], health.text
        # The worker meets the refusals (its advertisement; rq's heartbeat ends its loop, and the
        # loop's next start is refused too) and waits instead of exiting.
        met = ("heartbeat: could not advertise this worker", "worker loop ended on Redis trouble; again in 2 s")
        wait_for(lambda: all(m in stack.logs("worker", tail=None)[logged:] for m in met), 30, f"the worker to log {met}")
        assert jobs["worker"].poll() is None, stack.logs("worker")
    finally:
        empty(r, n)
    assert httpx.get(stack.base_url + "/healthz", timeout=10).json() == {"status": "ok", "redis": True}
    with stack.client(ALICE) as c:
        job = c.post(JOBS, json=job_body(stack))
        assert job.status_code == 200, job.text
        wait_for(lambda: c.get(f"{JOBS}/{job.json()['job_id']}").json()["status"] == "completed", 120,
                 "a job after the memory came back")
    assert jobs["worker"].poll() is None


def test_a_paused_redis_is_a_quick_503(stack, jobs):
    pid = stack.redis_server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    resumed = threading.Timer(15, os.kill, (pid, signal.SIGCONT))  # even if the test fails
    resumed.start()
    try:
        t0 = time.monotonic()
        health = httpx.get(stack.base_url + "/healthz", timeout=30)
        assert health.status_code == 503 and time.monotonic() - t0 < 5, (health.text, time.monotonic() - t0)
        answers = all_routes(stack, jobs)
        assert_503_or_fine(answers, must_503=(f"POST {JOBS}", f"GET {JOBS}", f"GET {JOBS}/{jobs['queued']}",
                                              f"POST {API}/logprob", f"POST {API}/files"), words="Redis is unavailable")
        slow = [(what, round(took, 1)) for what, _, took in answers if took > 5]
        assert not slow, slow
    finally:
        os.kill(pid, signal.SIGCONT)
        resumed.cancel()
    wait_for(lambda: httpx.get(stack.base_url + "/healthz", timeout=10).status_code == 200, 30, "healthz")
    with stack.client(ALICE) as c:
        assert c.get(f"{JOBS}/{jobs['queued']}").status_code == 200
    assert jobs["worker"].poll() is None
