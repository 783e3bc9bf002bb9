"""Worker advertisements: what each live worker can do, in Redis, for the API to read.

Two keys per worker, both expiring (a dead worker disappears within `ttl_s`):

  mtq:worker:<name>          JSON {name, host, pid, queues, version, started_at, models_dir,
                             models: [{model_id, model_type, model_path}]}; written by the
                             worker's supervisor from its heartbeat (`advertise`), which also
                             renews the key below.
  mtq:worker:<name>:loaded   JSON [model_id, ...]: the models its training process holds
                             loaded; written by the training process itself (`publish_loaded`)
                             whenever that set changes, so the supervisor never needs MLX.

`models` lists the directories under the worker's MTQ_MODELS_DIR that hold a config.json
(names, and org/name for Hugging Face ids); model_type is "vlm" for a config with a vision
part, "llm" otherwise, null when config.json cannot be read. Readers: `live_workers`,
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

from shared.schemas import MODEL_NAME

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


def model_type(config_file: Path) -> str | None:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    return "vlm" if "vision_config" in config else "llm"


def local_models(models_dir: Path) -> list[dict[str, Any]]:
    """Model directories under models_dir: <name>/config.json and <org>/<name>/config.json."""
    found = []
    candidates = sorted(models_dir.glob("*/config.json")) + sorted(models_dir.glob("*/*/config.json"))
    for config in candidates[:MAX_MODELS]:
        model_dir = config.parent
        parts = model_dir.relative_to(models_dir).parts
        if not all(_MODEL_NAME.match(p) for p in parts):
            continue  # not a name a job could use (hidden, temporary...)
        found.append({"model_id": "/".join(parts), "model_type": model_type(config), "model_path": str(model_dir)})
    return found


def record(name: str, queues: list[str], models_dir: Path, started_at: float) -> dict[str, Any]:
    return {
        "name": name, "host": socket.gethostname(), "pid": os.getpid(), "queues": queues,
        "version": package_version(), "started_at": started_at, "models_dir": str(models_dir),
        "models": local_models(models_dir),
    }


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
        out.append({**json.loads(raw), "loaded": json.loads(loaded) if loaded else []})
    if gone:
        r.srem(WORKERS, *gone)
    return out


def model_list(r: redis.Redis) -> list[dict[str, Any]]:
    """The seed's models list, from the live workers: {model_id, model_type, model_path,
    loaded}, one entry per model_id (loaded if any worker holds it), sorted by model_id.
    A loaded model that is not under a worker's models directory (an absolute path or a
    Hugging Face cache entry) is listed too."""
    models: dict[str, dict[str, Any]] = {}
    for worker in live_workers(r):
        for m in worker["models"]:
            models.setdefault(m["model_id"], {**m, "loaded": False})
        for model_id in worker["loaded"]:
            entry = models.setdefault(model_id, {"model_id": model_id, "model_type": "llm", "model_path": model_id,
                                                 "loaded": True})
            entry["loaded"] = True
    return [models[k] for k in sorted(models)]
