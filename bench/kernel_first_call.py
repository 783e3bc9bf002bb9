"""A fresh process's first call of five of the decode's CUDA kernels, each timed alone, then a second call.

    TMPDIR=DIR python3 bench/kernel_first_call.py [--rows 8] [--hidden 1024] [--rank 8]

MLX 0.32 compiles a custom kernel (mx.fast.cuda_kernel) with NVRTC at its first call in every
process: its custom_kernel.cpp keeps those kernels out of its disk cache. Run twice on one cache
(TMPDIR), the second process's first calls say what a warm process still pays per kernel: NVRTC's
seconds if it compiles, milliseconds if a module came from the cache. Copied into another tree
(bench/ beside its worker/), it runs that tree's kernels. Prints one JSON line: each kernel's
first and second call in seconds, and the decode kernels' modules in MLX's PTX cache before and
after. In a tree that seeds MLX's PTX cache (worker/decode/ptx_cache.py), also whether the source
it hashes is the one MLX builds (MLX prints its own with verbose=True), and where they differ.
"""

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from worker.decode import lora_kernel, norm_kernel, swiglu_kernel  # noqa: E402
from worker.runtime.backend import cuda  # noqa: E402
from worker.supervisor import kernel_cache  # noqa: E402


def modules() -> int:
    """The decode's kernels (custom_kernel_mtq_*) among the compiled modules in MLX's PTX cache."""
    folder = kernel_cache.kernel_dir(mx.__version__, "cuda")
    return sum(1 for _ in folder.rglob("custom_kernel_mtq_*.ptx")) if folder.exists() else 0


def source_check(x: mx.array, a: mx.array) -> dict:
    """lora_kernel.down's source as MLX builds it (its verbose print) against ptx_cache.mlx_source's."""
    from worker.decode import ptx_cache  # only in a tree that seeds MLX's cache
    inputs, template = [x, a], [("T", x.dtype), ("THREADS", lora_kernel.THREADS)]
    made = mx.fast.cuda_kernel(name="mtq_lora_down", input_names=["x", "a"], output_names=["t"],
                               source=lora_kernel.DOWN, header=lora_kernel.HEADER)
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            mx.eval(made(inputs=inputs, template=template, grid=(lora_kernel.THREADS, x.shape[0], 1),
                         threadgroup=(lora_kernel.THREADS, 1, 1), output_shapes=[(x.shape[0], a.shape[1])],
                         output_dtypes=[mx.float32], verbose=True))
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        printed = out.read().decode(errors="replace")
    mlx = printed.split("```\n", 1)[-1].rsplit("\n```", 1)[0]
    kname, ours = ptx_cache.mlx_source("mtq_lora_down", ("x", "a"), ("t",), lora_kernel.DOWN, lora_kernel.HEADER,
                                       inputs, [mx.float32], template)
    at = next((i for i, (p, q) in enumerate(zip(mlx, ours)) if p != q), min(len(mlx), len(ours)))
    path = ptx_cache.module_path(kernel_cache.kernel_dir(mx.__version__, "cuda"), kname, ours)
    return {"mlx_source_matches": mlx == ours, "lengths": [len(mlx), len(ours)], "first_difference": at,
            "mlx_there": mlx[max(0, at - 80):at + 80], "ours_there": ours[max(0, at - 80):at + 80],
            "seeded_module": str(path), "seeded_module_exists": path.exists()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    if not cuda():
        raise SystemExit("the decode's kernels run only on MLX's CUDA backend")
    rows, hidden, rank = args.rows, args.hidden, args.rank
    before = modules()
    x = mx.random.normal((rows, hidden)).astype(mx.bfloat16)
    r = mx.random.normal((rows, hidden)).astype(mx.bfloat16)
    a = mx.random.normal((hidden, rank)) * 0.01
    b = mx.random.normal((rank, hidden)) * 0.01
    t = mx.random.normal((rows, rank))
    y = mx.concatenate([x, r], axis=1)  # gate, up
    norm = nn.RMSNorm(hidden)
    norm.weight = norm.weight.astype(mx.bfloat16)
    mx.eval(x, r, a, b, t, y, norm.parameters())  # MLX's own kernels for these, before any timing
    calls = {"lora_down": lambda: lora_kernel.down(x, a),
             "lora_up": lambda: lora_kernel.up(x, t, b, 2.0),
             "add_norm": lambda: norm_kernel.add_norm(x, r, norm)[:2],
             "add_norm_down": lambda: norm_kernel.add_norm(x, r, norm, a=a),
             "swiglu": lambda: swiglu_kernel.swiglu(y)[0]}  # includes MLX's activation headers
    seconds = {}
    for name, call in calls.items():
        for turn in ("first", "second"):
            start = time.perf_counter()
            mx.eval(call())
            seconds[f"{name}_{turn}"] = round(time.perf_counter() - start, 4)
    seeding = importlib.util.find_spec("worker.decode.ptx_cache") is not None
    print(json.dumps({"device": str(mx.default_device()), "tree": str(ROOT), "seconds": seconds,
                      "decode_modules_before": before, "decode_modules_after": modules(),
                      "source_check": source_check(x, a) if seeding else None}))


if __name__ == "__main__":
    main()
