"""Compiled kernels shared by a fleet's workers through Redis, so that a worker joining a fleet
starts warm: MLX compiles a fresh machine's kernels on first use (minutes on a fresh CUDA
machine), and the kernel cache (worker/supervisor/kernel_cache.py) keeps them per $MTQ_HOME only.

A fleet is the workers of one MLX version on one kind of device (backend, device name, machine
architecture): what one of them compiles, the others can load. In Redis (shared/keys.py) each
fleet has an index, kernel name -> the sha256 of its entry, and each entry (the fleet it was
compiled for, the kernel's name, its files: a CPU kernel's shared object; a CUDA kernel's
NVRTC output, .ptx, and the list of names beside it, .txt) is stored once, under its own sha256.

    publish  the kernels in the worker's cache that the fleet's index lacks: at start, after each
             job, and while idle when the cache has grown (scoring and completions compile too)
    fetch    at start, before the first job: the fleet's kernels the cache lacks, each verified
             before it is written (its sha256, its fleet, its name, its files' names and sizes).
             A refused entry is never written: it leaves the index, MLX compiles the kernel when
             a job needs it, and the worker then publishes its own.

Bounds: an entry of at most ENTRY_MAX_BYTES; all fleets' entries together at most
MTQ_KERNEL_SHARE_MB of Redis memory, first come first kept (past it nothing more is published);
MTQ_KERNEL_SHARE_MB=0 turns sharing off. Sharing is an optimisation: a Redis or disk error is
logged and the kernels are compiled as without it.

No MLX here: the training process (worker/runtime/training_process.py) names its fleet.
"""

import hashlib
import json
import logging
import time
from pathlib import Path, PurePosixPath

import redis

from shared.keys import KERNELS_BYTES, kernel_entry_key, kernels_index_key
from worker.supervisor import kernel_cache

log = logging.getLogger(__name__)

ENTRY_MAX_BYTES = 16 * 2**20  # one kernel's files (a CPU kernel's are about 16 KB)
# A file younger than this may still be being written by another worker on the same $MTQ_HOME
# (MLX's CPU compiler writes the shared object in place): it is published later.
FRESH_S = 1.0
IDLE_CHECK_S = 10.0  # while idle, how often the cache is looked at for new kernels
# A kernel's files by backend: the first suffix names it, the others sit beside it (same stem).
SUFFIXES = {"cpu": (".so",), "cuda": (".ptx", ".txt")}

# KEYS: the fleet's index, the entry, the byte count; ARGV: name, sha256, size, cap, entry.
_ADD = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 0 then
  if tonumber(redis.call('GET', KEYS[3]) or '0') + tonumber(ARGV[3]) > tonumber(ARGV[4]) then return -1 end
  redis.call('SET', KEYS[2], ARGV[5])
  redis.call('INCRBY', KEYS[3], ARGV[3])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
# The same KEYS; ARGV: name, sha256. Only while the index still names that entry.
_DROP = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
local size = redis.call('STRLEN', KEYS[2])
if redis.call('DEL', KEYS[2]) == 1 then redis.call('DECRBY', KEYS[3], size) end
return 1
"""


def fleet_id(fleet: dict) -> str:
    """The fleet's part of its index key, e.g. 'device=cpu device_name=AMD EPYC machine=x86_64 mlx=0.32.4'."""
    return " ".join(f"{k}={fleet[k]}" for k in sorted(fleet))


def pack(name: str, fleet: dict, files: list[tuple[str, bytes]]) -> bytes:
    """An entry: a JSON header line (name, fleet, each file's path in the cache and size), then the files."""
    head = {"name": name, "fleet": fleet, "files": [[path, len(data)] for path, data in files]}
    return json.dumps(head, sort_keys=True).encode() + b"\n" + b"".join(data for _, data in files)


def unpack(entry: bytes | None, sha256: str, name: str, fleet: dict, backend: str) -> list[tuple[str, bytes]] | str:
    """The files of the entry the fleet's index names `name` by `sha256`, once verified; else why it is refused."""
    if entry is None:
        return "its entry is missing or too large"
    if hashlib.sha256(entry).hexdigest() != sha256:
        return "its content does not match its sha256"
    head, _, body = entry.partition(b"\n")
    try:
        head = json.loads(head)
        files = [(path, size) for path, size in head["files"]]
        if not all(isinstance(path, str) and type(size) is int and size >= 0 for path, size in files):
            raise ValueError(files)
    except (ValueError, TypeError, KeyError):
        return "its header cannot be read"
    if head.get("fleet") != fleet:
        return f"it was compiled for another fleet ({fleet_id(head['fleet']) if isinstance(head.get('fleet'), dict) else '?'})"
    if head.get("name") != name:
        return "it names another kernel"
    if not safe_name(name, backend):
        return "its name is not a path inside the cache"
    stem = name[:-len(SUFFIXES[backend][0])]
    paths = [path for path, _ in files]
    if not paths or paths[0] != name or len(set(paths)) != len(paths) or \
            not set(paths) <= {stem + suffix for suffix in SUFFIXES[backend]}:
        return "its files are not the kernel's"
    if sum(size for _, size in files) != len(body):
        return "its files' sizes do not add up"
    out, at = [], 0
    for path, size in files:
        out.append((path, body[at:at + size]))
        at += size
    return out


