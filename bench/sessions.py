"""A Tinker training step through the whole stack, against the same step in this process.

    python bench/sessions.py MODEL_DIR [--datums 8] [--tokens 128] [--rank 8] [--steps 3]
        [--rounds 5] [--warmup 2]

Starts a private stack (`mtq up`: redis-server, the API, one worker) with MODEL_DIR as its model,
and loads the same model in this process as a worker loads it (worker/runtime/models.py
get_model). A step is one forward_backward of --datums cross-entropy datums of --tokens tokens
(random token ids, one draw for the whole run) and one optim_step, waited for:
  api    the official `tinker` SDK against the stack: HTTP, the protobuf codec, the call queue in
         Redis, the session job on the worker's training process, the futures and their polling
  local  worker/sessions/training_client.py's TrainingClient on this process's copy: the same
         math with no service around it
Both start from the same LoRA (rank --rank, one seed). --warmup steps of each are not timed
(compilation); then --rounds rounds run --steps steps of each, the order reversed every other
round. Printed: each path's min / median / max seconds a step over the rounds, the ratio
api / local of the medians with the rounds' own smallest and largest (the spread), and the
service's cost a step (the medians' difference). On Linux CPU the process first re-executes
itself with the system OpenBLAS, as a worker does (worker/supervisor/openblas.py).
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

import numpy as np  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from bench.private_stack import TOKEN, private_stack, wait_for_workers  # noqa: E402
from shared.settings import load_settings  # noqa: E402
from worker.runtime.models import get_model  # noqa: E402
from worker.sessions.training_client import LoraConfig, TrainingClient  # noqa: E402

SEED = 1
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def make_data(datums: int, tokens: int, vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(seq[:-1].astype(np.int32), seq[1:].astype(np.int64)) for seq in rng.integers(0, vocab, (datums, tokens + 1))]


def api_step(tc, data) -> float:
    batch = [types.Datum(model_input=types.ModelInput.from_ints(x.tolist()),
                         loss_fn_inputs={"target_tokens": y, "weights": np.ones(len(y), np.float32)}) for x, y in data]
    t0 = time.perf_counter()
    fb = tc.forward_backward(batch, "cross_entropy")
    step = tc.optim_step(types.AdamParams(**ADAM))
    fb.result()
    step.result()
    return time.perf_counter() - t0


def local_step(client: TrainingClient, data) -> float:
    batch = [(x, {"target_tokens": y, "weights": np.ones(len(y), np.float32)}) for x, y in data]
    t0 = time.perf_counter()
    client.forward_backward(batch, "cross_entropy", {}, False)
    client.optim_step(**ADAM)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    model_dir = Path(args.model_dir).resolve()
    name = model_dir.name
    model, _, _ = get_model(name, dataclasses.replace(load_settings(), models_dir=model_dir.parent))
    data = make_data(args.datums, args.tokens, model.args.vocab_size)
    local = TrainingClient(model, LoraConfig(rank=args.rank, seed=SEED))
    times: dict[str, list[float]] = {"api": [], "local": []}
    with private_stack(model_dir) as (stack, client, log):
        wait_for_workers(client, stack, log)
        with tinker.ServiceClient(base_url=str(client.base_url), api_key=f"tml-{TOKEN}") as service:
            tc = service.create_lora_training_client(base_model=name, rank=args.rank, seed=SEED).result()
            run = {"api": lambda: api_step(tc, data), "local": lambda: local_step(local, data)}
            for _ in range(args.warmup):
                run["api"](), run["local"]()
            for r in range(args.rounds):
                for path in (("api", "local") if r % 2 == 0 else ("local", "api")):
                    times[path].append(statistics.median(run[path]() for _ in range(args.steps)))
    api, loc = times["api"], times["local"]
    ratios = [a / b for a, b in zip(api, loc)]
    print(json.dumps({"model": name, "datums": args.datums, "tokens": args.tokens, "rank": args.rank,
                      "rounds": args.rounds, "steps_per_round": args.steps}))
    for path, t in times.items():
        print(f"{path:5s} s/step  min {min(t):.4f}  median {statistics.median(t):.4f}  max {max(t):.4f}")
    print(f"api/local  {statistics.median(api) / statistics.median(loc):.3f}x  "
          f"(rounds: {min(ratios):.3f}-{max(ratios):.3f})  service cost {statistics.median(api) - statistics.median(loc):+.4f} s/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
