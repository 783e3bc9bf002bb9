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

from conftest import wait_for

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
