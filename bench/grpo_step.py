"""Seconds per GRPO step against a lower bound measured in the same run.

    python bench/grpo_step.py MODEL_DIR --group-size 4 --batch-size 2 --max-completion-len 64 [--steps 8] [--set beta=0.04 ...]

    python bench/grpo_step.py MODEL_DIR --sweep 8,4,128 16,4,256 8,2,1024 [--set ...]

    --rounds N: everything N times in turn in this process (each round a fresh job: its warm-up
    steps, then its timed steps), the figures and ratios then given per round and as min /
    median / max (a figure from one round is as noisy as the machine: docs/performance.md)

Prints one JSON line (a line a round, then the summary, with --rounds):
  step_s          median seconds of a whole trainer step (sampling, rewards, loss, update,
                  metrics), after --warmup steps
  tokens_per_s    sampled tokens per second during the sampling phase
  peak_memory_gb  the largest step's peak memory
  lower_bound_s   mlx_lm's own batch_generate of the same B*G rows and lengths, plus one
                  forward+backward of the same batch (medians)
  ratio           step_s / lower_bound_s
  micro_batch_size, gradient_checkpointing, estimated_peak_gb: the trainer's memory plan
EOS is switched off on both sides so every completion runs to max_completion_len.

--sweep G,B,L ...: the trainer alone (no lower bound) at each group size x batch size x
completion length, one JSON line each (each round), then a table of rows x length with step
time (min / median / max of the rounds), measured peak memory and the estimate the
micro-batch was chosen from.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from shared.schemas import JobCreate  # noqa: E402
from worker.kinds.grpo import GRPOTrainer  # noqa: E402
from worker.rewards.scorer import build_scorer  # noqa: E402
from worker.runtime.adapter_layers import attach_adapter  # noqa: E402
from worker.runtime.logprobs import as_item, prompt_token_ids  # noqa: E402
from worker.runtime.projection_groups import fuse_shared_inputs  # noqa: E402
from worker.runtime.train_core import TrainState  # noqa: E402

PROMPTS = ["What is 2+2?", "Say hello.", "Name a prime number.", "Write a haiku about rain.",
           "Count to five.", "What colour is the sky?", "Spell 'queue'.", "Translate 'cat' to French."]


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def lower_bound(model, tokenizer, prompt_ids, group_size, length, temperature, reps):
    rows = [p for p in prompt_ids for _ in range(group_size)]
    sampler = make_sampler(temp=temperature)
    gen_times, fb_times = [], []
    width = max(len(p) for p in rows) + length
    inputs = mx.array([[0] * (width - len(p) - length) + p + [1] * length for p in rows])

    def loss(m):
        logits = m(inputs)[:, :-1].astype(mx.float32)
        return nn.losses.cross_entropy(logits, inputs[:, 1:]).mean()

    value_and_grad = nn.value_and_grad(model, loss)
    for _ in range(reps):
        t = time.perf_counter()
        out = mlx_lm.batch_generate(model, tokenizer, rows, max_tokens=length, sampler=sampler, return_token_ids=True)
        gen_times.append(time.perf_counter() - t)
        assert all(len(ids) == length for ids in out.token_ids), "a row stopped early"
        t = time.perf_counter()
        mx.eval(value_and_grad(model))
        fb_times.append(time.perf_counter() - t)
    return statistics.median(gen_times), statistics.median(fb_times)


def make_trainer(model, tokenizer, model_dir, group_size, batch_size, length, iters, overrides):
    """The trainer of a fresh job (fresh LoRA) on the loaded model, and the job's spec."""
    config = {"group_size": group_size, "batch_size": batch_size, "max_completion_len": length, "iters": iters}
    config.update(overrides)
    spec = JobCreate.model_validate({"model_id": model_dir, "prompts": (PROMPTS * 64)[:batch_size], "config": config})
    mx.random.seed(spec.config.seed)
    attach_adapter(model, spec.config)
    return spec, GRPOTrainer(model, tokenizer, spec, build_scorer(spec, "bench"))


def run_trainer(model, tokenizer, model_dir, group_size, batch_size, length, steps, warmup, overrides):
    """Steps of a fresh job (fresh LoRA) on the loaded model; returns its spec, trainer and metrics."""
    spec, trainer = make_trainer(model, tokenizer, model_dir, group_size, batch_size, length, steps + warmup, overrides)
    state = TrainState()
    metrics = [trainer.step(state, lambda: False)[0] for _ in range(steps + warmup)][warmup:]
    return spec, trainer, metrics


