"""End to end: REST -> Redis/rq -> a real worker process (main-thread MLX) -> progress -> adapter.

The first test has a worker of its own (MTQ_SAMPLES_EVENTS_KEPT=2); the others share the module's
worker (conftest's `worker`), one job after another."""

import json
from pathlib import Path


JOBS = "/admin/api/fine-tune/grpo/jobs"

# The seed bug report's request body, verbatim; tests change only model_id.
SEED_BODY = json.loads((Path(__file__).resolve().parents[1] / "examples" / "seed_job.json").read_text())


def events_of(stack, job_id) -> list[dict]:
    from conftest import read_events
    return [e for _, e in read_events(stack.redis, job_id)]


def test_the_event_stream_keeps_every_step_and_the_last_samples(stack, workers):
    """A step's `samples` event holds every completion: the stream keeps the last
    MTQ_SAMPLES_EVENTS_KEPT of them (2 here) and every step's grpo_step event."""
    workers(env=dict(stack.env, MTQ_SAMPLES_EVENTS_KEPT="2"))
    body = dict(SEED_BODY, model_id=stack.tiny_model.name, adapter_name="kept_samples",
                config=dict(SEED_BODY["config"], iters=5))
    with stack.client() as c:
        job_id = c.post(JOBS, json=body).json()["job_id"]
    assert stack.wait_job(job_id)["status"] == "completed"
    events = events_of(stack, job_id)
    assert [e["iter"] for e in events if e["type"] == "grpo_step"] == [0, 1, 2, 3, 4]
    samples = [e for e in events if e["type"] == "samples"]
    assert [e["iter"] for e in samples] == [3, 4]
    assert all(len(g) == 2 and all(isinstance(t, str) for t in g) for e in samples for g in e["completions"])


def test_seed_job_completes_with_progress_and_adapter(stack, worker):
    body = dict(SEED_BODY, model_id=stack.tiny_model.name)  # resolved under MTQ_MODELS_DIR
    with stack.client() as c:
        created = c.post(JOBS, json=body)
        assert created.status_code == 200, created.text
        job_id = created.json()["job_id"]
        assert created.json()["status"] == "queued"
    job = stack.wait_job(job_id)
    assert job["status"] == "completed", job["error"]
    assert job["error"] == ""
    p = job["progress"]
    assert p["iter"] == p["total_iters"] == 2
    assert isinstance(p["loss"], float) and isinstance(p["mean_reward"], float)
    assert p["mean_reward"] > 0  # length reward: characters of the completions
    assert job["started_at"] >= job["created_at"] and job["finished_at"] >= job["started_at"]

    adapter = stack.workdir / "home" / "adapters" / stack.tiny_model.name / "grpo_smoke"
    assert job["adapter_path"] == str(adapter)
    assert (adapter / "adapters.safetensors").is_file()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["num_layers"] == 4 and config["lora_parameters"]["rank"] == 4

    # The job ran on the main thread of the worker's training process (a child of `mtq worker`).
    started = [e for e in events_of(stack, job_id) if e["type"] == "started"]
    assert started and started[0]["main_thread"] is True and started[0]["supervisor_pid"] == worker.pid
    assert started[0]["pid"] != worker.pid
    steps = [e for e in events_of(stack, job_id) if e["type"] == "grpo_step"]
    assert [e["iter"] for e in steps] == [0, 1]  # 0-based step index, as the seed server

    # mlx_lm loads the adapter and generates with it.
    import mlx_lm
    model, tokenizer = mlx_lm.load(str(stack.tiny_model), adapter_path=job["adapter_path"])
    text = mlx_lm.generate(model, tokenizer, "hello", max_tokens=5)
    assert isinstance(text, str) and len(text) > 0


def test_a_job_for_a_model_no_worker_has_waits_naming_it_and_the_worker_takes_the_next_job(stack, worker):
    with stack.client() as c:
        bad = c.post(JOBS, json=dict(SEED_BODY, model_id="no-such-model-anywhere")).json()
        good = c.post(JOBS, json=dict(SEED_BODY, model_id=str(stack.tiny_model), adapter_name="after_waiting")).json()
        assert bad["status"] == "queued" and bad["waiting_for_worker"] == "no live worker has model 'no-such-model-anywhere'"
        good_job = stack.wait_job(good["job_id"])
        assert good_job["status"] == "completed", good_job["error"]
        assert c.get(f"{JOBS}/{bad['job_id']}").json()["status"] == "queued"  # never taken, never failed
        assert c.delete(f"{JOBS}/{bad['job_id']}").status_code == 200


def test_sse_stream_follows_a_running_job(stack, worker):
    body = dict(SEED_BODY, model_id=stack.tiny_model.name, config=dict(SEED_BODY["config"], iters=3))
    with stack.client() as c:
        job_id = c.post(JOBS, json=body).json()["job_id"]
        events = []
        with c.stream("GET", f"{JOBS}/{job_id}/stream", timeout=120) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[len("data: "):]))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "done"
    steps = [e for e in events if e["type"] == "grpo_step"]
    assert [e["iter"] for e in steps] == [0, 1, 2]
    for e in steps:
        for field in ("iter", "total_iters", "loss", "mean_reward", "mean_ratio", "n_samples"):
            assert field in e, field
        assert e["n_samples"] == 2
    assert events[-1]["adapter_path"]


def test_cancel_running_job_stops_it_and_worker_moves_on(stack, worker):
    long = dict(SEED_BODY, model_id=stack.tiny_model.name,
                config=dict(SEED_BODY["config"], iters=10_000, max_completion_len=64))
    with stack.client() as c:
        job_id = c.post(JOBS, json=long).json()["job_id"]
        stack.wait_job(job_id, statuses=("running",), timeout=120)
        queued = c.post(JOBS, json=dict(SEED_BODY, model_id=stack.tiny_model.name)).json()["job_id"]
        never = c.post(JOBS, json=dict(SEED_BODY, model_id=stack.tiny_model.name)).json()["job_id"]
        assert c.post(f"{JOBS}/{never}/cancel").json()["status"] == "cancelled"
        assert c.post(f"{JOBS}/{job_id}/cancel").status_code == 200
    job = stack.wait_job(job_id, timeout=30)
    assert job["status"] == "cancelled"
    assert job["progress"].get("iter", 0) < 10_000  # {} if cancelled before its first step
    assert stack.wait_job(queued)["status"] == "completed"
    never_job = stack.wait_job(never)
    assert never_job["status"] == "cancelled" and never_job["started_at"] == 0.0
    assert not [e for e in events_of(stack, never) if e["type"] == "started"]
