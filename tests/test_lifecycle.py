"""The job lifecycle (shared/lifecycle.py) and the worker's supervisor, with real processes:
poison jobs, atomic enqueues, the reconciler, stalls, resume rules, fenced artefacts, retention.

The tests with no worker or workers of their own come first; the last ones share the module's
worker (conftest's `worker`, with the short lease)."""

import os
import threading
import time

import pytest
import redis
from conftest import kill_when, wait_for

from shared import lifecycle
from shared.keys import job_key, lease_key
from worker.supervisor.reconciler import Reconciler

JOBS = "/admin/api/fine-tune/grpo/jobs"
TTL = "2"  # seconds: the lease, so lost workers and jobs are noticed within seconds


def body(stack, reward=None, **config):
    base = {"group_size": 2, "batch_size": 2, "iters": 6, "max_completion_len": 8,
            "lora_layers": 2, "learning_rate": 1e-3, "checkpoint_every": 2}
    spec = {"model_id": stack.tiny_model.name, "prompts": ["What is 2+2?", "Say hello."],
            "config": {**base, **config}}
    if reward:
        spec["reward"] = [{"type": "python", "function": f"tests.reward_fns:{reward}"}]
    return spec


def events(stack, job_id) -> list[dict]:
    return [e for _, e in stack.events(job_id)]


def short_lease(stack, **more) -> dict:
    return dict(stack.env, MTQ_LEASE_TTL=TTL, **more)


@pytest.fixture(scope="module")
def worker_env(stack) -> dict:
    """The module's worker (conftest's `worker`, for the last tests) has the short lease too."""
    return short_lease(stack)


def test_poison_job_fails_after_max_attempts_and_the_workers_live_on(stack, workers):
    procs = [workers(env=short_lease(stack)) for _ in range(3)]
    job_id = stack.submit(body(stack, reward="exit_process", max_attempts=3))
    job = stack.wait_job(job_id, timeout=180)

    assert job["status"] == "failed"
    assert job["failed_attempts"] == 3 and job["attempts"] == 3
    assert "gave up after 3 attempts" in job["error"] and "exited with code 1" in job["error"], job["error"]
    assert "phase scoring" in job["error"]
    requeued = [e for e in events(stack, job_id) if e["type"] == "requeued"]
    assert len(requeued) == 2 and all(e["counted"] for e in requeued)

    # Each death cost a training process, not a worker: all three are alive and take work.
    assert all(p.poll() is None for p in procs)
    normal = stack.submit(body(stack))
    assert stack.wait_job(normal, timeout=120)["status"] == "completed"


class Monitor:
    """Redis MONITOR in a thread: every command, with the connection that sent it."""

    def __init__(self, r: redis.Redis):
        self.r, self.commands, self.ready = r, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with self.r.monitor() as m:
            self.ready.set()
            for cmd in m.listen():
                self.commands.append((cmd["client_port"], cmd["command"]))
                if "MONITOR-STOP" in cmd["command"]:
                    return

    def __enter__(self):
        self.thread.start()
        self.ready.wait(5)
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.r.get("MONITOR-STOP")
        self.thread.join(10)

    def transactions(self) -> list[list[str]]:
        """The commands of each MULTI ... EXEC, per connection."""
        open_tx: dict[str, list[str]] = {}
        done = []
        for port, cmd in self.commands:
            if cmd == "MULTI":
                open_tx[port] = []
            elif cmd == "EXEC":
                done.append(open_tx.pop(port))
            elif port in open_tx:
                open_tx[port].append(cmd)
        return done


def _one_transaction_queues_it(monitor: Monitor, job_id: str) -> bool:
    """Some MULTI/EXEC both set the job's status to queued and pushed its rq job."""
    for tx in monitor.transactions():
        sets_queued = any(c.startswith(f"HSET {job_key(job_id)} ") and " status queued" in c for c in tx)
        pushes = any(c.startswith(("RPUSH rq:queue:", "LPUSH rq:queue:")) and job_id in c for c in tx)
        if sets_queued and pushes:
            return True
    return False


