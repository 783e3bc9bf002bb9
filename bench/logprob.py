"""Log-prob scoring latency through the whole stack, against the seed server's approach.

    python bench/logprob.py MODEL_DIR [--requests 40] [--batch 8]

Starts a private stack (`mtq up`: redis-server, the API, one worker) with MODEL_DIR as its
model, then measures POST /admin/api/fine-tune/logprob over HTTP:
  idle/single   one {prompt, completion} per request, the worker idle
  idle/batch    --batch items per request
  busy/single   the same while the worker trains a GRPO job (answered between its steps)
  busy/batch
and, in the same run, the seed server's approach as the reference: load the model (mlx_lm.load),
score with one forward pass, free it, for every request (in this process, no HTTP).
Prints one JSON line per case: p50_ms, p99_ms, requests_per_s.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.private_stack import private_stack  # noqa: E402

PROMPTS = ["What is 2+2?", "Say hello to the queue.", "Count to three", "Name a prime number."]
COMPLETION = " The answer, written out in a few plain words, is four."


def percentiles(seconds: list[float]) -> dict:
    ms = sorted(s * 1000 for s in seconds)
    return {"p50_ms": round(statistics.median(ms), 1), "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1),
            "requests_per_s": round(len(ms) / (sum(seconds) or 1e-9), 1)}


def timed_requests(client: httpx.Client, model_id: str, n: int, batch: int) -> list[float]:
    times = []
    for i in range(n):
        items = [{"prompt": PROMPTS[(i + k) % len(PROMPTS)], "completion": COMPLETION} for k in range(batch)]
        body = {"model_id": model_id, "prompt": items[0]["prompt"], "completion": COMPLETION} if batch == 1 else \
            {"model_id": model_id, "items": items}
        t0 = time.perf_counter()
        resp = client.post("/admin/api/fine-tune/logprob", json=body)
        times.append(time.perf_counter() - t0)
        assert resp.status_code == 200, resp.text
    return times


def seed_reference(model_dir: str, n: int) -> list[float]:
    """What the seed server does per request: load, one forward, free."""
    import gc

    import mlx.core as mx
    import mlx_lm

    times = []
    for i in range(n):
        t0 = time.perf_counter()
        model, tokenizer = mlx_lm.load(model_dir)
        prompt = list(tokenizer.encode(PROMPTS[i % len(PROMPTS)]))
        ids = list(tokenizer.encode(COMPLETION))
        logits = model(mx.array([prompt + ids]))[0].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        total = sum(logp[len(prompt) - 1 + k, t] for k, t in enumerate(ids))
        mx.eval(total)
        del model, tokenizer, logits, logp
        gc.collect()
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    model_dir = Path(args.model_dir).resolve()
    from worker.supervisor.openblas import reexec_with_openblas

    reexec_with_openblas()  # the reference runs in this process: give it the worker's BLAS
    results = []
    with private_stack(model_dir) as (stack, client, log):
        deadline = time.monotonic() + 180
        while True:  # the stack is up once the worker answers a first request (model loaded, kernels built)
            try:
                if client.post("/admin/api/fine-tune/logprob", json={"model_id": model_dir.name, "prompt": "hi",
                                                                    "completion": " there"}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and stack.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        timed_requests(client, model_dir.name, 3, args.batch)  # warm-up: every shape once

        def case(name, batch):
            t = timed_requests(client, model_dir.name, args.requests if batch == 1 else max(args.requests // 4, 5), batch)
            results.append({"case": name, "items_per_request": batch, **percentiles(t)})

        case("idle/single", 1)
        case("idle/batch", args.batch)
        job = client.post("/admin/api/fine-tune/grpo/jobs", json={
            "model_id": model_dir.name, "prompts": PROMPTS,
            "config": {"iters": 100_000, "group_size": 4, "batch_size": 2, "max_completion_len": 32}}).json()
        while client.get(f"/admin/api/fine-tune/grpo/jobs/{job['job_id']}").json()["progress"].get("iter", 0) < 2:
            time.sleep(0.2)
        case("busy/single", 1)
        case("busy/batch", args.batch)
        client.post(f"/admin/api/fine-tune/grpo/jobs/{job['job_id']}/cancel")
        step_time = client.get(f"/admin/api/fine-tune/grpo/jobs/{job['job_id']}").json()["progress"].get("step_time")
        results.append({"case": "busy: the training job's step_s", "step_s": step_time})
    ref = seed_reference(str(model_dir), max(args.requests // 4, 5))
    results.append({"case": "seed approach (load + forward + free per request)", "items_per_request": 1,
                    **percentiles(ref)})
    for row in results:
        print(json.dumps({"model": model_dir.name, **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
