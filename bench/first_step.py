"""The first training step of a fresh training process with a cold and with a warm kernel cache
(worker/supervisor/kernel_cache.py): what a second worker on the same $MTQ_HOME saves.

    python bench/first_step.py MODEL_DIR [--kinds sft dpo grpo] [--cache DIR] [--fleet REDIS_URL]
                               [--vary lora_rank=16 lora_layers=2 batch_size=4]

For each kind, two fresh processes in turn, each set up as a worker's training process is
(kernel_cache.use with MTQ_KERNEL_CACHE = a new empty directory, or --cache, emptied first):
the first finds the cache empty and compiles MLX's kernels into it, the second finds them
there. Each times its job's first step and then a second one (the step without any compile).
Prints one JSON line per kind:
  cold_first_step_s  the first step with an empty cache (MLX compiles its kernels)
  warm_first_step_s  the first step of the next process on the same cache
  later_step_s       the warm process's second step
  kernels            compiled kernels in the cache after the cold run (the CPU's .so files;
                     CUDA: each kernel's files)
  kernel_cache_mb    their size on disk (what a fleet's share holds of this job: MTQ_KERNEL_SHARE_MB)
--vary KEY=VALUE ...: then, for each, one more process on the same warm cache whose job differs
from the first two by that one field (a job's config; batch_size is GRPO's prompts per step):
  varied            per field: its first step and the kernels it compiled that the cache lacked
                    (what a job of another LoRA rank, layer count or batch costs a warm worker)
With --fleet, the cold process also publishes its kernels to that Redis as a worker does
(worker/supervisor/kernel_share.py; MTQ_KERNEL_SHARE_MB must not be 0), and a third process, on
an empty kernel cache and an empty CUDA driver cache (a new machine joining the fleet), fetches
them before its first step:
  fleet_fetch_s         its fetch
  fleet_fetched         the kernels (CUDA: their files) it took from the fleet
  fleet_first_step_s    its first step
  fleet_compiled        kernels its two steps compiled that the fleet did not have (0: none)
Each process's CUDA driver cache is its kernel cache's (kernel_cache.use; CUDA_CACHE_PATH unset).
The trainers: SFT and DPO on 4 rows / pairs of about 64 tokens, batch 2, LoRA on all layers;
GRPO group 4, batch 2, 32 completion tokens (bench/grpo_step.py make_trainer).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.settings import load_settings  # noqa: E402
from worker.supervisor import kernel_cache, kernel_share  # noqa: E402
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402


def child(kind: str, model_dir: str, fleet: str | None, role: str, overrides: dict) -> None:
    """A training process's first two steps of a job of `kind` (its config changed by overrides),
    as one JSON line; role "publish": then it publishes its kernels to the fleet's Redis,
    "fetch": it fetches them first."""
    kernel_cache.use(load_settings().kernel_cache_dir)  # as worker/supervisor/child.py child_main, before MLX
    import mlx.core as mx
    import mlx_lm

    from shared.jobstore import connect
    from worker.runtime.training_process import kernel_backend, shared_kernels

    share = shared_kernels(connect(fleet), load_settings()) if fleet else None
    t0 = time.perf_counter()
    if share and role == "fetch":
        share.fetch()
    fetch_s = time.perf_counter() - t0
    fetched = len(kernel_cache.compiled_kernels(mx.__version__, kernel_backend()))

    from shared.kinds import KINDS
    from worker.kinds.dpo_job import DPOTrainer
    from worker.kinds.sft_job import SFTTrainer
    from worker.runtime.adapter_layers import attach_adapter
    from worker.runtime.train_core import TrainState

    model, tokenizer = mlx_lm.load(model_dir)
    words = " ".join(["word"] * 32)
    if kind == "grpo":
        sys.path.insert(0, str(Path(__file__).parent))
        from grpo_step import make_trainer

        tokenizer.eos_token_ids = []
        config = dict(overrides)
        _, trainer = make_trainer(model, tokenizer, model_dir, 4, config.pop("batch_size", 2), 32, 2, config)
        step = lambda state: trainer.step(state, lambda: False)  # noqa: E731
    else:
        rows = [{"text": f"{i} {words} {words}"} for i in range(8)] if kind == "sft" else [
            {"prompt": f"{i} {words}", "chosen": f"yes {words}", "rejected": f"no {words}"} for i in range(8)]
        spec = KINDS[kind].spec_model.model_validate({"model_id": "bench", "dataset": rows, "config": {
            "batch_size": 2, "iters": 2, "lora_layers": -1, **overrides}})
        mx.random.seed(0)
        attach_adapter(model, spec.config)
        trainer = (SFTTrainer if kind == "sft" else DPOTrainer)(model, tokenizer, spec, rows, None)
        step = trainer.step
    state, times = TrainState(), []
    for _ in range(2):
        t0 = time.perf_counter()
        step(state)
        times.append(time.perf_counter() - t0)
    if share and role == "publish":
        time.sleep(kernel_share.FRESH_S)  # publish skips files younger than this (another worker may be writing them)
        share.publish()
    files = kernel_cache.compiled_kernels(mx.__version__, kernel_backend())
    print(json.dumps({"first_step_s": times[0], "later_step_s": times[1], "kernels": len(files), "fetched": fetched,
                      "cache_bytes": sum(f.stat().st_size for f in files), "fetch_s": fetch_s,
                      "device": str(mx.default_device())}))


def run_child(kind: str, model_dir: str, cache: Path, fleet: str | None = None, role: str = "",
              overrides: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_CACHE_PATH"}  # each cache its own driver cache
    out = subprocess.run([sys.executable, __file__, model_dir, "--child", kind, "--role", role,
                          "--set", json.dumps(overrides or {}), *(["--fleet", fleet] if fleet else [])],
                         capture_output=True, text=True,
                         env=dict(env, MTQ_KERNEL_CACHE=str(cache)), timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="an mlx_lm model directory")
    p.add_argument("--kinds", nargs="+", default=["sft", "dpo", "grpo"], choices=["sft", "dpo", "grpo"])
    p.add_argument("--cache", type=Path, help="the kernel cache directory to use (emptied first); default: a new temporary one")
    p.add_argument("--fleet", metavar="REDIS_URL", help="also time a new worker that fetches the cold run's kernels from this Redis")
    p.add_argument("--vary", nargs="*", default=[], metavar="KEY=VALUE",
                   help="one more warm process per field, the job changed by it (e.g. lora_rank=16)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--set", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--role", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    reexec_with_openblas()
    if args.child:
        return child(args.child, args.model, args.fleet, args.role, json.loads(args.set))
    vary = {key: json.loads(value) for key, value in (kv.split("=", 1) for kv in args.vary)}
    for kind in args.kinds:
        with tempfile.TemporaryDirectory() as d:
            cache = args.cache or Path(d) / "kernel-cache"
            shutil.rmtree(cache, ignore_errors=True)
            cold = run_child(kind, args.model, cache, args.fleet, "publish")
            warm = run_child(kind, args.model, cache)
            joined = run_child(kind, args.model, Path(d) / "new-machine", args.fleet, "fetch") if args.fleet else None
            varied, kernels = [], warm["kernels"]
            for key, value in vary.items():
                other = run_child(kind, args.model, cache, overrides={key: value})
                varied.append({key: value, "first_step_s": round(other["first_step_s"], 3),
                               "compiled": other["kernels"] - kernels})
                kernels = other["kernels"]
        line = {"kind": kind, "device": cold["device"], "cold_first_step_s": round(cold["first_step_s"], 3),
                "warm_first_step_s": round(warm["first_step_s"], 3), "later_step_s": round(warm["later_step_s"], 3),
                "kernels": cold["kernels"], "kernel_cache_mb": round(cold["cache_bytes"] / 1e6, 2)}
        if varied:
            line["varied"] = varied
        if joined:
            line.update(fleet_fetch_s=round(joined["fetch_s"], 3), fleet_fetched=joined["fetched"],
                        fleet_first_step_s=round(joined["first_step_s"], 3),
                        fleet_compiled=joined["kernels"] - joined["fetched"])
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