def test_every_transition_to_queued_is_one_transaction_with_its_rq_job(stack):
    """No two halves to die between: create, resume, hand-back and re-queue (lose) each write
    the status and push the rq job in one MULTI/EXEC."""
    r = stack.redis
    with Monitor(r) as mon:
        job_id = stack.submit(body(stack))
    assert _one_transaction_queues_it(mon, job_id), "create"

    epoch = lifecycle.start(r, job_id, "test-worker", lease_ttl_s=60)
    with Monitor(r) as mon:
        lifecycle.hand_back(r, job_id, epoch, "test")
    assert _one_transaction_queues_it(mon, job_id), "hand back"

    epoch = lifecycle.start(r, job_id, "test-worker", lease_ttl_s=60)
    with Monitor(r) as mon:
        assert lifecycle.lose(r, job_id, "test", epoch=epoch) == "queued"
    assert _one_transaction_queues_it(mon, job_id), "re-queue of a lost job"

    epoch = lifecycle.start(r, job_id, "test-worker", lease_ttl_s=60)
    lifecycle.finish(r, job_id, epoch, "failed", {"type": "failed"})
    with Monitor(r) as mon, stack.client() as c:
        assert c.post(f"{JOBS}/{job_id}/resume").status_code == 200
    assert _one_transaction_queues_it(mon, job_id), "resume"

    # A transaction that never reaches EXEC (its process died) leaves nothing behind.
    before = r.dbsize()
    with r.pipeline() as p:
        p.multi()
        p.zadd("mtq:jobs", {"never": 1.0})
        lifecycle._write(p, r, "never", {}, lifecycle.Change("queued", {"kind": "grpo", "spec": '{"model_id": "m", "prompts": ["hi"]}'},
                                                          enqueue=True))
        p.reset()  # the client dies here
    assert r.dbsize() == before and not r.exists(job_key("never"))
    lifecycle.cancel(r, job_id)


def test_reconciler_repairs_a_queued_job_without_rq_job_and_a_running_job_without_lease(stack, workers):
    r = stack.redis
    orphan = stack.submit(body(stack))
    r.delete(f"rq:job:{orphan}")  # as if the rq job had been lost
    r.lrem(stack.rq_queue(orphan).key, 0, orphan)
    leaseless = stack.submit(body(stack))
    assert lifecycle.start(r, leaseless, "gone-worker", lease_ttl_s=60)  # taken by a worker...
    r.lrem(stack.rq_queue(leaseless).key, 0, leaseless)
    r.delete(lease_key(leaseless))  # ...that died without a trace

    t0 = time.time()
    workers(env=short_lease(stack))
    for job_id in (orphan, leaseless):
        job = stack.wait_job(job_id, timeout=120)
        assert job["status"] == "completed", job["error"]
        assert job["progress"]["iter"] == 6
        requeued = [(t, e) for t, e in stack.events(job_id) if e["type"] == "requeued"]
        assert requeued, job_id
        assert requeued[0][0] - t0 < 20  # the worker's start, then one reconciler period (TTL/4, plus TTL/2 grace)
    assert any("rq job" in e["reason"] for e in events(stack, orphan) if e["type"] == "requeued")
    assert any("lease expired" in e["reason"] for e in events(stack, leaseless) if e["type"] == "requeued")


def test_reconciler_moves_hub_jobs_when_a_holder_appears_and_skips_unreadable_records(stack):
    """Two jobs for org/held wait on the hub queue; one record is then made unreadable. When a
    worker advertising org/held appears, the reconciler moves the readable job to the model's
    queue and leaves the other where it is (no exception stops the pass); a second scan with
    the same workers moves nothing."""
    from shared import workers as ads

    good, bad = (stack.submit(dict(body(stack), model_id="org/held")) for _ in range(2))
    def queue(job_id):
        return stack.redis.hget(job_key(job_id), "queue").decode()

    assert {queue(good), queue(bad)} == {"default@hub@1gb"}
    stack.redis.hset(job_key(bad), "spec", "{not json")
    reconciler = Reconciler(stack.redis, grace_s=60)
    assert reconciler.scan_queued() == []  # no live worker has it: nothing to move
    ads.advertise(stack.redis, {"name": "holder", "lanes": ["default"], "memory_gb": 8, "hub": False, "queues": [],
                                "models": [{"model_id": "org/held"}]}, ttl_s=60)
    try:
        assert reconciler.scan_queued() == [good]
        assert reconciler.scan_queued() == []
    finally:
        ads.withdraw(stack.redis, "holder")
    assert queue(good) == "default@org:held@1gb" and stack.get_job(good)["waiting_for_worker"] is None
    assert queue(bad) == "default@hub@1gb"
    with stack.client() as c:
        assert c.delete(f"{JOBS}/{good}").status_code == 200
        assert c.delete(f"{JOBS}/{bad}").status_code == 200


