"""MLX's settings for a process that lives as long as its worker (the training process), set
before MLX starts. No MLX here: worker/supervisor/child.py child_main calls `use` first.

MLX's CUDA backend caches the CUDA graphs it builds (an LRU of MLX_CUDA_GRAPH_CACHE_SIZE, 400)
and, by default, counts every miss of the process's life: past twice the capacity it raises
"Cache thrashing is happening" on every miss after, so a worker that ran enough jobs of other
kinds and shapes would fail each new one for the rest of its life (bench/worker_life.py).
Without the count the cache evicts as any LRU does, and a miss costs one graph's instantiation.
"""

import os

SETTINGS = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}


def use() -> None:
    """This process's MLX settings (and its children's), where the environment names none."""
    for name, value in SETTINGS.items():
        os.environ.setdefault(name, value)
