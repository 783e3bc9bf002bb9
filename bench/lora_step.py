"""Where a LoRA SFT step's time goes, against full fine-tuning of the same model and rows, in
interleaved rounds in one process (docs/performance.md "LoRA's product in the model's dtype").

    python bench/lora_step.py MODEL_DIR [--batch-size 4] [--length 128] [--steps 10] [--warmup 3] [--rounds 3]
    python bench/lora_step.py MODEL_DIR --variants step_lora step_full   # those alone
    python bench/lora_step.py MODEL_DIR --count

--count: no timing; the primitives of each fwdbwd_* variant's graph (the SFT loss and its
gradients, before evaluation: mx.export_to_dot), by type, then those of the step_* variants'
compiled steps (forward, backward and update after mx.compile's simplification and fusion, each
fused kernel counted as one "Compiled"), each with its first step's loss and gradient norm (the
same rows and initial weights for every LoRA variant). Where a step is host-bound (the H200: a cost per
primitive), their count is what a variant adds; it depends on the layer count and the kind of
layers, not on the rows, and the fwdbwd_* counts not on the width, so any machine can print it
(a compiled step's fusions may differ a little between widths).

Variants, each on the same padded rows (bench/train_step.py rows_for), LoRA rank 8 on every
linear layer of every block, full fine-tuning of every block, the model's q/k/v and gate/up
fused as a worker loads it (fuse_shared_inputs):
  step_lora       the SFT trainer's compiled step (worker/kinds/sft_job.py) with the job's layers
                  (worker/runtime/adapter_layers.py InputDtypeLoRALinear: the product in the
                  model's dtype, float32 weights; those that read one input computed together,
                  SharedInput, with their pair the trainable weights, pair_inputs: AdamW's)
  step_lora_built the same with each group's pair built from its layers' matrices at each step
                  (a Muon or Adafactor job's)
  step_lora_each  the same, each layer on its own (no SharedInput)
  step_lora_f32   the same with mlx_lm's LoRALinear (its product promoted to float32; each alone)
  step_full       the trainer's step, fine_tune_type full
  fwdbwd_*        the SFT loss's forward and backward alone (not compiled, no update) of each,
                  and of `merged`: the adapter added into the base weight before one matmul
                  (x @ (W + s (A B)^T)^T), a layer this project does not use (measured as an option)
Prints each variant's median seconds per round (min / median / max over the rounds) and the
ratios of the rounds. Imports MLX, mlx_lm and the trainer modules only (runs where bench/train_step.py runs).
"""

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.tuner.lora import LoRALinear  # noqa: E402
from train_step import LORA, rows_for  # noqa: E402

from shared.kinds import KINDS  # noqa: E402
from worker.kinds.sft_job import SFTTrainer  # noqa: E402
from worker.kinds.supervised_trainer import make_step  # noqa: E402
from worker.runtime.adapter_layers import InputDtypeLoRALinear, attach_adapter, remove_adapter_layers  # noqa: E402
from worker.runtime.projection_groups import fuse_shared_inputs  # noqa: E402
from worker.runtime.train_core import TrainState  # noqa: E402


class MergedLoRALinear(InputDtypeLoRALinear):
    def __call__(self, x):
        w = self.linear.weight + (self.scale * (self.lora_b.T @ self.lora_a.T)).astype(x.dtype)
        y = x @ w.T
        return y + self.linear.bias if "bias" in self.linear else y


