"""Model staging: a gang member without the job's model receives it from its leader over Redis
before the gang forms (docs/distributed.md#model-staging), as mlx_lm's `share` copies a model to
every node. No MLX here: files and Redis only.

    mtq:stage:<job_id>:<epoch>   hash, per attempt: rank<k> -> "have" | "need" | "got <bytes>" |
                                 "done" | "error: ..." (member k's state), and "manifest" (JSON:
                                 the model's files, each a list of chunk hashes), which the
                                 leader writes once some member needs the model
    mtq:model-chunk:<sha256>     one chunk (CHUNK_BYTES at most) of a model file, named by the
                                 SHA-256 of its bytes: a chunk stored once serves every file,
                                 model and gang that has it; each expires after CHUNK_TTL_S

A member checks every chunk against its name on arrival (a chunk that does not match is
refused and deleted, so that the next attempt stores it again), writes the files into a private
directory under its models directory and renames it into place, so a model directory is never
partial. The leader waits for its members (`lead`) and a member for the manifest (`receive`)
without progress for at most `wait_s` (MTQ_GANG_JOIN_S): the attempt is then lost.
"""

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import redis

CHUNK_BYTES = 8 * 2**20
CHUNK_TTL_S = 3600
POLL_S = 0.2


class StagingFailed(RuntimeError):
    pass


def stage_key(job_id: str, epoch: int) -> str:
    return f"mtq:stage:{job_id}:{epoch}"


def chunk_key(digest: str) -> str:
    return f"mtq:model-chunk:{digest}"


def model_files(model_dir: Path) -> list[Path]:
    """The files of a model directory (a Hugging Face snapshot's are links: followed), sorted."""
    return sorted(p for p in model_dir.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(model_dir).parts))


def publish(r: redis.Redis, model_dir: Path) -> dict:
    """Store the model's files as chunks (those already stored only have their expiry renewed);
    its manifest: {"files": [{"path", "size", "chunks": [sha256, ...]}]}."""
    files = []
    for path in model_files(model_dir):
        chunks = []
        with path.open("rb") as f:
            while data := f.read(CHUNK_BYTES):
                digest = hashlib.sha256(data).hexdigest()
                if not r.expire(chunk_key(digest), CHUNK_TTL_S):
                    r.set(chunk_key(digest), data, ex=CHUNK_TTL_S)
                chunks.append(digest)
        files.append({"path": path.relative_to(model_dir).as_posix(), "size": path.stat().st_size, "chunks": chunks})
    return {"files": files}


def fetch(r: redis.Redis, manifest: dict, target: Path, progress: Callable[[int], None] = lambda n: None) -> Path:
    """Write the manifest's model at `target` (a directory that does not exist yet), from its
    chunks, each checked against its hash; atomically: a private directory beside it, renamed
    into place. Raises StagingFailed on a missing or corrupted chunk or a bad file name."""
    tmp = target.parent / f".{target.name}.staging-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    received = 0
    try:
        for entry in manifest["files"]:
            rel = Path(entry["path"])
            if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                raise StagingFailed(f"model staging: a file name outside the model directory: {entry['path']!r}")
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("wb") as f:
                for digest in entry["chunks"]:
                    data = r.get(chunk_key(digest))
                    if data is None:
                        raise StagingFailed(f"model staging: chunk {digest[:12]} of {entry['path']} is gone from Redis")
                    if hashlib.sha256(data).hexdigest() != digest:
                        # Content-addressed: a bad copy would be reused by every later attempt.
                        r.eval("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end "
                               "return 0", 1, chunk_key(digest), data)
                        raise StagingFailed(f"model staging: chunk {digest[:12]} of {entry['path']} does not match its "
                                            "hash; refused")
                    f.write(data)
                    received += len(data)
                    progress(received)
            if out.stat().st_size != entry["size"]:
                raise StagingFailed(f"model staging: {entry['path']} has {out.stat().st_size} bytes, not {entry['size']}")
        if target.exists():  # another job's staging got there first: its copy stays
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _wait(r: redis.Redis, key: str, done: Callable[[dict], bool], wait_s: float, mark: Callable[[], None],
          what: str) -> dict:
    """Poll the staging hash until done(fields); a mark at every change. Raises StagingFailed
    after wait_s without a change, or when a member reports an error."""
    last, since = None, time.monotonic()
    while True:
        fields = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
        errors = [f"{k}: {v}" for k, v in fields.items() if v.startswith("error")]
        if errors:
            raise StagingFailed("model staging failed: " + "; ".join(errors))
        if done(fields):
            return fields
        if fields != last:
            last, since = fields, time.monotonic()
            mark()
        elif time.monotonic() - since > wait_s:
            raise StagingFailed(f"model staging: no progress within {wait_s:g}s waiting for {what}")
        time.sleep(POLL_S)


def lead(r: redis.Redis, job_id: str, epoch: int, size: int, model_dir: Path, wait_s: float,
         mark: Callable[[], None]) -> list[int]:
    """Rank 0: once every member said whether it has the model, publish it if any needs it and
    wait until each of those has it. The ranks that received it."""
    key = stage_key(job_id, epoch)
    ranks = [f"rank{k}" for k in range(1, size)]
    fields = _wait(r, key, lambda f: all(k in f for k in ranks), wait_s, mark, "every member to check its models")
    needing = [k for k in ranks if fields[k] != "have"]
    if needing:
        manifest = publish(r, model_dir)
        r.hset(key, "manifest", json.dumps(manifest))
        _wait(r, key, lambda f: all(f[k] == "done" for k in needing), wait_s, mark, "members to receive the model")
    r.expire(key, CHUNK_TTL_S)
    return [int(k.removeprefix("rank")) for k in needing]


def receive(r: redis.Redis, job_id: str, epoch: int, rank: int, target: Path | None, wait_s: float,
            mark: Callable[[], None]) -> bool:
    """A member: say whether it has the model (target None: it has it); else wait for the
    leader's manifest and write the model at `target`. Whether it received the model."""
    key, field = stage_key(job_id, epoch), f"rank{rank}"
    r.hset(key, field, "have" if target is None else "need")
    r.expire(key, CHUNK_TTL_S)
    if target is None:
        return False
    fields = _wait(r, key, lambda f: "manifest" in f, wait_s, mark, "the leader's manifest")
    try:
        fetch(r, json.loads(fields["manifest"]), target, lambda n: (r.hset(key, field, f"got {n}"), mark()))
    except StagingFailed as e:
        r.hset(key, field, f"error: {e}")
        raise
    r.hset(key, field, "done")
    return True