def test_a_worker_that_lost_the_lease_writes_no_adapter_files(stack, tmp_path):
    import multiprocessing

    from worker.runtime.training_process import JobRun
    from worker.supervisor.lease import Lease
    from worker.supervisor.marks import Marks

    r = stack.redis
    job_id = stack.submit(body(stack))
    old = lifecycle.start(r, job_id, "old-worker", lease_ttl_s=60)
    assert lifecycle.lose(r, job_id, "test", epoch=old) == "queued"  # the job moved on
    lifecycle.start(r, job_id, "new-worker", lease_ttl_s=60)

    stale = JobRun(Lease(r, job_id, "old-worker", old), Marks(multiprocessing.get_context("spawn")), os.getppid())
    out = tmp_path / "adapters" / "m" / "a"
    with pytest.raises(lifecycle.LeaseLost):
        stale.commit_adapter(out, lambda d: (d / "adapters.safetensors").write_bytes(b"stale"))
    assert not out.exists() and list(out.parent.iterdir()) == []  # no files, no leftovers
    assert not r.exists(f"mtq:job:{job_id}:adapter")
    lifecycle.cancel(r, job_id)


def test_every_terminal_path_leaves_no_key_after_retention(stack, workers):
    """completed, failed, cancelled while queued, cancelled while running (on a live worker and
    on one that died), failed out of attempts: after MTQ_JOB_RETENTION_S nothing of them is left."""
    r = stack.redis
    env = short_lease(stack, MTQ_JOB_RETENTION_S="8")
    stack.stop_proc(stack.api)
    stack.api = stack.spawn("api", "api", env=env)  # the API cancels queued jobs: same retention
    wait_for(stack._api_up, 30, "the API")
    jobs: dict[str, str] = {}

    def ended(name: str, job_id: str, status: str) -> None:
        """The job ends with `status`, and then every key of it has an expiry."""
        jobs[name] = job_id
        wait_for(lambda: r.hget(job_key(job_id), "status") == status.encode(), 120, f"{name} to end {status}",
                 interval=0.05)
        keys = r.keys(f"*{job_id[:8]}*")  # its adapter name's claim too: grpo-<first 8 of its id>
        # Gone since KEYS (-2) may only be rq's record of the execution, rq:execution:<id>:<uuid>, and
        # its set of them, rq:executions:<id>: rq deletes both as it ends the execution, just after
        # the job's own status was written. Every other key: an expiry.
        rq_execution = (b"rq:execution:", b"rq:executions:")
        ttls = [(k, r.pttl(k)) for k in keys]
        lasting = [(k, ttl) for k, ttl in ttls if not (ttl > 0 or (ttl == -2 and k.startswith(rq_execution)))]
        assert keys and not lasting, (name, lasting)  # only the offending keys: pytest cuts a long message

    try:
        workers(env=env)
        ended("completed", stack.submit(body(stack, iters=2)), "completed")
        ended("failed", stack.submit(body(stack, reward="raises")), "failed")
        ended("poisoned", stack.submit(body(stack, reward="exit_process", max_attempts=1)), "failed")
        running = stack.submit(body(stack, iters=100_000))
        stack.wait_job(running, statuses=("running",), timeout=120)
        queued, dead = stack.submit(body(stack)), stack.submit(body(stack))
        with stack.client() as c:
            assert c.post(f"{JOBS}/{queued}/cancel").json()["status"] == "cancelled"
            ended("queued-cancel", queued, "cancelled")
            r.lrem(stack.rq_queue(dead).key, 0, dead)
            assert lifecycle.start(r, dead, "gone-worker", lease_ttl_s=60)
            r.delete(lease_key(dead))  # its worker died
            assert c.post(f"{JOBS}/{dead}/cancel").json()["status"] == "cancelled"
            ended("dead-worker-cancel", dead, "cancelled")
            assert c.post(f"{JOBS}/{running}/cancel").json()["status"] == "cancelled"
            ended("running-cancel", running, "cancelled")
        wait_for(lambda: not any(r.keys(f"*{j[:8]}*") for j in jobs.values()), 60, "every key to expire")
    finally:
        stack.stop_proc(stack.api)
        stack.start_api()


