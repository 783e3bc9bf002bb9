"""Experiment trackers (docs/trackers.md): what a job asks for (`report_to`), the metric names
each tracker gets, and what the trackers leave in Redis (the config fields:
shared/report_specs.py). No tracker library is imported here: only the tracker process
(worker/trackers/) imports one.

A job's metrics reach a tracker the way transformers' integration callbacks log a TRL trainer's:
its step events' metrics under their own names (TRL's: `loss`, `reward`, `rewards/margins`...),
its `eval` events' `val_*` metrics as `eval_*`, each at the step's global step (completed
optimizer steps). TensorBoard and wandb get them through `rewrite_logs` (`train/loss`,
`eval/loss`), MLflow as they are (`loss`, `eval_loss`), as those callbacks do.

Each tracker's state (status, stream cursor, MLflow run id, error) and the TensorBoard event
files live in one hash per job (shared.keys.trackers_key): field `<tracker>` holds the state's
JSON, `tensorboard/<file name>` a file's bytes.
"""

import json
import re
from typing import Any

import redis

from shared.keys import EVENTS_MAXLEN, events_key, job_key, trackers_key
from shared.kinds import Kind
from shared.report_specs import TRACKERS

TB_PREFIX = "tensorboard/"
# tensorboardX's file names (events.out.tfevents.<time>.<host><suffix>): nothing else is stored or served.
TB_FILE = re.compile(r"^events\.out\.tfevents\.[A-Za-z0-9._-]{1,200}$")
NOT_METRICS = ("type", "worker", "iter", "total_iters")
MLFLOW_NAME = re.compile(r"[^0-9A-Za-z_\-. :/]")  # what MLflowCallback replaces by "_"


def report_to(config: dict[str, Any], default: tuple[str, ...]) -> list[str]:
    """The trackers of a job's config (its summary's dump): its own, else the server's default."""
    chosen = config.get("report_to")
    return list(dict.fromkeys(default if chosen is None else chosen))


def logs_of(kind: Kind, event: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(global step, metrics under transformers' log names) of a step or eval event; None for
    any other event. The seed server's duplicate names (the kind's seed_aliases) are left out."""
    if event.get("type") == kind.step_event:
        skip = {*NOT_METRICS, *(seed for seed, _ in kind.seed_aliases)}
        # A step's val_* metrics come with its eval event too: logged from there, once.
        metrics = {k: v for k, v in event.items() if k not in skip and not k.startswith("val_")}
        step = int(event["iter"]) - kind.first_step + 1
    elif event.get("type") == "eval":
        metrics = {"eval_" + k[4:]: v for k, v in event.items() if k.startswith("val_")}
        step = int(event["iter"])
    else:
        return None
    return step, {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def rewrite_logs(logs: dict[str, float]) -> dict[str, float]:
    """transformers' rewrite_logs: `eval_x` -> `eval/x`, anything else -> `train/x`."""
    return {("eval/" + k[5:] if k.startswith("eval_") else "train/" + k): v for k, v in logs.items()}


def mlflow_names(logs: dict[str, float]) -> dict[str, float]:
    return {MLFLOW_NAME.sub("_", k): v for k, v in logs.items()}


# --------------------------------------------------------------------------- state in Redis


def state(r: redis.Redis, job_id: str) -> dict[str, dict[str, Any]]:
    """Every tracker's state of the job: {tracker: {status, step, error, ...}}."""
    raw = r.hmget(trackers_key(job_id), TRACKERS)
    return {name: json.loads(value) for name, value in zip(TRACKERS, raw) if value is not None}


def save_state(r: redis.Redis, job_id: str, name: str, value: dict[str, Any]) -> None:
    _write(r, job_id, {name: json.dumps(value)})


def store_tensorboard(r: redis.Redis, job_id: str, files: dict[str, bytes]) -> None:
    """Store (replace) these event files of the job's."""
    _write(r, job_id, {TB_PREFIX + name: data for name, data in files.items()})


# KEYS: job, trackers. ARGV: field, value, ... A tracker may write after its job finished: its hash then expires
# with the job's keys; after the job was deleted, nothing is written (no key would ever expire it).
_WRITE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV))
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return 1
"""


def _write(r: redis.Redis, job_id: str, fields: dict[str, Any]) -> None:
    if fields:
        r.eval(_WRITE, 2, job_key(job_id), trackers_key(job_id), *(x for pair in fields.items() for x in pair))


def tensorboard_files(r: redis.Redis, job_id: str) -> dict[str, bytes]:
    """The job's TensorBoard event files, by name ({} if none)."""
    found = {}
    for field, data in r.hscan_iter(trackers_key(job_id), match=TB_PREFIX + "*"):
        name = field.decode()[len(TB_PREFIX):]
        if TB_FILE.fullmatch(name):
            found[name] = data
    return found


# KEYS: job, events. ARGV: event JSON, maxlen. A tracker's event goes in only while its job runs: after the
# terminal event it would be read as the job's last word.
_EVENT_WHILE_RUNNING = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'data', ARGV[1])
return 1
"""


def event_while_running(r: redis.Redis, job_id: str, event: dict[str, Any]) -> bool:
    return bool(r.eval(_EVENT_WHILE_RUNNING, 2, job_key(job_id), events_key(job_id), json.dumps(event), EVENTS_MAXLEN))
