"""Phases a person can read: a queued job waits for a worker; the first job on a fresh kernel
cache says, within 2 s of starting, that MLX is compiling its kernels, that this happens once,
and how long it has taken so far; the kernels go into the worker's kernel cache (MTQ_KERNEL_CACHE).

A module of its own: its one worker has an empty kernel cache and is killed once the phase is
seen, so that the test does not wait the minute the compilation takes.
"""

import os
import re
import signal
import time

from conftest import read_events, wait_for

from shared.settings import load_settings
from worker.runtime.warm_up import warm_up

JOBS = "/admin/api/fine-tune/grpo/jobs"
CONFIG = {"iters": 2, "group_size": 2, "batch_size": 1, "max_completion_len": 8, "lora_layers": 2, "lora_rank": 4,
          "lora_alpha": 8.0}


def test_waiting_for_worker_then_compiling_within_2s_on_a_fresh_kernel_cache(stack, tmp_path):
    with stack.client() as c:
        job_id = c.post(JOBS, json={"model_id": stack.tiny_model.name, "prompts": ["Say hello."],
                                    "config": CONFIG}).json()["job_id"]
        job = c.get(f"{JOBS}/{job_id}").json()
        assert job["status"] == "queued" and job["phase"] == "waiting_for_worker"

        fresh_tmp = tmp_path / "tmp"  # an empty kernel cache
        fresh_tmp.mkdir()
        worker = stack.start_worker(env=dict(stack.env, MTQ_KERNEL_CACHE=str(fresh_tmp)))
        try:
            seen = []  # (seconds since started_at, phase, note)

            def compiling():
                job = c.get(f"{JOBS}/{job_id}").json()
                if job["started_at"]:
                    seen.append((time.time() - job["started_at"], job["phase"], job["phase_note"]))
                return seen and seen[-1][1] == "compiling"

            wait_for(compiling, 60, f"phase compiling; seen: {seen}", interval=0.05)
            after_s, _, note = seen[-1]
            print(f"\nphase compiling {after_s:.2f}s after started_at")  # -s shows the figure
            assert after_s < 2.0, seen
            assert "compiling its kernels" in note and "happens once" in note
            assert {phase for _, phase, _ in seen} <= {"starting", "loading_model", "compiling"}, seen
            time.sleep(1.5)
            job = c.get(f"{JOBS}/{job_id}").json()
            assert job["phase"] == "compiling" and job["phase_s"] >= 1.0, job  # how long so far
            assert re.search(r"compiling for \d+ s so far", job["phase_note"]), job["phase_note"]
            # The kernels really are being compiled into the fresh cache.
            wait_for(lambda: list(fresh_tmp.glob("mlx/*/cpu/*")), 60, "kernels in the fresh cache")
        finally:
            os.killpg(worker.pid, signal.SIGKILL)  # with its compiler children
            worker.wait(10)
            c.post(f"{JOBS}/{job_id}/cancel")  # not the next test's worker's: a waiting job stops its warm-up


