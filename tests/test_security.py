"""Hostile input, against the real stack: every attack is a 4xx at submission or a clean
`failed` (or `cancelled`) job within its time limit, and a normal job still completes on
the same worker afterwards.

One API process (with named tokens and roles), one worker for the module's jobs.
"""

import asyncio
import dataclasses
import json
import os
import socket
import statistics
import threading
import time

import httpx
import pytest
from conftest import REWARD_PORT, ROOT, TOKEN, Stack, running, wait_for
from reward_server import serving

from shared import jobstore
from shared.keys import JOBS_INDEX, job_key
from shared.settings import load_settings

JOBS = "/admin/api/fine-tune/grpo/jobs"
PROMPTS = ["What is 2+2?", "Say hello."]
SMALL = {"iters": 1, "batch_size": 1, "group_size": 2, "max_completion_len": 8, "lora_layers": 1, "lora_rank": 2}
TRAINER_A, TRAINER_B, VIEWER = "trainer-a-token-0123456789", "trainer-b-token-0123456789", "viewer-token-0123456789"
MAX_STREAMS = 500


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """The module's own stack: named tokens (MTQ_TOKENS_FILE) besides MTQ_API_TOKEN, and a
    stream cap of MAX_STREAMS per token."""
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    s.use_tokens([
        {"name": "alice", "token": TRAINER_A, "role": "trainer"},
        {"name": "bob", "token": TRAINER_B, "role": "trainer"},
        {"name": "victor", "token": VIEWER, "role": "viewer"},
    ])
    s.env.update(MTQ_MAX_STREAMS_PER_TOKEN=str(MAX_STREAMS))
    yield from running(s)


def body(stack, **fields) -> dict:
    return {"model_id": stack.tiny_model.name, "prompts": PROMPTS, "config": dict(SMALL), **fields}


def post_raw(client, text: str, path: str = JOBS) -> httpx.Response:
    return client.post(path, content=text.encode("utf-8", "surrogatepass"), headers={"Content-Type": "application/json"})


def create(client, stack, **fields) -> dict:
    res = client.post(JOBS, json=body(stack, **fields))
    assert res.status_code == 200, res.text
    return res.json()


def assert_list_and_get_work(client, job_id: str | None = None):
    assert client.get(JOBS, params={"limit": 200}).status_code == 200
    if job_id:
        assert client.get(f"{JOBS}/{job_id}").status_code == 200


def a_normal_job_completes(stack, client):
    job = create(client, stack)
    done = stack.wait_job(job["job_id"], timeout=120)
    assert done["status"] == "completed", done["error"]


# --- validation: nothing bad can be stored ------------------------------------------------

@pytest.mark.parametrize("field", ["beta", "weight_decay", "lora_alpha", "checkpoint_interval_s", "learning_rate", "temperature"])
@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN", "Infinity"])
def test_non_finite_config_is_400(stack, client, field, number):
    text = json.dumps(body(stack)).replace('"config": {', f'"config": {{"{field}": {number}, ', 1)
    res = post_raw(client, text)
    assert res.status_code == 400, res.text
    assert_list_and_get_work(client)


@pytest.mark.parametrize("where", [
    '"reward": [{"type": "length", "weight": NUMBER}]',
    '"reward": [{"type": "math_answer", "tolerance": NUMBER}]',
    '"prompts": [{"prompt": "2+2?", "answer": NUMBER}]',
])
def test_non_finite_numbers_anywhere_are_400(stack, client, where):
    text = json.dumps(body(stack, prompts=[])).replace('"prompts": []', where.replace("NUMBER", "1e999"))
    res = post_raw(client, text)
    assert res.status_code == 400, res.text


def test_non_finite_resume_override_is_400_and_the_job_stays_usable(stack, client):
    job_id = create(client, stack, model_id="no-such-model-for-resume")["job_id"]
    client.post(f"{JOBS}/{job_id}/cancel")  # queued -> cancelled at once (no worker takes it in time: see below)
    assert stack.wait_job(job_id, statuses=("cancelled", "failed"))["status"] in ("cancelled", "failed")
    for number in ("1e999", "NaN", "-Infinity"):
        res = post_raw(client, f'{{"config": {{"beta": {number}}}}}', f"{JOBS}/{job_id}/resume")
        assert res.status_code == 400, res.text
    res = post_raw(client, '{"config": {"batch_size": 1024, "group_size": 256}}', f"{JOBS}/{job_id}/resume")
    assert res.status_code == 400 and "MTQ_MAX_STEP_TOKENS" in res.text  # limits apply to resume too
    assert client.get(f"{JOBS}/{job_id}").json()["config"]["beta"] == 0.0
    assert_list_and_get_work(client, job_id)


