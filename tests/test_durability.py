"""Durable jobs with real processes: kill -9, SIGSTOP, Redis restarts, cancels, non-finite losses.

The tests with workers of their own (two that take over from each other, a short lease, a short
retention) come first; the last ones share the module's worker (conftest's `worker`)."""

import os
import signal
import time

from rq.registry import FailedJobRegistry, StartedJobRegistry

from conftest import wait_for
from reward_server import serving, slow_rewards

JOBS = "/admin/api/fine-tune/grpo/jobs"
TTL = "3"  # seconds; short, so dead workers are noticed within seconds in these tests


def body(stack, **config):
    base = {"group_size": 2, "batch_size": 2, "iters": 30, "max_completion_len": 16,
            "lora_layers": -1, "learning_rate": 1e-3, "checkpoint_every": 2}
    return {"model_id": stack.tiny_model.name, "prompts": ["What is 2+2?", "Say hello.", "Count to 3."],
            "config": {**base, **config}}


def two_workers(stack, workers) -> dict:
    """Two workers with a short lease, by pid: one can take over the other's job."""
    env = dict(stack.env, MTQ_LEASE_TTL=TTL)
    return {p.pid: p for p in (workers(env=env), workers(env=env))}


def wait_checkpoint(stack, job_id, step: int) -> dict:
    return wait_for(lambda: (j := stack.get_job(job_id))["checkpoint_step"] and j["checkpoint_step"] >= step and j,
                    120, f"a checkpoint at step {step}", interval=0.1)


def owner_pid(stack, job_id) -> int:
    """The `mtq worker` (supervisor) process whose training process runs the job."""
    started = [e for _, e in stack.events(job_id) if e["type"] == "started"]
    return started[-1]["supervisor_pid"]


def test_killed_worker_job_is_requeued_and_resumed_elsewhere(stack, workers):
    procs = two_workers(stack, workers)
    job_id = stack.submit(body(stack, iters=24))
    wait_checkpoint(stack, job_id, 4)
    victim = owner_pid(stack, job_id)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    procs[victim].wait(10)

    job = stack.wait_job(job_id, timeout=180)
    assert job["status"] == "completed", job["error"]
    assert job["progress"]["iter"] == job["progress"]["total_iters"] == 24
    assert job["attempts"] >= 2 and job["failed_attempts"] == 1 and job["resumed_from"] >= 4

    evs = stack.events(job_id)
    requeued = [(t, e) for t, e in evs if e["type"] == "requeued"]
    assert requeued and requeued[0][0] - killed_at < 90
    resumed = [e for _, e in evs if e["type"] == "resumed"]
    assert resumed and resumed[-1]["from_step"] >= 4
    assert owner_pid(stack, job_id) != victim

    import mlx_lm
    model, tokenizer = mlx_lm.load(str(stack.tiny_model), adapter_path=job["adapter_path"])
    assert mlx_lm.generate(model, tokenizer, "hi", max_tokens=3)


def test_long_job_is_never_declared_abandoned_while_its_worker_lives(stack, workers):
    workers(env=dict(stack.env, MTQ_LEASE_TTL="1"))
    # A reward server that answers each group after 0.05 s: 40 steps of 2 groups take 4 s at least
    # on any machine, several TTLs long.
    with serving(slow_rewards(0.05)) as server:
        job_id = stack.submit(dict(body(stack, iters=40), reward=[{"type": "endpoint", "url": server.url}]))
        queue = stack.rq_queue(job_id).name
        queue_registries = (StartedJobRegistry(queue, connection=stack.redis), FailedJobRegistry(queue, connection=stack.redis))
        deadline = time.monotonic() + 180
        started = None
        while (job := stack.get_job(job_id))["status"] in ("queued", "running"):
            started = started or (job["status"] == "running" and time.monotonic())
            for registry in queue_registries:
                registry.get_job_ids()  # listing runs rq's cleanup of expired (abandoned) entries
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert job["status"] == "completed", job["error"]
    assert time.monotonic() - started > 3  # the job outlived the 1 s TTL several times over
    assert job["attempts"] == 1 and job["failed_attempts"] == 0
    assert not [e for _, e in stack.events(job_id) if e["type"] == "requeued"]
    assert job_id not in FailedJobRegistry(queue, connection=stack.redis).get_job_ids()


def test_paused_worker_writes_nothing_after_losing_its_job(stack, workers):
    procs = two_workers(stack, workers)
    job_id = stack.submit(body(stack, iters=30))
    wait_checkpoint(stack, job_id, 2)
    paused = owner_pid(stack, job_id)
    os.killpg(paused, signal.SIGSTOP)  # the worker and its training process, like a laptop put to sleep
    try:
        wait_for(lambda: any(e["type"] == "requeued" for _, e in stack.events(job_id)), 60, "the job to be re-queued")
        wait_for(lambda: owner_pid(stack, job_id) != paused, 60, "another worker to take the job")
        new_owner_name = stack.get_job(job_id)["worker"]
    finally:
        os.killpg(paused, signal.SIGCONT)
    job = stack.wait_job(job_id, timeout=180)
    assert job["status"] == "completed", job["error"]
    assert job["worker"] == new_owner_name

    evs = [e for _, e in stack.events(job_id)]
    after = evs[next(i for i, e in enumerate(evs) if e["type"] == "requeued"):]
    steps_after = [e for e in after if e["type"] == "grpo_step"]
    assert steps_after and all(e["worker"] == new_owner_name for e in steps_after)
    assert [e["supervisor_pid"] for e in after if e["type"] == "started"] != [paused]
    assert procs[paused].poll() is None  # it lived on, and went back to waiting for jobs
    assert "no longer current" in stack.logs("worker") or "lease lost" in stack.logs("worker")


