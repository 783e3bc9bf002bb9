"""Worker advertisements: what each live worker can do, in Redis, for the API to read.

Two keys per worker, both expiring (a dead worker disappears within `ttl_s`):

  mtq:worker:<name>          JSON {name, host, pid, version, started_at, models_dir,
                             models: [{model_id, model_type, model_path, size_bytes, shape}],
                             queues, lanes, hub, declared (model ids it offers besides),
                             device, device_name, memory_total_gb, memory_gb, memory_declared,
                             current_job, gang_address ("host:port" its gang ranks listen on,
                             worker/supervisor/gang_claims.py; null where it cannot join its
                             backend), gang_backend, gang_error (why not), gang_rdma ({peer
                             worker: its RDMA device to that peer}, jaccl's), models_free_bytes
                             (free disk for models staged from a gang's leader)}; written by the worker's
                             supervisor from its heartbeat and when a job starts or ends
                             (`advertise`), which also renews the key below.
  mtq:worker:<name>:loaded   JSON [model_id, ...]: the models its training process holds
                             loaded; written by the training process itself (`publish_loaded`)
                             whenever that set changes, so the supervisor never needs MLX.

`models` lists the directories under the worker's MTQ_MODELS_DIR that hold a config.json
(names, and org/name for Hugging Face ids), those under MTQ_MODEL_ROOTS (absolute paths) and
the local Hugging Face cache's; size_bytes and shape feed the memory estimate that routes
jobs (shared/routing.py); model_type is "vlm" for a config with a vision part, "llm" otherwise, null when config.json cannot be read. Readers: `live_workers`,
`model_list` (the seed's GET /admin/api/fine-tune/models).
"""

import json
import os
import re
import socket
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import redis

from shared.memory_estimate import shape_from_config
from shared.model_ids import MODEL_NAME

WORKERS = "mtq:workers"  # set of worker names that advertised (entries whose key expired are dropped on read)
MAX_MODELS = 1000  # directories listed per worker
_MODEL_NAME = re.compile(rf"^{MODEL_NAME}$")


def worker_key(name: str) -> str:
    return f"mtq:worker:{name}"


def loaded_key(name: str) -> str:
    return f"mtq:worker:{name}:loaded"


def package_version() -> str:
    try:
        return version("mlx-train-queue")
    except PackageNotFoundError:
        return "unknown"


