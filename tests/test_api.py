"""The REST API over real HTTP against a real redis-server (no worker: jobs stay queued)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import CLOSED_PORT, read_events
from shared import fenced_writes, lifecycle
from shared.events import append_event

ROOT = Path(__file__).resolve().parents[1]

JOBS = "/admin/api/fine-tune/grpo/jobs"
SEED_JOB_FIELDS = {
    "job_id", "model_id", "prompts", "config", "adapter_name", "adapter_path", "status",
    "created_at", "started_at", "finished_at", "error", "progress",
}
SEED_CONFIG_DEFAULTS = {
    "group_size": 4, "iters": 50, "batch_size": 2, "learning_rate": 1e-5, "lora_layers": 16,
    "lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "max_completion_len": 64,
    "clip_ratio": 0.2, "reward_endpoint": "", "temperature": 1.0, "seed": 0, "reward_timeout": 30.0,
}


def create(client, **body) -> dict:
    res = client.post(JOBS, json={"model_id": "tiny", "prompts": ["What is 2+2?", "Say hello."], **body})
    assert res.status_code == 200, res.text
    return res.json()


def lines_until_closed(response: httpx.Response, timeout: float = 20):
    """The response's lines; fails if the server has not closed it within `timeout`
    (keep-alive comments every 15 s mean a stream that never ends never times out)."""
    deadline = time.monotonic() + timeout
    for line in response.iter_lines():
        assert time.monotonic() < deadline, "the stream did not end"
        yield line


def read_sse(response: httpx.Response) -> list[dict]:
    """Parse a text/event-stream body into [{'id':..., 'data':..., 'comment':...}]."""
    events, current = [], {}
    for line in lines_until_closed(response):
        if not line:
            if current:
                events.append(current)
            current = {}
        elif line.startswith(":"):
            current.setdefault("comment", line[1:].strip())
        else:
            field, _, value = line.partition(":")
            current[field] = value.removeprefix(" ")
    if current:
        events.append(current)
    return events


# --- auth -------------------------------------------------------------------------------

ADMIN_CALLS = [
    ("POST", JOBS, {"model_id": "tiny", "prompts": ["hi"]}),
    ("GET", JOBS, None),
    ("GET", JOBS + "/some-id", None),
    ("POST", JOBS + "/some-id/cancel", None),
    ("DELETE", JOBS + "/some-id", None),
    ("GET", JOBS + "/some-id/stream", None),
]


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["no-token", "wrong-token"])
@pytest.mark.parametrize("method,path,body", ADMIN_CALLS, ids=[f"{m} {p}" for m, p, _ in ADMIN_CALLS])
def test_admin_routes_need_the_token(stack, token, method, path, body):
    with stack.client(token=token) as c:
        res = c.request(method, path, json=body)
    assert res.status_code == 401, res.text
    assert res.headers["www-authenticate"] == "Bearer"
    assert res.json()["detail"] == "Admin authentication required"  # the seed server's words


def test_wrong_scheme_is_401(stack):
    res = httpx.get(stack.base_url + JOBS, headers={"Authorization": "Basic dGVzdDp0ZXN0"})
    assert res.status_code == 401


# --- create -----------------------------------------------------------------------------

def test_create_returns_a_queued_job_with_the_seed_fields_and_defaults(stack, client):
    job = create(client)
    assert SEED_JOB_FIELDS <= job.keys()
    assert job["status"] == "queued"
    assert job["model_id"] == "tiny"
    assert job["prompts"] == ["What is 2+2?", "Say hello."]
    assert job["adapter_name"]
    assert job["adapter_path"] == str(stack.workdir / "home" / "adapters" / "tiny" / job["adapter_name"])
    assert job["started_at"] == job["finished_at"] == 0.0 and job["error"] == ""  # the seed's values
    assert isinstance(job["created_at"], float)
    assert {k: job["config"][k] for k in SEED_CONFIG_DEFAULTS} == SEED_CONFIG_DEFAULTS
    assert job["progress"] == {} and job["phase"] == "waiting_for_worker"  # the seed's {} until the first step
    # It is on rq's queue for the workers, and GET returns the same record.
    assert job["job_id"] in stack.rq_queue(job["job_id"]).job_ids
    assert client.get(f"{JOBS}/{job['job_id']}").json() == job


def test_create_keeps_the_given_adapter_name_and_config(client):
    job = create(client, adapter_name="grpo_smoke", config={"group_size": 2, "iters": 3, "temperature": 0.8})
    assert job["adapter_name"] == "grpo_smoke"
    assert job["config"]["group_size"] == 2 and job["config"]["temperature"] == 0.8


@pytest.mark.parametrize("body,loc", [
    ({"model_id": "tiny", "prompts": ["hi"], "config": {"group_size": 0}}, ["body", "config", "group_size"]),
    ({"model_id": "tiny", "prompts": []}, ["body", "prompts"]),
    ({"prompts": ["hi"]}, ["body", "model_id"]),
    ({"model_id": "tiny", "prompts": ["hi"], "config": {"no_such_knob": 1}}, ["body", "config", "no_such_knob"]),
], ids=["group_size-0", "no-prompts", "no-model", "unknown-config-field"])
def test_invalid_input_is_400_with_field_errors(client, body, loc):
    res = client.post(JOBS, json=body)
    assert res.status_code == 400, res.text
    assert isinstance(res.json()["detail"], str)
    assert loc in [e["loc"] for e in res.json()["errors"]]


@pytest.mark.parametrize("body", [
    {"config": {"reward_endpoint": "http://example.com/r"}},
    {"reward": [{"type": "endpoint", "url": "http://example.com/r"}]},
], ids=["config.reward_endpoint", "reward-source"])
def test_disallowed_reward_host_is_400(stack, client, body):
    queued_before = stack.rq_jobs_queued()
    res = client.post(JOBS, json={"model_id": "tiny", "prompts": ["hi"], **body})
    assert res.status_code == 400, res.text
    [error] = res.json()["errors"]
    assert res.json()["detail"] == error["msg"]
    assert {"loc", "msg", "type"} <= error.keys()
    assert "example.com" in error["msg"] and "not allowed" in error["msg"]
    assert stack.rq_jobs_queued() == queued_before  # nothing was queued


def test_allowed_reward_host_is_accepted(client):
    url = f"http://127.0.0.1:{CLOSED_PORT}/reward"  # listed with its port (tests/conftest.py)
    job = create(client, config={"reward_endpoint": url})
    assert job["config"]["reward_endpoint"] == url


# --- unknown ids ------------------------------------------------------------------------

@pytest.mark.parametrize("method,suffix,message", [
    ("GET", "", "Job not found"), ("POST", "/cancel", "Job not found or not cancellable"),
    ("DELETE", "", "Job not found or currently running"), ("GET", "/stream", "Job not found"),
    ("GET", "/adapter", "Job not found"), ("GET", "/history", "Job not found"), ("POST", "/resume", "Job not found"),
])
def test_unknown_job_is_404(client, method, suffix, message):
    res = client.request(method, f"{JOBS}/no-such-job{suffix}")
    assert res.status_code == 404
    assert res.json() == {"detail": f"{message}: no-such-job"}


# --- list -------------------------------------------------------------------------------

def test_list_filters_by_status_and_pages_with_after(stack, client):
    stack.redis.flushdb()  # start from no jobs, so the counts below are exact
    ids = [create(client)["job_id"] for _ in range(5)]  # oldest first
    for job_id in ids[:3]:
        assert client.post(f"{JOBS}/{job_id}/cancel").status_code == 200

    everything = client.get(JOBS)
    assert [j["job_id"] for j in everything.json()] == ids[::-1]  # a plain array, newest first
    assert everything.headers["X-Has-More"] == "false" and "X-Next-After" not in everything.headers

    queued = client.get(JOBS, params={"status": "queued"}).json()
    assert [j["job_id"] for j in queued] == ids[4:2:-1]

    pages, after = [], None
    while True:
        page = client.get(JOBS, params={"status": "cancelled", "limit": 2, **({"after": after} if after else {})})
        pages.append([j["job_id"] for j in page.json()])
        assert all(j["status"] == "cancelled" for j in page.json())
        if page.headers["X-Has-More"] == "false":
            assert "X-Next-After" not in page.headers
            break
        after = page.headers["X-Next-After"]
        assert after == page.json()[-1]["job_id"]
    assert pages == [[ids[2], ids[1]], [ids[0]]]


@pytest.mark.parametrize("params,code", [
    ({"after": "no-such-job"}, 400),
    ({"limit": 0}, 400),
    ({"limit": 1001}, 400),
    ({"status": "paused"}, 400),
])
def test_list_rejects_bad_query(client, params, code):
    assert client.get(JOBS, params=params).status_code == code


def test_jobs_of_every_kind_list_newest_first_and_answer_by_id_with_their_kind(stack, client):
    """GET /admin/api/jobs pages every kind's jobs as each kind's list does; GET
    /admin/api/jobs/{id} answers a job of any kind; /admin/api/kinds names each kind's routes."""
    from shared.kinds import KINDS

    stack.redis.flushdb()
    pairs = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    made = [create(client), client.post(KINDS["dpo"].prefix, json={"model_id": "tiny", "preference_pairs": pairs}).json(),
            client.post(KINDS["sft"].prefix, json={"model_id": "tiny", "dataset": [{"text": "a"}]}).json()]
    assert [j["kind"] for j in made] == ["grpo", "dpo", "sft"]
    client.post(f"{JOBS}/{made[0]['job_id']}/cancel")

    listed = client.get("/admin/api/jobs")
    assert [(j["job_id"], j["kind"]) for j in listed.json()] == [(j["job_id"], j["kind"]) for j in made[::-1]]
    assert listed.json()[1]["preference_pairs"] == pairs  # each its kind's job object
    assert listed.headers["X-Has-More"] == "false"
    first = client.get("/admin/api/jobs", params={"limit": 2})
    assert first.headers["X-Has-More"] == "true" and first.headers["X-Next-After"] == made[1]["job_id"]
    rest = client.get("/admin/api/jobs", params={"limit": 2, "after": first.headers["X-Next-After"]}).json()
    assert [j["job_id"] for j in rest] == [made[0]["job_id"]]
    assert [j["job_id"] for j in client.get("/admin/api/jobs", params={"status": "cancelled"}).json()] == [made[0]["job_id"]]
    for job in made:
        got = client.get(f"/admin/api/jobs/{job['job_id']}").json()
        assert got == client.get(f"{KINDS[job['kind']].prefix}/{job['job_id']}").json()
    assert client.get("/admin/api/jobs/no-such-job").json() == {"detail": "Job not found: no-such-job"}
    assert client.get("/admin/api/jobs", params={"after": "no-such-job"}).status_code == 400

    kinds = {k["name"]: k for k in client.get("/admin/api/kinds").json()}
    assert set(kinds) == set(KINDS)
    assert kinds["grpo"]["step_event"] == "grpo_step" and kinds["grpo"]["first_step"] == 0
    assert kinds["sft"]["prefix"] == "/admin/api/fine-tune/jobs" and kinds["sft"]["headline"] == "loss"
    assert {"title": "reward margin", "metrics": ["rewards/margins", "val_rewards/margins"]} in kinds["dpo"]["charts"]


