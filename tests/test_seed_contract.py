"""The seed server's contract, route by route (../shared/reference/anchors.md, "Its exact
contract"), against the real API, a real redis-server and a real worker: status codes,
messages and shapes its clients rely on.

One stack for the module: named tokens (two trainers, a viewer, the admin), the API bound to
every interface (to tell loopback clients from others), and a models directory with "tiny" and
"org/tiny" (a Hugging Face-style id, which puts a '/' in adapter URLs). The tests that need no
worker run first; the module's worker starts after they have removed their queued jobs.
"""

import io
import json
import subprocess
import sys
import tarfile

import httpx
import pytest

from conftest import ROOT, TOKEN, Stack, running, wait_for
from shared.workers import local_models

API = "/admin/api/fine-tune"
JOBS = f"{API}/grpo/jobs"
ALICE, BOB, VIEWER = "alice-trainer-token-0123", "bob-trainer-token-01234", "victor-viewer-token-0123"
SMALL = {"iters": 2, "batch_size": 1, "group_size": 2, "max_completion_len": 8, "lora_layers": 2, "lora_rank": 4}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    models = s.workdir / "models"
    (models / "org").mkdir(parents=True)
    (models / "tiny").symlink_to(tiny_model)
    (models / "org" / "tiny").symlink_to(tiny_model)
    s.use_tokens([
        {"name": "alice", "token": ALICE, "role": "trainer"},
        {"name": "bob", "token": BOB, "role": "trainer"},
        {"name": "victor", "token": VIEWER, "role": "viewer"},
    ])
    s.env.update(MTQ_MODELS_DIR=str(models))
    yield from running(s)


@pytest.fixture(scope="module")
def admin(stack):
    with stack.client() as c:
        yield c


def create(client, **fields) -> dict:
    res = client.post(JOBS, json={"model_id": "tiny", "prompts": ["What is 2+2?", "Say hello."], **fields})
    assert res.status_code == 200, res.text
    return res.json()


# --- POST create: 400s with the seed's messages ----------------------------------------------------

@pytest.mark.parametrize("body,detail", [
    ({"prompts": ["hi"]}, "model_id is required"),
    ({"model_id": "tiny"}, "prompts (non-empty list) required"),
    ({"model_id": "tiny", "prompts": []}, "prompts (non-empty list) required"),
    ({"model_id": "tiny", "prompts": "hi"}, "prompts (non-empty list) required"),
    ({"model_id": "tiny", "prompts": ["hi"], "config": {"no_such_knob": 1}}, "Invalid config: unknown field 'no_such_knob'"),
    ({"model_id": "tiny", "prompts": ["hi"], "config": {"group_size": 0}},
     "Invalid config: group_size: Input should be greater than or equal to 1"),
    ({"model_id": "tiny", "prompts": ["hi"], "config": {"iters": "many"}},
     "Invalid config: iters: Input should be a valid integer, unable to parse string as an integer"),
], ids=["no-model_id", "no-prompts", "empty-prompts", "prompts-not-a-list", "unknown-config-key", "group_size-0", "iters-text"])
def test_invalid_bodies_are_400_with_a_readable_detail(stack, admin, body, detail):
    queued = stack.rq_jobs_queued()
    res = admin.post(JOBS, json=body)
    assert res.status_code == 400, res.text
    assert res.json()["detail"] == detail
    assert res.json()["errors"] and {"loc", "msg", "type"} <= res.json()["errors"][0].keys()
    assert stack.rq_jobs_queued() == queued  # nothing was queued


