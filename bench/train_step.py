"""Seconds per optimizer step of the supervised kinds against a lower bound measured in the same
run, and the SFT kind against `mlx_lm lora` on the same model, rows and batch.

    python bench/train_step.py MODEL_DIR [--kinds sft sft-full sft-qlora dpo dpo-full orpo kto ...] [--batch-size 4]
                               [--length 128] [--steps 8] [--warmup 2] [--quant-bits 4] [--uncompiled]
                               [--mlx-lm] [--rounds 1] [--json OUT.json]

Each kind's trainer (worker/kinds/sft_job.py, dpo_job.py, kto_job.py, reward_model_job.py) runs
on rows of --length tokens (SFT: batch_size rows; the preference kinds: batch_size pairs =
2 x batch_size rows, chosen and rejected in one padded batch; KTO: 2 x batch_size rows, half
of them desirable), 2 x batch_size examples, so
that the warm-up steps have seen every one (DPO's reference log-probs are computed at an
example's first step and kept, so the timed steps have none to compute: `reference_s` is what
a step of the first epoch adds, the reference forward of its batch).
`sft` is LoRA on the model as loaded; `sft-full` trains every transformer block's weights and
`sft-qlora` LoRA on a copy quantized to --quant-bits, each on a fresh copy made as a job makes
it (worker/runtime/models.py prepare_private); `dpo-full`, `orpo-full`, `kto-full` and
`reward-full` train every block's weights of such a copy too (their jobs take LoRA only: these
time a LoRA step against the full step of the same kind). Prints one JSON line per kind (and
writes them all to --json):
  step_s          median seconds of a whole trainer step (batch, loss, gradient, update, metrics),
                  compiled as the job runs it (worker/kinds/supervised_trainer.py make_step)
  uncompiled_step_s  (--uncompiled) the same trainer with its step not compiled
  lower_bound_s   median seconds of mlx_lm's default_loss forward+backward of the same padded
                  batch (the same token rows, the same trainable weights, no update, not compiled)
  ratio           step_s / lower_bound_s
  peak_memory_gb, tokens_per_s (trained tokens per second of a whole step)
  mlx_lm          (--mlx-lm, SFT only) `mlx_lm lora` in a child process on a data directory of the
                  same rows (train.jsonl), the same batch, LoRA shape and learning rate, run for
                  warmup + steps iterations with a report every iteration: its median
                  tokens_per_second and seconds per iteration over the steps after the warm-up,
                  and `speed_vs_mlx_lm` = its seconds per iteration / step_s (above 1: faster than mlx_lm)
  step_vs_full    (a kind listed with its -full variant) its step_s / the full step's
  --rounds N      every measurement N times, in turn (each kind, and in it ours, mlx_lm's, the
                  bound, ...): each figure is the median over the rounds, each ratio the median of
                  the rounds' ratios (a loaded machine's drift hits both sides of a ratio alike),
                  with each round's beside it (ratio_by_round, speed_vs_mlx_lm_by_round,
                  speed_vs_uncompiled_by_round, step_vs_full_by_round)

It imports MLX, mlx_lm (with transformers/tokenizers), numpy, pydantic and the project's
trainer modules only: no Redis, rq or HTTP libraries (tests/test_supervised_trainer.py checks),
so it runs on a machine that has just MLX's wheels (e.g. the H200: ../shared/gpu/README.md).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.tuner.trainer import default_loss  # noqa: E402

from shared.kinds import KINDS  # noqa: E402
from shared.train_specs import quantization  # noqa: E402
from worker.kinds.dpo_job import DPOTrainer  # noqa: E402
from worker.kinds.kto_job import KTOTrainer  # noqa: E402
from worker.kinds.reward_model_job import RewardTrainer  # noqa: E402
from worker.kinds.sft_job import SFTTrainer  # noqa: E402
from worker.runtime.adapter_layers import attach_adapter, remove_adapter_layers  # noqa: E402
from worker.runtime.models import prepare_private  # noqa: E402
from worker.runtime.projection_groups import fuse_shared_inputs  # noqa: E402
from worker.runtime.train_core import TrainState  # noqa: E402

# name -> (job kind, its trainer, fine_tune_type). Only SFT jobs take full (and qlora); a preference kind's
# or KTO's `-full` trains every block's own weights all the same (attach_adapter's full), on a private copy
# as SFT's does, for issue 41's "a LoRA step at most the full step's time" of each kind. Their reference
# (the model with its adapters off: here the weights at an example's first step) costs what LoRA's does.
VARIANTS = {"sft": ("sft", SFTTrainer, "lora"), "sft-full": ("sft", SFTTrainer, "full"),
            "sft-qlora": ("sft", SFTTrainer, "qlora"), "dpo": ("dpo", DPOTrainer, None),
            "dpo-full": ("dpo", DPOTrainer, "full"), "orpo": ("orpo", DPOTrainer, None),
            "orpo-full": ("orpo", DPOTrainer, "full"), "kto": ("kto", KTOTrainer, None),
            "kto-full": ("kto", KTOTrainer, "full"), "reward": ("reward", RewardTrainer, None),
            "reward-full": ("reward", RewardTrainer, "full")}


def rows_for(kind: str, n: int, length: int) -> list[dict]:
    words = " ".join(["word"] * length)
    if kind == "sft":
        return [{"text": f"{i} {words}"} for i in range(n)]
    half = " ".join(["word"] * (length // 2))
    if kind == "kto":  # as many rows as a preference kind's pairs have, half of them desirable
        return [{"prompt": f"{i // 2} {half}", "completion": f"{'yes' if i % 2 else 'no'} {half}", "label": i % 2 == 1}
                for i in range(2 * n)]
    return [{"prompt": f"{i} {half}", "chosen": f"yes {half}", "rejected": f"no {half}"} for i in range(n)]


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_for(fine_tune_type: str | None, shared, args):
    """The shared model for LoRA kinds; for full / qlora a private copy, as a job makes it."""
    if fine_tune_type not in ("full", "qlora"):
        return shared
    model, tokenizer, config = mlx_lm.load(args.model, lazy=True, return_config=True)
    quant = quantization(args.quant_bits, "affine") if fine_tune_type == "qlora" else None
    prepare_private(model, config, args.model, fine_tune_type, quant, max_gb=float("inf"))
    return model, tokenizer


LORA = {"lora_layers": -1, "lora_rank": 8, "lora_alpha": 20.0, "learning_rate": 1e-5}  # mlx_lm lora's defaults, all layers

# `mlx_lm lora` itself (its main(), as the command runs it) with a callback that prints its per-report figures.
MLX_LM_LORA = """
import json, sys
from mlx_lm import lora
from mlx_lm.tuner.callbacks import TrainingCallback
class Print(TrainingCallback):
    def on_train_loss_report(self, info):
        print("REPORT " + json.dumps(info), flush=True)