# --- cancel and delete --------------------------------------------------------------------

def test_cancel_a_queued_job_then_again_is_404(client):
    job_id = create(client)["job_id"]
    res = client.post(f"{JOBS}/{job_id}/cancel")
    assert res.status_code == 200
    assert res.json()["status"] == "cancelled" and res.json()["finished_at"] > 0
    again = client.post(f"{JOBS}/{job_id}/cancel")
    assert again.status_code == 404
    assert again.json()["detail"] == f"Job not found or not cancellable: {job_id}"


def test_delete_a_cancelled_job_deletes_record_and_events(stack, client):
    job_id = create(client)["job_id"]
    client.post(f"{JOBS}/{job_id}/cancel")

    res = client.delete(f"{JOBS}/{job_id}")
    assert res.status_code == 200
    assert res.json() == {"status": "deleted"}
    assert client.get(f"{JOBS}/{job_id}").status_code == 404
    assert client.delete(f"{JOBS}/{job_id}").status_code == 404
    assert stack.redis.exists(f"mtq:job:{job_id}", f"mtq:job:{job_id}:events") == 0


def test_running_job_cancel_is_at_once_and_delete_is_404(stack, client):
    job_id = create(client)["job_id"]
    assert lifecycle.start(stack.redis, job_id, "test-worker", lease_ttl_s=60)  # as a worker would
    assert client.delete(f"{JOBS}/{job_id}").status_code == 404
    res = client.post(f"{JOBS}/{job_id}/cancel")
    assert res.status_code == 200 and res.json()["status"] == "cancelled"  # its worker is fenced out at once
    assert stack.redis.hget(f"mtq:job:{job_id}", "lease_epoch") == b"2"  # ...whose lease epoch was 1


