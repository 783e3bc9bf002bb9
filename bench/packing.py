"""Trained tokens per second of SFT steps packed (the config's `packing`) against the same steps
unpacked (each micro-batch right-padded to its longest row), on rows of mixed length.

    python bench/packing.py MODEL_DIR [--rows 64] [--batch-size 8] [--max-seq-length 512] [--long-share 0.25]
                           [--steps 6] [--rounds 3] [--pack-to-max] [--json OUT.json]

The dataset: --rows text rows of mixed length (seeded): a --long-share of them long (a half to
all of --max-seq-length words, cut to --max-seq-length tokens), the rest short (a twentieth to a
quarter of it), as chat and instruction data mostly are. The trainers (worker/kinds/sft_job.py
SFTTrainer, LoRA rank 8 on every layer) take the same rows at each step (the same seed): `unpacked`, `packed` (as a job
packs: sequences as long as the micro-batch's longest row) and, with --pack-to-max,
`packed_to_max` (sequences of max_seq_length positions, as TRL packs). Each round builds them,
runs --steps steps of each once (a compile of every batch shape they meet) and then times the
same --steps steps again; its figure is trained tokens over the timed seconds. The rounds take
the trainers in turn, in reversed order every other round (a loaded machine's drift hits all
alike), and each packed one's ratio to unpacked is printed per round with its min / median /
max. Also printed: the padding each way (the share of the batches' positions that are no row's
token) and the last timed step's loss each way, which must agree.

Imports MLX, mlx_lm and the project's trainer modules only, like bench/train_step.py.
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402

from shared.train_specs import SFTJobCreate  # noqa: E402
from worker.kinds.sft_job import SFTTrainer  # noqa: E402
from worker.runtime.adapter_layers import attach_adapter, remove_adapter_layers  # noqa: E402
from worker.runtime.train_core import TrainState, batch_rows  # noqa: E402

WORDS = "red blue green stone river cloud apple tree house car road sun moon star bird fish".split()


def mixed_rows(n: int, max_len: int, long_share: float, seed: int = 0) -> list[dict]:
    """n text rows, a long_share of max_len / 2 to max_len words, the rest of max_len / 20 to max_len / 4."""
    rnd = random.Random(seed)
    lengths = [rnd.randint(max_len // 2, max_len) if rnd.random() < long_share else rnd.randint(max_len // 20, max_len // 4)
               for _ in range(n)]
    return [{"text": " ".join(rnd.choices(WORDS, k=k))} for k in lengths]


def padding_share(trainer: SFTTrainer, steps: int) -> float:
    """Padding's share of the positions of the batches of `steps` steps."""
    cfg, tokens, positions = trainer.cfg, 0, 0
    for step in range(steps):
        for ids in batch_rows(len(trainer.train_rows), cfg.batch_size, step, cfg.grad_accumulation_steps, cfg.seed):
            arrays, _ = trainer.arrays(ids, trainer.train_rows)
            positions += arrays[0].size
            tokens += sum(len(trainer.train_tok.tokens[i]) - 1 for i in ids)
    return 1 - tokens / positions


def run(model, tokenizer, rows: list[dict], variant: str, args) -> dict:
    config = {"lora_layers": -1, "lora_rank": 8, "lora_alpha": 20.0, "learning_rate": 1e-5, "batch_size": args.batch_size,
              "iters": 2 * args.steps, "max_seq_length": args.max_seq_length, "packing": variant != "unpacked"}
    spec = SFTJobCreate(model_id="bench", dataset=rows, config=config)
    mx.random.seed(0)
    attach_adapter(model, spec.config, "lora")
    trainer = SFTTrainer(model, tokenizer, spec, rows, None)
    if variant == "packed_to_max":
        trainer.pack_to = args.max_seq_length
    state = TrainState()
    for _ in range(args.steps):  # every batch shape of the timed steps compiled
        trainer.step(state)
    state = TrainState()
    t0 = time.perf_counter()
    metrics = [trainer.step(state) for _ in range(args.steps)]
    seconds = time.perf_counter() - t0
    out = {"tokens_per_s": state.num_tokens / seconds, "loss": metrics[-1]["loss"],
           "padding": padding_share(trainer, args.steps)}
    remove_adapter_layers(model)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="an mlx_lm model directory")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-seq-length", type=int, default=512)
    p.add_argument("--long-share", type=float, default=0.25, help="the share of long rows (0: all short)")
    p.add_argument("--pack-to-max", action="store_true", help="also pack into sequences of max_seq_length positions")
    p.add_argument("--steps", type=int, default=6, help="timed steps per round (run once untimed first)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="OUT", help="also write the results, with the device, to this JSON file")
    args = p.parse_args()
    model, tokenizer = mlx_lm.load(args.model)
    rows = mixed_rows(args.rows, args.max_seq_length, args.long_share)
    variants = ["unpacked", "packed"] + (["packed_to_max"] if args.pack_to_max else [])
    rounds = []
    for k in range(args.rounds):
        r = {v: run(model, tokenizer, rows, v, args) for v in (variants if k % 2 == 0 else variants[::-1])}
        for v in variants[1:]:
            r[v]["ratio"] = r[v]["tokens_per_s"] / r["unpacked"]["tokens_per_s"]
        rounds.append(r)
        print(json.dumps({"round": k, **{v: {key: round(x, 4) for key, x in r[v].items()} for v in variants}}), flush=True)
    summary = {}
    for v in variants:
        summary[v] = {"tokens_per_s_median": round(statistics.median(r[v]["tokens_per_s"] for r in rounds)),
                      "padding": round(rounds[0][v]["padding"], 3)}
        if v != "unpacked":
            ratios = [r[v]["ratio"] for r in rounds]
            summary[v].update(ratio_min=round(min(ratios), 3), ratio_median=round(statistics.median(ratios), 3),
                              ratio_max=round(max(ratios), 3))
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "device": str(mx.default_device()), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "rows": args.rows, "batch_size": args.batch_size, "max_seq_length": args.max_seq_length,
            "long_share": args.long_share, "steps": args.steps,
            "summary": summary, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