def model_info(model_id: str, model_dir: Path) -> dict[str, Any]:
    """What routing needs to know of a model directory: its type, the size of its weights
    (the safetensors files) and its shape (config.json), for the memory estimate."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        return {"model_id": model_id, "model_type": None, "model_path": str(model_dir), "size_bytes": None, "shape": None}
    shape = shape_from_config(config)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return {"model_id": model_id, "model_type": "vlm" if "vision_config" in config else "llm",
            "model_path": str(model_dir), "size_bytes": size, "shape": None if shape is None else shape.as_dict()}


def local_models(models_dir: Path, absolute: bool = False) -> list[dict[str, Any]]:
    """Model directories under models_dir: <name>/config.json and <org>/<name>/config.json,
    named as a job names them: <name> and <org>/<name>, or (absolute: a directory of
    MTQ_MODEL_ROOTS) by their absolute path."""
    found = []
    candidates = sorted(models_dir.glob("*/config.json")) + sorted(models_dir.glob("*/*/config.json"))
    for config in candidates[:MAX_MODELS]:
        model_dir = config.parent
        parts = model_dir.relative_to(models_dir).parts
        if not all(_MODEL_NAME.fullmatch(p) for p in parts):
            continue  # not a name a job could use (hidden, temporary...)
        found.append(model_info(str(model_dir) if absolute else "/".join(parts), model_dir))
    return found


def hub_cache_models() -> list[dict[str, Any]]:
    """Models in the local Hugging Face cache (models--<org>--<name>/snapshots/<rev>/config.json)."""
    from huggingface_hub import constants  # no network, no MLX: only where the cache is

    found = {}
    for config in sorted(Path(constants.HF_HUB_CACHE).glob("models--*--*/snapshots/*/config.json"))[:MAX_MODELS]:
        org_name = config.parents[2].name.removeprefix("models--").split("--", 1)
        model_id = "/".join(org_name)
        if all(_MODEL_NAME.fullmatch(p) for p in org_name):
            found[model_id] = model_info(model_id, config.parent)
    return list(found.values())


def all_local_models(models_dir: Path, model_roots: tuple[Path, ...]) -> list[dict[str, Any]]:
    """Every model a worker can load without the network: its models directory, the
    directories of MTQ_MODEL_ROOTS (by absolute path) and the Hugging Face cache."""
    models = local_models(models_dir)
    for root in model_roots:
        models += local_models(root, absolute=True)
    return (models + hub_cache_models())[:MAX_MODELS]


def record(name: str, models_dir: Path, models: list[dict[str, Any]], started_at: float, **offer: Any) -> dict[str, Any]:
    """A worker's advertisement. models: all_local_models(...). offer: queues, lanes, hub,
    declared (--models), device, device_name, memory_total_gb, memory_gb (what it runs jobs
    in: declared or detected), memory_declared, current_job, gang_address, gang_backend,
    gang_error, gang_rdma, models_free_bytes."""
    return {"name": name, "host": socket.gethostname(), "pid": os.getpid(), "version": package_version(),
            "started_at": started_at, "models_dir": str(models_dir), "models": models, **offer}


def advertise(r: redis.Redis, rec: dict[str, Any], ttl_s: float) -> None:
    """Write (or renew) a worker's record, and renew its loaded set's expiry."""
    ttl_ms = max(int(ttl_s * 1000), 1000)
    with r.pipeline() as p:
        p.set(worker_key(rec["name"]), json.dumps(rec), px=ttl_ms)
        p.pexpire(loaded_key(rec["name"]), ttl_ms)
        p.sadd(WORKERS, rec["name"])
        p.execute()


def publish_loaded(r: redis.Redis, name: str, model_ids: list[str], ttl_s: float) -> None:
    """The training process: these are the models I hold loaded now."""
    r.set(loaded_key(name), json.dumps(sorted(model_ids)), px=max(int(ttl_s * 1000), 1000))


def withdraw(r: redis.Redis, name: str) -> None:
    """A worker that stops cleanly removes its advertisement at once."""
    with r.pipeline() as p:
        p.delete(worker_key(name), loaded_key(name))
        p.srem(WORKERS, name)
        p.execute()


def get_worker(r: redis.Redis, name: str) -> dict[str, Any] | None:
    """One live worker's record, with `loaded` (None if it is not live)."""
    raw, loaded = r.mget(worker_key(name), loaded_key(name))
    return None if raw is None else _with_loaded(raw, loaded)


def live_workers(r: redis.Redis) -> list[dict[str, Any]]:
    """The records of the workers whose advertisement has not expired, each with `loaded`."""
    names = sorted(n.decode() for n in r.smembers(WORKERS))
    if not names:
        return []
    with r.pipeline(transaction=False) as p:
        for name in names:
            p.get(worker_key(name))
            p.get(loaded_key(name))
        answers = p.execute()
    out, gone = [], []
    for i, name in enumerate(names):
        raw, loaded = answers[2 * i], answers[2 * i + 1]
        if raw is None:
            gone.append(name)
            continue
        out.append(_with_loaded(raw, loaded))
    if gone:
        r.srem(WORKERS, *gone)
    return out


def _with_loaded(raw: bytes, loaded: bytes | None) -> dict[str, Any]:
    """An advertisement and the models its training process holds loaded."""
    return {**json.loads(raw), "loaded": json.loads(loaded) if loaded else []}


def model_list(r: redis.Redis) -> list[dict[str, Any]]:
    """The seed's models list, from the live workers: {model_id, model_type, model_path,
    loaded}, one entry per model_id (loaded if any worker holds it), sorted by model_id.
    A loaded model that is not under a worker's models directory (an absolute path or a
    Hugging Face cache entry) is listed too."""
    models: dict[str, dict[str, Any]] = {}
    for worker in live_workers(r):
        for m in worker["models"]:
            if m["model_id"].startswith("/"):
                continue  # a directory under MTQ_MODEL_ROOTS: listed once loaded, as before
            models.setdefault(m["model_id"], {k: m[k] for k in ("model_id", "model_type", "model_path")} | {"loaded": False})
        for model_id in worker["loaded"]:
            entry = models.setdefault(model_id, {"model_id": model_id, "model_type": "llm", "model_path": model_id,
                                                 "loaded": True})
            entry["loaded"] = True
    return [models[k] for k in sorted(models)]
