"""Routing (shared/routing.py) with real workers that share nothing but Redis: each has its own
MTQ_HOME and models directory. Jobs go only to a worker that holds their model and has the
memory their config needs; a job nobody can run waits, saying why, and starts when a capable
worker joins; with several free workers, the one holding the model loaded gets the job."""

import shutil
import time

import pytest
from conftest import Stack, running, wait_for

from shared import routing
from shared.schemas import JobCreate

JOBS = "/admin/api/fine-tune/grpo/jobs"
SMALL = {"group_size": 2, "batch_size": 2, "iters": 1, "max_completion_len": 8, "lora_layers": 2}
# Estimated from the config alone: 512 rows of 2302 positions of the tiny model's KV cache
# (2 layers x 2 KV heads x 16 dims, float32) at the GPU's 1.85 copies: about 1.12 GB, memory class 2 GB.
BIG = {"group_size": 256, "batch_size": 2, "iters": 1, "max_completion_len": 2300, "lora_layers": 2}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("routing"), tiny_model)
    s.env["MTQ_MAX_STEP_TOKENS"] = "2000000"  # the API's bound on BIG's step
    yield from running(s)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three tiny models of different seeds, each under its own name."""
    from worker.runtime.make_model import make_model

    root = tmp_path_factory.mktemp("routing-models")
    return {name: make_model(root / name, size="tiny", seed=seed) for seed, name in enumerate(("m-a", "m-b", "m-c"), 1)}


def start(stack, name: str, models: dict, held: list[str], *args: str):
    """A worker with its own home and models directory (copies: no shared disk)."""
    home = stack.workdir / name
    for model in held:
        shutil.copytree(models[model], home / "models" / model)
    proc = stack.start_worker("--name", name, *args, env=own_env(stack, home, home / "models"))
    wait_for(lambda: (worker(stack, name) or {}).get("memory_gb"), 60, f"worker {name} to advertise its memory")
    return proc


def own_env(stack, home, models_dir) -> dict:
    return dict(stack.env, MTQ_HOME=str(home), MTQ_MODELS_DIR=str(models_dir), MTQ_MODEL_ROOTS="", HF_HOME=str(home / "hf"))


def worker(stack, name: str) -> dict | None:
    with stack.client() as c:
        res = c.get(f"/admin/api/workers/{name}")
    return res.json() if res.status_code == 200 else None


def submit(stack, model: str, config: dict) -> dict:
    with stack.client() as c:
        res = c.post(JOBS, json={"model_id": model, "prompts": ["What is 2+2?", "Say hello."], "config": config})
    assert res.status_code == 200, res.text
    return res.json()


def started_on(stack, job_id: str) -> list[str]:
    return [e["worker"] for _, e in stack.events(job_id) if e["type"] == "started"]


def test_jobs_go_only_to_workers_that_hold_their_model_and_have_the_memory(stack, models):
    start(stack, "wa", models, ["m-a"], "--memory-gb", "1")
    start(stack, "wb", models, ["m-b"])
    assert worker(stack, "wa")["memory_gb"] == 1 and worker(stack, "wa")["memory_declared"] is True
    assert worker(stack, "wa")["queues"] == ["default@worker:wa", "default@m-a@1gb"]
    assert worker(stack, "wb")["device"] == "cpu" and worker(stack, "wb")["memory_total_gb"] > 0
    assert worker(stack, "nobody") is None

    small = [submit(stack, m, SMALL) for m in ("m-a", "m-b", "m-a", "m-b")]
    waiting = submit(stack, "m-c", SMALL)
    big = submit(stack, "m-a", BIG)
    assert waiting["waiting_for_worker"] == "no live worker has model 'm-c'" == waiting["phase_note"]  # web page, mtq watch
    assert big["waiting_for_worker"].startswith("needs about 1.12 GB (memory class 2 GB); the largest live worker "
                                                "that can run it has 1 GB"), big["waiting_for_worker"]
    for job in small:
        done = stack.wait_job(job["job_id"], timeout=120)
        assert done["status"] == "completed", done["error"]
        assert done["worker"] == {"m-a": "wa", "m-b": "wb"}[done["model_id"]]
        assert done["waiting_for_worker"] is None
    time.sleep(2)  # wa is free and listening: it must still not take the big job
    assert stack.get_job(big["job_id"])["status"] == "queued" and not started_on(stack, big["job_id"])
    assert stack.get_job(waiting["job_id"])["status"] == "queued"

    # A worker with m-c and m-a and the default (detected) memory joins: both jobs start there,
    # the big one first (a worker serves its larger memory classes first).
    start(stack, "wc", models, ["m-a", "m-c"])
    running_job = stack.wait_job(big["job_id"], statuses=("running", "completed", "failed"), timeout=120)
    assert running_job["worker"] == "wc"
    assert wait_for(lambda: started_on(stack, big["job_id"]), 60, "the started event") == ["wc"]
    with stack.client() as c:
        assert c.post(f"{JOBS}/{big['job_id']}/cancel").status_code == 200
    done = stack.wait_job(waiting["job_id"], timeout=120)
    assert done["status"] == "completed" and done["worker"] == "wc" and done["waiting_for_worker"] is None
    assert not [j for j in small + [waiting] if "model not found" in stack.get_job(j["job_id"])["error"]]


def test_a_worker_routes_a_job_it_cannot_fit_elsewhere_without_starting_it(stack, models):
    """The API could not size the model (no live worker had it): the job waits in class 1, and
    the 1 GB worker that dequeues it measures it and routes it to the 2 GB class, unstarted."""
    shutil.copytree(models["m-a"], stack.workdir / "wd-models" / "m-d")
    job = submit(stack, "m-d", BIG)
    assert job["waiting_for_worker"] == "no live worker has model 'm-d'"
    stack.start_worker("--name", "wd", "--memory-gb", "1", env=own_env(stack, stack.workdir / "wd", stack.workdir / "wd-models"))

    def rerouted():
        events = [e for _, e in stack.events(job["job_id"]) if e["type"] == "rerouted"]
        return events and events[0]
    event = wait_for(rerouted, 60, "the job to be routed again")
    assert event["from_queue"] == "default@m-d@1gb" and "worker wd has 1 GB" in event["reason"]
    again = stack.get_job(job["job_id"])
    assert again["status"] == "queued" and again["attempts"] == 0
    assert again["waiting_for_worker"].startswith("needs about 3.02 GB (memory class 4 GB)"), again["waiting_for_worker"]  # the CPU's 5 copies
    assert stack.rq_queue(job["job_id"]).name == "default@m-d@4gb"
    with stack.client() as c:
        assert c.delete(f"{JOBS}/{job['job_id']}").status_code == 200


def test_the_worker_holding_the_model_loaded_gets_ten_jobs_in_a_row(stack, models):
    """wb has m-b loaded (the first test ran m-b jobs on it); wc has m-b on disk only. Both are
    free and listen to m-b's queue, yet every job runs on wb without loading the model."""
    shutil.copytree(models["m-b"], stack.workdir / "wc" / "models" / "m-b")  # wc picks it up at its next heartbeat
    wait_for(lambda: "default@m-b@1gb" in worker(stack, "wc")["queues"], 30, "wc to offer m-b")
    wait_for(lambda: not worker(stack, "wc")["current_job"], 60, "wc to be free")
    assert "m-b" in worker(stack, "wb")["loaded"] and "m-b" not in worker(stack, "wc")["loaded"]
    for _ in range(10):
        job = submit(stack, "m-b", SMALL)
        done = stack.wait_job(job["job_id"], timeout=120)
        assert done["status"] == "completed", done["error"]
        ready = [e for _, e in stack.events(job["job_id"]) if e["type"] == "model_ready"]
        assert (done["worker"], ready[0]["cached"]) == ("wb", True)