lora.get_reporting_callbacks = lambda *args, **kwargs: Print()  # what --report-to would make
sys.argv = ["mlx_lm.lora", *sys.argv[1:]]
lora.main()
"""


def mlx_lm_lora(model_dir: str, rows: list[dict], args) -> dict:
    """`mlx_lm lora` on the same rows, batch and LoRA: its median figures after the warm-up."""
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "data"
        data.mkdir()
        for split in ("train", "valid"):
            (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (Path(d) / "config.yaml").write_text(json.dumps({"lora_parameters": {"rank": LORA["lora_rank"], "scale": LORA["lora_alpha"],
                                                                               "dropout": 0.0}}))
        cmd = [sys.executable, "-c", MLX_LM_LORA, "--model", model_dir, "--train", "--data", str(data), "-c", str(Path(d) / "config.yaml"),
               "--batch-size", str(args.batch_size), "--iters", str(args.warmup + args.steps), "--num-layers", "-1",
               "--learning-rate", str(LORA["learning_rate"]), "--steps-per-report", "1", "--steps-per-eval", "100000",
               "--val-batches", "1", "--adapter-path", str(Path(d) / "adapter"), "--save-every", "100000"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"mlx_lm lora failed: {out.stderr[-2000:]}")
    reports = [json.loads(line[len("REPORT "):]) for line in out.stdout.splitlines() if line.startswith("REPORT ")]
    timed = reports[args.warmup:]
    return {"tokens_per_s": round(statistics.median(r["tokens_per_second"] for r in timed)),
            "step_s": round(statistics.median(1 / r["iterations_per_second"] for r in timed), 4)}


def time_steps(trainer, args) -> tuple[float, list[dict]]:
    """(median step seconds after the warm-up, the timed steps' metrics)."""
    state = TrainState()
    for _ in range(args.warmup):
        trainer.step(state)
    metrics = []
    return median_time(lambda: metrics.append(trainer.step(state)), args.steps), metrics


def prepare(name: str, shared, args) -> tuple[Callable[[], dict], Callable[[list[dict]], dict]]:
    """(one round of the variant's measurements, the variant's line from its rounds)."""
    kind, trainer_class, fine_tune_type = VARIANTS[name]
    model, tokenizer = model_for(fine_tune_type, shared, args)
    rows = rows_for(kind, args.batch_size * 2, args.length)
    config = {"batch_size": args.batch_size * (2 if kind == "kto" else 1), "iters": args.warmup + args.steps, **LORA}
    if fine_tune_type and kind == "sft":
        config.update(fine_tune_type=fine_tune_type, quant_bits=args.quant_bits)
    spec = KINDS[kind].spec_model.model_validate({"model_id": "bench", "dataset": rows, "config": config})

    def trainer(compiled: bool):
        mx.random.seed(0)
        attach_adapter(model, spec.config, fine_tune_type or "lora")
        made = trainer_class(model, tokenizer, spec, rows, None)
        made.compiled = compiled
        return made

    def lower_bound(trained) -> tuple[float, dict]:
        """mlx_lm's loss, forward+backward, on the same padded rows as step 0's batch."""
        (arrays, _) = trained.arrays(list(range(config["batch_size"])), trained.train_rows)
        inputs = arrays[0]
        tokens = mx.concatenate([inputs, inputs[:, -1:]], axis=1)
        lengths = mx.array([[1, inputs.shape[1]]] * inputs.shape[0])
        vg = nn.value_and_grad(model, lambda b, l: default_loss(model, b, l)[0])

        def fwd_bwd():
            loss, grads = vg(tokens, lengths)
            mx.eval(loss, grads)

        fwd_bwd()
        return median_time(fwd_bwd, args.steps), {"rows": int(inputs.shape[0]), "width": int(inputs.shape[1])}

    shape = {}

    def one_round() -> dict:
        r = {}
        if args.uncompiled:
            r["uncompiled_step_s"] = time_steps(trainer(False), args)[0]
        compiled = trainer(True)
        mx.reset_peak_memory()
        r["step_s"], metrics = time_steps(compiled, args)
        r["peak_memory_gb"] = mx.get_peak_memory() / 1e9
        r["tokens_per_s"] = statistics.median(m["tokens_per_second"] for m in metrics)
        r["lower_bound_s"], measured = lower_bound(compiled)
        shape.update(measured)
        if compiled.reference is not None:
            batch = list(range(config["batch_size"]))
            r["reference_s"] = median_time(lambda: compiled.reference_logps(batch, compiled.train_rows), args.steps)
        remove_adapter_layers(model)
        if args.mlx_lm and name == "sft":
            theirs = mlx_lm_lora(args.model, rows, args)
            r["mlx_lm_step_s"], r["mlx_lm_tokens_per_s"] = theirs["step_s"], theirs["tokens_per_s"]
        return r

    def line(rounds: list[dict]) -> dict:
        def median(key: str, digits: int = 4):
            return round(statistics.median(r[key] for r in rounds), digits)

        out = {"kind": name, **shape, **{k: (round(median(k)) if "tokens" in k else median(k)) for k in rounds[0]},
               **ratio("ratio", [r["step_s"] / r["lower_bound_s"] for r in rounds])}
        if args.mlx_lm and name == "sft":
            out.update(ratio("speed_vs_mlx_lm", [r["mlx_lm_step_s"] / r["step_s"] for r in rounds]))
        if args.uncompiled:
            out.update(ratio("speed_vs_uncompiled", [r["uncompiled_step_s"] / r["step_s"] for r in rounds]))
        return out

    return one_round, line


def ratio(key: str, values: list[float]) -> dict:
    """The median of the rounds' ratios, and each round's (their spread)."""
    return {key: round(statistics.median(values), 2), f"{key}_by_round": [round(x, 2) for x in values]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="an mlx_lm model directory")
    p.add_argument("--kinds", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--length", type=int, default=128, help="tokens per row (about)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps not timed (MLX CUDA compiles kernels on first use)")
    p.add_argument("--quant-bits", type=int, choices=[4, 8], default=4, help="sft-qlora's base quantization")
    p.add_argument("--rounds", type=int, default=1, help="repeat every measurement this many times, in turn (medians)")
    p.add_argument("--uncompiled", action="store_true", help="also time each trainer with its step not compiled")
    p.add_argument("--mlx-lm", action="store_true", help="also run `mlx_lm lora` on the SFT rows (sft only)")
    p.add_argument("--json", metavar="OUT", help="also write the results, with the device, to this JSON file")
    args = p.parse_args()
    shared = mlx_lm.load(args.model)
    fuse_shared_inputs(shared[0])  # as a worker loads a shared model (worker/runtime/models.py)
    variants = {name: prepare(name, shared, args) for name in args.kinds}
    rounds = {name: [] for name in args.kinds}
    for _ in range(args.rounds):  # every variant once a round, in turn: a machine's drift hits them alike
        for name, (one_round, _) in variants.items():
            rounds[name].append(one_round())
    results = []
    for name, (_, line) in variants.items():
        results.append(line(rounds[name]))
        full = f"{name}-full"
        if full in rounds:  # a LoRA step against its kind's full step, round by round
            steps = [a["step_s"] / b["step_s"] for a, b in zip(rounds[name], rounds[full])]
            results[-1].update(ratio("step_vs_full", steps))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "device": str(mx.default_device()), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "batch_size": args.batch_size, "length": args.length, "steps": args.steps, "warmup": args.warmup,
            "quant_bits": args.quant_bits, "results": results}, indent=2))


if __name__ == "__main__":
    main()
