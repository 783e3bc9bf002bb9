"""A training process's kernels for two jobs that differ only in their numbers (tests/test_scalars.py).

    python tests/compiled_numbers.py MODEL_DIR CACHE_DIR [KIND ...]

Set up as the worker's training process is (worker/supervisor/kernel_cache.py: MLX compiles into
CACHE_DIR), it runs one step of each KIND's job with the first config of CASES, then one of a job
that changes every number of it, its batch size too (not its structure: beta stays above 0, top_p
below 1, a batch has more than one row), on a fresh LoRA each, and prints one JSON line per kind:
the kernels the first compiled, and the names of those the second added (none, where the numbers
are inputs of the compiled functions; on CUDA, each kernel's files).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.supervisor import kernel_cache  # noqa: E402

WORDS = " ".join(["word"] * 12)
OPTIMIZER = ({"learning_rate": 1e-4, "max_grad_norm": 1.0},
             {"learning_rate": 3e-4, "max_grad_norm": 0.5, "weight_decay": 0.01, "adam_beta1": 0.8, "adam_beta2": 0.99,
              "adam_epsilon": 1e-6})
LORA = ({"lora_alpha": 16.0}, {"lora_alpha": 32.0})
BATCH = ({"batch_size": 2}, {"batch_size": 3})  # a mean's 1/count was a constant of the batch's size
CASES = {
    "grpo": ({"temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "clip_ratio": 0.2, "epsilon_high": 0.28, "beta": 0.04},
             {"temperature": 0.9, "top_p": 0.8, "min_p": 0.1, "clip_ratio": 0.3, "epsilon_high": 0.35, "beta": 0.1}),
    # The accumulation's count divided the gradients; a schedule's numbers were the compiled update's.
    "sft": ({"grad_accumulation_steps": 3, "lr_scheduler": "cosine", "warmup_steps": 1},
            {"grad_accumulation_steps": 4, "lr_scheduler": "cosine", "warmup_steps": 2}),
    "dora": ({"fine_tune_type": "dora"}, {"fine_tune_type": "dora"}),  # an SFT job of DoRA layers
    "dpo": ({"beta": 0.1, "label_smoothing": 0.1, "loss_type": ["sigmoid", "hinge"], "loss_weights": [1.0, 0.5]},
            {"beta": 0.3, "label_smoothing": 0.2, "loss_type": ["sigmoid", "hinge"], "loss_weights": [0.8, 0.3]}),
    "orpo": ({"beta": 0.1, "lambda_odds": 1.0, "lr_schedule": {"name": "cosine_decay", "arguments": [1e-4, 10],
                                                                "warmup": 1}},
             {"beta": 0.2, "lambda_odds": 0.5, "lr_schedule": {"name": "cosine_decay", "arguments": [3e-4, 20],
                                                                "warmup": 2}}),
    "kto": ({"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0},
            {"beta": 0.3, "desirable_weight": 1.5, "undesirable_weight": 0.7}),
    "cpo": ({"beta": 0.1, "label_smoothing": 0.1, "cpo_alpha": 1.0},
            {"beta": 0.2, "label_smoothing": 0.2, "cpo_alpha": 0.5}),
}


def rows(kind: str) -> list[dict]:
    if kind in ("sft", "dora"):
        return [{"text": f"{i} {WORDS}"} for i in range(4)]
    if kind == "kto":
        return [{"prompt": f"{i} {WORDS}", "completion": f"yes {WORDS}", "label": i % 2 == 0} for i in range(4)]
    return [{"prompt": f"{i} {WORDS}", "chosen": f"yes {WORDS}", "rejected": f"no {WORDS}"} for i in range(4)]


def step(kind: str, model, tokenizer, model_dir: str, config: dict) -> None:
    """One step of a fresh job of `kind` with `config` on the loaded model."""
    import mlx.core as mx

    from shared.kinds import KINDS
    from worker.rewards.scorer import build_scorer
    from worker.runtime.adapter_layers import attach_adapter
    from worker.runtime.train_core import TrainState
    from worker.runtime.warm_up import POLICY, SUPERVISED  # each kind's trainer

    mx.random.seed(0)
    if kind == "grpo":
        spec = KINDS[kind].spec_model.model_validate({"model_id": model_dir, "prompts": ["One.", "Two.", "Three."],
                                                      "config": {"group_size": 2, "max_completion_len": 8, "iters": 2,
                                                                 **config}})
        attach_adapter(model, spec.config)
        with build_scorer(spec, "numbers") as scorer:
            POLICY[kind](model, tokenizer, spec, scorer).step(TrainState(), lambda: False)
        return
    data, name = rows(kind), "sft" if kind == "dora" else kind
    spec = KINDS[name].spec_model.model_validate({"model_id": model_dir, "dataset": data,
                                                  "config": {"iters": 2, **config}})
    attach_adapter(model, spec.config, config.get("fine_tune_type", "lora"))
    trainer, _ = SUPERVISED[name]
    trainer(model, tokenizer, spec, data, None).step(TrainState())


def main() -> None:
    model_dir, cache = sys.argv[1], Path(sys.argv[2])
    kernel_cache.use(cache)  # as worker/supervisor/child.py child_main, before MLX
    import mlx.core as mx
    import mlx_lm

    from worker.runtime.training_process import kernel_backend

    model, tokenizer = mlx_lm.load(model_dir)
    tokenizer.eos_token_ids = []  # every completion runs to its end: the same decode steps each time

    def kernels() -> set[str]:  # a CPU's kernels, or each CUDA kernel's files
        return {p.name for p in kernel_cache.compiled_kernels(mx.__version__, kernel_backend())}

    for kind in sys.argv[3:] or list(CASES):
        first, second = ({**a, **b, **c, **d} for a, b, c, d in zip(CASES[kind], OPTIMIZER, LORA, BATCH))
        before = kernels()
        step(kind, model, tokenizer, model_dir, first)
        after_first = kernels()
        step(kind, model, tokenizer, model_dir, second)
        print(json.dumps({"kind": kind, "first": len(after_first - before),
                          "new": sorted(kernels() - after_first)}), flush=True)


if __name__ == "__main__":
    main()