@pytest.mark.parametrize("seed,code", [(0, 200), (2**32 - 1, 200), (2**32, 400), (-1, 400), (10**30, 400)])
def test_seed_range(stack, client, seed, code):
    res = client.post(JOBS, json=body(stack, config={**SMALL, "seed": seed}))
    assert res.status_code == code, res.text


@pytest.mark.parametrize("text", ["{", '{"model_id": "tiny",}', "[" * 100_000 + "]" * 100_000, "\xff\xfe"])
def test_malformed_json_is_400(client, text):
    res = client.post(JOBS, content=text.encode("latin-1"), headers={"Content-Type": "application/json"})
    assert res.status_code == 400, res.text
    assert res.json()["detail"]


def test_deep_nesting_is_400(stack, client):
    deep = json.dumps(body(stack, prompts=[{"prompt": "x", "extra": json.loads("[" * 200 + "]" * 200)}]))
    res = post_raw(client, deep)
    assert res.status_code == 400 and "nested deeper" in res.text


@pytest.mark.parametrize("where", ['"prompts": ["\\ud800"]', '"prompts": [{"prompt": "x", "a\\udfff": 1}]', '"adapter_name": "\\ud800"'])
def test_lone_surrogates_are_400(stack, client, where):
    text = json.dumps(body(stack, prompts=[])).replace('"prompts": []', where)
    res = post_raw(client, text)
    assert res.status_code == 400, res.text


@pytest.mark.parametrize("pattern", ["a{4294967296}", "a{1001}", "(a)\\1", "(?=x)y", "x" * 3000])
def test_regex_that_re2_rejects_or_too_long_is_400(stack, client, pattern):
    res = client.post(JOBS, json=body(stack, reward=[{"type": "regex", "pattern": pattern}]))
    assert res.status_code == 400, res.text


def test_unreadable_record_is_listed_as_such_and_can_be_deleted(stack, client):
    """A record an older version wrote (here: the infinity stored as null) breaks nothing."""
    good = create(client, stack)["job_id"]
    bad = "0" * 32
    spec = json.loads(stack.redis.hget(job_key(good), "spec"))
    spec["config"]["beta"] = None
    stack.redis.hset(job_key(bad), mapping={"spec": json.dumps(spec), "status": "failed", "created_at": repr(time.time()),
                                            "progress": "{}"})
    stack.redis.zadd(JOBS_INDEX, {bad: time.time()})
    listed = client.get(JOBS, params={"limit": 200})
    assert listed.status_code == 200
    entry, = [j for j in listed.json() if j["job_id"] == bad]
    assert entry["status"] == "unreadable" and "stored record cannot be loaded" in entry["error"]
    assert any(j["job_id"] == good for j in listed.json())
    got = client.get(f"{JOBS}/{bad}")
    assert got.status_code == 200 and got.json()["status"] == "unreadable"
    for method, suffix in (("POST", "/cancel"), ("POST", "/resume"), ("GET", "/stream")):
        assert client.request(method, f"{JOBS}/{bad}{suffix}").status_code in (404, 409, 200), suffix
    assert client.delete(f"{JOBS}/{bad}").status_code == 200
    assert client.get(f"{JOBS}/{bad}").status_code == 404


@pytest.mark.parametrize("suffix", [":events", ":events/stream", ":adapter", ":checkpoint/cancel", "%00", "x" * 100, "%2F", "/"])
def test_job_paths_with_key_characters_are_404(stack, client, suffix):
    job_id = create(client, stack)["job_id"]
    for method in ("GET", "DELETE"):
        res = client.request(method, f"{JOBS}/{job_id}{suffix}")
        assert res.status_code in (404, 405), (method, suffix, res.text)


# --- limits ----------------------------------------------------------------------------------