def summary(metrics, trainer, group_size, batch_size, length) -> dict:
    plan = trainer.memory
    return {
        "group_size": group_size, "batch_size": batch_size, "max_completion_len": length,
        "step_s": round(statistics.median(m["step_time"] for m in metrics), 4),
        "tokens_per_s": round(statistics.median(m["tokens_per_second"] for m in metrics), 1),
        "peak_memory_gb": round(max(m["peak_memory_gb"] for m in metrics), 4),
        "micro_batch_size": plan.micro_batch_size, "gradient_checkpointing": plan.gradient_checkpointing,
        "estimated_peak_gb": round(plan.peak_gb, 4), "dense_decode_gb": round(plan.dense_decode_gb, 4),
    }


def spread(values) -> str:
    """min / median / max, or the one value of a single round."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def sweep(model, tokenizer, args, overrides):
    shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.sweep]
    runs = {shape: [] for shape in shapes}
    for r in range(args.rounds):
        for G, B, L in shapes:
            _, trainer, metrics = run_trainer(model, tokenizer, args.model_dir, G, B, L, args.steps, args.warmup, overrides)
            runs[G, B, L].append(summary(metrics, trainer, G, B, L))
            print(json.dumps({"model": Path(args.model_dir).name, "device": str(mx.default_device()), "round": r,
                              **runs[G, B, L][-1]}), flush=True)
            del trainer
            gc.collect()
            mx.clear_cache()
    print("\n| G | B | L | rows | micro-batch | checkpointing | step s | peak GB | estimate GB |\n|---|---|---|---|---|---|---|---|---|")
    for (G, B, L), rounds in runs.items():
        r = rounds[-1]
        print(f"| {G} | {B} | {L} | {G * B} | {r['micro_batch_size']} | {r['gradient_checkpointing']} "
              f"| {spread([x['step_s'] for x in rounds])} | {max(x['peak_memory_gb'] for x in rounds):.3f} "
              f"| {r['estimated_peak_gb']:.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-completion-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps not timed (compilation)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="job config overrides")
    ap.add_argument("--sweep", nargs="+", metavar="G,B,L", help="trainer only, at each group,batch,length")
    ap.add_argument("--rounds", type=int, default=1, help="measure everything this many times in turn")
    args = ap.parse_args()
    overrides = {k: parse_value(v) for k, v in (kv.split("=", 1) for kv in args.set)}

    model, tokenizer = mlx_lm.load(args.model_dir)
    fuse_shared_inputs(model)  # as a worker loads it (worker/runtime/models.py)
    tokenizer.eos_token_ids = []  # both sides decode every row to full length
    default_memory_limit = mx.get_memory_limit()
    if args.sweep:
        return sweep(model, tokenizer, args, overrides)
    lines = []
    for r in range(args.rounds):
        spec, trainer, metrics = run_trainer(
            model, tokenizer, args.model_dir, args.group_size, args.batch_size, args.max_completion_len,
            args.steps, args.warmup, overrides,
        )
        result = summary(metrics, trainer, args.group_size, args.batch_size, args.max_completion_len)
        del trainer
        gc.collect()
        mx.set_memory_limit(default_memory_limit)  # the trainer set its job's limit: not the lower bound's
        prompt_ids = [prompt_token_ids(tokenizer, as_item(p), spec.config.use_chat_template) for p in spec.prompts]
        gen_s, fb_s = lower_bound(model, tokenizer, prompt_ids, args.group_size, args.max_completion_len,
                                  spec.config.temperature, max(args.steps // 2, 3))
        bound = gen_s + fb_s
        lines.append({
            "model": Path(args.model_dir).name, "device": str(mx.default_device()),
            "ld_preload": os.environ.get("LD_PRELOAD", ""), **result,
            "lower_bound_s": round(bound, 4), "lower_bound_generate_s": round(gen_s, 4),
            "lower_bound_fwd_bwd_s": round(fb_s, 4), "ratio": round(result["step_s"] / bound, 3),
        })
        print(json.dumps({"round": r, **lines[-1]} if args.rounds > 1 else lines[-1]), flush=True)
    if args.rounds > 1:
        steps, ratios = [x["step_s"] for x in lines], [x["ratio"] for x in lines]
        print(json.dumps({"rounds": args.rounds, "step_s": statistics.median(steps), "step_s_by_round": steps,
                          "lower_bound_s": statistics.median(x["lower_bound_s"] for x in lines),
                          "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                          "ratio_by_round": ratios}))


if __name__ == "__main__":
    main()
