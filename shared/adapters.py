"""Adapters: where a job's adapter lives on a worker's disk, and its copy in Redis.

A completed job stores its adapter's files in Redis (shared.keys.adapter_key: file name
-> bytes) and indexes it in ADAPTERS_INDEX ("<model_id>/<adapter_name>" -> job_id of the
newest completed job of that name; shared/lifecycle.py `finish`). The API lists, deletes and
serves adapters from there, so a client never needs the worker's disk.

An adapter name (of a model) belongs to one owner at a time: the owner of the jobs that use
it (claim_name, when a job is created). Another owner's job of that name is refused (409), so
no one overwrites another's adapter, on disk or in the index. The name is free again once
every job that used it is gone (deleted, or expired after MTQ_JOB_RETENTION_S: the claim
expires with the last job of the name to finish, shared/lifecycle.py).

An adapter can also be uploaded (POST /admin/api/fine-tune/files?purpose=adapter): mlx_lm's
adapters.safetensors alone, or a .tar.gz of an adapter directory (what the download routes
give). Either can be a job's `init_adapter`, as a completed job's adapter can; `adapter_shape`
is what the API compares with the new job's config, `cached_copy` what the worker loads.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.datasets import file_key
from shared.keys import ADAPTERS_INDEX, adapter_key, adapter_name_key, job_key
from shared.settings import Settings

if TYPE_CHECKING:  # the trainers import adapter_dir and need no Redis client
    import redis

WEIGHTS_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
HEAD_FILE = "value_head.safetensors"  # a reward model's value head (worker/kinds/reward_head.py)
MODEL_WEIGHTS_FILE = "model.safetensors"  # a full fine-tune's artefact is a whole model directory
ADAPTER_FILES = (WEIGHTS_FILE, CONFIG_FILE, HEAD_FILE)
ADAPTER_LEAVES = ("lora_a", "lora_b", "m")  # mlx_lm's LoRA and DoRA weights (m: DoRA's magnitudes)
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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


# --------------------------------------------------------------------------- uploaded adapters


class AdapterFileError(ValueError):
    """An upload that is not an mlx_lm adapter; the message says why."""


def upload_files(content: bytes, max_bytes: int) -> dict[str, bytes]:
    """The files of an uploaded adapter: a .tar.gz of an adapter directory (its adapters.safetensors,
    and adapter_config.json / value_head.safetensors if there; other members are ignored), or
    adapters.safetensors alone. Extracted sizes are bounded by max_bytes in all."""
    if content[:2] != b"\x1f\x8b":
        return {WEIGHTS_FILE: content}
    try:
        with tarfile.open(fileobj=io.BytesIO(content), mode="r:gz") as tar:
            members = [m for m in tar.getmembers() if m.isfile() and Path(m.name).name in ADAPTER_FILES]
            if sum(m.size for m in members) > max_bytes:
                raise AdapterFileError(f"its files hold more than {max_bytes} bytes (MTQ_MAX_FILE_BYTES)")
            files = {Path(m.name).name: tar.extractfile(m).read() for m in members}
    except (tarfile.TarError, EOFError, OSError) as e:
        raise AdapterFileError(f"not a readable .tar.gz: {e}") from None
    if WEIGHTS_FILE not in files:
        raise AdapterFileError(f"the archive has no {WEIGHTS_FILE}")
    return files


def safetensors_shapes(content: bytes) -> dict[str, list[int]]:
    """Tensor names and shapes from a safetensors file's header (8 bytes of length, then JSON)."""
    n = int.from_bytes(content[:8], "little") if len(content) >= 8 else -1
    if not 2 <= n <= min(len(content) - 8, 100 * 2**20):
        raise AdapterFileError(f"{WEIGHTS_FILE} is not a safetensors file")
    try:
        header = json.loads(content[8:8 + n])
        return {name: [int(d) for d in t["shape"]] for name, t in header.items() if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise AdapterFileError(f"{WEIGHTS_FILE} has an unreadable safetensors header") from None


def upload_summary(files: dict[str, bytes]) -> dict[str, Any]:
    """What the API checks a job's config against (adapter_shape), from an upload's files."""
    shapes = safetensors_shapes(files[WEIGHTS_FILE])
    other = [k for k in shapes if k.rsplit(".", 1)[-1] not in ADAPTER_LEAVES]
    if not shapes or other:
        raise AdapterFileError(f"not an mlx_lm LoRA / DoRA adapter (tensor {other[0] if other else 'none'!r})")
    config = None
    if CONFIG_FILE in files:
        try:
            config = json.loads(files[CONFIG_FILE])
        except ValueError:
            raise AdapterFileError(f"{CONFIG_FILE} is not JSON") from None
    ranks = {shape[1] for name, shape in shapes.items() if name.endswith(".lora_a") and len(shape) == 2}
    if len(ranks) != 1:
        raise AdapterFileError(f"its lora_a weights have {len(ranks)} different ranks")
    layers = {int(m.group(1)) for name in shapes if (m := LAYER.search(name))}
    return {"tensors": len(shapes), "rank": ranks.pop(), "layers": len(layers),
            "dora": any(name.endswith(".m") for name in shapes), "config": config,
            "value_head": HEAD_FILE in files}


def adapter_shape(config: dict | None, summary: dict | None = None) -> dict[str, Any]:
    """An adapter's shape as a job's config names it (lora_rank, lora_layers, lora_alpha, dora,
    full), from its adapter_config.json and, for an upload, its weights (summary: the number of
    layers with LoRA as `layer_count`); what the files do not say is left out."""
    shape: dict[str, Any] = {}
    if summary is not None:
        shape = {"lora_rank": summary["rank"], "layer_count": summary["layers"], "dora": summary["dora"], "full": False}
    if config:
        lora = config.get("lora_parameters") or {}
        shape.update({"lora_rank": lora.get("rank"), "lora_layers": config.get("num_layers"),
                      "lora_alpha": lora.get("scale"), "dora": config.get("fine_tune_type") == "dora",
                      "full": config.get("fine_tune_type") == "full"})
    return {k: v for k, v in shape.items() if v is not None}


def shape_mismatches(job_config, fine_tune_type: str, shape: dict[str, Any]) -> list[str]:
    """How an adapter of `shape` does not fit a job's config (its fine_tune_type): each field in words."""
    if fine_tune_type == "full" or shape.get("full"):
        return ["fine_tune_type: a full fine-tune's weights are no adapter, and it starts from none"]
    errors = []
    if "dora" in shape and shape["dora"] != (fine_tune_type == "dora"):
        errors.append(f"fine_tune_type: {fine_tune_type} here, {'dora' if shape['dora'] else 'lora'} in the adapter")
    for name in ("lora_rank", "lora_layers", "lora_alpha"):
        if name in shape and shape[name] != getattr(job_config, name):
            errors.append(f"{name}: {getattr(job_config, name)} here, {shape[name]} in the adapter")
    if "layer_count" in shape and job_config.lora_layers not in (-1, shape["layer_count"]):
        errors.append(f"lora_layers: {job_config.lora_layers} here, {shape['layer_count']} layers in the adapter")
    return errors


def init_files(r: redis.Redis, init, max_bytes: int) -> tuple[str, dict[str, bytes]]:
    """(its cache name, its files) of a job's init_adapter (shared/schemas.py InitAdapter, as
    the API resolved it): the stored adapter of its job, or the upload."""
    if init.file_id is not None:
        content = r.hget(file_key(init.file_id), "content")
        stored = {} if content is None else upload_files(content, max_bytes)
        where, what = f"uploads/{init.file_id}", f"file {init.file_id}"
    else:
        stored = files(r, init.job_id)
        where, what = f"adapters/{init.job_id}", f"the adapter of job {init.job_id}"
    if WEIGHTS_FILE not in stored:
        raise AdapterFileError(f"init_adapter: {what} is gone (deleted, or expired after MTQ_JOB_RETENTION_S)")
    return where, stored


def init_adapter_dir(r: redis.Redis, settings: Settings, init) -> Path | None:
    """A job's init_adapter as a directory on this machine (None: the job has none)."""
    return None if init is None else cached_copy(settings, *init_files(r, init, settings.max_file_bytes))


def cached_copy(settings: Settings, where: str, files: dict[str, bytes]) -> Path:
    """The files in this machine's cache ($MTQ_HOME/cache/<where>), written once (atomically)."""
    out = settings.home / "cache" / where
    if not (out / WEIGHTS_FILE).is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, blob in files.items():
            (tmp / Path(name).name).write_bytes(blob)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out