def api_rss_kb(stack) -> int:
    status = open(f"/proc/{stack.api.pid}/status").read()
    return int(status.split("VmRSS:")[1].split()[0])


def test_100mb_body_is_413_without_reading_it(stack):
    """Content-Length over the limit: refused before the body is read."""
    rss_before = api_rss_kb(stack)
    with socket.create_connection(("127.0.0.1", stack.api_port), timeout=10) as sock:
        sock.sendall(f"POST {JOBS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {100 * 2**20}\r\n\r\n".encode())
        sock.sendall(b'{"model_id": "' + b"x" * 2**20)
        answer = sock.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 413"), answer
    assert api_rss_kb(stack) - rss_before < 50_000


def test_chunked_body_is_cut_at_the_limit(stack):
    """No Content-Length: counted while read, refused once over the limit (16 MiB); the
    rest is never held (httpx sends it all before it reads the answer)."""
    def chunks():
        yield b'{"model_id": "tiny", "prompts": ["'
        for _ in range(100):
            yield b"x" * 2**20

    with stack.client() as c:
        try:
            res = c.post(JOBS, content=chunks(), headers={"Content-Type": "application/json"})
            assert res.status_code == 413, res.text
        except httpx.TransportError:
            pass  # the server answered 413 and closed while we were still sending
    assert api_rss_kb(stack) < 300_000


@pytest.mark.parametrize("fields, limit", [
    ({"prompts": ["x" * 10 * 2**20]}, "MTQ_MAX_PROMPT_CHARS"),  # the 10 MB prompt (under the body limit)
    ({"prompts": [[{"role": "user", "content": "x" * 40_000}]]}, "MTQ_MAX_PROMPT_CHARS"),
    ({"prompts": ["x"] * 10_001}, "MTQ_MAX_PROMPTS"),
    ({"config": {**SMALL, "batch_size": 1024, "group_size": 256}}, "MTQ_MAX_STEP_TOKENS"),
])
def test_limits_are_400_at_submission(stack, client, fields, limit):
    res = client.post(JOBS, json=body(stack, **fields))
    assert res.status_code == 400 and limit in res.text, res.text[:500]


# --- what a job may point at -------------------------------------------------------------------

@pytest.mark.parametrize("model_id", ["../../x", "/proc/self", "a/b/c", "..", "./tiny", "/tmp/../etc", "~/x", "tiny\x00"])
def test_model_ids_outside_the_allowed_places_are_400(stack, client, model_id):
    res = client.post(JOBS, json=body(stack, model_id=model_id))
    assert res.status_code == 400, res.text
    assert "/proc/self/" not in res.text and "fd" not in res.json()["detail"]


def test_absolute_path_under_model_roots_is_accepted(stack, client):
    assert client.post(JOBS, json=body(stack, model_id=str(stack.tiny_model))).status_code == 200


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:18094\\@localhost/secret",
    "http://user:pw@localhost:1/x",
    "http://10.0.0.1/x",
    "http://169.254.169.254/latest/meta-data",
    "http://[::ffff:127.0.0.1]:1/x",
    "file:///etc/passwd",
    "http://localhost.:1/x",
])
def test_reward_urls_that_could_reach_other_hosts_are_400(stack, client, url):
    as_source = client.post(JOBS, json=body(stack, reward=[{"type": "endpoint", "url": url}]))
    as_config = client.post(JOBS, json=body(stack, config={**SMALL, "reward_endpoint": url}))
    assert as_source.status_code == 400, as_source.text
    assert as_config.status_code == 400, as_config.text


def test_json_schema_with_a_remote_ref_is_400(stack, client):
    schema = {"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:1/schema.json"}}}
    res = client.post(JOBS, json=body(stack, reward=[{"type": "json_valid", "schema": schema}]))
    assert res.status_code == 400 and "inside the schema" in res.text, res.text


@pytest.mark.parametrize("function", ["antigravity:x", "this:x", "logging:basicConfig", "unittest.__main__:main",
                                      "os:system", "tests.reward_fns_evil:x", "reward_fnsX:f"])
def test_python_rewards_outside_the_allow_list_are_400_naming_the_module(stack, client, function):
    res = client.post(JOBS, json=body(stack, reward=[{"type": "python", "function": function}]))
    assert res.status_code == 400, res.text
    assert f"module {function.split(':')[0]!r} is not allowed" in res.text