def test_other_field_errors_are_400_naming_the_field(admin):
    res = admin.post(JOBS, json={"model_id": "tiny", "prompts": ["hi"], "adapter_name": "../x"})
    assert res.status_code == 400 and res.json()["detail"].startswith("adapter_name: String should match pattern")
    res = admin.post(JOBS, json={"model_id": "../etc", "prompts": ["hi"]})
    assert res.status_code == 400 and "model_id" in res.json()["detail"]
    res = admin.post(JOBS, json={"model_id": "tiny", "prompts": ["ok", 3]})
    assert res.status_code == 400
    assert res.json()["detail"] == "prompts[1] must be a string, a list of chat messages or an item {prompt, ...}"
    res = admin.post(JOBS, content=b"{not json", headers={"Content-Type": "application/json"})
    assert res.status_code == 400 and res.json()["detail"].startswith("malformed JSON body")
    res = admin.get(JOBS, params={"limit": 1001})
    assert res.status_code == 400 and res.json()["detail"].startswith("query parameter limit:")


# --- the job object on creation --------------------------------------------------------------------

def test_a_fresh_job_has_the_seeds_field_values(stack, admin):
    job = create(admin, adapter_name="fresh")
    assert job["status"] == "queued"
    assert job["started_at"] == 0.0 and job["finished_at"] == 0.0 and job["error"] == "" and job["progress"] == {}
    assert job["adapter_path"] == str(stack.workdir / "home" / "adapters" / "tiny" / "fresh")
    assert job["config"]["lora_alpha"] == 16.0 and job["config"]["use_chat_template"] is False
    assert admin.get(f"{JOBS}/{job['job_id']}").json() == job
    # The seed's other fields and its defaults for a job without an adapter_name.
    unnamed = create(admin)
    assert unnamed["adapter_path"] == str(stack.workdir / "home" / "adapters" / "tiny" / unnamed["adapter_name"])


# --- GET one, cancel, delete: the seed's codes and messages -------------------------------------

def test_unknown_jobs_are_404_with_the_seeds_messages(admin):
    assert admin.get(f"{JOBS}/nope").json() == {"detail": "Job not found: nope"}
    assert admin.get(f"{JOBS}/nope").status_code == 404
    res = admin.post(f"{JOBS}/nope/cancel")
    assert res.status_code == 404 and res.json() == {"detail": "Job not found or not cancellable: nope"}
    res = admin.delete(f"{JOBS}/nope")
    assert res.status_code == 404 and res.json() == {"detail": "Job not found or currently running: nope"}


def test_cancel_answers_the_cancelled_job_and_a_finished_job_is_not_cancellable(admin):
    job_id = create(admin)["job_id"]
    res = admin.post(f"{JOBS}/{job_id}/cancel")
    assert res.status_code == 200
    assert res.json()["status"] == "cancelled" and res.json()["job_id"] == job_id and res.json()["finished_at"] > 0
    again = admin.post(f"{JOBS}/{job_id}/cancel")
    assert again.status_code == 404 and again.json() == {"detail": f"Job not found or not cancellable: {job_id}"}


def test_delete_removes_a_queued_job_and_its_rq_job(stack, admin):
    job_id = create(admin)["job_id"]
    queue = stack.rq_queue(job_id)
    assert job_id in queue.job_ids
    res = admin.delete(f"{JOBS}/{job_id}")
    assert res.status_code == 200 and res.json() == {"status": "deleted"}
    assert job_id not in queue.job_ids
    assert admin.get(f"{JOBS}/{job_id}").status_code == 404
    assert admin.delete(f"{JOBS}/{job_id}").status_code == 404
    # A finished job too.
    done = create(admin)["job_id"]
    admin.post(f"{JOBS}/{done}/cancel")
    assert admin.delete(f"{JOBS}/{done}").json() == {"status": "deleted"}


# --- GET list: a plain array; the cursor rides in headers ------------------------------------------

