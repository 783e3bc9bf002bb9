"""A gang's rank in its training process (worker/supervisor/gang_claims.py is the queue's side):
its group over mx.distributed, and the sums across ranks that make a step of N ranks the step of
one worker for the same global batch (docs/distributed.md).

Every rank draws the same rows for a step (train_core.batch_rows: a function of step and seed)
and takes every N-th of them (`share`, as mlx_lm's trainer does). A loss that is a weighted mean
over its rows (tokens for SFT, pairs for DPO) is the weighted sum of the ranks' means, each
weighted by its share of the normaliser, so the gradients, the loss and its statistics are
summed across ranks after that weighting (`sum_tree`, in buckets as mlx_lm's average_gradients).

A step's rows are shared evenly (every N-th), or by speed (MTQ_GANG_SHARES "speed", the
default; supervised kinds): after each step the ranks sum a vector of their seconds per row of
the step's local work (before its gradients are summed), and every rank apportions the next
step's rows from that same vector (`Pace`), so all ranks agree on every share without talking.
The weighting by share of the normaliser keeps the step exactly one worker's for any split.

Backends (MTQ_GANG_BACKEND, `backend_env`), each formed from the environment variables MLX
reads, once per process (a process that joined one is replaced after its attempt):
    ring        TCP, every platform: MLX_RANK, MLX_HOSTFILE (a file: each rank's "host:port")
    jaccl       RDMA over Thunderbolt 5 (macOS 26.2+): MLX_RANK, MLX_JACCL_COORDINATOR (rank
                0's "host:port"), MLX_IBV_DEVICES (a file: the matrix of each rank's RDMA device
                to each other rank, null to itself)
    jaccl-ring  the same, neighbours only, with MLX_JACCL_RING=1
    nccl        CUDA: MLX_RANK, MLX_WORLD_SIZE, NCCL_HOST_IP and NCCL_PORT (rank 0's address);
                each worker's GPU is its CUDA_VISIBLE_DEVICES
"""

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from shared.routing import max_share

BUCKET_BYTES = 32 * 2**20  # mlx_lm's all-reduce bucket
BACKENDS = ("ring", "jaccl", "jaccl-ring", "nccl")
PACE_DECAY = 0.5  # weight of the newest step's seconds per row in a rank's pace
# A test and bench hook (MTQ_GANG_SLOW_S_PER_ROW): a rank sleeps this long per row of its local
# work, as a slower machine would take.
SLOW_S_PER_ROW = float(os.environ.get("MTQ_GANG_SLOW_S_PER_ROW") or 0)


def apportion(n: int, speeds: list[float]) -> list[int]:
    """n rows split in proportion to speeds, at least one each and at most `max_share` (what
    routing sized each member for; the rows over it go to the fastest ranks under it), by
    largest remainders (ties: the lower rank), so that the even split of rows[rank::size]
    comes out for equal speeds."""
    k = len(speeds)
    if n < k or not all(s > 0 for s in speeds):
        return [len(range(r, n, k)) for r in range(k)]
    exact = [(n - k) * s / sum(speeds) for s in speeds]
    counts = [1 + int(e) for e in exact]
    for r in sorted(range(k), key=lambda r: (-(exact[r] - int(exact[r])), r))[: n - sum(counts)]:
        counts[r] += 1
    cap = max_share(n, k)
    over = sum(max(c - cap, 0) for c in counts)
    counts = [min(c, cap) for c in counts]
    for r in sorted(range(k), key=lambda r: (-speeds[r], r)):
        more = min(over, cap - counts[r])
        counts[r] += more
        over -= more
    return counts


def interleave(counts: list[int]) -> list[int]:
    """Each position's rank, counts[r] positions of rank r, spread evenly (smooth weighted
    round robin): rank r's positions of equal counts are r, r + k, r + 2k..."""
    current, order = [0] * len(counts), []
    for _ in range(sum(counts)):
        current = [c + w for c, w in zip(current, counts)]
        r = max(range(len(counts)), key=lambda i: (current[i], -i))
        current[r] -= sum(counts)
        order.append(r)
    return order


@dataclass
class Pace:
    """The ranks' measured seconds per row (the same on every rank: each step's are summed)."""

    per_row: list[float] | None = None  # None: no step measured yet (shares are even)

    def speeds(self) -> list[float] | None:
        return None if self.per_row is None else [1 / max(t, 1e-9) for t in self.per_row]


