"""A gang's rank in its training process (worker/supervisor/gang_claims.py is the queue's side):
its group over mx.distributed, and the sums across ranks that make a step of N ranks the step of
one worker for the same global batch (docs/distributed.md).

Every rank draws the same rows for a step (train_core.batch_rows: a function of step and seed)
and takes every N-th of them (`share`, as mlx_lm's trainer does). A loss that is a weighted mean
over its rows (tokens for SFT, pairs for DPO) is the weighted sum of the ranks' means, each
weighted by its share of the normaliser, so the gradients, the loss and its statistics are
summed across ranks after that weighting (`sum_tree`, in buckets as mlx_lm's average_gradients).

The ring backend (TCP; every platform) forms from MLX_RANK and MLX_HOSTFILE, once per process:
a process that joined one is replaced after its attempt (the supervisor starts a fresh
training process).
"""

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

BUCKET_BYTES = 32 * 2**20  # mlx_lm's all-reduce bucket


@dataclass(frozen=True)
class Gang:
    rank: int = 0
    size: int = 1
    group: Any = None  # mx.distributed.Group

    def share(self, items: list) -> list:
        """This rank's share of a step's rows: every size-th, from its rank."""
        return items[self.rank::self.size]

    def sum(self, x: mx.array) -> mx.array:
        """x summed over the ranks (on the CPU stream: the ring backend's)."""
        return x if self.size == 1 else mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)

    def sum_tree(self, tree):
        """Every array of a tree summed over the ranks, flattened into buckets of BUCKET_BYTES."""
        if self.size == 1:
            return tree
        flat = tree_flatten(tree)
        out, bucket, size = [], [], 0
        for i, (_, v) in enumerate(flat):
            bucket.append(v)
            size += v.nbytes
            if size >= BUCKET_BYTES or i == len(flat) - 1:
                dtype = mx.float32 if any(b.dtype == mx.float32 for b in bucket) else bucket[0].dtype
                summed = self.sum(mx.concatenate([b.reshape(-1).astype(dtype) for b in bucket]))
                offset = 0
                for b in bucket:
                    out.append(summed[offset:offset + b.size].reshape(b.shape).astype(b.dtype))
                    offset += b.size
                bucket, size = [], 0
        return tree_unflatten([(k, v) for (k, _), v in zip(flat, out)])


SOLO = Gang()


def join(rank: int, hostfile: list[list[str]]) -> Gang:
    """Join the ring group of `hostfile` (each rank's "host:port" addresses) as `rank`. Waits for
    every rank (the supervisor bounds it: MTQ_GANG_JOIN_S). The hostfile is a temporary file,
    gone once joined: MLX reads it once, in init (mlx/distributed/ring/ring.cpp)."""
    with tempfile.TemporaryDirectory(prefix="mtq-gang-") as directory:
        path = Path(directory) / "hostfile.json"
        path.write_text(json.dumps(hostfile))
        os.environ.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(path))
        group = mx.distributed.init(strict=True, backend="ring")
    if group.size() != len(hostfile) or group.rank() != rank:
        raise RuntimeError(f"joined a group of {group.size()} as rank {group.rank()}, not {len(hostfile)} as {rank}")
    return Gang(rank, len(hostfile), group)
