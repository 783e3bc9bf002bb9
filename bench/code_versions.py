"""The decode and a GRPO step of two or more versions of the code, in one process, in interleaved rounds.

    git archive 440805b worker shared | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    python bench/code_versions.py MODEL_DIR /tmp/old . [--rows 8 32] [--tokens 96] [--group-size 8]
        [--lora-layers 16] [--grpo 4,2,64 8,4,128] [--rounds 5] [--warmup 2] [--json OUT]

Each TREE is a directory holding `worker/` and `shared/` (this repository, or an older commit's);
the first is the baseline. Each is copied into a temporary directory as the packages v0_worker
and v0_shared (v1_..., and so on), its absolute imports of `worker` and `shared` rewritten to
them, so the trees' modules live side by side in the process (module names held in strings, such
as a kind's worker module, are left alone: no measure here reaches them). What the bench calls is
taken from whichever module of the tree defines it (`def sample(`, `class GRPOTrainer`, ...), so
trees that keep it in different places compare as they are.

Every tree gets its own copy of the model, loaded as a worker loads it (the projections that read
one input fused, by the tree's own fuse_shared_inputs), and the same inputs:

  decode   the tree's sample() with its make_decode_step(): R rows of R / group size prompts of
           random token ids of slightly different lengths, --tokens tokens each, temperature 1,
           EOS off; milliseconds per decode position, prompt prefill included. At each --rows,
           without LoRA, then with LoRA on the last --lora-layers blocks (mlx_lm's
           linear_to_lora_layers, rank 8, scale 16, from one seed in every tree; its B matrices
           drawn at random too, so that LoRA changes the logits). Every tree's samples are
           compared with the first's, drawn with the same key: the agreement line.
  grpo     seconds of one step of the tree's GRPOTrainer, a fresh LoRA job at each G,B,L of
           --grpo (a job's defaults otherwise; EOS off: every row decodes L tokens); each tree's
           trainer runs under the memory limit it set itself. The steps' losses are compared
           with the first tree's.

MLX compiles per process, each tree its own functions: --warmup rounds are not timed. Then
--rounds rounds run every tree once each, the order reversed every other round (A B, B A, ...).
Printed per measure: each tree's min / median / max over the rounds, and each later tree's ratio
to the first: of the medians, and the smallest and largest of the rounds' own ratios (the
spread). --json writes every round's figure, after each measure. On Linux CPU the process first
re-executes itself with the system OpenBLAS (worker/supervisor/openblas.py).
"""

import argparse
import gc
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.tuner.lora import LoRALinear  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

from bench.decode import agreement, make_prompts  # noqa: E402

PROMPTS = ["What is 2+2?", "Say hello.", "Name a prime number.", "Write a haiku about rain.",
           "Count to five.", "What colour is the sky?", "Spell 'queue'.", "Translate 'cat' to French."]
PACKAGES = ("worker", "shared")
IMPORT = re.compile(rf"^(\s*)(from|import)\s+({'|'.join(PACKAGES)})\b", re.M)
# `import worker.x` binds the name `worker`, which an alias would not: no tree has one, and a tree
# that did would fail at once here rather than with a NameError in the middle of a measure.
BARE_IMPORT = re.compile(rf"^\s*import\s+({'|'.join(PACKAGES)})\b(?!.*\bas\b)", re.M)


class Tree:
    """One code tree's worker/ and shared/, imported under aliases, and what the bench calls of it."""

    NAMES = ("sample", "make_decode_step", "SamplingParams", "fuse_shared_inputs",
             "GRPOTrainer", "TrainState", "attach_adapter", "build_scorer", "JobCreate")

    def __init__(self, root: Path, index: int, into: Path):
        self.root, self.label, self.into = root, chr(ord("A") + index), into
        prefix = f"v{index}_"
        self.packages = [into / (prefix + name) for name in PACKAGES]
        for name, package in zip(PACKAGES, self.packages):
            shutil.copytree(root / name, package, ignore=shutil.ignore_patterns("__pycache__"))
        for package in self.packages:
            for path in package.rglob("*.py"):
                text = path.read_text()
                if BARE_IMPORT.search(text):
                    raise SystemExit(f"{root}: {path.relative_to(into)} has a plain `import worker/shared...`")
                path.write_text(IMPORT.sub(lambda m: f"{m[1]}{m[2]} {prefix}{m[3]}", text))
        for name in self.NAMES:
            setattr(self, name, self.defined(name))

    def defined(self, name: str):
        """`name` from the one module of the tree that defines it at its top level."""
        pattern = re.compile(rf"^(def|class) {name}\b", re.M)
        hits = [p for package in self.packages for p in sorted(package.rglob("*.py")) if pattern.search(p.read_text())]
        if len(hits) != 1:
            raise SystemExit(f"{self.root}: {name} defined in {len(hits)} modules: {[str(p) for p in hits]}")
        parts = hits[0].relative_to(self.into).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        return getattr(importlib.import_module(module), name)


