"""Peak memory of one SFT training step with loss_type nll and with chunked_nll, on a model with
Qwen's 151,936-token vocabulary at 2,048 tokens.

    python bench/chunked_nll.py [--size tiny|small] [--tokens 2048] [--vocab 151936] [--json OUT.json]

The model is a random-weight Qwen3 of worker/runtime/make_model.py's --size shapes (tiny: hidden
64, 2 blocks; small: hidden 256, 4 blocks; float32) with its vocabulary widened to --vocab (tied
embedding, as Qwen3's small models); the rows are tokenised by the tiny model's tokenizer (ids
below 1,024: the targets' values do not change the memory). Each loss type trains one step of
LoRA (every block, rank 8) on one row of --tokens tokens, compiled as a job runs it
(worker/kinds/supervised_trainer.py Trainer.step), after a warm-up step; printed per loss type:
the step's peak memory (mx.reset_peak_memory before it, mx.get_peak_memory after), its seconds
and loss, and the logits' size, tokens x vocab x 4 bytes. One JSON line each, and the ratio.
"""

import argparse
import json
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
from worker.kinds.sft_job import CHUNK, SFTTrainer  # noqa: E402
from worker.runtime.adapter_layers import attach_adapter, remove_adapter_layers  # noqa: E402
from worker.runtime.make_model import SIZES, build_model, make_model  # noqa: E402
from worker.runtime.train_core import TrainState  # noqa: E402


def step(model, tokenizer, rows: list[dict], loss_type: str, tokens: int) -> dict:
    spec = SFTJobCreate(model_id="bench", dataset=rows, config={
        "loss_type": loss_type, "batch_size": 1, "iters": 2, "max_seq_length": tokens, "lora_layers": -1,
        "lora_rank": 8, "learning_rate": 1e-5})
    mx.random.seed(0)
    attach_adapter(model, spec.config, "lora")
    trainer = SFTTrainer(model, tokenizer, spec, rows, None)
    state = TrainState()
    trainer.step(state)  # the warm-up: the compile
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    metrics = trainer.step(state)
    seconds = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    remove_adapter_layers(model)
    return {"loss_type": loss_type, "peak_memory_gb": round(peak / 1e9, 3), "step_s": round(seconds, 2),
            "loss": round(metrics["loss"], 6)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        _, tokenizer = mlx_lm.load(str(make_model(Path(d) / "tiny", size="tiny")))
    config = dict(SIZES[args.size], vocab_size=args.vocab)
    model = build_model(config, seed=0)
    model.eval()
    words = "the cat reads a book quickly and the dog runs to the river "
    rows = [{"text": words * (args.tokens // 4)}]  # over --tokens tokens: cut to exactly --tokens
    shape = {"model": f"qwen3 {args.size} shapes (hidden {config['hidden_size']}, {config['num_hidden_layers']} blocks), "
                      f"vocab {args.vocab}", "tokens": args.tokens,
             "logits_gb": round(args.tokens * args.vocab * 4 / 1e9, 3), "chunk": CHUNK}
    results = [{**shape, **step(model, tokenizer, rows, loss_type, args.tokens)} for loss_type in ("nll", "chunked_nll")]
    for r in results:
        print(json.dumps(r), flush=True)
    summary = {"peak_memory_ratio": round(results[0]["peak_memory_gb"] / results[1]["peak_memory_gb"], 2),
               "loss_difference": abs(results[0]["loss"] - results[1]["loss"])}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, **summary}, indent=2))


if __name__ == "__main__":
    main()
