"""The trainer's step under alternatives to its memory choices, in one process (kernels compile
once), for docs/performance.md's account of where the memory plan's time goes:

    python bench/grpo_variants.py MODEL_DIR 16,4,256 8,4,128 --variants plan unlimited-sampling in-place-kv [--steps 5 --warmup 2] [--set k=v ...]

  plan                 the trainer as it is
  unlimited-sampling   no MLX memory limit while sampling (the plan's limit for the loss step)
  in-place-kv          the decode writes each token into the KV cache with mx.slice_update
                       instead of mx.where

Prints bench/grpo_step.py --sweep's JSON line and table for each variant.
"""

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_step  # noqa: E402  (re-executes with OpenBLAS on Linux CPU)
import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402

import worker.kinds.grpo as grpo  # noqa: E402
from worker.decode.kv_cache import StaticKVCache  # noqa: E402
from worker.runtime.projection_groups import fuse_shared_inputs  # noqa: E402

PLAN_UPDATE = StaticKVCache.update_and_fetch
PLAN_SAMPLE = grpo.sample
DEVICE_LIMIT = mx.get_memory_limit()  # MLX's default, before a trainer sets its job's


def in_place_update(self, keys, values):
    if self.keys is None or keys.shape[2] != 1:
        return PLAN_UPDATE(self, keys, values)
    start = self.slots.write_pos.reshape(1)
    self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), start, axes=(2,))
    self.values = mx.slice_update(self.values, values.astype(self.values.dtype), start, axes=(2,))
    return self.keys, self.values


def sample_without_limit(*args, **kwargs):
    limit = mx.set_memory_limit(DEVICE_LIMIT)  # returns the previous limit
    try:
        return PLAN_SAMPLE(*args, **kwargs)
    finally:
        mx.set_memory_limit(limit)


@contextlib.contextmanager
def variant(name: str):
    if name == "in-place-kv":
        StaticKVCache.update_and_fetch = in_place_update
    elif name == "unlimited-sampling":
        grpo.sample = sample_without_limit
    try:
        yield
    finally:
        StaticKVCache.update_and_fetch, grpo.sample = PLAN_UPDATE, PLAN_SAMPLE
        mx.set_memory_limit(DEVICE_LIMIT)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("sweep", nargs="+", metavar="G,B,L")
    ap.add_argument("--variants", nargs="+", default=["plan", "unlimited-sampling", "in-place-kv"],
                    choices=["plan", "unlimited-sampling", "in-place-kv"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="steps not timed (compilation)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="job config overrides")
    args = ap.parse_args()
    overrides = {k: grpo_step.parse_value(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    model, tokenizer = mlx_lm.load(args.model_dir)
    fuse_shared_inputs(model)  # as a worker loads it (worker/runtime/models.py)
    tokenizer.eos_token_ids = []  # every row decodes to full length
    for name in args.variants:
        print(f"variant: {name}", flush=True)
        with variant(name):
            grpo_step.sweep(model, tokenizer, args, overrides)


if __name__ == "__main__":
    main()