def load_model(tree: Tree, model_dir: str):
    model, tokenizer = mlx_lm.load(model_dir)
    tree.fuse_shared_inputs(model)  # as a worker loads a shared model
    model.freeze()  # a job's base model is frozen
    tokenizer.eos_token_ids = []  # EOS off: every row decodes to full length
    return model, tokenizer


def attach_decode_lora(model, layers: int) -> None:
    """LoRA on the last `layers` blocks, the same weights in every tree's copy (one seed)."""
    mx.random.seed(0)
    linear_to_lora_layers(model, layers, {"rank": 8, "scale": 16.0, "dropout": 0.0})
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear):  # B starts at zero: drawn, so that LoRA's products count
            m.lora_b = 0.01 * mx.random.normal(m.lora_b.shape)
    model.eval()
    mx.eval(model.parameters())


def interleaved(trees: list[Tree], run, warmup: int, rounds: int) -> dict[str, list[float]]:
    """run(tree, round) -> a figure; round < 0 for warm-ups. Every tree once per round, the order
    reversed every other round."""
    for w in range(warmup):
        for tree in trees:
            run(tree, -1 - w)
    figures = {t.label: [] for t in trees}
    for r in range(rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            figures[tree.label].append(run(tree, r))
    return figures


def summarize(trees: list[Tree], figures: dict[str, list[float]], unit: str) -> dict:
    """Print and return each tree's min / median / max, and each later tree's ratio to the first."""
    out = {"unit": unit, "trees": {}, "ratios": {}}
    base = trees[0].label
    for tree in trees:
        f = figures[tree.label]
        out["trees"][tree.label] = {"root": str(tree.root), "rounds": [round(x, 5) for x in f],
                                    "min": min(f), "median": statistics.median(f), "max": max(f)}
        print(f"    {tree.label} {str(tree.root):32s} {unit}  min {min(f):8.3f}  median {statistics.median(f):8.3f}"
              f"  max {max(f):8.3f}", flush=True)
    for tree in trees[1:]:
        per_round = [x / y for x, y in zip(figures[tree.label], figures[base])]
        ratio = out["trees"][tree.label]["median"] / out["trees"][base]["median"]
        out["ratios"][tree.label] = {"of_medians": ratio, "rounds": [round(x, 4) for x in per_round],
                                     "min": min(per_round), "max": max(per_round)}
        print(f"    {tree.label}/{base}  {ratio:.3f} (rounds {min(per_round):.3f} to {max(per_round):.3f})", flush=True)
    return out


def measure_decode(trees, models, rows: int, args, lora: int) -> dict:
    """ms per decode position of each tree's sampler, and its samples' agreement with the first tree's."""
    G = min(args.group_size, rows)
    vocab = models[trees[0].label][0].args.vocab_size
    prompts = make_prompts(vocab, rows // G, args.prompt_len)
    steps, samples = {}, {}
    for tree in trees:
        p = tree.SamplingParams(max_tokens=args.tokens, temperature=1.0)
        steps[tree.label] = (p, tree.make_decode_step(models[tree.label][0], p, [], 0))

    def run(tree, r):
        p, step = steps[tree.label]
        t0 = time.perf_counter()
        out = tree.sample(models[tree.label][0], step, prompts, G, p, [], mx.random.key(max(r, 0)))
        seconds = time.perf_counter() - t0
        assert out.steps == args.tokens
        samples[tree.label] = out  # the last round's: the same key in every tree
        return 1000 * seconds / args.tokens

    print(f"  decode, {rows} rows, {args.tokens} tokens, {f'LoRA on {lora} blocks' if lora else 'no LoRA'}", flush=True)
    result = {"measure": "decode", "rows": rows, "group_size": G, "tokens": args.tokens, "lora_layers": lora,
              **summarize(trees, interleaved(trees, run, args.warmup, args.rounds), "ms/pos"), "agreement": {}}
    first = samples[trees[0].label]
    for tree in trees[1:]:
        agree = agreement(samples[tree.label], first)
        result["agreement"][tree.label] = agree
        print(f"    {tree.label} vs {trees[0].label}: rows the same {agree['rows_as_first']:.3f}, tokens before a row's "
              f"first difference {agree['tokens_before_difference']:.4f}, their largest log-prob difference "
              f"{agree['max_logprob_diff_before']:.2e}", flush=True)
    return result


def measure_grpo(trees, models, shape: str, args, default_memory_limit: int) -> dict:
    """Seconds per step of each tree's GRPOTrainer on a fresh LoRA job, and its losses against the first tree's."""
    G, B, L = (int(x) for x in shape.split(","))
    jobs, losses = {}, {t.label: [] for t in trees}
    for tree in trees:
        model, tokenizer = models[tree.label]
        mx.set_memory_limit(default_memory_limit)  # a trainer sets its own: not its predecessor's
        config = {"group_size": G, "batch_size": B, "max_completion_len": L, "iters": args.warmup + args.rounds}
        spec = tree.JobCreate.model_validate({"model_id": args.model_dir, "prompts": (PROMPTS * 64)[:B], "config": config})
        mx.random.seed(spec.config.seed)
        tree.attach_adapter(model, spec.config)
        trainer = tree.GRPOTrainer(model, tokenizer, spec, tree.build_scorer(spec, "bench"))
        jobs[tree.label] = (trainer, tree.TrainState(), mx.get_memory_limit())

    def run(tree, r):
        trainer, state, limit = jobs[tree.label]
        mx.set_memory_limit(limit)
        t0 = time.perf_counter()
        metrics = trainer.step(state, lambda: False)[0]
        seconds = time.perf_counter() - t0
        losses[tree.label].append(metrics["loss"])
        return seconds

    print(f"  GRPO step, G{G} B{B} L{L}", flush=True)
    result = {"measure": "grpo_step", "group_size": G, "batch_size": B, "max_completion_len": L,
              **summarize(trees, interleaved(trees, run, args.warmup, args.rounds), "s/step"),
              "losses": losses, "max_loss_diff": {}}
    for tree in trees[1:]:  # a tree's i-th step is the first tree's i-th step: same seed, same data
        diff = max(abs(a - b) for a, b in zip(losses[tree.label], losses[trees[0].label]))
        result["max_loss_diff"][tree.label] = diff
        print(f"    {tree.label} vs {trees[0].label}: largest difference of the steps' losses {diff:.2e}", flush=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("trees", type=Path, nargs="+", metavar="TREE",
                    help="directories holding worker/ and shared/; the first is the baseline")
    ap.add_argument("--rows", type=int, nargs="*", default=[8, 32], help="decode row counts (none: no decode)")
    ap.add_argument("--tokens", type=int, default=96, help="decode: tokens per row")
    ap.add_argument("--group-size", type=int, default=8, help="decode: rows per distinct prompt")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--lora-layers", type=int, default=16, help="decode: LoRA on the last N blocks (at most all; 0: none)")
    ap.add_argument("--grpo", nargs="*", default=["4,2,64", "8,4,128"], metavar="G,B,L", help="GRPO step shapes (none: no GRPO)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="rounds not timed (compilation)")
    ap.add_argument("--json", type=Path, help="write the header and every measure here")
    args = ap.parse_args()
    if len(args.trees) < 2:
        ap.error("give at least two trees")

    with tempfile.TemporaryDirectory(prefix="code_versions_") as tmp:
        sys.path.insert(0, tmp)
        trees = [Tree(root.resolve(), i, Path(tmp)) for i, root in enumerate(args.trees)]
        models = {t.label: load_model(t, args.model_dir) for t in trees}
        layers = min(args.lora_layers, len(models[trees[0].label][0].layers))
        report = {"device": str(mx.default_device()), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                  "model": args.model_dir, "trees": {t.label: str(t.root) for t in trees},
                  "rounds": args.rounds, "warmup": args.warmup, "measures": []}
        print(f"device {report['device']}, mlx {report['mlx']}, mlx_lm {report['mlx_lm']}, {args.rounds} rounds after "
              f"{args.warmup} warm-up, trees " + ", ".join(f"{t.label} {t.root}" for t in trees), flush=True)

        def save(measure):
            report["measures"].append(measure)
            if args.json:
                args.json.write_text(json.dumps(report, indent=1))

        default_memory_limit = mx.get_memory_limit()
        for lora in [0, layers] if layers else [0]:
            if lora:
                for model, _ in models.values():
                    attach_decode_lora(model, lora)
            for rows in args.rows:
                save(measure_decode(trees, models, rows, args, lora))
        for shape in args.grpo:
            save(measure_grpo(trees, models, shape, args, default_memory_limit))
            gc.collect()  # the shape's trainers, before the next ones
            mx.clear_cache()


if __name__ == "__main__":
    main()