def test_list_is_a_plain_array_with_the_cursor_in_headers(stack):
    with stack.client(BOB) as bob:  # a trainer sees only its own jobs: exactly these three
        ids = [create(bob)["job_id"] for _ in range(3)]
        everything = bob.get(JOBS)
        assert everything.status_code == 200 and isinstance(everything.json(), list)
        assert [j["job_id"] for j in everything.json()] == ids[::-1]  # newest first
        assert everything.headers["X-Has-More"] == "false" and "X-Next-After" not in everything.headers

        first = bob.get(JOBS, params={"limit": 2})
        assert [j["job_id"] for j in first.json()] == [ids[2], ids[1]]
        assert first.headers["X-Has-More"] == "true" and first.headers["X-Next-After"] == ids[1]
        rest = bob.get(JOBS, params={"limit": 2, "after": first.headers["X-Next-After"]})
        assert [j["job_id"] for j in rest.json()] == [ids[0]] and rest.headers["X-Has-More"] == "false"

        bob.post(f"{JOBS}/{ids[0]}/cancel")
        assert [j["job_id"] for j in bob.get(JOBS, params={"status": "cancelled"}).json()] == [ids[0]]
        for job_id in ids:
            bob.post(f"{JOBS}/{job_id}/cancel")


# --- auth: ?key= / ?api_key= from loopback only ------------------------------------------------------

@pytest.mark.parametrize("param", ["key", "api_key"])
def test_query_key_is_accepted_from_loopback_only(stack, param):
    on_loopback = httpx.get(f"{stack.base_url}{JOBS}", params={param: TOKEN})
    assert on_loopback.status_code == 200, on_loopback.text
    assert httpx.get(f"{stack.base_url}{JOBS}", params={param: "wrong-token"}).status_code == 401
    # A client elsewhere, as a reverse proxy on this machine reports it (uvicorn takes the client
    # address from X-Forwarded-For when the proxy is on loopback): the query key is refused...
    elsewhere = {"X-Forwarded-For": "203.0.113.7"}
    refused = httpx.get(f"{stack.base_url}{JOBS}", params={param: TOKEN}, headers=elsewhere)
    assert refused.status_code == 401, refused.text
    # ...while the header works from anywhere.
    accepted = httpx.get(f"{stack.base_url}{JOBS}", headers={**elsewhere, "Authorization": f"Bearer {TOKEN}"})
    assert accepted.status_code == 200


# --- with a worker --------------------------------------------------------------------------------------

def models(client) -> dict:
    listed = client.get(f"{API}/models")
    assert listed.status_code == 200
    assert client.get(f"{API}/jobs/models").json() == listed.json()  # the seed's other path
    return {m["model_id"]: m for m in listed.json()}


def test_models_come_from_the_workers_advertisements(stack, admin, worker):
    listed = models(admin)
    assert set(listed) == {"tiny", "org/tiny"}
    assert listed["tiny"] == {"model_id": "tiny", "model_type": "llm", "model_path": str(stack.workdir / "models" / "tiny"),
                              "loaded": False}
    [advertised] = admin.get("/admin/api/workers").json()
    assert advertised["queues"][0] == "default@worker:" + advertised["name"] and advertised["loaded"] == []
    assert "default@tiny@1gb" in advertised["queues"] and "default@org:tiny@1gb" in advertised["queues"]
    assert advertised["device"] == "cpu" and advertised["memory_gb"] > 0 and advertised["lanes"] == ["default"]
    assert advertised["pid"] == worker.pid and advertised["version"] and advertised["started_at"] > 0


def test_a_running_job_is_not_deletable_and_cancel_answers_it_cancelled(stack, admin, worker):
    job_id = create(admin, config={**SMALL, "iters": 10_000})["job_id"]
    job = wait_for(lambda: (j := admin.get(f"{JOBS}/{job_id}").json())["progress"] and j, 120, "a first step", 0.1)
    assert job["status"] == "running" and job["started_at"] > 0
    # progress: completed steps (1-based) and the seed's keys.
    assert job["progress"]["iter"] >= 1 and job["progress"]["total_iters"] == 10_000
    assert isinstance(job["progress"]["loss"], float) and isinstance(job["progress"]["mean_reward"], float)
    assert models(admin)["tiny"]["loaded"] is True

    res = admin.delete(f"{JOBS}/{job_id}")
    assert res.status_code == 404 and res.json() == {"detail": f"Job not found or currently running: {job_id}"}
    res = admin.post(f"{JOBS}/{job_id}/cancel")
    assert res.status_code == 200 and res.json()["status"] == "cancelled"
    assert admin.delete(f"{JOBS}/{job_id}").json() == {"status": "deleted"}


