"""The multi-turn decode (worker/decode/episodes.py) against a single-turn decode of the same rows
and tokens, and its prefill of appended turns against re-running the whole conversation.

    python3 bench/episodes.py MODEL_DIR [--rows 16] [--turns 4] [--eos-every 24] [--appended 24]
                              [--max-tokens 96] [--prompt-len 24] [--history 160] [--rounds 5]
                              [--lora-layers 4] [--json OUT]

Each round, interleaved in this process:
  episodes  sample_episodes of --rows rows (one prompt each, --prompt-len tokens), temperature 1,
            every --eos-every-th token id ending a turn; every turn that ends so is answered by
            --appended scripted tokens until --turns turns; --max-tokens model tokens per episode
  single    sample() of the same rows (group size 1), EOS off, for as many tokens per row as the
            episodes held on average after their prompts (drawn and appended): the same total
            tokens, all drawn one position at a time
  append    one prefill of --appended tokens into every row's KV buffers after --history tokens
            (what the multi-turn decode does once a turn is answered)
  rerun     one forward pass of all --history + --appended tokens of every row (what a decode
            without a KV cache across turns would run instead)

Printed: each one's median seconds and the ratios episodes / single and append / rerun, median
with their min and max over the rounds. On Linux CPU the process re-executes itself with the
system OpenBLAS (worker/supervisor/openblas.py).
"""

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

from worker.decode.draw import SamplingParams  # noqa: E402
from worker.decode.episodes import Limits, _Buffers, make_episode_step, sample_episodes  # noqa: E402
from worker.decode.sampling import make_decode_step, sample  # noqa: E402
from worker.runtime.logprobs import PaddingMaskCache, left_pad  # noqa: E402
from worker.runtime.projection_groups import fuse_shared_inputs  # noqa: E402

PAD = 0


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--eos-every", type=int, default=24)
    ap.add_argument("--appended", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--history", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lora-layers", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()

    model = mlx_lm.load(args.model)[0]
    fuse_shared_inputs(model)
    model.freeze()
    mx.random.seed(0)
    linear_to_lora_layers(model, args.lora_layers, {"rank": 8, "scale": 16.0, "dropout": 0.0})
    model.eval()
    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, args.prompt_len - i % 3).tolist() for i in range(args.rows)]
    eos = list(range(0, vocab, args.eos_every))
    params = SamplingParams(args.max_tokens)
    limits = Limits(args.turns, args.max_tokens + args.turns * args.appended)
    episode_step = make_episode_step(model, params, eos, PAD)
    appended = rng.integers(1, vocab, args.appended).tolist()

    def episodes(pool):
        return sample_episodes(model, episode_step, prompts, params, limits, eos, PAD, mx.random.key(1),
                               lambda r, tokens: appended, pool)

    history = [rng.integers(1, vocab, args.history).tolist() for _ in range(args.rows)]
    chunk = mx.array([appended] * args.rows)

    def append():
        buffers = _Buffers(args.rows, len(model.layers), args.history + args.appended)
        tokens, pad = left_pad(history, pad_id=PAD)
        mx.eval(buffers.prefill(model, tokens, pad), buffers.keys)
        seconds, logits = timed(lambda: mx.eval(buffers.prefill(model, chunk, mx.zeros((args.rows,), mx.int32))))
        return seconds

    def rerun():
        tokens, pad = left_pad([h + appended for h in history], pad_id=PAD)
        return timed(lambda: mx.eval(model.model(tokens, cache=[PaddingMaskCache(pad) for _ in model.layers])))[0]

    times = {k: [] for k in ("episodes", "single", "append", "rerun")}
    with ThreadPoolExecutor(4) as pool:
        episodes(pool)  # warm-up: compiles
        seconds, result = timed(lambda: episodes(pool))
        model_tokens = int(np.array(result.samples.mask).sum())
        per_row = max(1, round((model_tokens + result.appended_tokens) / args.rows))
        single_params = SamplingParams(per_row)
        single_step = make_decode_step(model, single_params, [], PAD)
        sample(model, single_step, prompts, 1, single_params, [], mx.random.key(1))  # warm-up
        append(), rerun()
        for _ in range(args.rounds):
            times["episodes"].append(timed(lambda: episodes(pool))[0])
            times["single"].append(timed(lambda: sample(model, single_step, prompts, 1, single_params, [],
                                                        mx.random.key(1)))[0])
            times["append"].append(append())
            times["rerun"].append(rerun())
    turns = [len(t) for t in result.turns]
    record = {"rows": args.rows, "model_tokens": model_tokens, "single_tokens_per_row": per_row,
              "appended_tokens": result.appended_tokens, "turns_mean": float(np.mean(turns)),
              "decode_steps": result.decode_steps,
              **{f"{k}_s": statistics.median(v) for k, v in times.items()}}
    print(f"episodes: {args.rows} rows, {model_tokens} model tokens, {result.appended_tokens} appended, "
          f"{np.mean(turns):.2f} turns/row, {result.decode_steps} decode steps")
    for k, v in times.items():
        print(f"  {k:9s} median {statistics.median(v):.4f} s  (min {min(v):.4f}, max {max(v):.4f})")
    for a, b in (("episodes", "single"), ("append", "rerun")):
        ratios = [x / y for x, y in zip(times[a], times[b])]
        record[f"{a}/{b}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        print(f"  {a} / {b}: median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f}) "
              f"over {args.rounds} interleaved rounds")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
