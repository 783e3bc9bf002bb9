"""Where a fresh process's first GRPO step goes: each phase twice in one process, the first time
paying what the process has not loaded, compiled or built yet, and which of MLX's cached kernels
it read. Issue 41 asks a warm cache to make a new process's first step at most 3 s; on an H100
GRPO's took 11 s with nothing compiled (its first sampling 13-14 s, the next 0.5-0.6), where
SFT's took 1.1 s.

    TMPDIR=DIR CUDA_CACHE_PATH=DIR/cuda-driver python bench/first_sampling.py MODEL_DIR [G,B,L]

Run it twice on one DIR (the first fills the cache, the second is the warm process issue 41
means), then with other settings (MLX_CUDA_USE_CUDNN_SDPA=0, MLX_USE_CUDA_GRAPHS=0) on the same
DIR. Prints one JSON line: the seconds of each phase, first and second time (load: model and
trainer; sample_1: prefill and the first draw; sample_2: one compiled decode step more, a new
trace; sample_L: the whole sampling, its buffers another shape, so traced again; loss: the loss
phase's forward and backward over the samples), the kernels in MLX's cache before and after, and
those the process read, by kind (custom_kernel_: the decode's kernels, mx.fast.cuda_kernel,
which MLX 0.32 never writes to its cache itself, so 0 unless something put them there; MLX
reads a kernel's .txt file, its lowered names, only when it loads that kernel from the cache, so
an access time that moved says the kernel came from disk; `atime` false where the filesystem
keeps none).
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_step  # noqa: E402  (re-executes with OpenBLAS on Linux CPU)
import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
import numpy as np  # noqa: E402

from worker.decode.sampling import sample  # noqa: E402
from worker.kinds.grpo import make_batch  # noqa: E402
from worker.runtime.backend import cuda  # noqa: E402
from worker.runtime.projection_groups import fuse_shared_inputs  # noqa: E402
from worker.supervisor import kernel_cache  # noqa: E402


def reset_access_times(files: list[Path]) -> bool:
    """Set each file's access time a second before its modification time, so that a read moves it
    (relatime); whether this filesystem keeps access times at all (one file read here)."""
    for p in files:
        st = p.stat()
        os.utime(p, ns=(st.st_mtime_ns - 10**9, st.st_mtime_ns))
    if not files:
        return False
    before = files[0].stat().st_atime_ns
    files[0].read_bytes()
    kept = files[0].stat().st_atime_ns != before
    st = files[0].stat()
    os.utime(files[0], ns=(st.st_mtime_ns - 10**9, st.st_mtime_ns))
    return kept


def timed(run):
    """run()'s result and its seconds, to the end of the GPU's work."""
    mx.synchronize()
    t = time.perf_counter()
    out = run()
    mx.synchronize()
    return out, round(time.perf_counter() - t, 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("shape", nargs="?", default="8,4,128", metavar="G,B,L")
    args = ap.parse_args()
    G, B, L = (int(x) for x in args.shape.split(","))
    if L < 3:
        ap.error("L must be at least 3: the phases decode 1, 2 and L tokens")
    backend = "cuda" if cuda() else "cpu"
    before = kernel_cache.compiled_kernels(mx.__version__, backend)
    atime = reset_access_times([p for p in before if p.suffix == ".txt"])

    phases = {}
    t = time.perf_counter()
    model, tokenizer = mlx_lm.load(args.model_dir)
    fuse_shared_inputs(model)  # as a worker loads it (worker/runtime/models.py)
    tokenizer.eos_token_ids = []  # every row L tokens
    _, trainer = grpo_step.make_trainer(model, tokenizer, args.model_dir, G, B, L, 1, {})
    mx.set_memory_limit(int(trainer.memory.peak_gb * 1e9))  # as the trainer sets it
    phases["load"] = round(time.perf_counter() - t, 3)

    prompt_ids = trainer.prompt_ids[:B]
    advantages = mx.array(np.random.default_rng(0).standard_normal(G * B).astype(np.float32))
    for rep in (1, 2):
        model.eval()
        for n in (1, 2, L):
            params = dataclasses.replace(trainer.sampling, max_tokens=n)
            samples, phases[f"sample_{n if n < L else 'L'}_{rep}"] = timed(lambda p=params: sample(  # evaluated there
                model, trainer.decode_step, prompt_ids, G, p, trainer.eos_ids, mx.random.key(rep)))
        batch = make_batch(prompt_ids, samples, samples.mask, G)
        batch.advantages = advantages
        model.train()
        _, phases[f"loss_{rep}"] = timed(lambda b=batch: mx.eval(trainer.loss_and_grads(b, b.old_logp)))

    after = kernel_cache.compiled_kernels(mx.__version__, backend)
    known = set(before)
    read = [p for p in before if p.suffix == ".txt" and (st := p.stat()).st_atime_ns > st.st_mtime_ns - 10**9]
    decode_kernels = [p for p in after if p.suffix == ".txt" and p.name.startswith("custom_kernel_")]
    print(json.dumps({
        "device": str(mx.default_device()), "shape": args.shape, "phases": phases,
        "one_time": {k[:-2]: round(v - phases[k[:-1] + "2"], 3) for k, v in phases.items() if k.endswith("_1")},
        "cache_files_before": len(before), "cache_files_added": len([p for p in after if p not in known]),
        "atime": atime,
        "read_kernels": len(read), "read_decode_kernels": len([p for p in read if p.name.startswith("custom_kernel_")]),
        "decode_kernels_in_cache": len(decode_kernels),
        "env": {k: os.environ[k] for k in ("MLX_CUDA_USE_CUDNN_SDPA", "MLX_USE_CUDA_GRAPHS") if k in os.environ},
    }), flush=True)


if __name__ == "__main__":
    main()
