"""The phases of a GRPO step alone, in one process: the loss phase (forward, backward and
gradient accumulation over micro-batches) under other memory choices than the plan's, on one
batch sampled once; and with --sampling, the sampling phase under the plan's memory limit and
without one.

    python bench/step_phases.py MODEL_DIR 16,4,256 --configs plan ckpt:16:64 ckpt:64:1024 full:64:16384@none [--reps 3] [--sampling]

A config is `plan` (the trainer's own choice) or CHECKPOINTING:MICRO_BATCH:LOGITS_CHUNK[@LIMIT]:
  CHECKPOINTING  `ckpt` (each layer keeps only its input) or `full` (every activation kept)
  MICRO_BATCH    rows per forward+backward
  LOGITS_CHUNK   completion positions turned into full-vocabulary logits at a time
  LIMIT          MLX's memory limit: `plan` (the default: the plan's peak estimate, as the
                 trainer sets it), `none`, or a number of GB. MLX's limit is soft: above it,
                 allocations wait for queued work, and still proceed when nothing is queued.
Prints one JSON line per config (and per sampling limit): the seconds of each repetition (the
first one compiles) and the peak memory of the repetitions after the first. EOS is off: every
row has L tokens.
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_step  # noqa: E402  (re-executes with OpenBLAS on Linux CPU)
import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
import numpy as np  # noqa: E402

from worker.decode.sampling import sample  # noqa: E402
from worker.kinds.grpo import make_batch  # noqa: E402
from worker.runtime.projection_groups import fuse_shared_inputs  # noqa: E402


def parse_config(text: str) -> tuple[dict, str]:
    """(job config overrides, limit) of one --configs entry."""
    choice, _, limit = text.partition("@")
    if choice == "plan":
        return {}, limit or "plan"
    checkpointing, micro_batch, chunk = choice.split(":")
    if checkpointing not in ("ckpt", "full"):
        raise SystemExit(f"{text}: checkpointing is ckpt or full")
    overrides = {"gradient_checkpointing": checkpointing == "ckpt", "micro_batch_size": int(micro_batch)}
    return {**overrides, "_chunk": int(chunk)}, limit or "plan"


def timed(run, reps: int) -> tuple[list[float], float]:
    """Seconds of each of `reps` runs, and the peak memory (GB) of the runs after the first."""
    seconds, peaks = [], []
    for _ in range(reps):
        gc.collect()
        mx.synchronize()
        mx.reset_peak_memory()
        t = time.perf_counter()
        run()
        seconds.append(round(time.perf_counter() - t, 3))
        peaks.append(mx.get_peak_memory() / 1e9)
    return seconds, round(max(peaks[1:] or peaks), 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("shape", metavar="G,B,L")
    ap.add_argument("--configs", nargs="+", default=["plan"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sampling", action="store_true", help="also time sample() under the plan's limit and without one")
    args = ap.parse_args()
    G, B, L = (int(x) for x in args.shape.split(","))
    model, tokenizer = mlx_lm.load(args.model_dir)
    fuse_shared_inputs(model)  # as a worker loads it (worker/runtime/models.py)
    tokenizer.eos_token_ids = []
    device_limit = mx.get_memory_limit()

    _, trainer = grpo_step.make_trainer(model, tokenizer, args.model_dir, G, B, L, 1, {})
    plan = trainer.memory
    model.eval()

    prompt_ids = trainer.prompt_ids[:B]
    sample_args = (model, trainer.decode_step, prompt_ids, G, trainer.sampling, trainer.eos_ids)

    def sample_once():
        return sample(*sample_args, mx.random.key(0))

    for limit in (["plan", "none"] if args.sampling else []):
        mx.set_memory_limit(int(plan.peak_gb * 1e9) if limit == "plan" else device_limit)
        seconds, peaks = timed(lambda: mx.eval(sample_once().tokens), args.reps)
        print(json.dumps({"phase": "sampling", "shape": args.shape, "device": str(mx.default_device()), "limit": limit,
                          "seconds": seconds, "peak_memory_gb": peaks}), flush=True)
    mx.set_memory_limit(device_limit)
    samples = sample_once()
    advantages = np.random.default_rng(0).standard_normal(G * B).astype(np.float32)
    batch = make_batch(prompt_ids, samples, samples.mask, G)
    batch.advantages = mx.array(advantages)
    del samples, trainer
    model.train()

    for text in args.configs:
        overrides, limit = parse_config(text)
        chunk = overrides.pop("_chunk", None)
        _, trainer = grpo_step.make_trainer(model, tokenizer, args.model_dir, G, B, L, 1, overrides)
        if chunk is not None:
            trainer.chunk_tokens = chunk  # read when the loss is first traced, below
        mx.set_memory_limit(device_limit if limit == "none" else int((plan.peak_gb if limit == "plan" else float(limit)) * 1e9))
        seconds, peaks = timed(lambda t=trainer: mx.eval(t.loss_and_grads(batch, batch.old_logp)), args.reps)
        print(json.dumps({
            "phase": "loss", "config": text, "shape": args.shape, "device": str(mx.default_device()),
            "micro_batch_size": trainer.memory.micro_batch_size, "gradient_checkpointing": trainer.memory.gradient_checkpointing,
            "logits_chunk_tokens": trainer.chunk_tokens, "limit": limit, "seconds": seconds,
            "peak_memory_gb": peaks, "plan_peak_estimate_gb": round(plan.peak_gb, 3),
        }), flush=True)
        del trainer
        mx.set_memory_limit(device_limit)


if __name__ == "__main__":
    main()
