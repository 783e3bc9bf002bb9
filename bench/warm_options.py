"""The kernels a job's options compile after a worker's warm-up (worker/runtime/warm_up.py).

    python bench/warm_options.py MODEL_DIR CACHE_DIR [--kind grpo|sft] [--options JSON ...]

Set up as the training process is (worker/supervisor/kernel_cache.py: MLX compiles into
CACHE_DIR, which should start empty), it runs `warm_up` on the model, then one step of a fresh
job of --kind at the warm-up's first LoRA layout for each option set in turn (GRPO: group_size 4,
batch_size 2, 8 tokens; SFT: 4 rows of 12 words, prompt and completion), each on what the steps
before it left in the cache, and prints a line per step: the options, the kernels it added and
its seconds. The default option sets are each of the kind's options that may change the compiled
steps' structure, one at a time.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.supervisor import kernel_cache  # noqa: E402
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

OPTIONS = {"grpo": [{}, {"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}, {"temperature": 0.0}, {"temperature": 0.7},
           {"loss_type": "grpo"}, {"loss_type": "bnpo"}, {"loss_type": "dr_grpo"},
           {"importance_sampling_level": "sequence"}, {"scale_rewards": "batch"}, {"scale_rewards": "none"},
           {"num_iterations": 2}, {"lora_dropout": 0.05}, {"stop": ["xy"]}, {"beta": 0.04}, {"micro_batch_size": 1},
           {"beta": 0.04, "micro_batch_size": 1}],
           "sft": [{}, {"optimizer": "adam"}, {"optimizer": "sgd"}, {"optimizer": "muon"}, {"optimizer": "adafactor"},
                   {"lr_schedule": {"name": "cosine_decay", "arguments": [1e-5, 100], "warmup": 10}},
                   {"grad_accumulation_steps": 2}, {"gradient_checkpointing": True}, {"fine_tune_type": "dora"},
                   {"lora_dropout": 0.05}, {"loss_type": "chunked_nll"}, {"loss_type": "dft"}, {"mask_prompt": True},
                   {"packing": True}, {"batch_size": 1}]}
WORDS = " ".join(["word"] * 12)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("cache_dir", type=Path)
    ap.add_argument("--kind", choices=list(OPTIONS), default="grpo")
    ap.add_argument("--options", type=json.loads, nargs="+")
    args = ap.parse_args()
    kernel_cache.use(args.cache_dir)  # as worker/supervisor/child.py child_main, before MLX
    os.environ["MTQ_MODEL_ROOTS"] = str(Path(args.model_dir).resolve().parent)
    import mlx.core as mx

    from shared.kinds import KINDS
    from shared.settings import load_settings
    from worker.kinds.sft_job import SFTTrainer
    from worker.rewards.scorer import build_scorer
    from worker.runtime.adapter_layers import attach_adapter, remove_adapter_layers
    from worker.runtime.models import get_model
    from worker.runtime.train_core import TrainState
    from worker.runtime.training_process import kernel_backend
    from worker.runtime.warm_up import POLICY, lora_layouts, warm_up

    def kernels() -> set[str]:
        return {p.name for p in kernel_cache.compiled_kernels(mx.__version__, kernel_backend())}

    settings, model_id = load_settings(), str(Path(args.model_dir).resolve())
    t0, before = time.perf_counter(), kernels()
    warm_up(model_id, settings, should_stop=lambda: False, job_waiting=lambda: False)
    print(json.dumps({"warm_up_s": round(time.perf_counter() - t0, 1), "kernels": len(kernels() - before)}), flush=True)
    model, tokenizer, _ = get_model(model_id, settings)
    layout = {"lora_layers": lora_layouts(len(model.layers))[0]}  # the warm-up's first, a job's default on 17+ blocks
    rows = [{"prompt": f"{i} {WORDS}", "completion": f" yes {WORDS}"} for i in range(4)]
    for options in args.options or OPTIONS[args.kind]:
        mx.random.seed(0)
        config = {"iters": 1, **layout, **options}
        if args.kind == "grpo":
            spec = KINDS["grpo"].spec_model.model_validate(
                {"model_id": model_id, "prompts": ["One.", "Two."],
                 "config": {"group_size": 4, "batch_size": 2, "max_completion_len": 8, **config}})
        else:
            spec = KINDS["sft"].spec_model.model_validate({"model_id": model_id, "dataset": rows, "config": config})
        before, t0 = kernels(), time.perf_counter()
        attach_adapter(model, spec.config, spec.config.fine_tune_type if args.kind == "sft" else "lora")
        try:
            if args.kind == "grpo":
                with build_scorer(spec, "options") as scorer:
                    POLICY["grpo"](model, tokenizer, spec, scorer).step(TrainState(), lambda: False)
            else:
                SFTTrainer(model, tokenizer, spec, rows, None).step(TrainState())
        finally:
            remove_adapter_layers(model)
        print(json.dumps({"options": options, "new_kernels": len(kernels() - before),
                          "seconds": round(time.perf_counter() - t0, 2)}), flush=True)


if __name__ == "__main__":
    main()
