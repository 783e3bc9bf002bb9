"""The Tinker-compatible API (docs/sessions.md) driven by the official `tinker` SDK against the
real stack: redis-server, the API, a worker, the tiny model. A custom loop's calls (forward_backward,
optim_step, save_state, sampling...) run on the worker's training process as a session job,
and the SDK's own types parse every answer.
"""

import os
import signal

import numpy as np
import pytest
import tinker
from conftest import TOKEN, Stack, running, wait_for
from tinker import types

SESSIONS = "/admin/api/fine-tune/session/jobs"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    yield from running(Stack(tmp_path_factory.mktemp("sessions"), tiny_model))


def service(stack, token: str = TOKEN) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=stack.base_url, api_key=f"tml-{token}")


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """A cross_entropy datum: each input token predicts the next."""
    inputs, targets = tokens[:-1], tokens[1:]
    return types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={
        "target_tokens": np.array(targets, dtype=np.int64),
        "weights": np.array(weights or [1.0] * len(targets), dtype=np.float32)})


SEQUENCE = [5, 17, 300, 42, 42, 9, 100, 200, 300, 400, 7, 8]


def test_a_supervised_loop_trains_saves_samples_and_lists_its_checkpoints(stack, worker):
    """create_lora_training_client -> forward_backward + optim_step (the loss falls) -> save_state,
    save_weights_for_sampler -> sampling from the saved weights -> the RestClient's runs and
    checkpoints; the session's job completes when the client closes the session."""
    with service(stack) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1)
        info = tc.get_info()
        assert info.model_data.model_name == "tiny" and info.lora_rank == 4
        losses = []
        for _ in range(6):
            fb = tc.forward_backward([datum(SEQUENCE)], "cross_entropy")
            step = tc.optim_step(types.AdamParams(learning_rate=5e-2))
            out = fb.result()
            step.result()
            losses.append(out.metrics["loss:sum"])
            assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(SEQUENCE) - 1
        print("\ncross_entropy loss:sum per step:", [round(x, 3) for x in losses])
        assert losses[-1] < losses[0] * 0.8
        state = tc.save_state("after-six").result()
        assert state.path.endswith("/weights/after-six")
        sampler_path = tc.save_weights_for_sampler("six").result().path
        sampler = sc.create_sampling_client(model_path=sampler_path)
        got = sampler.sample(types.ModelInput.from_ints(SEQUENCE[:4]), num_samples=3,
                             sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
        assert len(got.sequences) == 3 and all(1 <= len(s.tokens) <= 6 for s in got.sequences)
        assert all(len(s.logprobs) == len(s.tokens) for s in got.sequences)

        rest = sc.create_rest_client()
        run_id = tc.model_id
        run = rest.get_training_run(run_id).result()
        assert run.base_model == "tiny" and run.lora_rank == 4
        ckpts = rest.list_checkpoints(run_id).result().checkpoints
        assert {c.checkpoint_id for c in ckpts} == {"weights/after-six", "sampler_weights/six"}
        assert {r.training_run_id for r in rest.list_training_runs().result().training_runs} >= {run_id}
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


def test_a_killed_worker_fails_the_pending_futures_and_the_state_loads_on_another(stack, workers):
    """kill -9 of the session's worker: a call it never answered fails with a message that says to
    load the last save_state; create_training_client_from_state_with_optimizer then continues on
    another worker from exactly that state (its next loss is the one the first would have had)."""
    first = workers()
    with service(stack) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=2)
        for _ in range(2):
            tc.forward_backward([datum(SEQUENCE)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        saved = tc.save_state("two").result().path
        expected = tc.forward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"]
        job_id = session_job_of(stack, tc.model_id)
        os.kill(supervisor_pid(stack, job_id), signal.SIGKILL)
        first.wait(10)
        with pytest.raises(tinker.RequestFailedError, match="load the last save_state"):
            tc.forward_backward([datum(SEQUENCE)], "cross_entropy").result()
        workers()
        again = sc.create_training_client_from_state_with_optimizer(saved)
        assert again.forward([datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
        assert session_job_of(stack, again.model_id) != job_id
    with stack.client() as c:
        assert c.get(f"{SESSIONS}/{job_id}").json()["status"] == "failed"  # one attempt: its state died with it
