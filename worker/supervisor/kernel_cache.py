"""Where MLX keeps the kernels it compiles, for the training process: a directory under $MTQ_HOME
(MTQ_KERNEL_CACHE, default $MTQ_HOME/kernel-cache) rather than the temp directory, so that the
kernels outlive a cleaned /tmp and a second worker on the same $MTQ_HOME (the same machine, or
a shared volume) runs its first step without compiling them.

    CPU    MLX caches compiled kernels in temp_directory_path()/mlx/<version>/cpu, and only
           TMPDIR moves that: the training process's TMPDIR is the cache directory (its other
           temporary files go there too, and so stay under $MTQ_HOME)
    CUDA   MLX_PTX_CACHE_DIR when set, else temp_directory_path()/mlx/<version>/ptx: the same
           TMPDIR puts it in the cache directory
    Metal  no disk cache: each process compiles its kernels

No MLX here: the training process's entry (worker/supervisor/child.py child_main) calls `use`
before MLX is imported.
"""

import os
import tempfile
from pathlib import Path


def use(cache_dir: Path) -> None:
    """Make this process (and the processes it starts) keep MLX's kernels in cache_dir."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(cache_dir)
    tempfile.tempdir = None  # Python's tempfile reads TMPDIR again


def compiled_kernels(version: str, backend: str) -> list[Path]:
    """The kernels compiled into this process's cache so far (backend: "cpu" or "cuda")."""
    if backend == "cuda":
        where = Path(os.environ.get("MLX_PTX_CACHE_DIR") or Path(tempfile.gettempdir()) / "mlx" / version / "ptx")
        return [p for p in where.rglob("*") if p.is_file()] if where.is_dir() else []
    where = Path(tempfile.gettempdir()) / "mlx" / version / "cpu"
    return list(where.rglob("*.so")) if where.is_dir() else []