def test_a_job_on_a_gone_workers_own_queue_moves_to_the_shared_queue(stack):
    """A worker advertised m-b loaded and free, got the job on its own queue, then vanished:
    the reconciler (every worker's heartbeat) routes the job again, and wb runs it."""
    from shared import workers as ads

    wb = worker(stack, "wb")
    ghost = dict(wb, name="ghost", queues=[], current_job=None)
    ghost.pop("loaded")
    ads.advertise(stack.redis, ghost, ttl_s=60)
    ads.publish_loaded(stack.redis, "ghost", ["m-b"], ttl_s=60)
    job = submit(stack, "m-b", SMALL)
    assert stack.rq_queue(job["job_id"]).name == "default@worker:ghost"  # sorted first of two warm, free workers
    ads.withdraw(stack.redis, "ghost")
    done = stack.wait_job(job["job_id"], timeout=120)
    assert done["status"] == "completed" and done["worker"] == "wb"
    [moved] = [e for _, e in stack.events(job["job_id"]) if e["type"] == "rerouted"]
    assert moved["reason"] == "worker ghost is gone" and moved["from_queue"] == "default@worker:ghost"


def test_a_worker_serves_its_lanes_in_order(stack, models):
    """Queued before the worker starts, in the order default, high: it runs the high one first."""
    shutil.copytree(models["m-a"], stack.workdir / "we-models" / "m-e")
    first = submit(stack, "m-e", SMALL)
    second = submit(stack, "m-e", dict(SMALL, queue="high"))
    assert stack.rq_queue(second["job_id"]).name == "high@m-e@1gb"
    stack.start_worker("--name", "we", "--lanes", "high,default",
                       env=own_env(stack, stack.workdir / "we", stack.workdir / "we-models"))
    done = [stack.wait_job(j["job_id"], timeout=120) for j in (first, second)]
    assert [d["status"] for d in done] == ["completed", "completed"]
    assert done[1]["started_at"] < done[0]["started_at"]