# --- roles -----------------------------------------------------------------------------------

def test_trainers_see_only_their_jobs_viewers_only_read_admin_sees_all(stack):
    with stack.client(TRAINER_A) as alice, stack.client(TRAINER_B) as bob, \
            stack.client(VIEWER) as victor, stack.client() as admin:
        job = alice.post(JOBS, json=body(stack, model_id="no-such-model-roles")).json()
        job_id = job["job_id"]
        assert job["owner"] == "alice"
        for method, suffix in (("GET", ""), ("GET", "/stream"), ("POST", "/cancel"), ("POST", "/resume"), ("DELETE", "")):
            assert bob.request(method, f"{JOBS}/{job_id}{suffix}").status_code == 404, (method, suffix)
        assert job_id not in [j["job_id"] for j in bob.get(JOBS, params={"limit": 200}).json()]
        assert job_id in [j["job_id"] for j in alice.get(JOBS, params={"limit": 200}).json()]
        assert all(j["owner"] == "alice" for j in alice.get(JOBS, params={"limit": 200}).json())

        assert victor.post(JOBS, json=body(stack)).status_code == 403
        assert victor.post(f"{JOBS}/{job_id}/cancel").status_code == 403
        assert victor.delete(f"{JOBS}/{job_id}").status_code == 403
        assert victor.get(f"{JOBS}/{job_id}").status_code == 200

        assert job_id in [j["job_id"] for j in admin.get(JOBS, params={"limit": 200}).json()]
        assert admin.get(f"{JOBS}/{job_id}").json()["owner"] == "alice"
        assert alice.post(f"{JOBS}/{job_id}/cancel").status_code in (200, 404)


def test_the_any_kind_routes_keep_the_roles(stack):
    """GET /admin/api/jobs and /admin/api/jobs/{id}: a trainer sees only its own jobs (others'
    are 404), a viewer and the admin see every job, of every kind."""
    pairs = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    with stack.client(TRAINER_A) as alice, stack.client(TRAINER_B) as bob, \
            stack.client(VIEWER) as victor, stack.client() as admin:
        mine = [alice.post(JOBS, json=body(stack, model_id="no-such-model-roles")).json()["job_id"],
                alice.post("/admin/api/fine-tune/dpo/jobs", json={"model_id": "no-such-model-roles",
                                                                 "preference_pairs": pairs}).json()["job_id"]]
        for job_id in mine:
            assert bob.get(f"/admin/api/jobs/{job_id}").json() == {"detail": f"Job not found: {job_id}"}
            assert alice.get(f"/admin/api/jobs/{job_id}").json()["owner"] == "alice"
            for who in (victor, admin):
                assert who.get(f"/admin/api/jobs/{job_id}").status_code == 200
        assert not set(mine) & {j["job_id"] for j in bob.get("/admin/api/jobs", params={"limit": 1000}).json()}
        alices = alice.get("/admin/api/jobs", params={"limit": 1000}).json()
        assert set(mine) <= {j["job_id"] for j in alices} and all(j["owner"] == "alice" for j in alices)
        assert {j["kind"] for j in alices} >= {"grpo", "dpo"}
        for who in (victor, admin):
            assert set(mine) <= {j["job_id"] for j in who.get("/admin/api/jobs", params={"limit": 1000}).json()}
        for job_id in mine:
            alice.post(f"{JOBS}/{job_id}/cancel")
            alice.post(f"/admin/api/fine-tune/dpo/jobs/{job_id}/cancel")


# --- event streams ---------------------------------------------------------------------------

def test_bad_last_event_id_is_400_and_a_good_one_resumes(stack, client):
    job_id = create(client, stack)["job_id"]
    client.post(f"{JOBS}/{job_id}/cancel")
    for bad in ("99999999999999999999999", "1-99999999999999999999", "18446744073709551616-0", "-1", "1-2-3", "$"):
        res = client.get(f"{JOBS}/{job_id}/stream", headers={"Last-Event-ID": bad})
        assert res.status_code == 400, (bad, res.text)
    res = client.get(f"{JOBS}/{job_id}/stream", headers={"Last-Event-ID": "18446744073709551615-0"})
    assert res.status_code == 200


