"""Tenants and resources (issue 23), against the real stack with several named tokens: one token
holder cannot use, overwrite or starve another's work, and no request holds a worker or the API
for long. One test (or more) per finding of the issue, then a two-tenant soak.

alice and bob are trainers, victor a viewer, and the stack's MTQ_API_TOKEN the admin. The
tests that need no worker run first (one of them leaves a scoring request parked for want of
any live worker); the module's worker starts after them.
"""

import asyncio
import base64
import json
import math
import os
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import REWARD_PORT, TOKEN, Stack, free_port, running, wait_for
from reward_server import serving
from shared import jobstore, scoring

API = "/admin/api/fine-tune"
JOBS, SFT, REWARD_JOBS = f"{API}/grpo/jobs", f"{API}/jobs", f"{API}/reward/jobs"
FILES, LOGPROB, SCORE, ADAPTERS = f"{API}/files", f"{API}/logprob", f"{API}/reward/score", f"{API}/adapters"
ALICE, BOB, VICTOR = "alice-tenant-token-0123456789", "bob-tenant-token-0123456789", "victor-tenant-token-012345"
SMALL = {"iters": 2, "batch_size": 1, "group_size": 2, "max_completion_len": 8, "lora_layers": 1, "lora_rank": 2}
PROMPTS = ["What is 2+2?", "Say hello."]
QUOTA = 20_000  # MTQ_MAX_FILES_BYTES_PER_TOKEN here
LIST_BYTES = 2 * 2**20  # MTQ_MAX_LIST_BYTES here


class HubProbe:
    """Stands in for the Hugging Face hub (HF_ENDPOINT): accepts connections, counts them, and
    never answers, as a hub that hangs would."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            self.held.append(conn)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("tenants"), tiny_model)
    s.use_tokens([
        {"name": "alice", "token": ALICE, "role": "trainer"},
        {"name": "bob", "token": BOB, "role": "trainer"},
        {"name": "victor", "token": VICTOR, "role": "viewer"},
    ])
    s.data_root = tmp_path_factory.mktemp("data")
    s.outside = tmp_path_factory.mktemp("outside")
    s.hub = HubProbe()
    # Names, networks and '*' never open this host: only an exact host:port does (REWARD_PORT).
    s.env.update(MTQ_DATA_ROOTS=str(s.data_root), MTQ_SCORE_WAIT_S="2", HF_ENDPOINT=s.hub.url,
                 MTQ_REWARD_HOSTS=f"*,127.0.0.0/8,::1,localhost,127.0.0.1:{REWARD_PORT}",
                 MTQ_MAX_FILES_BYTES_PER_TOKEN=str(QUOTA), MTQ_MAX_LIST_BYTES=str(LIST_BYTES))
    s.env.pop("HF_HUB_OFFLINE", None)
    yield from running(s)


def client(stack, token: str = TOKEN) -> httpx.Client:
    return stack.client(token)


def grpo(stack, **fields) -> dict:
    return {"model_id": stack.tiny_model.name, "prompts": PROMPTS, "config": dict(SMALL), **fields}


def exponential_schema(depth: int = 40) -> dict:
    """$defs d0..d{depth}: each d_i is allOf [d_{i+1}, d_{i+1}]: 2^depth checks of any value."""
    defs = {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "object"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


# --- 1. a cost bound for every reward -------------------------------------------------------------

def test_1_a_json_schema_whose_refs_expand_exponentially_is_400(stack):
    with client(stack, ALICE) as alice:
        res = alice.post(JOBS, json=grpo(stack, reward=[{"type": "json_valid", "schema": exponential_schema()}]))
        assert res.status_code == 400 and "expands" in res.text, res.text
        small = {"$defs": {"n": {"type": "number"}}, "properties": {"a": {"$ref": "#/$defs/n"}}}
        assert alice.post(JOBS, json=grpo(stack, reward=[{"type": "json_valid", "schema": small}])).status_code == 200


SCORE_EXPONENTIAL_SCHEMA = """
import json, sys, time
from shared.reward_specs import JsonValidReward
from shared.schemas import GRPOConfig, JobCreate, PromptItem
from worker.rewards.batch import RewardError
from worker.rewards.scorer import build_scorer

source = JsonValidReward.model_construct(type="json_valid", json_schema=json.loads(sys.argv[1]), name=None,
                                         weight=1.0)
spec = JobCreate.model_construct(model_id="tiny", prompts=["p"], reward=[source], config=GRPOConfig(reward_timeout=1))
t0 = time.monotonic()
try:
    with build_scorer(spec, "job") as scorer:
        scorer.score(0, [PromptItem(prompt="p")], [["{}", "[]"]])
except RewardError as e:
    print(f"{time.monotonic() - t0:.2f} {e}")