def in_hf_cache(home, repo_id: str, model_dir) -> None:
    """Put a model into the Hugging Face cache of the worker whose home this is, as the hub would."""
    snapshot = home / "hf" / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abcd"
    shutil.copytree(model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")


def test_a_job_on_the_hub_queue_moves_when_a_worker_with_its_model_joins(stack, models):
    """No live worker has org/late and none has hub access: its jobs wait on the hub queue. A
    worker with org/late in its Hugging Face cache (and no --hub) joins, and the reconciler moves
    them to the model's queues: one runs there; the other, in a lane no worker serves, now says
    that instead."""
    home = stack.workdir / "wl"
    in_hf_cache(home, "org/late", models["m-a"])
    job = submit(stack, "org/late", SMALL)
    slow = submit(stack, "org/late", dict(SMALL, queue="slow"))
    for j in (job, slow):
        assert j["waiting_for_worker"].startswith("no live worker has model 'org/late', and none has hub access")
    assert [stack.rq_queue(j["job_id"]).name for j in (job, slow)] == ["default@hub@1gb", "slow@hub@1gb"]
    stack.start_worker("--name", "wl", env=own_env(stack, home, home / "models"))
    done = stack.wait_job(job["job_id"], timeout=120)
    assert done["status"] == "completed" and done["worker"] == "wl", done["error"]
    [moved] = [e for _, e in stack.events(job["job_id"]) if e["type"] == "rerouted"]
    assert (moved["reason"], moved["from_queue"]) == ("a live worker now has model 'org/late'", "default@hub@1gb")
    waiting = stack.get_job(slow["job_id"])
    assert waiting["status"] == "queued" and waiting["waiting_for_worker"].startswith(
        "no live worker that can run it takes jobs of queue 'slow'"), waiting["waiting_for_worker"]
    assert stack.rq_queue(slow["job_id"]).name == "slow@org:late@1gb"
    with stack.client() as c:
        assert c.delete(f"{JOBS}/{slow['job_id']}").status_code == 200


def test_hugging_face_ids_from_a_workers_cache_or_the_hub_queue(stack, models):
    """A worker offers the models of its Hugging Face cache under their ids; a job for an id
    no worker has goes to the hub queue, which only a worker with --hub takes (offline here:
    it fails cleanly, saying so)."""
    home = stack.workdir / "wh"
    in_hf_cache(home, "org/cached", models["m-a"])
    elsewhere = submit(stack, "org/elsewhere", SMALL)
    assert elsewhere["waiting_for_worker"].startswith("no live worker has model 'org/elsewhere', and none has hub access")
    assert stack.rq_queue(elsewhere["job_id"]).name == "default@hub@1gb"
    stack.start_worker("--name", "wh", "--hub", env=dict(own_env(stack, home, home / "models"), HF_HUB_OFFLINE="1"))
    cached = submit(stack, "org/cached", SMALL)
    assert cached["waiting_for_worker"] is None and stack.rq_queue(cached["job_id"]).name == "default@org:cached@1gb"
    done = stack.wait_job(cached["job_id"], timeout=120)
    assert done["status"] == "completed" and done["worker"] == "wh", done["error"]
    failed = stack.wait_job(elsewhere["job_id"], timeout=120)
    assert failed["worker"] == "wh" and "HF_HUB_OFFLINE is set" in failed["error"], failed["error"]


def test_routing_names_and_reasons():
    assert [routing.memory_class(g) for g in (None, 0.2, 1, 1.01, 3.9, 4, 40)] == [1, 1, 1, 2, 4, 4, 64]
    assert routing.memory_classes(5.3) == [4, 2, 1] and routing.memory_classes(0.5) == []
    assert routing.worker_queues("w", ["high", "default"], ["m", "org/m"], 2, hub=True) == [
        "high@worker:w", "high@m@2gb", "high@org:m@2gb", "high@m@1gb", "high@org:m@1gb", "high@hub@2gb", "high@hub@1gb",
        "default@worker:w", "default@m@2gb", "default@org:m@2gb", "default@m@1gb", "default@org:m@1gb",
        "default@hub@2gb", "default@hub@1gb"]
    assert routing.model_key("/models/a,b/../c").startswith("path-") and "," not in routing.model_key("/x,y")
    spec = JobCreate(model_id="org/m", prompts=["hi"], config={"queue": "high"})
    assert routing.route("grpo", spec, []) == routing.Route(
        "high@hub@1gb", None, "no live worker has model 'org/m', and none has hub access (mtq worker --hub)")
    hub = {"name": "h", "hub": True, "lanes": ["default"], "memory_gb": 8, "models": []}
    assert routing.route("grpo", spec, [hub]).waiting_for_worker.startswith("no live worker that can run it takes jobs of queue 'high'")
    assert routing.route("grpo", spec, [dict(hub, lanes=["high"])]).waiting_for_worker is None