# --- SSE ----------------------------------------------------------------------------------

STEP = {"type": "grpo_step", "iter": 1, "total_iters": 2, "loss": 0.5, "mean_reward": 1.0,
        "mean_ratio": 1.0, "n_samples": 8}
DONE = {"type": "done", "adapter_path": "/a"}


def finish(r, job_id, status="completed", event=DONE, **fields):
    """What a worker does: take the job, then its last write (final status + terminal event, atomically)."""
    epoch = lifecycle.start(r, job_id, "test-worker", lease_ttl_s=60) or int(r.hget(f"mtq:job:{job_id}", "lease_epoch"))
    lifecycle.finish(r, job_id, epoch, status, event, **fields)


def test_stream_replays_follows_and_ends_after_the_terminal_event(stack, client):
    job_id = create(client)["job_id"]
    append_event(stack.redis, job_id, {"type": "started"})
    append_event(stack.redis, job_id, STEP)

    with client.stream("GET", f"{JOBS}/{job_id}/stream") as res:
        assert res.status_code == 200
        assert res.headers["content-type"].startswith("text/event-stream")
        received = []
        # The two events already there (replayed), then two appended while we listen.
        for line in lines_until_closed(res):
            if line.startswith("data:"):
                received.append(json.loads(line.removeprefix("data:")))
                if len(received) == 2:
                    append_event(stack.redis, job_id, {**STEP, "iter": 2})
                    finish(stack.redis, job_id)
        # The loop ended: the server closed the response after "done".
    assert [e["type"] for e in received] == ["started", "grpo_step", "grpo_step", "done"]
    assert received[1] == STEP and received[2]["iter"] == 2 and received[3]["adapter_path"] == "/a"