"""


def test_1_a_json_schema_reward_is_bounded_by_reward_timeout():
    """A record written around the API (which refuses the schema): the worker's scorer (on the
    training process's main thread, as here) stops the check after reward_timeout, as it stops a
    python reward."""
    import subprocess
    import sys

    from conftest import ROOT

    try:
        res = subprocess.run([sys.executable, "-c", SCORE_EXPONENTIAL_SCHEMA, json.dumps(exponential_schema())], cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the JSON-schema reward ran past 30 s")
    seconds, _, error = res.stdout.strip().partition(" ")
    assert res.returncode == 0 and "timed out after 1s (config.reward_timeout)" in error, res.stdout + res.stderr
    assert float(seconds) < 5


def test_1_stall_timeout_above_the_server_cap_is_400(stack):
    with client(stack, ALICE) as alice:
        res = alice.post(JOBS, json=grpo(stack, config={**SMALL, "stall_timeout_s": 86_400}))
        assert res.status_code == 400 and "MTQ_MAX_STALL_TIMEOUT_S" in res.text, res.text
        res = alice.post(SFT, json={"model_id": "tiny", "dataset": [{"text": "x"}], "config": {"stall_timeout_s": 86_400}})
        assert res.status_code == 400 and "MTQ_MAX_STALL_TIMEOUT_S" in res.text, res.text


# --- 5. uploaded files are their owner's -------------------------------------------------------------

def upload(c: httpx.Client, content: bytes, filename: str = "rows.jsonl") -> httpx.Response:
    return c.post(FILES, params={"filename": filename}, content=content)


def test_5_an_uploaded_file_is_usable_only_by_its_owner(stack):
    with client(stack, ALICE) as alice, client(stack, BOB) as bob, client(stack) as admin:
        res = upload(alice, b'{"text": "alice only"}\n')
        assert res.status_code == 200, res.text
        ref = {"file_id": res.json()["id"]}
        sft = {"model_id": "tiny-nobody", "dataset": ref, "config": {"iters": 1}}
        stolen = bob.post(SFT, json=sft)
        missing = bob.post(SFT, json={**sft, "dataset": {"file_id": "file-" + "0" * 32}})
        assert stolen.status_code == missing.status_code == 400
        assert stolen.json()["detail"] == missing.json()["detail"].replace("0" * 32, ref["file_id"][5:])
        assert alice.post(SFT, json=sft).status_code == 200
        assert admin.post(SFT, json=sft).status_code == 200  # admins use every file


# --- 3. adapter names ---------------------------------------------------------------------------------

def test_3_an_adapter_name_is_free_again_once_its_jobs_are_gone(stack):
    with client(stack, ALICE) as alice, client(stack, BOB) as bob:
        job = alice.post(JOBS, json=grpo(stack, model_id="tiny-nobody", adapter_name="freed-name")).json()
        assert bob.post(JOBS, json=grpo(stack, model_id="tiny-nobody", adapter_name="freed-name")).status_code == 409
        assert alice.delete(f"{JOBS}/{job['job_id']}").status_code == 200
        res = bob.post(JOBS, json=grpo(stack, model_id="tiny-nobody", adapter_name="freed-name"))
        assert res.status_code == 200, res.text
        assert alice.post(JOBS, json=grpo(stack, model_id="tiny-nobody", adapter_name="freed-name")).status_code == 409


# --- 6. reward egress never reaches this host's services ----------------------------------------

def own_address() -> str | None:
    """A non-loopback address of this host, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))  # no packet is sent: only a route is chosen
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_6_reward_urls_on_this_host_are_400_unless_listed_exactly(stack):
    """MTQ_REWARD_HOSTS here is '*,127.0.0.0/8,::1,localhost' and one exact host:port: only that
    one reaches this host."""
    port = free_port()
    urls = [f"http://127.0.0.1:{port}/", f"http://localhost:{port}/", f"http://[::1]:{port}/", f"http://0.0.0.0:{port}/",
            f"http://127.0.0.2:{port}/", f"http://[::ffff:127.0.0.1]:{port}/", f"http://127.0.0.1:{REWARD_PORT + 1}/"]
    if own_address():
        urls.append(f"http://{own_address()}:{port}/")
    with client(stack, ALICE) as alice:
        for url in urls:
            for fields in ({"reward": [{"type": "endpoint", "url": url}]}, {"config": {**SMALL, "reward_endpoint": url}}):
                res = alice.post(JOBS, json=grpo(stack, **fields))
                assert res.status_code == 400 and "MTQ_REWARD_HOSTS" in res.text, (url, res.text)
        listed = alice.post(JOBS, json=grpo(stack, model_id="tiny-nobody",
                                            reward=[{"type": "endpoint", "url": f"http://127.0.0.1:{REWARD_PORT}/r"}]))
        assert listed.status_code == 200, listed.text
        assert alice.post(JOBS, json=grpo(stack, model_id="tiny-nobody",
                                          reward=[{"type": "endpoint", "url": "http://203.0.113.9/r"}])).status_code == 200


# --- 7. dataset paths ---------------------------------------------------------------------------------

def symlinked_dataset(stack) -> Path:
    """A data directory under MTQ_DATA_ROOTS whose train.jsonl is a symlink to a file outside."""
    secret = stack.outside / "secret.jsonl"
    secret.write_text('{"text": "outside the data roots"}\n')
    directory = stack.data_root / "evil"
    directory.mkdir(exist_ok=True)
    if not (directory / "train.jsonl").is_symlink():
        (directory / "train.jsonl").symlink_to(secret)
    return directory