def test_finished_jobs_expire_after_retention_and_leave_the_index(stack, workers):
    from shared.events import append_event
    from shared.jobstore import list_jobs
    from shared.keys import EVENTS_MAXLEN, JOBS_INDEX, events_key, job_key

    workers(env=dict(stack.env, MTQ_JOB_RETENTION_S="2"))
    job_id = stack.submit(body(stack, iters=1))
    assert stack.wait_job(job_id)["status"] == "completed"
    assert 0 < stack.redis.ttl(job_key(job_id)) <= 2 and 0 < stack.redis.ttl(events_key(job_id)) <= 2
    wait_for(lambda: not stack.redis.exists(job_key(job_id)), 10, "the record to expire")
    list_jobs(stack.redis, limit=100)
    assert stack.redis.zscore(JOBS_INDEX, job_id) is None

    # Event streams are capped.
    for i in range(EVENTS_MAXLEN + 2000):
        append_event(stack.redis, "capped", {"type": "x", "i": i})
    assert stack.redis.xlen(events_key("capped")) < EVENTS_MAXLEN + 1000


def test_sigterm_checkpoints_and_hands_the_job_back_at_once(stack, workers):
    procs = two_workers(stack, workers)
    job_id = stack.submit(body(stack, iters=40, checkpoint_every=1000))  # no periodic checkpoint
    wait_for(lambda: stack.get_job(job_id)["progress"].get("iter", 0) >= 3, 120, "three steps")
    leaving = owner_pid(stack, job_id)
    sent_at = time.time()
    os.kill(leaving, signal.SIGTERM)
    assert procs[leaving].wait(20) == 0  # a warm shutdown that does not wait for the job to end

    requeued = [(t, e) for t, e in stack.events(job_id) if e["type"] == "requeued"]
    assert requeued and requeued[0][1]["reason"] == "worker shutting down"
    assert requeued[0][0] - sent_at < 5
    job = stack.wait_job(job_id, timeout=180)
    assert job["status"] == "completed", job["error"]
    assert job["resumed_from"] >= 3  # from the checkpoint written on the way out
    assert owner_pid(stack, job_id) != leaving


def test_cancel_running_job_quickly_and_queued_job_never_runs(stack, worker):
    running = stack.submit(body(stack, iters=10_000, max_completion_len=64))
    stack.wait_job(running, statuses=("running",), timeout=120)
    wait_checkpoint(stack, running, 2)
    queued = stack.submit(body(stack, iters=2))
    never = stack.submit(body(stack, iters=2))
    with stack.client() as c:
        assert c.post(f"{JOBS}/{never}/cancel").json()["status"] == "cancelled"
        t0 = time.monotonic()
        assert c.post(f"{JOBS}/{running}/cancel").status_code == 200
        stack.wait_job(running, statuses=("cancelled",), timeout=10)
        assert time.monotonic() - t0 < 2.0
        assert c.post(f"{JOBS}/{running}/cancel").status_code == 404  # the seed's "not cancellable"
    assert stack.get_job(running)["checkpoint_step"] is not None  # the last checkpoint is kept
    assert stack.wait_job(queued)["status"] == "completed"
    never_job = stack.get_job(never)
    assert never_job["status"] == "cancelled" and never_job["started_at"] == 0.0


def test_redis_restart_mid_job_loses_nothing(stack, worker):
    job_id = stack.submit(body(stack, iters=30))
    wait_checkpoint(stack, job_id, 2)
    stack.redis_server.stop()
    try:
        with stack.client() as c:
            resp = c.get(f"{JOBS}/{job_id}")
        assert resp.status_code == 503
        assert "Redis is unavailable" in resp.json()["detail"]
        time.sleep(1.0)
    finally:
        stack.redis_server.start()  # same port, same append-only file
    job = stack.wait_job(job_id, timeout=180)
    assert job["status"] == "completed", job["error"]
    assert job["progress"]["iter"] == 30


def test_non_finite_loss_fails_with_step_and_resume_continues_from_last_good_checkpoint(stack, worker):
    # lr 1e30 after a warmup step at lr 0: step 1 is fine, step 2's update overflows.
    job_id = stack.submit(body(stack, iters=8, learning_rate=1e30, warmup_steps=3, checkpoint_every=1, max_grad_norm=None))
    job = stack.wait_job(job_id)
    assert job["status"] == "failed"
    assert "non-finite loss" in job["error"] and "at step 3" in job["error"]
    assert job["checkpoint_step"] == 1

    with stack.client() as c:
        assert c.post(f"{JOBS}/{job_id}/resume", json={"config": {"learning_rate": "x"}}).status_code == 400
        resp = c.post(f"{JOBS}/{job_id}/resume", json={"config": {"learning_rate": 1e-3, "warmup_steps": 0}})
        assert resp.status_code == 200, resp.text
        # The route returns the job as it is by then: queued, or already taken by the idle worker.
        assert resp.json()["status"] in ("queued", "running") and resp.json()["error"] == ""
    job = stack.wait_job(job_id)
    assert job["status"] == "completed", job["error"]
    assert job["resumed_from"] == 1 and job["progress"]["iter"] == 8
    assert job["config"]["learning_rate"] == 1e-3
    with stack.client() as c:
        assert c.post(f"{JOBS}/{job_id}/resume").status_code == 409  # completed jobs do not resume


def test_api_restart_changes_nothing_for_queued_and_running_jobs(stack, worker):
    running = stack.submit(body(stack, iters=12))
    stack.wait_job(running, statuses=("running",), timeout=120)
    queued = stack.submit(body(stack, iters=2))
    stack.stop_proc(stack.api)
    stack.start_api()
    assert stack.wait_job(running)["status"] == "completed"
    assert stack.wait_job(queued)["status"] == "completed"
