"""The Tinker-compatible API (docs/sessions.md) driven by the official `tinker` SDK against the
real stack: redis-server, the API, a worker, the tiny model. A custom loop's calls (forward_backward,
optim_step, save_state, sampling...) run on the worker's training process as a session job,
and the SDK's own types parse every answer.
"""

import io
import os
import signal
import tarfile

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import tinker
from conftest import TOKEN, Stack, running
from tinker import types

from shared.sessions import session_key
from worker.runtime.make_model import make_model

SESSIONS = "/admin/api/fine-tune/session/jobs"
ALICE, BOB, VICTOR = "alice-token-0123456789", "bob-token-0123456789ab", "victor-token-0123456789"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # A final norm of 16: at 1 the tiny model's logits stay within about +-1.3 whatever its LoRA
    # learns (worker/runtime/make_model.py), and a loss can barely fall.
    model = make_model(tmp_path_factory.mktemp("sharp") / "tiny", final_norm=16.0)
    s = Stack(tmp_path_factory.mktemp("sessions"), model)
    s.env.update(MTQ_SESSION_IDLE_TIMEOUT_S="15", MTQ_LEASE_TTL="5")
    s.use_tokens([{"name": "alice", "token": ALICE, "role": "trainer"}, {"name": "bob", "token": BOB, "role": "trainer"},
                  {"name": "victor", "token": VICTOR, "role": "viewer"}])
    yield from running(s)


def service(stack, token: str = TOKEN) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=stack.base_url, api_key=f"tml-{token}")


def rest(stack, token: str = TOKEN) -> tinker.RestClient:
    return tinker.RestClient(base_url=stack.base_url, api_key=f"tml-{token}")


def key(token: str = TOKEN) -> dict[str, str]:
    """The SDK's credentials, for plain HTTP."""
    return {"X-API-Key": f"tml-{token}"}


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """A cross_entropy datum: each input token predicts the next."""
    inputs, targets = tokens[:-1], tokens[1:]
    return types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={
        "target_tokens": np.array(targets, dtype=np.int64),
        "weights": np.array(weights or [1.0] * len(targets), dtype=np.float32)})


SEQUENCE = [5, 17, 300, 42, 42, 9, 100, 200, 300, 400, 7, 8]