def test_7_a_dataset_file_symlinked_out_of_the_data_roots_is_400(stack):
    directory = symlinked_dataset(stack)
    good = stack.data_root / "good"
    good.mkdir(exist_ok=True)
    (good / "train.jsonl").write_text('{"text": "inside"}\n')
    with client(stack, ALICE) as alice:
        res = alice.post(SFT, json={"model_id": "tiny-nobody", "dataset": str(directory), "config": {"iters": 1}})
        assert res.status_code == 400 and "MTQ_DATA_ROOTS" in res.text, res.text
        assert str(stack.outside) not in res.text
        res = alice.post(SFT, json={"model_id": "tiny-nobody", "dataset": str(good), "config": {"iters": 1}})
        assert res.status_code == 200, res.text


# --- 12, 13. bounds on totals ----------------------------------------------------------------------

def test_12_a_prompt_set_of_300000_empty_messages_is_400_at_once(stack):
    body = json.dumps(grpo(stack, prompts=[[{"role": "user", "content": ""}] * 300_000])).encode()
    assert len(body) > 9_000_000
    health: list[float] = []

    def probe():
        for _ in range(5):
            t0 = time.monotonic()
            httpx.get(stack.base_url + "/healthz", timeout=30)
            health.append(time.monotonic() - t0)
            time.sleep(0.05)

    with client(stack, ALICE) as alice:
        thread = threading.Thread(target=probe)
        t0 = time.monotonic()
        thread.start()
        res = alice.post(JOBS, content=body, headers={"Content-Type": "application/json"})
        took = time.monotonic() - t0
        thread.join()
    assert res.status_code == 400 and "MTQ_MAX_JSON_VALUES" in res.text, res.text[:300]
    assert took < 2.5, took
    assert max(health) < 1.0, health


def test_13_a_job_larger_than_the_stored_size_limit_is_400(stack):
    with client(stack, ALICE) as alice:
        res = alice.post(JOBS, json=grpo(stack, prompts=["x" * 32_768] * 300))  # under every per-field limit
        assert res.status_code == 400 and "MTQ_MAX_JOB_BYTES" in res.text, res.text[:300]


def test_13_the_list_answer_is_bounded_and_the_summary_leaves_the_prompts_out(stack):
    from cli.client import ApiClient

    with client(stack, ALICE) as alice:
        ids = []
        for _ in range(5):  # 5 x 1 MB of prompts
            res = alice.post(JOBS, json=grpo(stack, model_id="tiny-nobody", prompts=["y" * 32_000] * 32))
            assert res.status_code == 200, res.text[:300]
            ids.append(res.json()["job_id"])
        page = alice.get(JOBS, params={"limit": 100})
        assert page.status_code == 200 and len(page.content) < LIST_BYTES + 1_100_000
        assert page.headers["X-Has-More"] == "true" and len(page.json()) < 5
        seen = [j["job_id"] for j in page.json()]
        while page.headers["X-Has-More"] == "true":  # the seed's cursor reaches the rest
            page = alice.get(JOBS, params={"limit": 100, "after": page.headers["X-Next-After"]})
            seen += [j["job_id"] for j in page.json()]
        assert set(ids) <= set(seen)
        summary = alice.get(JOBS, params={"limit": 100, "view": "summary"})
        assert summary.status_code == 200 and set(ids) <= {j["job_id"] for j in summary.json()}
        assert len(summary.content) < 3000 * len(summary.json()) and "prompts" not in summary.json()[0]
        assert summary.json()[0]["model_id"] == "tiny-nobody" and summary.json()[0]["config"]["iters"] == SMALL["iters"]
    listed = ApiClient(stack.base_url, ALICE).list_jobs(limit=100)  # `mtq jobs` asks for the summary
    assert set(ids) <= {j["job_id"] for j in listed} and all("prompts" not in j for j in listed)


# --- 14. uploads per token --------------------------------------------------------------------------

def test_14_uploads_have_a_quota_per_token(stack):
    row = b'{"text": "' + b"q" * 7_000 + b'"}\n'
    with client(stack, BOB) as bob, client(stack, VICTOR) as victor:
        used = [upload(bob, row) for _ in range(2)]
        assert all(r.status_code == 200 for r in used), used[-1].text
        over = upload(bob, row)
        assert over.status_code == 413 and "MTQ_MAX_FILES_BYTES_PER_TOKEN" in over.text, over.text
        with client(stack, ALICE) as alice:
            assert upload(alice, row).status_code == 200  # another token's quota is its own
            assert alice.delete(f"{FILES}/{used[0].json()['id']}").status_code == 404  # and bob's files bob's
        assert victor.delete(f"{FILES}/{used[0].json()['id']}").status_code == 403
        assert bob.delete(f"{FILES}/{used[0].json()['id']}").status_code == 200
        assert upload(bob, row).status_code == 200  # deleting frees the quota


# --- 15, 16. loopback, and the access log ----------------------------------------------------------

@pytest.mark.parametrize("header", [{"Forwarded": "for=203.0.113.7"}, {"Forwarded": 'for="[2001:db8::1]:4711"'},
                                    {"X-Real-IP": "203.0.113.7"}, {"X-Forwarded-For": "203.0.113.7"}])
def test_15_a_request_through_a_proxy_is_not_loopback(stack, header):
    assert httpx.get(stack.base_url + JOBS, params={"key": TOKEN}).status_code == 200
    assert httpx.get(stack.base_url + JOBS, params={"key": TOKEN}, headers=header).status_code == 401
    assert httpx.get(stack.base_url + "/metrics").status_code == 200
    assert httpx.get(stack.base_url + "/metrics", headers=header).status_code == 401