def test_a_worker_that_offers_a_model_compiles_its_kernels_before_its_first_job(stack, tmp_path):
    """worker/runtime/warm_up.py: a worker started with --models on an empty kernel cache warms the model
    up while no job is submitted: the kernels go into the cache and the model stays loaded. Its
    first job (another batch, LoRA rank and scale than the warm-up's steps, and LoRA on one of the
    two blocks, for which a warm-up of LoRA on both alone left 8 kernels to compile) then finds
    the model loaded, never shows the compiling phase, and compiles no kernel; nor do SFT, DPO,
    ORPO, CPO and KTO jobs after it, of 1 to 3 rows or pairs (a warm-up of GRPO alone left them 15,
    9, 13, 5 and 6 on the `small` model), nor RLOO, REINFORCE and reward-model jobs (a warm-up
    without RLOO's and the reward model's steps left them 14, 0 and 8 here), nor GRPO jobs with a
    KL term and a top-p filter, or a loss micro-batch of one row, nor an SFT job with gradient
    accumulation (a warm-up without OPTIONS left them 6, 8 and 3)."""
    fresh = tmp_path / "cache"
    fresh.mkdir()
    kernels = lambda: list(fresh.glob("mlx/*/cpu/*"))  # noqa: E731
    worker = stack.start_worker("--name", "warm", "--models", stack.tiny_model.name,
                                env=dict(stack.env, MTQ_KERNEL_CACHE=str(fresh)))
    model = stack.tiny_model.name
    pairs = [{"prompt": f"Question {i}?", "chosen": "A kind answer.", "rejected": "No."} for i in range(3)]
    labelled = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                for p in pairs for side in ("chosen", "rejected")]
    api = "/admin/api/fine-tune"
    jobs = [(JOBS, {"model_id": model, "prompts": ["Say hello."], "config": {**CONFIG, "lora_layers": 1}}),
            (JOBS, {"model_id": model, "prompts": ["Say hello."],
                    "config": {**CONFIG, "lora_layers": 1, "beta": 0.1, "top_p": 0.8}}),
            (JOBS, {"model_id": model, "prompts": ["Say hello."],
                    "config": {**CONFIG, "lora_layers": 1, "micro_batch_size": 1}}),
            (f"{api}/jobs", {"model_id": model, "dataset": [{"text": f"Row {i}, some words."} for i in range(3)],
                             "config": {"iters": 2, "batch_size": 1, "lora_layers": 1, "lora_rank": 4}}),
            (f"{api}/jobs", {"model_id": model, "dataset": [{"text": f"Row {i}, some words."} for i in range(3)],
                             "config": {"iters": 2, "lora_layers": 1, "grad_accumulation_steps": 2}}),
            (f"{api}/dpo/jobs", {"model_id": model, "dataset": pairs,
                                 "config": {"iters": 2, "batch_size": 1, "beta": 0.3}}),
            (f"{api}/orpo/jobs", {"model_id": model, "dataset": pairs,
                                  "config": {"iters": 2, "batch_size": 3, "lambda_odds": 0.5}}),
            (f"{api}/cpo/jobs", {"model_id": model, "dataset": pairs, "config": {"iters": 2, "batch_size": 1}}),
            (f"{api}/kto/jobs", {"model_id": model, "dataset": labelled, "config": {"iters": 2, "batch_size": 3}}),
            (f"{api}/rloo/jobs", {"model_id": model, "prompts": ["Say hello."],
                                  "config": {**CONFIG, "lora_layers": 1}}),
            (f"{api}/reinforce/jobs", {"model_id": model, "prompts": ["Say hello."], "config": CONFIG}),
            (f"{api}/reward/jobs", {"model_id": model, "dataset": pairs, "config": {"iters": 2, "batch_size": 3}})]
    try:
        with stack.client() as c:
            def warmed():
                res = c.get("/admin/api/workers/warm")
                return res.status_code == 200 and model in res.json()["loaded"]

            wait_for(warmed, 300, "the worker to warm its model up", interval=0.5)
            warm = len(kernels())
            assert warm > 0
            ran = []
            for route, body in jobs:
                res = c.post(route, json=body)
                assert res.status_code in (200, 201), res.text
                job_id, phases = res.json()["job_id"], set()

                def ended():
                    job = c.get(f"{route}/{job_id}").json()
                    phases.add(job["phase"])
                    return job["status"] in ("completed", "failed")

                wait_for(ended, 120, f"the job to end; phases {phases}", interval=0.05)
                job = c.get(f"{route}/{job_id}").json()
                assert job["status"] == "completed", job
                assert "compiling" not in phases, (route, phases)
                ready = [e for _, e in read_events(stack.redis, job_id) if e["type"] == "model_ready"]
                assert ready and ready[0]["cached"] is True
                ran.append((route.split("/")[-2], len(kernels()) - warm, job["finished_at"] - job["started_at"]))
        warmed_in = re.findall(r"warmed up \S+ in [\d.]+ s", stack.logs("worker", tail=None))
        print(f"\n{warmed_in}: {warm} kernels; then each job's new kernels and seconds from start to end: {ran}")
        assert len(kernels()) == warm, ran
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)


def test_a_job_that_arrives_stops_the_warm_up_between_two_steps(tiny_model, monkeypatch):
    """The warm-up asks before each of its steps (about twenty on a cold CUDA machine take minutes)
    whether a job waits, and stops there: the job compiles what it needs itself."""
    monkeypatch.setenv("MTQ_MODEL_ROOTS", str(tiny_model.parent))
    asked = []

    def job_waiting() -> bool:  # a job arrives during the first step
        asked.append(True)
        return len(asked) > 1

    warm_up(str(tiny_model), load_settings(), should_stop=lambda: False, job_waiting=job_waiting)
    assert len(asked) == 2