def a_following_job(stack, client) -> str:
    """A job that stays `running` with no worker on it: its streams stay open."""
    job_id = create(client, stack)["job_id"]
    client.post(f"{JOBS}/{job_id}/cancel")
    fake = "f" * 32
    record = stack.redis.hgetall(job_key(job_id))
    stack.redis.hset(job_key(fake), mapping={**record, b"status": b"running"})
    return fake


def api_threads(stack) -> int:
    status = open(f"/proc/{stack.api.pid}/status").read()
    return int(status.split("Threads:")[1].split()[0])


def test_500_streams_hold_no_threads_and_rest_stays_fast(stack, client):
    job_id = a_following_job(stack, client)
    for _ in range(50):  # warm the thread pool the sync routes run in
        client.get(f"{JOBS}/{job_id}")
    threads_before = api_threads(stack)

    async def run() -> tuple[list[float], int, int]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=stack.base_url, headers=headers, limits=limits, timeout=60) as ac, \
                httpx.AsyncClient(base_url=stack.base_url, headers=headers, timeout=10) as rest:
            opened: list[httpx.Response] = []

            async def open_one():
                response = await ac.send(ac.build_request("GET", f"{JOBS}/{job_id}/stream"), stream=True)
                opened.append(response)

            await asyncio.gather(*(open_one() for _ in range(MAX_STREAMS)))
            try:
                bad = [r for r in opened if r.status_code != 200]
                assert not bad, (len(bad), (await bad[0].aread())[:300])
                over = await rest.get(f"{JOBS}/{job_id}/stream")  # one more than the cap
                latencies = []
                for _ in range(30):
                    t0 = time.perf_counter()
                    assert (await rest.get(f"{JOBS}/{job_id}")).status_code == 200
                    latencies.append(time.perf_counter() - t0)
                return latencies, api_threads(stack), over.status_code
            finally:
                await asyncio.gather(*(r.aclose() for r in opened))

    latencies, threads_during, over_status = asyncio.run(run())
    print(f"\n500 streams: REST median {statistics.median(latencies) * 1000:.1f} ms, API threads {threads_before} -> {threads_during}")
    assert over_status == 429
    assert statistics.median(latencies) < 0.1, latencies
    assert threads_during <= threads_before + 2, (threads_before, threads_during)
    # Closed streams are uncounted: a new one opens.
    time.sleep(0.5)
    with client.stream("GET", f"{JOBS}/{job_id}/stream") as res:
        assert res.status_code == 200
    stack.redis.delete(job_key(job_id))


# --- jobs on the worker: each attack ends cleanly, then a normal job completes --------------

class TrickleServer:
    """An HTTP 'reward server' that answers one byte a second (status line first), or an
    endless body; records when each request arrived."""

    def __init__(self, mode: str):
        self.mode, self.arrivals = mode, []
        self.sock = socket.create_server(("127.0.0.1", REWARD_PORT))  # the port MTQ_REWARD_HOSTS lists
        self.url = f"http://127.0.0.1:{REWARD_PORT}/reward"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        with conn:
            conn.recv(65536)
            self.arrivals.append(time.monotonic())
            try:
                if self.mode == "trickle":
                    for byte in b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 30\r\n\r\n{"rewards": [1, 1]}' + b" " * 30:
                        conn.sendall(bytes([byte]))
                        time.sleep(1)
                else:  # an endless answer
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
                    chunk = b"[" * 2**20
                    for _ in range(2000):
                        conn.sendall(chunk)
            except OSError:
                pass

    def __enter__(self) -> "TrickleServer":
        return self

    def __exit__(self, *exc):
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept(): the port is free for the next server
        self.sock.close()


def test_backtracking_regex_runs_in_linear_time(stack, client, worker):
    prompts = ["Repeat 'a' many times: " + "a" * 200]
    reward = [{"type": "regex", "pattern": "([\\s\\S]+)+\\x00"}, {"type": "regex", "pattern": "(a|a)*(a|a)*b", "mode": "fullmatch"}]
    job = create(client, stack, prompts=prompts, reward=reward, config={**SMALL, "max_completion_len": 32, "iters": 2})
    done = stack.wait_job(job["job_id"], timeout=90)
    assert done["status"] == "completed", done["error"]
    a_normal_job_completes(stack, client)