def test_events_number_iter_from_zero_and_done_carries_the_adapter_path(stack, admin, worker):
    job = create(admin, adapter_name="numbered", config=SMALL)
    with admin.stream("GET", f"{JOBS}/{job['job_id']}/stream", timeout=240) as res:
        lines = list(res.iter_lines())
    assert not [line for line in lines if line.startswith("event:")]  # one `data:` line per event, `type` inside
    events = [json.loads(line[len("data:"):]) for line in lines if line.startswith("data:")]
    steps = [e for e in events if e["type"] == "grpo_step"]
    assert [e["iter"] for e in steps] == [0, 1]
    for e in steps:
        assert e["total_iters"] == 2 and e["n_samples"] == 2
        assert all(isinstance(e[k], float) for k in ("loss", "mean_reward", "mean_ratio"))
    assert [e["iter"] for e in events if e["type"] == "samples"] == [0, 1]
    assert events[-1] == {"type": "done", "adapter_path": job["adapter_path"]}
    done = admin.get(f"{JOBS}/{job['job_id']}").json()
    assert done["progress"]["iter"] == 2 and done["error"] == ""


def test_a_client_written_from_the_contract_trains_downloads_and_loads_the_adapter(stack, admin, worker, tmp_path):
    """tests/seed_client.py, as alice (a trainer), on "org/tiny": create, follow, download."""
    out = tmp_path / "downloaded"
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "seed_client.py"), stack.base_url, ALICE, "org/tiny", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:] + stack.logs("worker")
    report = json.loads(res.stdout)
    assert report["steps"] == [0, 1, 2] and report["files"] == ["adapter_config.json", "adapters.safetensors"]
    job_id = report["job_id"]

    # The files are the worker's, and came from Redis: they are served after the worker's copy is gone.
    on_disk = stack.workdir / "home" / "adapters" / "org" / "tiny" / "seed_client"
    for name in report["files"]:
        assert (out / name).read_bytes() == (on_disk / name).read_bytes()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["lora_parameters"]["scale"] == 8.0  # lora_alpha is the LoRA scale, as the seed server
    for f in on_disk.iterdir():
        f.unlink()
    on_disk.rmdir()
    with stack.client(ALICE) as alice:
        again = alice.get(f"{JOBS}/{job_id}/adapter")
    assert again.status_code == 200 and again.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(again.content), mode="r:gz") as tar:
        assert {m.name: tar.extractfile(m).read() for m in tar.getmembers()} == {
            name: (out / name).read_bytes() for name in report["files"]}

    # mlx_lm loads it, and it changes the model (the LoRA trained).
    import mlx.core as mx
    import mlx_lm

    base, tokenizer = mlx_lm.load(str(stack.tiny_model))
    tuned, _ = mlx_lm.load(str(stack.tiny_model), adapter_path=str(out))
    ids = mx.array([tokenizer.encode("What is 2+2?")])
    assert not mx.allclose(base(ids), tuned(ids)).item()