def train(tc, steps: int) -> None:
    """`steps` cross-entropy steps on SEQUENCE at learning rate 1e-2, each waited for."""
    for _ in range(steps):
        tc.forward_backward([datum(SEQUENCE)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_a_supervised_loop_trains_saves_samples_and_lists_its_checkpoints(stack, worker):
    """create_lora_training_client -> forward_backward + optim_step (the loss falls) -> save_state,
    save_weights_for_sampler -> sampling from the saved weights -> the RestClient's runs and
    checkpoints; the session's job completes when the client closes the session."""
    with service(stack) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        info = tc.get_info()
        assert info.model_data.model_name == "tiny" and info.lora_rank == 4
        losses = []
        for _ in range(6):
            fb = tc.forward_backward([datum(SEQUENCE)], "cross_entropy")
            step = tc.optim_step(types.AdamParams(learning_rate=1e-2))
            out = fb.result()
            step.result()
            losses.append(out.metrics["loss:sum"])
            assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(SEQUENCE) - 1
        print("\ncross_entropy loss:sum per step:", [round(x, 3) for x in losses])
        assert losses[-1] < losses[0] * 0.8
        state = tc.save_state("after-six").result()
        assert state.path.endswith("/weights/after-six")
        sampler_path = tc.save_weights_for_sampler("six").result().path
        sampler = sc.create_sampling_client(model_path=sampler_path).result()
        got = sampler.sample(types.ModelInput.from_ints(SEQUENCE[:4]), num_samples=3,
                             sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
        assert len(got.sequences) == 3 and all(1 <= len(s.tokens) <= 6 for s in got.sequences)
        assert all(len(s.logprobs) == len(s.tokens) for s in got.sequences)

        rest_client = rest(stack)
        run_id = tc.model_id
        run = rest_client.get_training_run(run_id).result()
        assert run.base_model == "tiny" and run.lora_rank == 4
        ckpts = rest_client.list_checkpoints(run_id).result().checkpoints
        assert {c.checkpoint_id for c in ckpts} == {"weights/after-six", "sampler_weights/six"}
        assert {r.training_run_id for r in rest_client.list_training_runs().result().training_runs} >= {run_id}
        session_job = stack.redis.hget(f"mtq:tinker:session:{run_id.split(':')[0]}:jobs", "tiny").decode()
    # The session finished with the SDK's `with`: its job completes, the worker is free.
    job = stack.wait_job(session_job, path=SESSIONS, timeout=60)
    assert job["status"] == "completed", job["error"]
    steps = [e for _, e in stack.events(session_job) if e.get("type") == "session_step"]
    assert [e["iter"] for e in steps] == [1, 2, 3, 4, 5, 6] and all(e["model_id"] == run_id for e in steps)


def session_job_of(stack, model_id: str) -> str:
    return stack.redis.hget(f"mtq:tinker:session:{model_id.split(':')[0]}:jobs", "tiny").decode()


def supervisor_pid(stack, job_id: str) -> int:
    return [e for _, e in stack.events(job_id) if e["type"] == "started"][-1]["supervisor_pid"]


def test_samplers_give_the_log_probs_mlx_lm_gives_for_the_same_adapter(stack, worker, tmp_path):
    """A sampler on a saved checkpoint, one on the weights as they are (save_weights_and_get_sampling_client)
    and one on the base model: the log-probs of what they sample, and compute_logprobs' of a prompt,
    are those mlx_lm computes with the checkpoint's archive as adapter_path (and with no adapter)."""
    with service(stack) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        train(tc, 3)
        path = tc.save_weights_for_sampler("three").result().path
        saved = sc.create_sampling_client(model_path=path).result()
        live = tc.save_weights_and_get_sampling_client().result()
        base = sc.create_sampling_client(base_model="tiny").result()
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11)
        prompt = types.ModelInput.from_ints(SEQUENCE[:5])
        got = {name: c.sample(prompt, num_samples=2, sampling_params=params).result()
               for name, c in (("saved", saved), ("live", live), ("base", base))}
        scored = saved.compute_logprobs(types.ModelInput.from_ints(SEQUENCE)).result()
        model_id, checkpoint_id = path.removeprefix("tinker://").split("/", 1)
        with stack.client() as c:  # the API's own archive of the checkpoint: mlx_lm's adapter files
            res = c.get(f"/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id}/archive",
                        headers=key())
        assert res.status_code == 200, res.text
        with tarfile.open(fileobj=io.BytesIO(res.content)) as tar:
            tar.extractall(tmp_path / "adapter", filter="data")
    adapter = next(p.parent for p in (tmp_path / "adapter").rglob("adapters.safetensors"))

    def logprobs(model, tokens):
        logits = model(mx.array([tokens]))[0].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return [logp[i - 1, tokens[i]].item() for i in range(1, len(tokens))]

    tuned = mlx_lm.load(str(stack.tiny_model), adapter_path=str(adapter))[0]
    plain = mlx_lm.load(str(stack.tiny_model))[0]
    assert scored[0] is None and scored[1:] == pytest.approx(logprobs(tuned, SEQUENCE), abs=1e-4)
    for name, model in (("saved", tuned), ("live", tuned), ("base", plain)):
        for seq in got[name].sequences:
            want = logprobs(model, SEQUENCE[:5] + list(seq.tokens))[4:]
            assert seq.logprobs == pytest.approx(want, abs=1e-4), name
    assert got["saved"].sequences[0].tokens == got["live"].sequences[0].tokens  # same weights, same seed
    assert got["base"].sequences != got["saved"].sequences


def test_two_clients_share_one_worker_and_leave_each_other_alone(stack, worker):
    """Two training clients of one session on one base model run on one session job; training one
    changes neither the other's loss nor the base model's."""
    with service(stack) as sc:
        a = sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        b = sc.create_lora_training_client(base_model="tiny", rank=8, seed=6).result()
        assert session_job_of(stack, a.model_id) == session_job_of(stack, b.model_id)
        base = sc.create_sampling_client(base_model="tiny").result()
        before_b = b.forward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"]
        before_base = base.compute_logprobs(types.ModelInput.from_ints(SEQUENCE)).result()
        train(a, 3)
        assert b.forward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"] == before_b
        assert base.compute_logprobs(types.ModelInput.from_ints(SEQUENCE)).result() == before_base
        assert a.forward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"] < before_b


def test_a_bad_call_fails_its_future_alone(stack, worker):
    """A loss the server does not serve, inputs that do not fit the loss, an optimizer setting out of
    range and a datum over the session's max_seq_len are each a clear error; the client goes on.
    So are asample's bounds (docs/sessions.md, Limits)."""
    with service(stack) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
        with pytest.raises(tinker.RequestFailedError, match="gspo") as e:
            tc.forward_backward([datum(SEQUENCE)], "gspo").result()
        assert e.value.category.value == "user"
        with pytest.raises(tinker.RequestFailedError, match="advantages"):
            tc.forward_backward([datum(SEQUENCE)], "ppo").result()
        with pytest.raises(tinker.BadRequestError, match="max_seq_len"):
            tc.forward_backward([datum(list(range(1, 1000)) * 9)], "cross_entropy").result()
        with pytest.raises(tinker.BadRequestError, match="beta1"):
            tc.optim_step(types.AdamParams(learning_rate=1e-3, beta1=1.5)).result()
        assert tc.forward_backward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"] > 0
        with stack.client(None) as c:  # asample's bounds, as plain HTTP: 400s that name the field
            sampler = c.post("/api/v1/create_sampling_session", headers=key(), json={
                "session_id": tc.model_id.split(":")[0], "sampling_session_seq_id": 99, "base_model": "tiny"}).json()
            prompt = {"chunks": [{"type": "encoded_text", "tokens": SEQUENCE[:4]}]}
            for extra, message in (({"num_samples": 257}, "num_samples"),
                                   ({"sampling_params": {"max_tokens": 32769}}, "max_tokens"),
                                   ({"sampling_params": {"max_tokens": 8190}}, "max_seq_len"),
                                   ({"sampling_params": {"stop": ["x"] * 17}}, "at most 16"),
                                   ({"topk_prompt_logprobs": 5}, "topk_prompt_logprobs")):
                res = c.post("/api/v1/asample", headers=key(), json={
                    "sampling_session_id": sampler["sampling_session_id"], "prompt": prompt, **extra})
                assert res.status_code == 400 and message in res.json()["detail"], (extra, res.text)


def test_keys_roles_and_owners(stack, worker):
    """A wrong key is a 401; a viewer's key reads but makes nothing; another trainer's session,
    run, checkpoint and future are 404s, as their jobs are."""
    with pytest.raises(tinker.AuthenticationError):
        service(stack, "not-a-token-of-this-server").create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.PermissionDeniedError):
        service(stack, VICTOR).create_lora_training_client(base_model="tiny", rank=4).result()
    with service(stack, ALICE) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=8).result()
        path = tc.save_state("alice").result().path
        tc.forward([datum(SEQUENCE)], "cross_entropy").result()
        futures = [k.decode().rsplit(":", 1)[1] for k in stack.redis.scan_iter("mtq:tinker:future:*")
                   if k.count(b":") == 3 and stack.redis.hget(k, "owner") == b"alice"]  # not their :done lists
        with stack.client(None) as c:
            assert c.post("/api/v1/get_info", json={"model_id": tc.model_id}, headers=key(BOB)).status_code == 404
            assert c.post("/api/v1/weights_info", json={"tinker_path": path}, headers=key(BOB)).status_code == 404
            assert c.post("/api/v1/session_heartbeat", json={"session_id": tc.model_id.split(":")[0]},
                          headers=key(BOB)).status_code == 404
            assert c.post("/api/v1/retrieve_future", json={"request_id": futures[0]}, headers=key(BOB)).status_code == 404
            assert c.get(f"/api/v1/training_runs/{tc.model_id}", headers=key(VICTOR)).status_code == 200
        assert tc.model_id not in {r.training_run_id for r in rest(stack, BOB).list_training_runs().result().training_runs}
        with service(stack, BOB) as sc_bob, pytest.raises(tinker.NotFoundError):  # closed: no heartbeat left behind
            sc_bob.create_training_client_from_state(path).result()


