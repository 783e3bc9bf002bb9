"""Trainer steps of two versions of the code, same model, same shapes: for before/after figures
measured on one machine in one sitting (step times drift between sessions on a shared GPU).

    git archive 1aecfa7 worker shared | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    for shape in 16,4,256 8,4,128; do for code in /tmp/old . /tmp/old .; do
        python bench/trainer_versions.py $code MODEL_DIR $shape; done; done

One shape per process: on the H200, this code's G8 B4 L128 steps took 2.3-2.5 s when run after
G16 B4 L256 in the same process, and a step took 1.80 s in a process of its own in another
sitting (a hint of an order effect, not yet measured side by side).

CODE_ROOT is a tree holding `worker/` and `shared/` (this repository, or an older commit's).
Prints one JSON line per shape G,B,L: median step seconds (and each timed step), sampled
tokens per second, the sampling phase's seconds, and peak memory. EOS is off, every row is decoded
to full length.
"""

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

PROMPTS = ["What is 2+2?", "Say hello.", "Name a prime number.", "Write a haiku about rain.",
           "Count to five.", "What colour is the sky?", "Spell 'queue'.", "Translate 'cat' to French."]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("code_root")
    ap.add_argument("model_dir")
    ap.add_argument("shapes", nargs="+", metavar="G,B,L")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="steps not timed (compilation)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.code_root).resolve()))

    import mlx.core as mx
    import mlx_lm

    from shared.schemas import JobCreate
    from worker.kinds.grpo import GRPOTrainer

    try:  # this tree's modules
        from worker.rewards.scorer import build_scorer
        from worker.runtime.adapter_layers import attach_adapter as attach_lora
        from worker.runtime.train_core import TrainState
    except ImportError:  # an older commit's (before worker/runtime/train_core.py)
        from worker.kinds.grpo import TrainState
        from worker.rewards import build_scorer
        from worker.runtime.models import attach_lora

    model, tokenizer = mlx_lm.load(args.model_dir)
    tokenizer.eos_token_ids = []
    default_limit = mx.get_memory_limit()
    for shape in args.shapes:
        G, B, L = (int(x) for x in shape.split(","))
        mx.set_memory_limit(default_limit)  # a newer trainer sets its own; an older one none
        config = {"group_size": G, "batch_size": B, "max_completion_len": L, "iters": args.steps + args.warmup}
        spec = JobCreate.model_validate({"model_id": args.model_dir, "prompts": (PROMPTS * 64)[:B], "config": config})
        mx.random.seed(spec.config.seed)
        attach_lora(model, spec.config)
        trainer = GRPOTrainer(model, tokenizer, spec, build_scorer(spec, "bench"))
        state = TrainState()
        metrics = [trainer.step(state, lambda: False)[0] for _ in range(args.steps + args.warmup)][args.warmup:]
        tokens_per_s = statistics.median(m["tokens_per_second"] for m in metrics)
        print(json.dumps({
            "code": args.code_root, "shape": shape, "device": str(mx.default_device()),
            "step_s": round(statistics.median(m["step_time"] for m in metrics), 3),
            "steps": [round(m["step_time"], 3) for m in metrics],
            "tokens_per_s": round(tokens_per_s), "sampling_s": round(G * B * L / tokens_per_s, 3),
            "peak_memory_gb": round(max(m["peak_memory_gb"] for m in metrics), 3),
        }), flush=True)
        del trainer
        gc.collect()
        mx.clear_cache()


if __name__ == "__main__":
    main()
