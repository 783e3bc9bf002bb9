"""Use the system OpenBLAS for MLX's CPU matmuls on Linux.

MLX's Linux CPU wheel bundles a reference BLAS (about 6 GFLOP/s for a 1024x1024 fp32
matmul); with Debian's libopenblas0-pthread preloaded the same matmul runs about 30x
faster. LD_PRELOAD only works at process start, so the worker re-executes itself once
with it set. MTQ_OPENBLAS=0 turns this off; MTQ_OPENBLAS=/path/libblas.so.3 picks a library.
"""

import os
import sys
from pathlib import Path

CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
]


def find_openblas() -> str | None:
    choice = os.environ.get("MTQ_OPENBLAS", "")
    if choice == "0" or sys.platform != "linux":
        return None
    for path in [choice] if choice else CANDIDATES:
        if Path(path).is_file():
            return path
    return None


def reexec_with_openblas() -> None:
    """Call before importing mlx. Replaces this process (same pid) when it has work to do."""
    lib = find_openblas()
    preload = os.environ.get("LD_PRELOAD", "")
    if lib is None or lib in preload.split(":") or "mlx.core" in sys.modules:
        return
    env = dict(os.environ, LD_PRELOAD=":".join(p for p in (lib, preload) if p))
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