@dataclass(frozen=True)
class Gang:
    rank: int = 0
    size: int = 1
    group: Any = None  # mx.distributed.Group
    by_speed: bool = False  # MTQ_GANG_SHARES "speed": shares follow the ranks' pace
    pace: Pace = field(default_factory=Pace)
    device: Any = mx.cpu  # where its sums run: ring's and jaccl's on the CPU, nccl's on the GPU

    def share(self, items: list) -> list:
        """This rank's share of a step's rows: every size-th, from its rank; by speed, rows
        in proportion to each rank's measured speed, spread over the step (`interleave`)."""
        speeds = self.pace.speeds() if self.by_speed else None
        if speeds is None:
            return items[self.rank::self.size]
        order = interleave(apportion(len(items), speeds))
        return [x for x, r in zip(items, order) if r == self.rank]

    def rows_per_rank(self, n: int) -> list[int]:
        """How many of n rows each rank takes (`share`)."""
        speeds = self.pace.speeds() if self.by_speed else None
        return [len(range(r, n, self.size)) for r in range(self.size)] if speeds is None else apportion(n, speeds)

    def local_work_done(self, rows: int) -> None:
        """The end of this rank's local work of a step (the test and bench hook's sleep)."""
        if SLOW_S_PER_ROW:
            time.sleep(SLOW_S_PER_ROW * rows)

    def measure(self, seconds: float, rows: int) -> None:
        """Every rank's seconds per row of this step's local work, summed across the ranks, into
        the pace (a decaying mean): the next step's shares. Every rank calls it once per step."""
        if self.size == 1 or not self.by_speed:
            return
        mine = [0.0] * self.size
        mine[self.rank] = seconds / max(rows, 1)
        every = self.sum(mx.array(mine, dtype=mx.float32)).tolist()
        old = self.pace.per_row
        self.pace.per_row = every if old is None else [PACE_DECAY * t + (1 - PACE_DECAY) * o for t, o in zip(every, old)]

    def sum(self, x: mx.array) -> mx.array:
        """x summed over the ranks (on the backend's device)."""
        return x if self.size == 1 else mx.distributed.all_sum(x, group=self.group, stream=self.device)

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


def backend_of(setting: str) -> str:
    """MTQ_GANG_BACKEND's backend here: "auto" is nccl on a CUDA GPU, else ring."""
    if setting != "auto":
        return setting
    return "nccl" if mx.default_device() == mx.gpu and mx.cuda.is_available() else "ring"


def backend_error(backend: str) -> str | None:
    """Why this machine cannot join gangs of `backend` (None: it can): the worker then
    advertises no gang address, so no gang picks it, and says why."""
    if backend not in BACKENDS:
        return f"MTQ_GANG_BACKEND={backend!r} is not one of auto, {', '.join(BACKENDS)}"
    name = "jaccl" if backend.startswith("jaccl") else backend
    if not mx.distributed.is_available(name):
        needs = {"jaccl": "a Mac with macOS 26.2+, Thunderbolt 5 and RDMA enabled (rdma_ctl enable)",
                 "nccl": "MLX's CUDA build (mlx[cuda]) on an NVIDIA GPU"}.get(name, "")
        return f"MTQ_GANG_BACKEND={backend}: this MLX ({mx.__version__}) has no {name} backend here; it needs {needs}"
    return None


def backend_env(backend: str, rank: int, hostfile: list[list[str]], directory: Path) -> dict[str, str]:
    """The environment variables MLX's `backend` forms its group from (the table above), for
    `rank` of the gang whose hostfile is each rank's entry: its "host:port" address (a jaccl
    gang's: then its RDMA device to each rank, "" for itself). Files go in `directory`."""
    env = {"MLX_RANK": str(rank)}
    if backend == "ring":
        (directory / "hostfile.json").write_text(json.dumps([entry[:1] for entry in hostfile]))
        env["MLX_HOSTFILE"] = str(directory / "hostfile.json")
    elif backend == "nccl":
        host, port = hostfile[0][0].rsplit(":", 1)
        env.update(MLX_WORLD_SIZE=str(len(hostfile)), NCCL_HOST_IP=host, NCCL_PORT=port)
    elif backend in ("jaccl", "jaccl-ring"):
        devices = [[d or None for d in entry[1:]] for entry in hostfile]
        (directory / "devices.json").write_text(json.dumps(devices))
        env.update(MLX_JACCL_COORDINATOR=hostfile[0][0], MLX_IBV_DEVICES=str(directory / "devices.json"))
        if backend == "jaccl-ring":
            env["MLX_JACCL_RING"] = "1"
    else:
        raise ValueError(backend_error(backend))
    return env


def join(rank: int, hostfile: list[list[str]], backend: str = "ring", by_speed: bool = False) -> Gang:
    """Join the group of `hostfile` (`backend_env`) as `rank`. Waits for every rank (the
    supervisor bounds it: MTQ_GANG_JOIN_S). A backend this machine lacks is refused at once.
    The files are temporary, gone once joined: MLX reads them once, in init
    (mlx/distributed/ring/ring.cpp, jaccl/jaccl.cpp)."""
    error = backend_error(backend)
    if error:
        raise RuntimeError(error)
    with tempfile.TemporaryDirectory(prefix="mtq-gang-") as directory:
        os.environ.update(backend_env(backend, rank, hostfile, Path(directory)))
        group = mx.distributed.init(strict=True, backend="jaccl" if backend.startswith("jaccl") else backend)
    if group.size() != len(hostfile) or group.rank() != rank:
        raise RuntimeError(f"joined a group of {group.size()} as rank {group.rank()}, not {len(hostfile)} as {rank}")
    return Gang(rank, len(hostfile), group, by_speed, device=mx.gpu if backend == "nccl" else mx.cpu)