def test_a_vanished_client_frees_its_worker_after_the_idle_timeout(stack, worker):
    """A client that stops calling and heartbeating (here: the SDK is never closed, and its
    process's heartbeats are not sent: plain HTTP) leaves its session's job; it completes after
    MTQ_SESSION_IDLE_TIMEOUT_S (15 s here) and the worker takes the next session."""
    with stack.client(None) as c:
        sid = c.post("/api/v1/create_session", json={"tags": []}, headers=key()).json()["session_id"]
        res = c.post("/api/v1/create_model", headers=key(), json={"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                                                 "lora_config": {"rank": 2}})
        assert res.status_code == 200, res.text
        rid = res.json()["request_id"]
        assert c.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=key()).json()["model_id"] == f"{sid}:train:0"
    job_id = session_job_of(stack, f"{sid}:train:0")
    job = stack.wait_job(job_id, path=SESSIONS, timeout=90)
    seen_at = float(stack.redis.hget(session_key(sid), "seen_at"))  # the last call (it may precede the job's start)
    assert job["status"] == "completed" and job["finished_at"] - seen_at >= 15
    ended = [e for _, e in stack.events(job_id) if e.get("type") == "session_ended"]
    assert "idle_timeout_s" in ended[0]["reason"]


def test_an_api_restart_loses_nothing(stack, worker):
    """The API restarts between a call and the retrieval of its result: the future, the run and
    its checkpoints are all in Redis, and the loop goes on."""
    with service(stack) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
        fb = tc.forward_backward([datum(SEQUENCE)], "cross_entropy")
        stack.stop_proc(stack.api)
        stack.start_api()
        assert fb.result().metrics["loss:sum"] > 0
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert tc.save_state("after-restart").result().path.endswith("/weights/after-restart")


def test_the_sdks_other_routes(stack, worker):
    """What the loops above leave out, through the SDK: the server's capabilities and health,
    load_state into a live client (its loss is the saved one again), the RestClient's sessions,
    weights info, user checkpoints and delete, the RL losses over the wire, each equal to its
    formula on the logprobs forward returns (sampling log-probs equal to them: every ratio 1),
    and how long each record lives in Redis."""
    with stack.client(None) as c:
        assert c.get("/api/v1/healthz").status_code == 200
    rest_client = rest(stack)
    assert "tiny" in {m.model_name for m in rest_client.get_server_capabilities().result().supported_models}
    with service(stack) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=10).result()
        train(tc, 1)
        path = tc.save_state("one").result().path
        saved = tc.forward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"]
        train(tc, 1)
        assert tc.forward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"] != saved
        with pytest.warns(FutureWarning, match="load_state"):  # deprecated by the SDK; older clients still call it
            tc.load_state(path).result()
        assert tc.forward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(saved, abs=1e-5)

        out = tc.forward([datum(SEQUENCE)], "cross_entropy").result()
        lp = np.array(out.loss_fn_outputs[0]["logprobs"].tolist())
        advantages = np.linspace(-1.0, 1.0, len(lp))
        rl = types.Datum(model_input=types.ModelInput.from_ints(SEQUENCE[:-1]), loss_fn_inputs={
            "target_tokens": np.array(SEQUENCE[1:], dtype=np.int64), "logprobs": lp.astype(np.float32),
            "advantages": advantages.astype(np.float32)})
        want = {"importance_sampling": -advantages.sum(), "ppo": -advantages.sum(),
                "cispo": -(lp * advantages).sum(), "dro": -(lp * advantages).sum()}
        for loss_fn, value in want.items():
            got = tc.forward([rl], loss_fn).result().metrics["loss:sum"]
            assert got == pytest.approx(value, abs=1e-3), loss_fn

        # The lifetimes docs/sessions.md states (Limits): futures an hour, sessions and runs a week
        # after their last use, checkpoints until deleted or their ttl_seconds.
        session_id = tc.model_id.split(":")[0]
        futures = [k for k in stack.redis.scan_iter("mtq:tinker:future:*") if k.count(b":") == 3]
        assert futures and all(3500 < stack.redis.ttl(k) <= 3600 for k in futures)
        week = 7 * 86_400
        assert week - 100 < stack.redis.ttl(f"mtq:tinker:session:{session_id}") <= week
        assert week - 100 < stack.redis.ttl(f"mtq:tinker:run:{tc.model_id}") <= week
        assert stack.redis.ttl(f"mtq:tinker:ckpt:{tc.model_id}:weights/one") == -1  # no expiry
        short = tc.save_state("short", ttl_seconds=7200).result().path
        assert 7100 < stack.redis.ttl(f"mtq:tinker:ckpt:{tc.model_id}:weights/short") <= 7200
        assert short in {ck.tinker_path for ck in rest_client.list_user_checkpoints().result().checkpoints}

        info = rest_client.get_weights_info_by_tinker_path(path).result()
        assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)
        assert tc.model_id in rest_client.get_session(session_id).result().training_run_ids
        assert session_id in rest_client.list_sessions().result().sessions
        assert path in {ck.tinker_path for ck in rest_client.list_user_checkpoints().result().checkpoints}
        rest_client.delete_checkpoint_from_tinker_path(path).result()
        assert "weights/one" not in {ck.checkpoint_id for ck in rest_client.list_checkpoints(tc.model_id).result().checkpoints}
        with pytest.raises(tinker.NotFoundError):
            sc.create_training_client_from_state(path).result()


def test_a_killed_worker_fails_the_pending_futures_and_the_state_loads_on_another(stack, workers):
    """kill -9 of the session's worker: a call it never answered fails with a message that says to
    load the last save_state; create_training_client_from_state_with_optimizer then continues on
    another worker from exactly that state (its next loss is the one the first would have had)."""
    # Last in the module: the session may run on the module's worker (an earlier test started it) or
    # on this one, and whichever runs it is killed.
    workers()
    with service(stack) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
        train(tc, 2)
        saved = tc.save_state("two").result().path
        expected = tc.forward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"]
        job_id = session_job_of(stack, tc.model_id)
        victim = supervisor_pid(stack, job_id)
        os.killpg(victim, signal.SIGKILL)  # the supervisor and its training process
        with pytest.raises(tinker.RequestFailedError, match="load the last save_state"):
            tc.forward_backward([datum(SEQUENCE)], "cross_entropy").result()
        workers()
        again = sc.create_training_client_from_state_with_optimizer(saved).result()
        assert again.forward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
        assert session_job_of(stack, again.model_id) != job_id
    with stack.client() as c:
        assert c.get(f"{SESSIONS}/{job_id}").json()["status"] == "failed"  # one attempt: its state died with it