def test_16_a_query_token_never_reaches_the_access_log(stack):
    for token in (BOB, "not-a-token-but-secret-0123"):
        httpx.get(stack.base_url + JOBS, params={"key": token}, headers={"Forwarded": "for=203.0.113.7"})
        httpx.get(stack.base_url + JOBS, params={"api_key": token, "limit": 1})
        # spellings the auth does not take, which the log must not keep either
        for name in ("KEY", "Key", "Api_Key", "access_token", "apiKey", "token", "k%65y"):
            httpx.get(f"{stack.base_url}{JOBS}?limit=1&{name}={token}")
    # One of the API's tokens under any name, percent-encoded, or as a path segment.
    encoded = "".join(f"%{b:02X}" for b in BOB.encode())
    for query in (f"foo={BOB}", f"q=x{BOB}y", f"foo={encoded}", BOB):
        httpx.get(f"{stack.base_url}{JOBS}?limit=1&{query}")
    httpx.get(f"{stack.base_url}{JOBS}/{BOB}")
    time.sleep(0.3)
    log = stack.logs("api")
    assert "key=" in log and "limit=1" in log and "foo=<redacted>" in log
    assert BOB not in log and encoded not in log and "not-a-token-but-secret-0123" not in log


# --- 17-19. model ids, uploads -----------------------------------------------------------------------

@pytest.mark.parametrize("model_id", ["../../etc", "/etc/passwd", "tiny\n", "tiny/../../x", "a/b/c"])
def test_17_model_ids_are_matched_whole_everywhere(stack, model_id):
    with client(stack, ALICE) as alice:
        source = {"type": "reward_model", "model_id": model_id, "adapter_name": "rm"}
        res = alice.post(JOBS, json=grpo(stack, reward=[source]))
        assert res.status_code == 400, res.text
        res = alice.post(LOGPROB, json={"model_id": model_id, "prompt": "p", "completion": "c"})
        assert res.status_code == 400, res.text
        res = alice.post(SCORE, json={"model_id": model_id, "adapter_name": "rm", "prompt": "p", "completions": ["c"]})
        assert res.status_code == 400, res.text


