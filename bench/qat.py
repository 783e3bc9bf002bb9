"""Quantization-aware training against none: the same SFT job (the job's trainer, worker/kinds/sft_job.py)
with and without QAT, each adapter then fused and quantized as `mtq export --quantize` writes it
(mlx_lm's fuse and quantize_model), and the eval loss of each quantized model on held-out rows.

    python bench/qat.py [MODEL_DIR] [--bits 4] [--iters 80] [--lr 1e-2] [--seed 0] [--fine-tune-type lora|full]

Without MODEL_DIR, the tiny random model (worker/runtime/make_model.py, final_norm 16 so that an
adapter can move its logits) is made in a temporary directory. The rows are one template ("W is
green and round and good") over 8 training words; the eval rows are 4 other words. Prints one JSON
line per arm (qat false / true): the eval loss of the trained model unquantized and quantized, and
last a line with `qat_gain`: the quantized eval loss without QAT minus with it (above 0: QAT's
quantized model is better).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_unflatten  # noqa: E402
from mlx_lm.utils import quantize_model  # noqa: E402

from shared.train_specs import SFTJobCreate  # noqa: E402
from worker.kinds.sft_job import SFTTrainer  # noqa: E402
from worker.runtime.adapter_layers import attach_adapter  # noqa: E402
from worker.runtime.make_model import make_model  # noqa: E402
from worker.runtime.train_core import TrainState  # noqa: E402

WORDS = ("apples", "rivers", "stones", "clouds", "trees", "boats", "songs", "birds")
EVAL_WORDS = ("houses", "lamps", "rings", "coins")


def rows(words) -> list[dict]:
    return [{"prompt": f"Tell me about {w}.", "completion": f"{w} is green and round and good"} for w in words]


def arm(model_dir: Path, args, qat: bool) -> dict:
    model, tokenizer, config = mlx_lm.load(str(model_dir), return_config=True)
    train, valid = rows(WORDS), rows(EVAL_WORDS)
    spec = SFTJobCreate(model_id="bench", dataset=train, config={
        "iters": args.iters, "batch_size": 4, "learning_rate": args.lr, "lora_layers": -1, "lora_rank": 8,
        "lora_alpha": 16.0, "fine_tune_type": args.fine_tune_type, "seed": args.seed, "val_batches": -1,
        "qat_enable": qat, "qat_bits": args.bits, "qat_start_step": 0})
    mx.random.seed(args.seed)
    attach_adapter(model, spec.config, args.fine_tune_type)
    trainer = SFTTrainer(model, tokenizer, spec, train, valid)
    state, t0 = TrainState(), time.perf_counter()
    for _ in range(args.iters):
        last = trainer.step(state)
    seconds = time.perf_counter() - t0
    spec.config.qat_enable = False  # evaluate the weights themselves, then the quantized model
    unquantized = trainer.evaluate()["val_loss"]
    fused = [(name, m.fuse()) for name, m in model.named_modules() if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    quantize_model(model, config, group_size=64, bits=args.bits, mode="affine")
    return {"qat": qat, "bits": args.bits, "fine_tune_type": args.fine_tune_type, "iters": args.iters,
            "train_loss": round(last["loss"], 4), "eval_loss": round(unquantized, 4),
            "eval_loss_quantized": round(trainer.evaluate()["val_loss"], 4), "train_s": round(seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5, 6, 8])
    p.add_argument("--iters", type=int, default=80)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fine-tune-type", choices=["lora", "full"], default="lora")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else make_model(Path(tmp) / "tiny", final_norm=16.0)
        results = [arm(model_dir, args, qat) for qat in (False, True)]
    for r in results:
        print(json.dumps(r))
    print(json.dumps({"qat_gain": round(results[0]["eval_loss_quantized"] - results[1]["eval_loss_quantized"], 4)}))


if __name__ == "__main__":
    main()