def test_python_reward_that_never_returns_fails_the_job_within_its_timeout(stack, worker):
    job_id = stack.submit(body(stack, reward="sleep_forever", reward_timeout=2))
    stack.wait_job(job_id, statuses=("running",), timeout=60)
    t0 = time.monotonic()
    job = stack.wait_job(job_id, timeout=60)
    assert job["status"] == "failed"
    assert "reward function tests.reward_fns:sleep_forever timed out after 2s" in job["error"]
    assert time.monotonic() - t0 < 2 + 20  # model load + first decode, then the 2 s limit
    assert job["failed_attempts"] == 0  # a clean failure, not a lost worker


def test_native_hang_is_ended_by_the_watchdog_and_counts_as_an_attempt(stack, worker):
    job_id = stack.submit(body(stack, reward="native_hang", stall_timeout_s=3, max_attempts=2, reward_timeout=1))
    job = stack.wait_job(job_id, timeout=120)
    assert job["status"] == "failed"
    assert "gave up after 2 attempts" in job["error"] and "stalled: no progress" in job["error"], job["error"]
    assert "phase scoring" in job["error"]
    pids = [e["pid"] for e in events(stack, job_id) if e["type"] == "started"]
    assert len(pids) == 2
    for pid in pids:  # the stuck training processes are gone (not left spinning)
        wait_for(lambda: not _alive(pid), 10, f"training process {pid} to exit")
    assert worker.poll() is None
    assert stack.wait_job(stack.submit(body(stack)), timeout=120)["status"] == "completed"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; it only waits for its parent to read its status
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killed_training_process_is_replaced_and_its_job_resumed(stack, worker):
    job_id = stack.submit(body(stack, iters=60, checkpoint_every=2))
    started = wait_for(lambda: [e for e in events(stack, job_id) if e["type"] == "started"], 120, "the start")
    kill_when(lambda: (stack.get_job(job_id)["checkpoint_step"] or 0) >= 2, started[-1]["pid"], "a checkpoint")
    job = stack.wait_job(job_id, timeout=120)
    assert job["status"] == "completed", job["error"]
    assert job["failed_attempts"] == 1 and job["resumed_from"] >= 2 and job["progress"]["iter"] == 60
    requeued = [e for e in events(stack, job_id) if e["type"] == "requeued"]
    assert "killed by SIGKILL" in requeued[0]["reason"]
    assert worker.poll() is None


def test_resume_refuses_lora_shape_changes_and_a_mismatched_checkpoint_fails_loudly(stack, worker):
    job_id = stack.submit(body(stack, iters=4, checkpoint_every=1, learning_rate=1e30, warmup_steps=2,
                                max_grad_norm=None))
    job = stack.wait_job(job_id)
    assert job["status"] == "failed" and job["checkpoint_step"] >= 1
    with stack.client() as c:
        resp = c.post(f"{JOBS}/{job_id}/resume", json={"config": {"lora_rank": 16, "learning_rate": 1e-3}})
        assert resp.status_code == 400 and "lora_rank" in resp.text
        resp = c.post(f"{JOBS}/{job_id}/resume", json={"config": {"lora_alpha": 3.0}})
        assert resp.status_code == 400 and "lora_alpha" in resp.text
    # A checkpoint that does not fit (e.g. a record edited by hand) fails the job, naming the tensors.
    raw = stack.redis.hget(job_key(job_id), "spec").decode().replace('"lora_rank":8', '"lora_rank":4')
    stack.redis.hset(job_key(job_id), "spec", raw)
    with stack.client() as c:
        assert c.post(f"{JOBS}/{job_id}/resume", json={"config": {"learning_rate": 1e-3}}).status_code == 200
    job = stack.wait_job(job_id)
    assert job["status"] == "failed" and "does not fit this job's LoRA" in job["error"], job["error"]
