"""Use the system OpenBLAS for MLX's CPU matmuls on Linux.

MLX's Linux CPU wheel bundles a reference BLAS (about 6 GFLOP/s for a 1024x1024 fp32
matmul); with Debian's libopenblas0-pthread preloaded the same matmul runs about 30x
faster. LD_PRELOAD only works at process start: the worker's supervisor sets it for the
training process it starts; a benchmark re-executes itself once with it set.
MTQ_OPENBLAS=0 turns this off; MTQ_OPENBLAS=/path/libblas.so.3 picks a library.
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


def _preload_value() -> str | None:
    """LD_PRELOAD with OpenBLAS added; None when there is nothing to add."""
    lib = find_openblas()
    preload = os.environ.get("LD_PRELOAD", "")
    if lib is None or lib in preload.split(":"):
        return None
    return ":".join(p for p in (lib, preload) if p)


def preload_for_children() -> None:
    """Processes started from now on (the training process) get OpenBLAS preloaded."""
    value = _preload_value()
    if value is not None:
        os.environ["LD_PRELOAD"] = value


def reexec_with_openblas() -> None:
    """Call before importing mlx. Replaces this process (same pid) when it has work to do."""
    value = _preload_value()
    if value is None or "mlx.core" in sys.modules:
        return
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], dict(os.environ, LD_PRELOAD=value))
