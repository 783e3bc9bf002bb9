"""Seconds per SFT step on a gang of N ranks (worker/runtime/gang_group.py) against one worker, and the
all-reduce's share of the gang's step, measured in one run over loopback (ring backend).

    python bench/distributed.py MODEL_DIR [--ranks 2] [--batch-size 8] [--length 128] [--steps 6] [--warmup 2]

It runs the SFT trainer (worker/kinds/sft_job.py, LoRA) on the same global batch alone, then as
--ranks processes joined by mx.distributed's ring backend on 127.0.0.1, each taking every
N-th row. Prints one JSON line:
  solo_step_s        median seconds of a step on one process
  gang_step_s        median seconds of a step on the gang (rank 0's)
  allreduce_s        median seconds of summing the step's gradient tree across the ranks alone
                     (worker/runtime/gang_group.py sum_tree, its size: the LoRA gradients), same run
  allreduce_share    allreduce_s / gang_step_s
  speedup            solo_step_s / gang_step_s
On a machine with fewer cores than ranks x MLX's threads (the 2-core CI box), the ranks share
the cores and ring's socket threads busy-poll: the figure is the all-reduce's overhead, not a
speed-up; across Macs each rank has its own machine (docs/distributed.md).

No Redis, rq or HTTP: MLX, mlx_lm and the trainer modules only.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402

from shared.train_specs import SFTJobCreate  # noqa: E402
from worker.kinds.sft_job import SFTTrainer  # noqa: E402
from worker.runtime import gang_group as gang  # noqa: E402
from worker.runtime.adapter_layers import attach_adapter  # noqa: E402
from worker.runtime.train_core import TrainState  # noqa: E402


def sft_trainer(args, part: gang.Gang):
    """(model, SFT trainer) on args.batch_size * 4 rows of about args.length tokens, LoRA on every
    layer, as `part`'s rank (bench/gang_uneven.py uses it too)."""
    model, tokenizer = mlx_lm.load(args.model)
    words = " ".join(["word"] * args.length)
    rows = [{"text": f"{i} {words}"} for i in range(args.batch_size * 4)]
    spec = SFTJobCreate(model_id="bench", dataset=rows, config=dict(
        batch_size=args.batch_size, max_seq_length=args.length + 8, lora_layers=-1, workers=part.size))
    mx.random.seed(0)
    attach_adapter(model, spec.config, "lora")
    trainer = SFTTrainer(model, tokenizer, spec, rows, None)
    trainer.gang = part
    return model, trainer


def run_ranks(n: int, extra: list[str] = (), env_of=lambda rank: os.environ) -> list[dict]:
    """This script (sys.argv plus `extra`) as n rank processes joined over loopback: each one's last JSON line."""
    hosts = [[f"127.0.0.1:{free_port()}"] for _ in range(n)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(hosts, f)
    ranks = [subprocess.Popen([sys.executable, sys.argv[0], *sys.argv[1:], "--rank", str(r), "--hostfile", f.name, *extra],
                              stdout=subprocess.PIPE, text=True, env=env_of(r)) for r in range(n)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in ranks]
    os.unlink(f.name)
    return outs


def run_rank(args, part: gang.Gang) -> dict:
    """This process's steps: their median time, and (in a gang) the all-reduce's alone."""
    model, trainer = sft_trainer(args, part)
    state, times = TrainState(), []
    for i in range(args.warmup + args.steps):
        times.append(trainer.step(state)["step_time"])
    grads = model.trainable_parameters()  # the gradient tree has the trainable parameters' shapes
    reduce_times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        mx.eval(part.sum_tree(grads))
        reduce_times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[args.warmup:]),
            "allreduce_s": statistics.median(reduce_times[args.warmup:]) if part.size > 1 else 0.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank process (started by the bench itself)
    parser.add_argument("--hostfile", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        result = run_rank(args, gang.join(args.rank, json.loads(Path(args.hostfile).read_text())))
        print(json.dumps(result), flush=True)
        return
    solo = run_rank(args, gang.SOLO)
    outs = run_ranks(args.ranks)
    g = outs[0]
    print(json.dumps({"model": args.model, "ranks": args.ranks, "batch_size": args.batch_size, "length": args.length,
                      "solo_step_s": round(solo["step_s"], 4), "gang_step_s": round(g["step_s"], 4),
                      "allreduce_s": round(g["allreduce_s"], 5),
                      "allreduce_share": round(g["allreduce_s"] / g["step_s"], 4),
                      "speedup": round(solo["step_s"] / g["step_s"], 3)}))


if __name__ == "__main__":
    main()