def test_stream_ids_are_the_stream_ids_and_last_event_id_resumes(stack, client):
    job_id = create(client)["job_id"]
    for event in ({"type": "started"}, STEP, {**STEP, "iter": 2}):
        append_event(stack.redis, job_id, event)
    finish(stack.redis, job_id)
    stream_ids = [eid for eid, _ in read_events(stack.redis, job_id)]

    with client.stream("GET", f"{JOBS}/{job_id}/stream") as res:
        events = read_sse(res)
    assert [e["id"] for e in events] == stream_ids

    with client.stream("GET", f"{JOBS}/{job_id}/stream", headers={"Last-Event-ID": stream_ids[1]}) as res:
        resumed = read_sse(res)
    assert [e["id"] for e in resumed] == stream_ids[2:]
    assert [json.loads(e["data"])["type"] for e in resumed] == ["grpo_step", "done"]

    bad = client.get(f"{JOBS}/{job_id}/stream", headers={"Last-Event-ID": "not-an-id"})
    assert bad.status_code == 400


def test_stream_of_a_resumed_job_goes_on_past_the_earlier_terminal_event(stack, client):
    job_id = create(client)["job_id"]
    append_event(stack.redis, job_id, STEP)
    finish(stack.redis, job_id, status="failed", event={"type": "failed", "error": "non-finite loss"})
    assert client.post(f"{JOBS}/{job_id}/resume").status_code == 200
    epoch = lifecycle.start(stack.redis, job_id, "test-worker", lease_ttl_s=60)
    fenced_writes.write(stack.redis, job_id, epoch, {"type": "resumed", "from_step": 1})

    with client.stream("GET", f"{JOBS}/{job_id}/stream") as res:
        received = []
        for line in lines_until_closed(res):
            if line.startswith("data:"):
                received.append(json.loads(line.removeprefix("data:"))["type"])
                if received[-1] == "resumed":
                    append_event(stack.redis, job_id, {**STEP, "iter": 2})
                    finish(stack.redis, job_id)
    assert received == ["grpo_step", "failed", "resume_requested", "resumed", "grpo_step", "done"]


def test_stream_of_a_cancelled_job_ends_with_cancelled(client):
    job_id = create(client)["job_id"]
    client.post(f"{JOBS}/{job_id}/cancel")
    with client.stream("GET", f"{JOBS}/{job_id}/stream") as res:
        events = read_sse(res)
    assert [json.loads(e["data"]) for e in events] == [{"type": "cancelled"}]


def test_stream_synthesizes_the_terminal_event_of_a_finished_job_without_one(stack, client):
    job_id = create(client)["job_id"]
    append_event(stack.redis, job_id, {"type": "started"})
    # Finished, but the terminal event is not in the stream (trimmed, or never written).
    finish(stack.redis, job_id, status="failed", event={"type": "failed", "error": "boom"}, error="boom")
    stack.redis.xdel(f"mtq:job:{job_id}:events", read_events(stack.redis, job_id)[-1][0])
    with client.stream("GET", f"{JOBS}/{job_id}/stream") as res:
        events = [json.loads(e["data"]) for e in read_sse(res)]
    assert events[0] == {"type": "started"}
    assert events[1]["type"] == "failed" and events[1]["error"] == "boom"
    assert len(events) == 2


# --- health, docs, no mlx -------------------------------------------------------------------

def test_healthz_needs_no_token(stack):
    res = httpx.get(stack.base_url + "/healthz")
    assert res.status_code == 200
    assert res.json() == {"status": "ok", "redis": True}


def test_docs_and_openapi_are_served(stack):
    assert httpx.get(stack.base_url + "/docs").status_code == 200
    spec = httpx.get(stack.base_url + "/openapi.json").json()
    assert spec["info"]["title"] == "mlx-train-queue"
    assert {JOBS, JOBS + "/{job_id}", JOBS + "/{job_id}/cancel", JOBS + "/{job_id}/stream", "/healthz"} <= spec["paths"].keys()
    assert any(s.get("scheme") == "bearer" for s in spec["components"]["securitySchemes"].values())


def test_the_api_never_imports_mlx(stack):
    code = "import sys, api.main, cli.main; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'worker')))"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    # ...and neither has the running API process (no libmlx mapped into it).
    assert "libmlx" not in open(f"/proc/{stack.api.pid}/maps").read()