def test_18_an_upload_nested_50000_deep_is_400(stack):
    with client(stack, ALICE) as alice:
        res = upload(alice, b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n")
        assert res.status_code == 400 and "nested deeper" in res.text, res.text[:300]


def test_19_json_lines_are_split_on_newlines_only(stack):
    text = "one\u2028two\u2029three\x85four\x0bfive\x0cdone"
    with client(stack, ALICE) as alice:
        res = upload(alice, (json.dumps({"text": text}, ensure_ascii=False) + "\r\n" + '{"text": "b"}\n').encode())
        assert res.status_code == 200 and res.json()["rows"] == 2, res.text
        sft = alice.post(SFT, json={"model_id": "tiny-nobody", "dataset": {"file_id": res.json()["id"]}})
        assert sft.status_code == 200, sft.text


# --- 20. cancel and delete leave nothing in rq ------------------------------------------------------

def test_20_cancel_and_delete_of_a_queued_job_leave_nothing_in_rq(stack):
    with client(stack, ALICE) as alice:
        job = alice.post(JOBS, json=grpo(stack, model_id="tiny-nobody-20")).json()
        queue = stack.rq_queue(job["job_id"])
        assert queue.count == 1
        assert alice.post(f"{JOBS}/{job['job_id']}/cancel").status_code == 200
        assert queue.count == 0 and not stack.redis.exists(f"rq:job:{job['job_id']}")
        assert alice.delete(f"{JOBS}/{job['job_id']}").status_code == 200
    depth = {k: v for k, v in stack.metrics().items() if k.startswith("mtq_queue_depth") and queue.name in k}
    assert set(depth.values()) <= {0.0}, depth
    assert not [k for k in stack.redis.keys("rq:job:*") if job["job_id"].encode() in k]


# --- 4. stored scoring answers (no worker is live yet: the request stays queued) ---------------------

def test_4_a_stored_scoring_answer_is_only_its_owners(stack):
    with client(stack, ALICE) as alice, client(stack, BOB) as bob, client(stack, VICTOR) as victor, \
            client(stack) as admin:
        res = alice.post(LOGPROB, json={"model_id": stack.tiny_model.name, "prompt": "hi", "completion": " there"})
        assert res.status_code == 202, res.text
        location = res.headers["location"]
        assert bob.get(location).status_code == 404
        assert bob.get(location).json()["detail"] == bob.get(f"{LOGPROB}/{'0' * 32}").json()["detail"].replace(
            "0" * 32, location.rsplit("/", 1)[1])
        assert alice.get(location).status_code == victor.get(location).status_code == admin.get(location).status_code == 202
        stack.parked = location  # answered once the worker is up (test_4_..._answered_later)


# --- with a worker ----------------------------------------------------------------------------------

def wait_job(stack, path: str, job_id: str, timeout: float = 120) -> dict:
    with client(stack) as admin:
        return wait_for(lambda: (j := admin.get(f"{path}/{job_id}").json())["status"] in ("completed", "failed", "cancelled")
                        and j, timeout, f"job {job_id}", interval=0.2)


@pytest.fixture(scope="module")
def alice_adapters(stack, worker):
    """alice's completed GRPO adapter "shared-name" and reward model "alice-rm", with the bytes of
    the adapter's files as they are on disk."""
    pairs = [{"prompt": "Say a colour.", "chosen": "blue", "rejected": "stone"}] * 4
    with client(stack, ALICE) as alice:
        made = alice.post(JOBS, json=grpo(stack, adapter_name="shared-name"))
        rm = alice.post(REWARD_JOBS, json={"model_id": stack.tiny_model.name, "preference_pairs": pairs,
                                           "adapter_name": "alice-rm", "config": {"iters": 2, "batch_size": 2}})
    for path, res in ((JOBS, made), (REWARD_JOBS, rm)):
        assert res.status_code == 200, res.text
        assert wait_job(stack, path, res.json()["job_id"])["status"] == "completed"
    on_disk = Path(made.json()["adapter_path"])
    return {"job": made.json(), "files": {f.name: f.read_bytes() for f in on_disk.iterdir()}}


def test_4_the_parked_request_is_answered_once_a_worker_is_up(stack, worker):
    with client(stack, ALICE) as alice:
        answer = wait_for(lambda: (a := alice.get(stack.parked)).status_code == 200 and a, 60, "the parked answer")
    assert answer.json()["token_count"] >= 1


# --- 2, 3. adapters and reward models are their owner's ---------------------------------------------

def test_2_a_grpo_job_cannot_score_with_another_owners_reward_model(stack, alice_adapters):
    source = {"type": "reward_model", "model_id": stack.tiny_model.name, "adapter_name": "alice-rm"}
    with client(stack, BOB) as bob, client(stack, ALICE) as alice:
        stolen = bob.post(JOBS, json=grpo(stack, reward=[source]))
        missing = bob.post(JOBS, json=grpo(stack, reward=[{**source, "adapter_name": "no-such-rm"}]))
        assert stolen.status_code == missing.status_code == 400, stolen.text
        assert stolen.json()["detail"] == missing.json()["detail"].replace("no-such-rm", "alice-rm")
        assert "shared-name" not in missing.text  # no list of the names there are
        assert bob.post(SCORE, json={"model_id": stack.tiny_model.name, "adapter_name": "alice-rm", "prompt": "p",
                                     "completions": ["c"]}).status_code == 404
        own = alice.post(JOBS, json=grpo(stack, reward=[source]))
        assert own.status_code == 200, own.text
        assert wait_job(stack, JOBS, own.json()["job_id"])["status"] == "completed"


def test_2_the_worker_refuses_another_owners_reward_model_in_a_record_written_around_the_api(stack, alice_adapters):
    from shared.schemas import JobCreate

    spec = JobCreate(**grpo(stack, reward=[{"type": "reward_model", "model_id": stack.tiny_model.name,
                                            "adapter_name": "alice-rm"}]))
    job_id = jobstore.create_job(stack.redis, spec, owner="bob", tenant="bob").job_id
    done = wait_job(stack, JOBS, job_id)
    assert done["status"] == "failed" and "Adapter not found" in done["error"], done["error"]


def test_3_another_owners_adapter_name_is_409_and_theirs_stays(stack, alice_adapters):
    with client(stack, BOB) as bob, client(stack, ALICE) as alice:
        res = bob.post(JOBS, json=grpo(stack, adapter_name="shared-name"))
        assert res.status_code == 409 and "shared-name" in res.text, res.text
        for other in ({"model_id": str(stack.tiny_model)}, {"adapter_name": "bobs-own"}):  # another model, another name
            res = bob.post(JOBS, json=grpo(stack, **{"adapter_name": "shared-name", **other}))
            assert res.status_code == 200, res.text
            assert wait_job(stack, JOBS, res.json()["job_id"])["status"] == "completed"
        again = alice.post(JOBS, json=grpo(stack, adapter_name="shared-name", model_id="tiny-nobody"))
        assert again.status_code == 200  # the owner reuses it (another model here: it stays queued)
        [mine] = [a for a in alice.get(ADAPTERS).json() if a["adapter_name"] == "shared-name"]
        assert mine["job_id"] == alice_adapters["job"]["job_id"]
    on_disk = Path(alice_adapters["job"]["adapter_path"])
    assert {f.name: f.read_bytes() for f in on_disk.iterdir()} == alice_adapters["files"]


# --- 6. reward egress, at call time; rq-dashboard --------------------------------------------------

def test_6_the_worker_refuses_a_reward_call_to_this_host(stack, worker):
    """A record written around the API, naming a server on loopback (where rq-dashboard listens):
    refused at call time, the server never asked."""
    from shared.schemas import JobCreate

    with serving(lambda body, k: {"rewards": [1.0] * len(body["completions"])}, port=free_port()) as server:
        spec = JobCreate(**grpo(stack, reward=[{"type": "endpoint", "url": server.url, "retries": 0}]))
        job_id = jobstore.create_job(stack.redis, spec, owner="bob").job_id
        done = wait_job(stack, JOBS, job_id)
    assert done["status"] == "failed" and "MTQ_REWARD_HOSTS" in done["error"], done["error"]
    assert server.requests == []


def test_6_rq_dashboard_asks_for_credentials_on_loopback(stack):
    """What a reward call on loopback did: empty another owner's queue through rq-dashboard."""
    with client(stack, ALICE) as alice:
        job = alice.post(JOBS, json=grpo(stack, model_id="tiny-nobody-6")).json()
    queue = stack.rq_queue(job["job_id"])
    port = free_port()
    dash = stack.spawn("dashboard", "dashboard", "--port", str(port))
    base = f"http://127.0.0.1:{port}/0"
    auth = {"Authorization": "Basic " + base64.b64encode(f"mtq:{TOKEN}".encode()).decode()}
    try:
        def up():
            try:
                return httpx.get(f"{base}/data/queues.json", timeout=2)
            except httpx.HTTPError:
                return None
        first = wait_for(up, 60, "rq-dashboard")
        assert first.status_code == 401
        emptied = httpx.post(f"http://127.0.0.1:{port}/queue/{queue.name}/queued/empty", timeout=5)
        assert emptied.status_code == 401 and queue.count == 1
        assert httpx.get(f"{base}/data/queues.json", headers=auth, timeout=5).status_code == 200
    finally:
        stack.stop_proc(dash)


# --- 7. the worker resolves dataset files too ---------------------------------------------------------

def test_7_the_worker_refuses_a_symlinked_dataset_in_a_record_written_around_the_api(stack, worker):
    from shared.train_specs import SFTJobCreate

    spec = SFTJobCreate(model_id=stack.tiny_model.name, dataset=str(symlinked_dataset(stack)), config={"iters": 1})
    job_id = jobstore.create_job(stack.redis, spec, owner="bob").job_id
    done = wait_job(stack, SFT, job_id)
    assert done["status"] == "failed" and "MTQ_DATA_ROOTS" in done["error"], done["error"]


def test_5_the_worker_refuses_another_owners_file_in_a_record_written_around_the_api(stack, worker):
    from shared.train_specs import SFTJobCreate

    with client(stack, ALICE) as alice:
        file_id = upload(alice, b'{"text": "alice only"}\n').json()["id"]
    spec = SFTJobCreate(model_id=stack.tiny_model.name, dataset={"file_id": file_id}, config={"iters": 1})
    job_id = jobstore.create_job(stack.redis, spec, owner="bob", tenant="bob").job_id
    done = wait_job(stack, SFT, job_id)
    assert done["status"] == "failed" and f"file {file_id} not found" in done["error"], done["error"]


# --- 8. the hub, only with --hub ---------------------------------------------------------------------

def test_8_a_worker_without_hub_never_contacts_the_hub(stack, worker):
    from shared.schemas import JobCreate

    before = stack.hub.connections
    with client(stack, ALICE) as alice:
        t0 = time.monotonic()
        res = alice.post(LOGPROB, json={"model_id": "some-org/absent-model", "prompt": "p", "completion": "c"})
        assert res.status_code == 404 and "Model not found: some-org/absent-model" in res.text, res.text
        assert time.monotonic() - t0 < 1.5
    spec = JobCreate(**grpo(stack, reward=[{"type": "reward_model", "model_id": "some-org/absent-rm", "adapter_name": "x"}]))
    job_id = jobstore.create_job(stack.redis, spec, owner="bob").job_id
    done = wait_job(stack, JOBS, job_id)
    assert done["status"] == "failed" and "--hub" in done["error"], done["error"]
    assert stack.hub.connections == before


# --- 9-11. scoring: nobody starves anybody ---------------------------------------------------------

def test_9_owners_take_turns_and_a_request_put_back_waits_for_the_others(stack):
    """bob queues three requests before alice's and carol's one each: the claims alternate owners,
    and bob's first, answered in part and put back, comes again only after alice's and carol's.
    (A queue of its own: no worker serves it.)"""
    queue = "@turns-test"
    ids = {name: scoring.submit(stack.redis, queue, owner, {"model_id": "m", "n": name})
           for name, owner in [("b1", "bob"), ("b2", "bob"), ("b3", "bob"), ("a1", "alice"), ("c1", "carol")]}
    names = {v: k for k, v in ids.items()}

    def claimed() -> str | None:
        item = scoring.claim(stack.redis, queue)
        return None if item is None else names[item[0]]

    assert claimed() == "b1"
    scoring.put_back(stack.redis, ids["b1"])
    assert [claimed() for _ in range(6)] == ["a1", "c1", "b1", "b2", "b3", None]
    assert stack.redis.llen(scoring.ready_key(queue)) == 0  # each claim took its ready entry


def test_9_requests_for_a_model_nobody_has_do_not_delay_anyone(stack, worker):
    async def flood():
        async with httpx.AsyncClient(base_url=stack.base_url, headers={"Authorization": f"Bearer {BOB}"},
                                     timeout=60) as bob:
            return await asyncio.gather(*(bob.post(LOGPROB, json={"model_id": f"nobody-org/model-{i % 3}", "prompt": "p",
                                                                  "completion": "c"}) for i in range(120)))

    answers = asyncio.run(flood())
    assert {a.status_code for a in answers} == {404}, {a.status_code for a in answers}
    with client(stack, ALICE) as alice:
        t0 = time.monotonic()
        res = alice.post(LOGPROB, json={"model_id": stack.tiny_model.name, "prompt": "hi", "completion": " there"})
        assert res.status_code == 200 and time.monotonic() - t0 < 1.5, res.text


def steps_of(stack, job_id: str) -> list[tuple[float, int]]:
    return [(t, e["iter"]) for t, e in stack.events(job_id) if e["type"] == "grpo_step"]


def test_10_a_large_log_prob_batch_is_split_across_a_running_jobs_steps(stack, worker):
    with client(stack, BOB) as bob, client(stack, ALICE) as alice:
        job = bob.post(JOBS, json=grpo(stack, config={**SMALL, "iters": 100_000})).json()
        wait_for(lambda: len(steps_of(stack, job["job_id"])) >= 3, 120, "a few steps")
        words = "red blue green stone river cloud apple tree house car road sun moon star bird fish ".split()
        items = [{"prompt": "Describe:", "completion": " ".join(words[(i + j) % len(words)] for j in range(170))[:1000]}
                 for i in range(48)]
        t0 = time.time()
        res = alice.post(LOGPROB, json={"model_id": stack.tiny_model.name, "items": items})
        while res.status_code == 202:
            res = alice.get(res.headers["location"])
        t1 = time.time()
        assert res.status_code == 200 and len(res.json()["results"]) == 48, res.text[:300]
        bob.post(f"{JOBS}/{job['job_id']}/cancel")
    during = [t for t, _ in steps_of(stack, job["job_id"]) if t0 <= t <= t1]
    gaps = [b - a for a, b in zip(during, during[1:])]
    print(f"\nbatch of 48 x 1000 characters: {t1 - t0:.1f} s, {len(during)} steps of the running job meanwhile, "
          f"longest gap {max(gaps, default=0):.2f} s")
    # Answered in one piece, the batch would leave at most the step it arrived in within the
    # window; two steps or more: the job stepped between its parts (how many depends on speed).
    assert len(during) >= 2 and max(gaps) < 5.0, (t1 - t0, during)


def test_11_a_log_prob_request_longer_than_the_models_context_is_400(stack, alice_adapters):
    with client(stack, ALICE) as alice:
        t0 = time.monotonic()
        res = alice.post(LOGPROB, json={"model_id": stack.tiny_model.name, "prompt": "p", "completion": "word " * 6_000})
        assert res.status_code == 400 and "context of 4096 tokens" in res.text, res.text[:300]
        res = alice.post(SCORE, json={"model_id": stack.tiny_model.name, "adapter_name": "alice-rm", "prompt": "p",
                                      "completions": ["word " * 6_000]})
        assert res.status_code == 400 and "context of 4096 tokens" in res.text, res.text[:300]
        assert time.monotonic() - t0 < 10


# --- 1. the worker caps stall_timeout_s ---------------------------------------------------------------

def test_1_the_worker_caps_stall_timeout_s(stack, worker, tmp_path):
    """A record written around the API with stall_timeout_s of a day, whose reward hangs in native
    code: a worker with MTQ_MAX_STALL_TIMEOUT_S=3 ends it after 3 s. (Its own model name, so that
    only this worker takes the job.)"""
    from shared.schemas import JobCreate

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-capped").symlink_to(stack.tiny_model)
    env = dict(stack.env, MTQ_MAX_STALL_TIMEOUT_S="3", MTQ_MODELS_DIR=str(tmp_path / "models"))
    capped = stack.start_worker("--name", "capped", env=env)
    try:
        spec = JobCreate(**grpo(stack, model_id="tiny-capped", reward=[{"type": "python", "function": "tests.reward_fns:native_hang"}],
                                config={**SMALL, "stall_timeout_s": 86_400, "max_attempts": 1}))
        job_id = jobstore.create_job(stack.redis, spec, owner="bob").job_id
        done = wait_job(stack, JOBS, job_id, timeout=90)
    finally:
        stack.stop_proc(capped)
    assert done["status"] == "failed" and "stall_timeout_s=3" in done["error"], done["error"]


# --- the soak ---------------------------------------------------------------------------------------------

SOAK_S = float(os.environ.get("MTQ_SOAK_S", "30"))
ALICE_ITERS = 3


def test_soak_two_tenants_and_a_viewer_while_one_attacks(stack, worker, alice_adapters):
    """alice trains, scores, uploads and lists; victor reads; bob sends every hostile request above
    (and trains one job of his own), all at once, for SOAK_S seconds. alice's jobs all complete
    with every step once, each of her scoring requests is answered, and nobody gets a 5xx. Her
    latencies are printed, not bounded (CI's 2-core machine once gave a p99 of 2.2 s): the turns
    that keep them short are test_9's and test_10's."""
    deadline = time.monotonic() + SOAK_S
    answers: list[tuple[str, str, int]] = []  # (who, route, status)
    latencies: list[float] = []
    alice_jobs: list[str] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def note(who: str, res: httpx.Response) -> httpx.Response:
        with lock:
            answers.append((who, f"{res.request.method} {res.request.url.path}", res.status_code))
        return res

    def scored(c: httpx.Client, body: dict) -> None:
        t0 = time.monotonic()
        res = note("alice", c.post(LOGPROB, json=body))
        while res.status_code == 202:
            res = note("alice", c.get(res.headers["location"]))
        assert res.status_code == 200, res.text
        latencies.append(time.monotonic() - t0)

    def alice():
        with client(stack, ALICE) as c:
            next_job = 0.0
            while time.monotonic() < deadline:
                if time.monotonic() >= next_job:
                    res = note("alice", c.post(JOBS, json=grpo(stack, config={**SMALL, "iters": ALICE_ITERS})))
                    assert res.status_code == 200, res.text
                    alice_jobs.append(res.json()["job_id"])
                    next_job = time.monotonic() + SOAK_S / 3
                scored(c, {"model_id": stack.tiny_model.name, "prompt": "What is 2+2?", "completion": " 4"})
                scored(c, {"model_id": stack.tiny_model.name, "adapter_name": "shared-name",
                           "items": [{"prompt": "Say hello.", "completion": f" hello {i}"} for i in range(4)]})
                assert note("alice", upload(c, b'{"text": "alice soak"}\n')).status_code == 200
                assert note("alice", c.get(JOBS, params={"limit": 20, "view": "summary"})).status_code == 200
                time.sleep(0.2)

    def victor():
        with client(stack, VICTOR) as c:
            while time.monotonic() < deadline:
                note("victor", c.get(JOBS, params={"limit": 10, "view": "summary"}))
                note("victor", c.get(JOBS, params={"limit": 5}))
                note("victor", c.get(ADAPTERS))
                if alice_jobs:
                    assert note("victor", c.get(f"{JOBS}/{alice_jobs[-1]}")).status_code == 200
                time.sleep(0.3)

    def bob():
        words = "red blue green stone river cloud apple tree house car road sun moon star bird fish ".split()
        big = [{"prompt": "Describe:", "completion": " ".join(words[(i + j) % 16] for j in range(170))[:1000]} for i in range(48)]
        hostile = [
            lambda c: c.post(JOBS, json=grpo(stack, reward=[{"type": "json_valid", "schema": exponential_schema()}])),
            lambda c: c.post(JOBS, json=grpo(stack, adapter_name="shared-name")),
            lambda c: c.post(JOBS, json=grpo(stack, reward=[{"type": "reward_model", "model_id": stack.tiny_model.name,
                                                              "adapter_name": "alice-rm"}])),
            lambda c: c.post(JOBS, json=grpo(stack, config={**SMALL, "reward_endpoint": f"http://127.0.0.1:{free_port()}/"})),
            lambda c: c.post(JOBS, json=grpo(stack, config={**SMALL, "stall_timeout_s": 86_400})),
            lambda c: c.post(LOGPROB, json={"model_id": stack.tiny_model.name, "items": big}),
            lambda c: c.post(LOGPROB, json={"model_id": "nobody-org/model", "prompt": "p", "completion": "c"}),
            lambda c: c.post(LOGPROB, json={"model_id": stack.tiny_model.name, "prompt": "p", "completion": "word " * 6_000}),
            lambda c: upload(c, b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n"),
            lambda c: upload(c, b'{"text": "' + b"b" * 6_000 + b'"}\n'),
            lambda c: c.get(f"{JOBS}/{alice_jobs[0]}" if alice_jobs else JOBS),
            lambda c: c.get(JOBS, params={"key": BOB}, headers={"Forwarded": "for=203.0.113.7", "Authorization": ""}),
        ]
        huge_messages = json.dumps(grpo(stack, prompts=[[{"role": "user", "content": ""}] * 300_000])).encode()
        with client(stack, BOB) as c:
            res = note("bob", c.post(JOBS, json=grpo(stack, config={**SMALL, "iters": 8})))
            assert res.status_code == 200, res.text
            note("bob", c.post(JOBS, content=huge_messages, headers={"Content-Type": "application/json"}))
            k = 0
            while time.monotonic() < deadline:
                note("bob", hostile[k % len(hostile)](c))
                k += 1

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)
        return threading.Thread(target=run)

    threads = [guarded(f) for f in (alice, victor, bob)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SOAK_S + 120)
    assert not failures and not any(t.is_alive() for t in threads), failures  # none waits for ever
    finished = [wait_job(stack, JOBS, job_id, timeout=180) for job_id in alice_jobs]
    for job in finished:
        assert job["status"] == "completed", job["error"]
        assert [i for _, i in steps_of(stack, job["job_id"])] == list(range(ALICE_ITERS)), job["job_id"]
    server_errors = [a for a in answers if a[2] >= 500]
    p99 = sorted(latencies)[math.ceil(0.99 * len(latencies)) - 1]  # nearest rank
    by_who = {who: sum(1 for w, _, _ in answers if w == who) for who in ("alice", "victor", "bob")}
    print(f"\nsoak {SOAK_S:.0f} s: {len(finished)} alice jobs completed, answers {by_who}, alice's scoring "
          f"{len(latencies)} answers, p50 {statistics.median(latencies) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
          f"max {max(latencies) * 1000:.0f} ms; 5xx: {len(server_errors)}")
    assert not server_errors, server_errors[:10]
    assert len(finished) >= 3 and len(latencies) >= 10, (len(finished), len(latencies))
    assert {code for who, _, code in answers if who == "bob"} >= {400, 401, 404, 409, 413}  # the attacks were refused
