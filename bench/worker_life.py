"""A warm worker's life in one process: many jobs of varying kind and shape one after another on
one loaded model, as a training process runs them. Prints each job's first and later step times,
and a job that raises (MLX's CUDA backend counts every CUDA-graph cache miss of a process and,
by default, raises "Cache thrashing is happening" once they pass twice MLX_CUDA_GRAPH_CACHE_SIZE,
for the rest of the process's life: docs/performance.md "A warm worker's CUDA graphs").

    python bench/worker_life.py MODEL_DIR [--jobs 24] [--steps 4] [--as-worker]

--as-worker sets MLX's environment as the training process sets it (worker/supervisor/mlx_env.py)
before MLX starts; without it the process has MLX's defaults (or what the caller exported).
Jobs cycle through SFT and GRPO with other LoRA ranks, layer counts, batch sizes and lengths;
the last job repeats the first, so its step time shows what a long life costs a known shape, and
one more repeats it after mx.clear_cache(), so that the two say whether MLX's cache of freed
buffers (each job's cache_gb) is what costs it.
Imports MLX, mlx_lm and the trainer modules only (runs where bench/grpo_step.py runs).
"""

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker.supervisor import mlx_env  # noqa: E402
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()
if "--as-worker" in sys.argv:
    mlx_env.use()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from grpo_step import make_trainer  # noqa: E402
from train_step import rows_for  # noqa: E402

from shared.kinds import KINDS  # noqa: E402
from worker.kinds.sft_job import SFTTrainer  # noqa: E402
from worker.runtime.adapter_layers import attach_adapter, remove_adapter_layers  # noqa: E402
from worker.runtime.projection_groups import fuse_shared_inputs  # noqa: E402
from worker.runtime.train_core import TrainState  # noqa: E402

RANKS, LAYERS, BATCHES = (8, 16, 4), (16, 8, -1, 4), (4, 2, 8)


def jobs(n: int) -> list[dict]:
    """n jobs, kinds alternating, shapes spread (every 7th of the product, so neighbours differ);
    the last repeats the first."""
    shapes = list(itertools.product(RANKS, LAYERS, BATCHES))
    made = [{"kind": ("sft", "grpo")[i % 2], **dict(zip(("lora_rank", "lora_layers", "batch_size"), shapes[(7 * i) % len(shapes)])),
             "length": (64, 96, 128)[i % 3]} for i in range(n - 1)]
    return made + [dict(made[0])]


def sft_steps(model, tokenizer, job: dict, steps: int) -> list[float]:
    rows = rows_for("sft", job["batch_size"] * 2, job["length"])
    spec = KINDS["sft"].spec_model.model_validate({"model_id": "bench", "dataset": rows, "config": {
        "batch_size": job["batch_size"], "iters": steps, "lora_rank": job["lora_rank"],
        "lora_layers": job["lora_layers"], "learning_rate": 1e-5}})
    mx.random.seed(0)
    attach_adapter(model, spec.config)
    trainer, state = SFTTrainer(model, tokenizer, spec, rows, None), TrainState()
    return [trainer.step(state)["step_time"] for _ in range(steps)]


def grpo_steps(model, tokenizer, model_dir: str, job: dict, steps: int) -> list[float]:
    _, trainer = make_trainer(model, tokenizer, model_dir, 4, job["batch_size"], job["length"], steps,
                              {"lora_rank": job["lora_rank"], "lora_layers": job["lora_layers"]})
    state = TrainState()
    return [trainer.step(state, lambda: False)[0]["step_time"] for _ in range(steps)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--jobs", type=int, default=24)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--as-worker", action="store_true")
    args = p.parse_args()
    model, tokenizer = mlx_lm.load(args.model)
    fuse_shared_inputs(model)  # as a worker loads it (worker/runtime/models.py)
    tokenizer.eos_token_ids = []  # every completion runs to its length
    env = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__, "env": env}), flush=True)
    failed, planned = 0, jobs(args.jobs)
    for i, job in enumerate(planned + [dict(planned[0])]):
        if i == args.jobs:
            mx.clear_cache()
        t0 = time.perf_counter()
        try:
            if job["kind"] == "sft":
                times = sft_steps(model, tokenizer, job, args.steps)
            else:
                times = grpo_steps(model, tokenizer, args.model, job, args.steps)
            result = {"first_s": round(times[0], 3), "later_s": round(statistics.median(times[1:]), 4)}
        except RuntimeError as e:  # what a job of a training process would fail with
            failed += 1
            result = {"error": str(e)[:160]}
        remove_adapter_layers(model)
        gc.collect()
        print(json.dumps({"job": i, **job, **result, "wall_s": round(time.perf_counter() - t0, 2),
                          "cache_gb": round(mx.get_cache_memory() / 1e9, 3), "after_clear_cache": i == args.jobs}),
              flush=True)
    print(json.dumps({"jobs": args.jobs, "failed": failed}))


if __name__ == "__main__":
    main()