def test_a_byte_a_second_reward_server_fails_within_reward_timeout(stack, client, worker):
    with TrickleServer("trickle") as server:
        reward = [{"type": "endpoint", "url": server.url, "retries": 0}]
        job = create(client, stack, reward=reward, config={**SMALL, "reward_timeout": 2})
        done = stack.wait_job(job["job_id"], timeout=90)
        ended = time.monotonic()
    assert done["status"] == "failed" and "Timeout" in done["error"], done["error"]
    assert ended - server.arrivals[0] < 2 + 2.5  # the deadline, plus our polling
    a_normal_job_completes(stack, client)


def test_cancel_stops_a_job_waiting_on_a_slow_reward_server(stack, client, worker):
    with TrickleServer("trickle") as server:
        reward = [{"type": "endpoint", "url": server.url, "retries": 0, "timeout": 120}]
        job_id = create(client, stack, reward=reward)["job_id"]
        wait_for(lambda: server.arrivals, 60, "the reward request")
        t0 = time.monotonic()
        assert client.post(f"{JOBS}/{job_id}/cancel").status_code == 200
        done = stack.wait_job(job_id, timeout=30)
    assert done["status"] == "cancelled", done
    assert time.monotonic() - t0 < 5  # not the reward's 120 s
    a_normal_job_completes(stack, client)


def test_an_endless_reward_answer_fails_at_the_size_cap(stack, client, worker):
    with TrickleServer("endless") as server:
        job = create(client, stack, reward=[{"type": "endpoint", "url": server.url, "retries": 0}])
        done = stack.wait_job(job["job_id"], timeout=90)
    assert done["status"] == "failed" and "MTQ_MAX_REWARD_RESPONSE_BYTES" in done["error"], done["error"]
    a_normal_job_completes(stack, client)


def test_worker_refuses_what_the_api_would_have_refused(stack, client, worker):
    """Records written around the API (an older version, a hand edit): the worker checks again."""
    for reward, message in (
        ([{"type": "python", "function": "antigravity:fly"}], "module 'antigravity' is not allowed"),
        ([{"type": "endpoint", "url": "http://10.255.255.1:9/x", "retries": 0}], "10.255.255.1"),
    ):
        from shared.schemas import JobCreate

        job_id = jobstore.create_job(stack.redis, JobCreate(**body(stack, reward=reward))).job_id
        done = stack.wait_job(job_id, timeout=90)
        assert done["status"] == "failed" and message in done["error"], done["error"]
    a_normal_job_completes(stack, client)


def test_a_job_that_does_not_fit_the_model_fails_before_its_first_step(stack, client, worker):
    for config, message in (({"max_completion_len": 5000}, "exceeds the model's context of 4096 tokens"),
                            ({"top_k": 100_000}, "larger than the model's vocabulary")):
        job = create(client, stack, config={**SMALL, **config})
        done = stack.wait_job(job["job_id"], timeout=90)
        assert done["status"] == "failed" and message in done["error"], done["error"]
        assert done["progress"] == {}  # no step ran
    a_normal_job_completes(stack, client)


# --- the worker's parts, called directly ------------------------------------------------------

def scorer_for(source: dict, **settings):
    from shared.schemas import JobCreate
    from worker.rewards.scorer import build_scorer

    spec = JobCreate(model_id="tiny", prompts=["p"], reward=[source])
    return lambda resolver=None: build_scorer(
        spec, "job", settings=dataclasses.replace(load_settings(), **settings),
        **({"resolver": resolver} if resolver else {}),
    )


