"""Where MLX keeps the kernels it compiles, for the training process: a directory under $MTQ_HOME
(MTQ_KERNEL_CACHE, default $MTQ_HOME/kernel-cache) rather than the temp directory, so that the
kernels outlive a cleaned /tmp and a second worker on the same $MTQ_HOME (the same machine, or
a shared volume) runs its first step without compiling them. Workers on other machines share
them through Redis (worker/supervisor/kernel_share.py).

    CPU    MLX caches compiled kernels in temp_directory_path()/mlx/<version>/cpu, and only
           TMPDIR moves that: the training process's TMPDIR is the cache directory (its other
           temporary files go there too, and so stay under $MTQ_HOME)
    CUDA   MLX_PTX_CACHE_DIR when set, else temp_directory_path()/mlx/<version>/ptx: the same
           TMPDIR puts it in the cache directory. The CUDA driver keeps its own cache of the
           machine code it builds from PTX (CUDA_CACHE_PATH, default ~/.nv/ComputeCache,
           hundreds of MB after one job): cache_dir/cuda-driver, unless CUDA_CACHE_PATH is set
    Metal  no disk cache: each process compiles its kernels

No MLX here: the training process's entry (worker/supervisor/child.py child_main) calls `use`
before MLX is imported.
"""

import os
import tempfile
from pathlib import Path

# The CUDA driver's cache size (CUDA_CACHE_MAXSIZE, bytes), unless set: the largest it accepts.
# Its default (256 MiB on older drivers, 1 GiB on newer) is near what one GRPO job left on an
# H200 (578 MB): a few jobs' shapes would evict each other's machine code, built again each time.
CUDA_DRIVER_CACHE_BYTES = 4 * 2**30


def use(cache_dir: Path) -> None:
    """Make this process (and the processes it starts) keep MLX's kernels, and the CUDA
    driver's, in cache_dir."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(cache_dir)
    tempfile.tempdir = None  # Python's tempfile reads TMPDIR again
    os.environ.setdefault("CUDA_CACHE_PATH", str(cache_dir / "cuda-driver"))
    os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(CUDA_DRIVER_CACHE_BYTES))


def kernel_dir(version: str, backend: str) -> Path:
    """The directory MLX `version` keeps this process's compiled kernels in (backend: "cpu" or "cuda")."""
    if backend == "cuda":
        return Path(os.environ.get("MLX_PTX_CACHE_DIR") or Path(tempfile.gettempdir()) / "mlx" / version / "ptx")
    return Path(tempfile.gettempdir()) / "mlx" / version / "cpu"


def compiled_kernels(version: str, backend: str) -> list[Path]:
    """The kernels compiled into this process's cache so far (CUDA: each kernel's files)."""
    where = kernel_dir(version, backend)
    if not where.is_dir():
        return []
    return [p for p in where.rglob("*") if p.is_file()] if backend == "cuda" else list(where.rglob("*.so"))


def write_whole(path: Path, data: bytes) -> None:
    """Whole or not at all: MLX may read the cache at any time (so may another worker's on this $MTQ_HOME)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".shared-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
