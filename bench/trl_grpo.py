"""TRL's GRPOTrainer on the same model and shapes as bench/grpo_step.py, for its figures beside
this project's in one sitting. Optional: it needs torch, transformers, peft, datasets and trl
(TRL 1.16 was measured), which are not this project's dependencies; install them into an
environment of their own.

    python bench/trl_grpo.py MODEL_DIR --group-size 8 --batch-size 4 --max-completion-len 128 \
        [--steps 8 --warmup 3] [--dtype bfloat16] [--json OUT]

MODEL_DIR: an unquantized model directory (`mtq make-model DIR --size qwen3-0.6b`: mlx_lm's format
is Hugging Face's, so transformers loads it). The configuration matches this project's defaults
for the comparison: LoRA r8 alpha 16 on every linear layer of the attention and MLP, beta 0, one
update per sampled batch (num_iterations 1), loss `dapo`, no vLLM (generation by transformers),
a length reward (the seed's default). Prints the median step time after `--warmup` steps.
"""

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=2, help="prompts per step")
    ap.add_argument("--max-completion-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).to(device)
    prompts = [f"Question {i}: say something about the number {i}." for i in range(64)]
    dataset = Dataset.from_dict({"prompt": prompts})
    rows = args.batch_size * args.group_size
    config = GRPOConfig(
        output_dir="/tmp/trl_grpo_bench", per_device_train_batch_size=rows, num_generations=args.group_size,
        max_completion_length=args.max_completion_len, max_steps=args.steps, learning_rate=1e-5, beta=0.0,
        loss_type="dapo", num_iterations=1, temperature=1.0, lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
        bf16=args.dtype == "bfloat16" and device == "cuda", use_cpu=device == "cpu", seed=0,
        gradient_checkpointing=True,
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            if device == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)

    times = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=config, train_dataset=dataset, peft_config=lora, callbacks=[times],
                          processing_class=tokenizer)
    trainer.train()
    timed = times.times[args.warmup:] or times.times
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    result = {"system": f"TRL {trl.__version__} (torch {torch.__version__}, {device}, {args.dtype})",
              "G": args.group_size, "B": args.batch_size, "L": args.max_completion_len,
              "step_s": statistics.median(timed), "steps": [round(t, 4) for t in times.times], "peak_gb": peak}
    print(f"TRL G{args.group_size} B{args.batch_size} L{args.max_completion_len}: step {result['step_s']:.3f} s "
          f"(median of {len(timed)} after {args.warmup} warm-up), peak {peak or 0:.2f} GB, {result['system']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
