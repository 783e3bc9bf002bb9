"""Warm-model preference: what a job saves by running on the worker that holds its model loaded.

    python bench/warm_model.py MODEL_DIR [--jobs 10]

Starts a private stack (`mtq up --workers 2`: redis-server, the API, two workers that both
have MODEL_DIR), then submits --jobs one-step GRPO jobs one after the other (each once the
previous completed). The first loads the model (cold); the router sends the next ones to the
own queue of the worker that holds it loaded (shared/routing.py). Prints one JSON line per
job (worker, model_ready.cached, model_ready.load_s, the job's wall time from created_at to
finished_at) and a summary: the cold load against the median cached one.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.private_stack import private_stack, wait_for_workers  # noqa: E402

JOBS = "/admin/api/fine-tune/grpo/jobs"


def model_ready(client: httpx.Client, job_id: str) -> dict:
    with client.stream("GET", f"{JOBS}/{job_id}/stream") as resp:
        for line in resp.iter_lines():
            if line.startswith("data:") and '"model_ready"' in line:
                return json.loads(line[5:])
    raise RuntimeError(f"job {job_id}: no model_ready event")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--jobs", type=int, default=10)
    args = ap.parse_args()
    model_dir = Path(args.model_dir).resolve()
    rows = []
    with private_stack(model_dir, workers=2) as (stack, client, log):
        wait_for_workers(client, stack, log, 2, timeout_s=180)
        for i in range(args.jobs):
            job = client.post(JOBS, json={"model_id": model_dir.name, "prompts": ["What is 2+2?", "Say hello."],
                                          "config": {"iters": 1, "group_size": 2, "batch_size": 2,
                                                     "max_completion_len": 8}}).json()
            ready = model_ready(client, job["job_id"])
            while (done := client.get(f"{JOBS}/{job['job_id']}").json())["status"] not in ("completed", "failed"):
                time.sleep(0.05)
            assert done["status"] == "completed", done["error"]
            rows.append({"job": i, "worker": done["worker"], "cached": ready["cached"], "load_s": round(ready["load_s"], 4),
                         "wall_s": round(done["finished_at"] - done["created_at"], 3)})
            print(json.dumps(rows[-1]), flush=True)
    cold = [r["load_s"] for r in rows if not r["cached"]]
    warm = [r["load_s"] for r in rows if r["cached"]]
    print(json.dumps({"model": model_dir.name, "jobs": len(rows), "cold_loads": len(cold), "cached": len(warm),
                      "workers_used": sorted({r["worker"] for r in rows}),
                      "cold_load_s": cold[0] if cold else None,
                      "cached_load_s_median": statistics.median(warm) if warm else None,
                      "saved_per_job_s": round(cold[0] - statistics.median(warm), 4) if cold and warm else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
