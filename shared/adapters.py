"""Adapters: where a job's adapter lives on a worker's disk, and its copy in Redis.

A completed GRPO job stores its adapter's files in Redis (shared.keys.adapter_key: file name
-> bytes) and indexes it in ADAPTERS_INDEX ("<model_id>/<adapter_name>" -> job_id of the
newest completed job of that name; shared/lifecycle.py `finish`). The API lists, deletes and
serves adapters from there, so a client never needs the worker's disk.

An adapter name (of a model) belongs to one owner at a time: the owner of the jobs that use
it (claim_name, when a job is created). Another owner's job of that name is refused (409), so
no one overwrites another's adapter, on disk or in the index. The name is free again once
every job that used it is gone (deleted, or expired after MTQ_JOB_RETENTION_S: the claim
expires with the last job of the name to finish, shared/lifecycle.py).
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.keys import ADAPTERS_INDEX, adapter_key, adapter_name_key, job_key
from shared.settings import Settings

if TYPE_CHECKING:  # the trainers import adapter_dir and need no Redis client
    import redis

WEIGHTS_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
MODEL_WEIGHTS_FILE = "model.safetensors"  # a full fine-tune's artefact is a whole model directory


def adapter_dir(settings: Settings, model_id: str, adapter_name: str) -> Path:
    """$MTQ_HOME/adapters/<model_id>/<adapter_name>; a model given as an absolute path
    contributes its directory name. The API sets a new job's adapter_path with it, and the
    worker writes the adapter there: both ask this one function."""
    model_part = Path(model_id).name if model_id.startswith("/") else model_id
    return settings.adapters_dir / model_part / adapter_name


def adapter_ref(model_id: str, adapter_name: str) -> str:
    """The adapters index's field: adapter names have no '/', so the last '/' splits it."""
    return f"{model_id}/{adapter_name}"


# KEYS[1]: the name's set of jobs; ARGV: owner ("" for none), the new job's id, the job key prefix.
# Jobs that are gone leave the set; 0 if a live one is another owner's, else the job joins it.
CLAIM_NAME = """
for _, job_id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local job = ARGV[3] .. job_id
  if redis.call('EXISTS', job) == 0 then
    redis.call('SREM', KEYS[1], job_id)
  elseif (redis.call('HGET', job, 'owner') or '') ~= ARGV[1] then
    return 0
  end
end
redis.call('SADD', KEYS[1], ARGV[2])
return 1
"""


def claim_name(r: redis.Redis, model_id: str, adapter_name: str, job_id: str, owner: str | None) -> bool:
    """Record that job `job_id` of `owner` uses this adapter name; False (nothing recorded) if
    a live job of another owner uses it."""
    return r.eval(CLAIM_NAME, 1, adapter_name_key(adapter_ref(model_id, adapter_name)), owner or "", job_id,
                  job_key("")) == 1


def split_ref(ref: str) -> tuple[str, str]:
    """(model_id, adapter_name) of an index field (adapter names have no '/')."""
    model_id, _, adapter_name = ref.rpartition("/")
    return model_id, adapter_name


def list_adapters(r: redis.Redis, model_id: str | None = None, owner: str | None = None) -> list[dict[str, Any]]:
    """The indexed adapters (of one model, of one token's jobs), sorted by model and name.
    Entries whose job has expired or was deleted are dropped from the index."""
    refs = {k.decode(): v.decode() for k, v in r.hgetall(ADAPTERS_INDEX).items()}
    if model_id is not None:
        refs = {ref: j for ref, j in refs.items() if split_ref(ref)[0] == model_id}
    items = sorted(refs.items())
    with r.pipeline(transaction=False) as p:
        for _, job_id in items:
            p.hmget(job_key(job_id), "adapter_path", "finished_at", "owner")
            p.hstrlen(adapter_key(job_id), WEIGHTS_FILE)
            p.hstrlen(adapter_key(job_id), MODEL_WEIGHTS_FILE)
            p.hget(adapter_key(job_id), CONFIG_FILE)
            p.exists(adapter_key(job_id))
        answers = p.execute()
    out, gone = [], []
    for i, (ref, job_id) in enumerate(items):
        (path, finished_at, job_owner), weights_len, model_len, config_raw, stored = answers[5 * i : 5 * i + 5]
        weights_len += model_len
        if not stored or path is None:
            gone.append(ref)
            continue
        if owner is not None and (job_owner or b"").decode() != owner:
            continue
        out.append(_entry(ref, job_id, path.decode(), finished_at, weights_len, config_raw))
    if gone:
        _forget(r, {ref: refs[ref] for ref in gone})
    return out


def _entry(ref: str, job_id: str, path: str, finished_at: bytes | None, weights_len: int,
           config_raw: bytes | None) -> dict[str, Any]:
    model_id, adapter_name = split_ref(ref)
    try:
        config = json.loads(config_raw) if config_raw else {}
    except ValueError:
        config = {}
    lora = config.get("lora_parameters") or {}
    return {
        "model_id": model_id, "adapter_name": adapter_name, "adapter_path": path,
        "has_weights": weights_len > 0, "has_config": config_raw is not None,
        "lora_layers": config.get("num_layers"), "lora_rank": lora.get("rank"),
        "fine_tune_type": config.get("fine_tune_type"),
        "job_id": job_id, "size": weights_len + len(config_raw or b""),
        "created_at": float(finished_at) if finished_at else None,
    }


def _forget(r: redis.Redis, refs: dict[str, str]) -> None:
    """Drop index entries, each only if it still names the same job (a newer job may have
    taken the name meanwhile)."""
    for ref, job_id in refs.items():
        r.eval("if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end return 0",
               1, ADAPTERS_INDEX, ref, job_id)


def find(r: redis.Redis, model_id: str, adapter_name: str) -> str | None:
    """The job id whose adapter carries this name, if its copy is still stored."""
    job_id = r.hget(ADAPTERS_INDEX, adapter_ref(model_id, adapter_name))
    if job_id is None or not r.exists(adapter_key(job_id.decode())):
        return None
    return job_id.decode()


def delete(r: redis.Redis, model_id: str, adapter_name: str) -> bool:
    """Remove the index entry and the adapter's copy in Redis. False if there is none."""
    from redis import WatchError

    ref = adapter_ref(model_id, adapter_name)
    with r.pipeline() as p:
        while True:
            try:
                p.watch(ADAPTERS_INDEX)
                job_id = p.hget(ADAPTERS_INDEX, ref)
                if job_id is None:
                    return False
                p.multi()
                p.hdel(ADAPTERS_INDEX, ref)
                p.delete(adapter_key(job_id.decode()))
                p.execute()
                return True
            except WatchError:
                continue


def files(r: redis.Redis, job_id: str) -> dict[str, bytes]:
    """The adapter's files as stored by the job ({} if there is no copy)."""
    return {k.decode(): v for k, v in r.hgetall(adapter_key(job_id)).items()}


def tar_gz(stored: dict[str, bytes]) -> bytes:
    """A .tar.gz of the adapter's files at its top level: extract it into a directory and
    pass that directory to mlx_lm.load(..., adapter_path=...)."""
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in sorted(stored):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(stored[name]), int(now), 0o644
            tar.addfile(info, io.BytesIO(stored[name]))
    return buf.getvalue()