def test_adapters_list_download_and_delete(stack, admin, worker):
    """After the client test: alice's adapter "org/tiny/seed_client" is indexed."""
    listed = admin.get(f"{API}/adapters", params={"model_id": "org/tiny"})
    assert listed.status_code == 200
    [entry] = [a for a in listed.json() if a["adapter_name"] == "seed_client"]
    job = admin.get(f"{JOBS}/{entry['job_id']}").json()
    assert entry == {
        "model_id": "org/tiny", "adapter_name": "seed_client", "adapter_path": job["adapter_path"],
        "has_weights": True, "has_config": True, "lora_layers": 2, "lora_rank": 4, "fine_tune_type": "lora",
        "job_id": job["job_id"], "size": entry["size"], "created_at": job["finished_at"],
    }
    assert entry["size"] > 1000
    assert {a["model_id"] for a in admin.get(f"{API}/adapters").json()} >= {"org/tiny", "tiny"}
    assert admin.get(f"{API}/adapters", params={"model_id": "other"}).json() == []

    download = f"{API}/adapters/org/tiny/seed_client/download"
    with stack.client(BOB) as bob, stack.client(ALICE) as alice, stack.client(VIEWER) as victor:
        # A trainer sees and downloads only its own jobs' adapters.
        assert [a for a in bob.get(f"{API}/adapters").json() if a["adapter_name"] == "seed_client"] == []
        assert bob.get(download).status_code == 404
        assert bob.get(f"{JOBS}/{job['job_id']}/adapter").status_code == 404
        assert bob.request("DELETE", f"{API}/adapters", json={"model_id": "org/tiny", "adapter_name": "seed_client"}).status_code == 404
        assert [a["adapter_name"] for a in alice.get(f"{API}/adapters").json()] == ["seed_client"]
        assert alice.get(download).status_code == 200 and victor.get(download).status_code == 200
        assert victor.request("DELETE", f"{API}/adapters", json={"model_id": "org/tiny", "adapter_name": "seed_client"}).status_code == 403

        for body in ({}, {"model_id": "org/tiny"}, {"adapter_name": "seed_client"}, {"model_id": "", "adapter_name": "x"}):
            res = alice.request("DELETE", f"{API}/adapters", json=body)
            assert res.status_code == 400 and res.json() == {"detail": "model_id and adapter_name required"}, body
        res = alice.request("DELETE", f"{API}/adapters", json={"model_id": "org/tiny", "adapter_name": "nope"})
        assert res.status_code == 404 and res.json() == {"detail": "Adapter not found"}
        res = alice.request("DELETE", f"{API}/adapters", json={"model_id": "org/tiny", "adapter_name": "seed_client"})
        assert res.status_code == 200 and res.json() == {"status": "deleted"}
        assert [a for a in alice.get(f"{API}/adapters").json() if a["adapter_name"] == "seed_client"] == []
        assert alice.get(download).status_code == 404
        assert alice.get(f"{JOBS}/{job['job_id']}/adapter").status_code == 404


def test_adapters_of_deleted_jobs_drop_out_of_the_list(admin, worker):
    [entry] = [a for a in admin.get(f"{API}/adapters").json() if a["adapter_name"] == "numbered"]
    assert admin.delete(f"{JOBS}/{entry['job_id']}").json() == {"status": "deleted"}
    assert [a for a in admin.get(f"{API}/adapters").json() if a["adapter_name"] == "numbered"] == []
    assert admin.get(f"{API}/adapters/tiny/numbered/download").status_code == 404


def test_local_models_are_model_directories_with_their_type_size_and_shape(tmp_path):
    shape = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 1024, "torch_dtype": "bfloat16"}
    for rel, config in (("a", json.dumps({"model_type": "qwen3", **shape})), ("org/b", '{"vision_config": {}}'),
                        ("c", "not json"), (".hidden", "{}"), ("org/.tmp-x", "{}")):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "config.json").write_text(config)
    (tmp_path / "a" / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "no-config").mkdir()
    assert local_models(tmp_path) == [
        {"model_id": "a", "model_type": "llm", "model_path": str(tmp_path / "a"), "size_bytes": 1000,
         "shape": {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 16,
                   "vocab": 1024, "act_bytes": 2}},
        {"model_id": "c", "model_type": None, "model_path": str(tmp_path / "c"), "size_bytes": None, "shape": None},
        {"model_id": "org/b", "model_type": "vlm", "model_path": str(tmp_path / "org" / "b"), "size_bytes": 0,
         "shape": None},
    ]


def test_a_stopped_worker_withdraws_its_advertisement(stack, admin, worker):
    """Last in the module: it stops the module's worker."""
    stack.stop_proc(worker)
    assert admin.get("/admin/api/workers").json() == []
    assert models(admin) == {}