def test_rebinding_the_name_to_another_address_is_refused_at_call_time():
    """The name passes the check; at call time it resolves (our resolver) to an address the
    allow-list does not have: refused without connecting. While it resolves to an allowed
    address (on loopback: listed with its port), the connection goes to exactly that address."""
    from worker.rewards.batch import RewardError

    with serving(lambda body, k: {"rewards": [1.0] * len(body["completions"])}) as server:
        port = int(server.url.split(":")[2].split("/")[0])
        answers = {"now": ["127.0.0.1"]}
        make = scorer_for({"type": "endpoint", "url": f"http://rewards.test:{port}/reward", "retries": 0},
                          reward_hosts=("rewards.test", f"127.0.0.1:{port}"))
        with make(lambda host, p: answers["now"] if host == "rewards.test" else []) as scorer:
            rewards, _ = scorer.score(1, [scorer_item()], [["a", "b"]])
            assert rewards.tolist() == [[1.0, 1.0]]
            assert server.requests[-1]["headers"]["host"] == f"rewards.test:{port}"
        answers["now"] = ["169.254.169.254"]
        n = len(server.requests)
        with make(lambda host, p: answers["now"]) as scorer, pytest.raises(RewardError, match="169.254.169.254"):
            scorer.score(1, [scorer_item()], [["a", "b"]])
        answers["now"] = ["127.0.0.1", "10.0.0.1"]  # one bad address is enough to refuse
        with make(lambda host, p: answers["now"]) as scorer, pytest.raises(RewardError, match="10.0.0.1"):
            scorer.score(1, [scorer_item()], [["a", "b"]])
        assert len(server.requests) == n


def scorer_item():
    from shared.schemas import PromptItem

    return PromptItem(prompt="p", answer="x")


def test_a_remote_ref_is_never_fetched_by_the_worker():
    from worker.rewards.batch import RewardError
    from worker.rewards.functions import json_valid_rewards, make_json_validator

    with serving(lambda body, k: {}) as server:
        schema = {"type": "object", "properties": {"a": {"$ref": server.url}}}
        validator = make_json_validator(schema)
        with pytest.raises(RewardError, match="does not resolve inside the schema"):
            json_valid_rewards(['{"a": 1}'], validator)
        assert server.requests == []
    local = make_json_validator({"$defs": {"n": {"type": "number"}}, "properties": {"a": {"$ref": "#/$defs/n"}}})
    assert json_valid_rewards(['{"a": 1}', '{"a": "x"}'], local) == [1.0, 0.0]