def safe_name(name: str, backend: str) -> bool:
    """A kernel's name is a relative path inside the cache directory, with its backend's suffix."""
    parts = PurePosixPath(name).parts
    return (0 < len(name) < 4096 and "\x00" not in name and "\\" not in name and not name.startswith("/")
            and all(part not in ("", ".", "..") for part in parts) and name.endswith(SUFFIXES[backend][0])
            and len(name) > len(SUFFIXES[backend][0]))


def local_kernels(where: Path, backend: str) -> dict[str, list[Path]]:
    """The kernels in a cache directory: name (its first file's path there) -> its files."""
    first, *others = SUFFIXES[backend]
    found = {}
    for path in where.rglob("*" + first) if where.is_dir() else ():
        if path.is_file():
            found[path.relative_to(where).as_posix()] = [path] + [p for s in others if (p := path.with_suffix(s)).is_file()]
    return found


class KernelShare:
    """A training process's side of its fleet's shared kernels: `where` is its cache directory
    for `backend` (kernel_cache.kernel_dir), cap_mb the fleets' total in Redis (0: off)."""

    def __init__(self, r: redis.Redis, where: Path, backend: str, fleet: dict, cap_mb: float):
        self.r, self.where, self.backend, self.fleet = r, where, backend, fleet
        self.cap = int(cap_mb * 2**20)
        self.index = kernels_index_key(fleet_id(fleet))
        self.published_count = -1  # kernels in the cache at the last complete publish (-1: publish again)
        self.looked_at = time.monotonic()

    def fetch(self) -> None:
        """Write the fleet's kernels that this cache lacks into it, each verified first."""
        if self.cap <= 0:
            return
        loaded, refused, t0 = 0, 0, time.monotonic()
        try:
            index = self.r.hgetall(self.index)
            have = local_kernels(self.where, self.backend)
            for raw_name, raw_sha in index.items():
                name, sha = raw_name.decode(errors="replace"), raw_sha.decode(errors="replace")
                if name in have:
                    continue
                key = kernel_entry_key(sha)
                entry = self.r.get(key) if self.r.strlen(key) <= ENTRY_MAX_BYTES else None
                files = unpack(entry, sha, name, self.fleet, self.backend)
                if isinstance(files, str):
                    log.warning("kernel share: refused %s: %s (MLX compiles it when needed)", name, files)
                    self.r.eval(_DROP, 3, self.index, key, KERNELS_BYTES, raw_name, raw_sha)
                    refused += 1
                    continue
                for path, data in files:
                    kernel_cache.write_whole(self.where / path, data)
                loaded += 1
        except (redis.RedisError, OSError) as e:
            log.warning("kernel share: could not fetch the fleet's kernels: %s", e)
        log.info("kernel share: fetched %d kernels from the fleet (%s) in %.2f s, refused %d", loaded,
                 fleet_id(self.fleet), time.monotonic() - t0, refused)

    def publish(self) -> int:
        """Add the kernels of this cache that the fleet's index lacks; how many were added."""
        if self.cap <= 0:
            return 0
        added, t0 = 0, time.monotonic()
        try:
            have = {name.decode(errors="replace") for name in self.r.hkeys(self.index)}
            kernels = local_kernels(self.where, self.backend)
            self.published_count = len(kernels)
            for name, paths in sorted(kernels.items()):
                if name in have:
                    continue
                if any(time.time() - p.stat().st_mtime < FRESH_S for p in paths):
                    self.published_count = -1  # the idle check publishes it, FRESH_S from now
                    self.looked_at = time.monotonic() - IDLE_CHECK_S + FRESH_S
                    continue
                entry = pack(name, self.fleet, [(p.relative_to(self.where).as_posix(), p.read_bytes()) for p in paths])
                if len(entry) > ENTRY_MAX_BYTES:
                    continue
                sha = hashlib.sha256(entry).hexdigest()
                done = self.r.eval(_ADD, 3, self.index, kernel_entry_key(sha), KERNELS_BYTES, name, sha, len(entry),
                                   self.cap, entry)
                if done < 0:
                    log.info("kernel share: full (MTQ_KERNEL_SHARE_MB=%s): %s and later kernels not published",
                             self.cap / 2**20, name)
                    break
                added += done
        except (redis.RedisError, OSError) as e:
            log.warning("kernel share: could not publish this worker's kernels: %s", e)
            self.published_count = -1
        if added:
            log.info("kernel share: published %d kernels to the fleet (%s) in %.2f s", added, fleet_id(self.fleet),
                     time.monotonic() - t0)
        return added

    def publish_if_grown(self) -> None:
        """While idle, every IDLE_CHECK_S: publish when the cache holds other kernels than at the last
        publish, or when the last one left a kernel too fresh to publish."""
        if self.cap <= 0 or time.monotonic() - self.looked_at < IDLE_CHECK_S:
            return
        self.looked_at = time.monotonic()
        if len(local_kernels(self.where, self.backend)) != self.published_count:
            self.publish()