def print_primitives(name: str):
    """A function of (loss, grads) that prints the primitives of their graph, by type (a label's
    first word: "SliceUpdate Sum" is a SliceUpdate)."""
    def count(outputs) -> None:
        loss, grads = outputs
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
            mx.export_to_dot(f.name, loss, *[g for _, g in tree_flatten(grads)])
            kinds = collections.Counter(re.sub(r"^Compiled.*", "Compiled", label)
                                        for label in re.findall(r'label ="([A-Za-z]+)[^"]*"', f.read()))
        top = ", ".join(f"{k} {n}" for k, n in kinds.most_common(8))
        print(f"{name:18s} primitives {sum(kinds.values()):6d}: {top}", flush=True)
    return count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--count", action="store_true", help="print each fwdbwd variant's primitives by type, no timing")
    p.add_argument("--variants", nargs="+", help="time these variants only (default: all)")
    args = p.parse_args()
    model, tokenizer = mlx_lm.load(args.model)
    fuse_shared_inputs(model)  # as a worker loads a shared model (worker/runtime/models.py)
    rows = rows_for("sft", args.batch_size * 2, args.length)

    def trainer(fine_tune_type: str, layer_class=None, groups: str = "shared") -> SFTTrainer:
        """groups: the job's SharedInput groups, their pairs its trainable weights ("shared"), their
        pairs built at each step ("built": attached as for Muon; the trainer's optimizer stays
        AdamW), or none ("each")."""
        spec = KINDS["sft"].spec_model.model_validate({"model_id": "bench", "dataset": rows, "config": {
            "batch_size": args.batch_size, "iters": 100_000, **LORA, "fine_tune_type": fine_tune_type}})
        mx.random.seed(0)
        unpaired = groups != "shared" or layer_class is not None
        attach_adapter(model, spec.config.model_copy(update={"optimizer": "muon"}) if unpaired else spec.config,
                       fine_tune_type)
        for _, m in model.named_modules():
            if layer_class is not None and isinstance(m, LoRALinear):
                m.__class__ = layer_class
            if groups == "each" and isinstance(m, InputDtypeLoRALinear):
                m.shared_input = None
        return SFTTrainer(model, tokenizer, spec, rows, None)

    def step(fine_tune_type, layer_class=None, groups="shared"):
        made, state = trainer(fine_tune_type, layer_class, groups), TrainState()
        return lambda: made.step(state)

    def fwd_bwd(fine_tune_type, layer_class=None, groups="shared", run=mx.eval):
        made = trainer(fine_tune_type, layer_class, groups)
        (arrays, _) = made.arrays(list(range(args.batch_size)), rows)
        vg = nn.value_and_grad(model, lambda *a: made.loss(model, *a)[0])
        return lambda: run(vg(*arrays))

    fwd_bwds = {"fwdbwd_lora": ("lora", None), "fwdbwd_lora_each": ("lora", None, "each"),
                "fwdbwd_lora_built": ("lora", None, "built"),
                "fwdbwd_lora_f32": ("lora", LoRALinear), "fwdbwd_full": ("full", None),
                "fwdbwd_merged": ("lora", MergedLoRALinear)}  # name -> (fine_tune_type, layer class[, groups])
    if args.count:
        for name, made_as in fwd_bwds.items():
            fwd_bwd(*made_as, run=print_primitives(name))()
            remove_adapter_layers(model)
        steps = {"step_lora": ("lora",), "step_lora_each": ("lora", None, "each"),
                 "step_lora_built": ("lora", None, "built"), "step_full": ("full",)}
        for name, made_as in steps.items():
            made = trainer(*made_as)  # the trainer's compiled step as SFTTrainer.step makes it, for one micro-batch
            mx.eval(model.state, made.optimizer.state)  # a lazy input would put its graph in the count
            (arrays, _) = made.arrays(list(range(args.batch_size)), rows)
            step = make_step(made.module, made.optimizer, made.loss, 1, made.numbers, made.gang, True)
            _, metrics = step(arrays, mx.array(1.0), None, True)
            outputs = [*metrics.values(), *[v for _, v in tree_flatten(made.module.trainable_parameters())],
                       *[v for _, v in tree_flatten(made.optimizer.state)]]
            print_primitives(name)((outputs[0], outputs[1:]))
            mx.eval(outputs)  # the next variant's graph starts from evaluated weights
            print(f"{name:18s} loss {metrics['loss'].item():.6f}, grad norm {metrics['grad_norm'].item():.6f}")
            remove_adapter_layers(model)
        return

    variants = {"step_lora": lambda: step("lora"), "step_lora_each": lambda: step("lora", groups="each"),
                "step_lora_built": lambda: step("lora", groups="built"),
                "step_lora_f32": lambda: step("lora", LoRALinear),
                "step_full": lambda: step("full"),
                **{name: (lambda made_as=made_as: fwd_bwd(*made_as)) for name, made_as in fwd_bwds.items()}}
    unknown = set(args.variants or ()) - set(variants)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}: {', '.join(variants)}")
    variants = {name: make for name, make in variants.items() if not args.variants or name in args.variants}
    seconds = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, make in variants.items():
            run = make()
            for _ in range(args.warmup):
                run()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            seconds[name].append(statistics.median(times))
            remove_adapter_layers(model)
            print(f"round {r} {name}: {seconds[name][-1] * 1e3:.1f} ms", flush=True)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, {args.batch_size} rows of ~{args.length} tokens")
    for name, v in seconds.items():
        print(f"{name:18s} ms  min {min(v) * 1e3:7.1f}  median {statistics.median(v) * 1e3:7.1f}  max {max(v) * 1e3:7.1f}")
    for a, b in (("step_lora", "step_full"), ("step_lora", "step_lora_built"), ("step_lora_each", "step_lora_built"),
                 ("step_lora_f32", "step_lora_each"),
                 ("fwdbwd_lora", "fwdbwd_full"), ("fwdbwd_lora", "fwdbwd_lora_built"),
                 ("fwdbwd_lora_each", "fwdbwd_lora_built"),
                 ("fwdbwd_lora_f32", "fwdbwd_lora_each"), ("fwdbwd_merged", "fwdbwd_full")):
        if a not in seconds or b not in seconds:
            continue
        ratios = [x / y for x, y in zip(seconds[a], seconds[b])]
        print(f"{a} / {b}: median {statistics.median(ratios):.2f}, rounds {[round(x, 2) for x in ratios]}")


if __name__ == "__main__":
    main()
