"""Seconds per SFT step of an uneven pair (one rank slowed) with even and with speed-weighted
shares (worker/runtime/gang_group.py), over loopback (ring backend), in interleaved rounds.

    python bench/gang_uneven.py MODEL_DIR [--batch-size 8] [--length 64] [--steps 6] [--warmup 2]
                                          [--rounds 2] [--slow-s-per-row 0.25]

Rank 1 is slowed by gang_group's sleep hook (MTQ_GANG_SLOW_S_PER_ROW: it sleeps that long per
row of its local work, as a slower Mac would take longer), rank 0 is not. Each round runs the
pair once with even shares (every other row) and once with shares by measured speed, in turn,
so that the machine's load falls on both alike. Prints one JSON line per run (rank 0's median
step seconds after the warm-up, and the rows each rank took in the last step), then a summary:
  even_step_s, speed_step_s   the medians over the rounds
  speedup                     even_step_s / speed_step_s

No Redis, rq or HTTP: MLX, mlx_lm and the trainer modules only.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import run_ranks, sft_trainer  # noqa: E402 (its OpenBLAS re-exec first)

from worker.runtime import gang_group as gang  # noqa: E402
from worker.runtime.train_core import TrainState  # noqa: E402


def run_rank(args, part: gang.Gang) -> dict:
    """This rank's steps: their median seconds after the warm-up, and the last step's rows per rank."""
    _, trainer = sft_trainer(args, part)
    state, times = TrainState(), []
    for _ in range(args.warmup + args.steps):
        metrics = trainer.step(state)
        times.append(metrics["step_time"])
    return {"step_s": statistics.median(times[args.warmup:]),
            "rows": [int(metrics[f"gang/rows_rank{r}"]) for r in range(part.size)]}


def pair(args, shares: str) -> dict:
    """One run of the pair: rank 0 as is, rank 1 slowed."""
    slowed = lambda rank: {**os.environ, "MTQ_GANG_SLOW_S_PER_ROW": str(args.slow_s_per_row if rank else 0)}  # noqa: E731
    return run_ranks(2, ["--shares", shares], slowed)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slow-s-per-row", type=float, default=0.25)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank process (started by the bench itself)
    parser.add_argument("--hostfile", help=argparse.SUPPRESS)
    parser.add_argument("--shares", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        part = gang.join(args.rank, json.loads(Path(args.hostfile).read_text()), "ring", args.shares == "speed")
        print(json.dumps(run_rank(args, part)), flush=True)
        return
    runs = {"even": [], "speed": []}
    for i in range(args.rounds):
        for shares in runs:
            out = pair(args, shares)
            runs[shares].append(out["step_s"])
            print(json.dumps({"round": i, "shares": shares, "step_s": round(out["step_s"], 4), "rows": out["rows"]}),
                  flush=True)
    even, speed = statistics.median(runs["even"]), statistics.median(runs["speed"])
    print(json.dumps({"model": args.model, "batch_size": args.batch_size, "length": args.length,
                      "slow_s_per_row": args.slow_s_per_row, "rounds": args.rounds, "even_step_s": round(even, 4),
                      "speed_step_s": round(speed, 4), "speedup": round(even / speed, 3)}))


if __name__ == "__main__":
    main()