def test_a_module_that_exits_on_import_is_a_reward_error(tmp_path, monkeypatch):
    """Like unittest.__main__ (SystemExit on import), were an operator to allow one: the job
    fails with a message instead of taking the worker down (and being re-queued forever)."""
    from worker.rewards.batch import RewardError
    from worker.rewards.sandbox import load_reward_function

    (tmp_path / "exits_on_import.py").write_text("raise SystemExit(2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="cannot import module 'exits_on_import' \\(SystemExit: 2\\)"):
        load_reward_function("exits_on_import:f", ("exits_on_import",))
    with pytest.raises(RewardError, match="not allowed"):
        load_reward_function("exits_on_import:f", ("other",))


@pytest.mark.parametrize("config", [{"lora_layers": 10**30}, {"top_k": 10**30}, {"warmup_steps": 10**30},
                                    {"checkpoint_every": 10**30}, {"stop": ["x" * 257]}, {"stop": [""]}])
def test_unbounded_numbers_and_strings_are_400(stack, client, config):
    assert client.post(JOBS, json=body(stack, config={**SMALL, **config})).status_code == 400


def test_prompt_fields_reach_only_the_parameters_a_function_declares():
    from worker.rewards.sandbox import declared_fields

    fields = {"answer": [1], "force": [True], "filename": ["/tmp/x"], "prompts": ["evil"]}

    def named(prompts, completions, answer):
        pass

    def trl_style(prompts, completions, **kwargs):
        pass

    assert declared_fields(named, fields) == {"answer": [1]}
    assert declared_fields(trl_style, fields) == {"answer": [1], "force": [True], "filename": ["/tmp/x"]}
    assert declared_fields(print, fields) == {}


def test_model_errors_name_the_model_not_the_file_system(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from worker.runtime.models import ModelNotFound, resolve_model

    settings = dataclasses.replace(load_settings(), models_dir=tmp_path / "models", model_roots=(tmp_path / "roots",))
    (tmp_path / "roots").mkdir()
    for model_id in ("../../x", "/proc/self", "/etc", str(tmp_path / "roots" / "missing"), "nothing-here"):
        with pytest.raises(ModelNotFound) as err:
            resolve_model(model_id, settings)
        assert str(tmp_path) not in str(err.value) or model_id.startswith(str(tmp_path)), str(err.value)
    (tmp_path / "roots" / "link").symlink_to("/etc")  # a symlink out of the roots does not count
    with pytest.raises(ModelNotFound):
        resolve_model(str(tmp_path / "roots" / "link"), settings)

    # A Hugging Face id on a worker without hub access (--hub), or without the hub: said at once.
    with pytest.raises(ModelNotFound, match="no hub access: mtq worker --hub"):
        resolve_model("some-org/some-model", settings)
    settings = dataclasses.replace(settings, hub=True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    t0 = time.monotonic()
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE"):
        resolve_model("some-org/some-model", settings)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed}")
    with pytest.raises(ModelNotFound, match="cannot reach the Hugging Face hub"):
        resolve_model("some-org/some-model", settings)
    assert time.monotonic() - t0 < 10


def test_tokens_file_errors_stop_the_api_at_start(tmp_path):
    """A broken tokens file is an error at start, not a 500 at each request."""
    import subprocess
    import sys

    bad = tmp_path / "tokens.json"
    bad.write_text(json.dumps([{"name": "x", "token": "short", "role": "root"}]))
    env = dict(os.environ, MTQ_TOKENS_FILE=str(bad), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", "import api.main"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "token" in res.stderr


# --- generated requests from the OpenAPI schema ------------------------------------------------

def test_generated_requests_never_get_a_5xx_or_an_undocumented_code(stack, client):
    """Hypothesis builds requests for every operation of /openapi.json: random JSON bodies,
    valid bodies with one field replaced by anything (NaN, huge numbers, lone surrogates,
    nesting), random ids, queries and Last-Event-IDs. No answer may be a 5xx, and each status
    must be one the schema documents for that operation."""
    import copy
    from urllib.parse import quote

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from shared.schemas import GRPOConfig

    schema = client.get("/openapi.json").json()
    operations = [(path, method, op) for path, item in schema["paths"].items() for method, op in item.items()]
    job_id = create(client, stack)["job_id"]
    valid = body(stack, config=GRPOConfig().model_dump(), reward=[{"type": "length"}],
                 prompts=["x", {"prompt": "y", "answer": 1}])

    any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)  # surrogates too
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | any_text
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
                          max_leaves=12)

    def key_paths(node, prefix=()):
        yield prefix
        if isinstance(node, dict):
            for k, v in node.items():
                yield from key_paths(v, (*prefix, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from key_paths(v, (*prefix, i))

    def replaced(path_and_value):
        path, value = path_and_value
        if not path:
            return value
        new = copy.deepcopy(valid)
        node = new
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return new

    mutated = st.tuples(st.sampled_from(list(key_paths(valid))), values).map(replaced)
    bodies = st.one_of(values, mutated, st.just(valid))
    ids = st.one_of(st.just(job_id), st.text(min_size=1, max_size=40),  # (an empty id would be another URL)
                    st.from_regex(r"[0-9a-f]{32}(:events)?", fullmatch=True))
    seen: dict[tuple[str, int], int] = {}

    @settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.sampled_from(operations), ids, bodies, st.dictionaries(st.sampled_from(["status", "limit", "after"]), any_text, max_size=3),
           st.one_of(st.none(), st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
                     .filter(lambda s: s == s.strip())))  # what HTTP can carry (no edge spaces: h11 refuses them)
    def one_request(operation, some_id, payload, query, last_event_id):
        path, method, op = operation
        url = path.replace("{job_id}", quote(some_id.encode("utf-8", "surrogatepass"), safe=""))
        kwargs = {}
        if "requestBody" in op:
            kwargs["content"] = json.dumps(payload).encode()
            kwargs["headers"] = {"Content-Type": "application/json"}
        if method == "get" and "{" not in path and path in (JOBS, "/admin/api/jobs"):
            kwargs["params"] = {k: v.encode("utf-8", "surrogatepass").decode("utf-8", "replace") for k, v in query.items()}
        if last_event_id is not None and path.endswith("/stream"):
            kwargs.setdefault("headers", {})["Last-Event-ID"] = last_event_id
        with client.stream(method.upper(), url, **kwargs) as res:  # a stream: only its status is read
            code = res.status_code
        seen[(f"{method} {path}", code)] = seen.get((f"{method} {path}", code), 0) + 1
        assert code < 500, (method, url, kwargs, code)
        assert str(code) in op["responses"], (method, path, code, sorted(op["responses"]))

    one_request()
    assert {code for (_, code) in seen} >= {200, 400, 404}, seen
