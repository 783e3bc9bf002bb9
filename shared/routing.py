"""Routing: which rq queue a job waits on, and which queues a worker listens to.

A job goes only to a worker that can run it, by rq's own mechanism: named queues. A job's
queue names what it needs, and a worker listens to the queues of everything it offers:

    <lane>@<model>@<N>gb       the job's model, and its memory class: its estimated need rounded
                               up to a power of two (1, 2, 4, ... GB); a worker listens to every
                               class up to its memory, for every model it can load
    <lane>@hub@<N>gb           a Hugging Face id no live worker holds: for workers with `--hub`
    <lane>@worker:<name>       one worker's own queue: a job for a model that worker holds loaded
                               (warm-model preference)

`lane` is the job's `config.queue` ("default"); a worker serves the lanes it is given in that
order (`--lanes high,default`), and rq serves a worker's queues in order, so an earlier lane
always goes first. Within a lane: its own queue, then the larger memory classes (jobs that
fewer workers can run), then the hub.

A model is named by its model_id, with org/name as org:name (rq-dashboard puts queue names in
URLs), except absolute paths (any characters, and rq joins queue names with ','), which are
named by a hash of the normalised path.

The estimate (shared/memory_estimate.py need_bytes) comes from the job's step (`step_of`: its
rows and their width, from its config and prompts) and the model's shape and size as the
workers that hold it advertise them (the largest, if they differ); with the GPU's sampling
factor, the lowest a device needs. The record keeps the step in its summary (`spec_summary`),
so the worker that takes the job checks again with its own device and model without reading
the spec (worker/supervisor/admission.py) and re-routes the job, without starting it,
when it does not fit: the API's class is a lower bound, never a reason to run a job that
does not fit. A model no live worker advertises has no size yet: its job waits in class 1,
and the first worker with the model checks it.
"""

import hashlib
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from shared import kinds
from shared.memory_estimate import GB, OPTIMIZER_STATES, ModelShape, need_bytes
from shared.model_ids import MODEL_NAME
from shared.schemas import DEFAULT_LANE, prompt_chars

WORKER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_MEMORY_CLASS_GB = 2**20
CHARS_PER_TOKEN = 4  # the API has no tokenizer; the training process plans with the real token counts
CHAT_TEMPLATE_TOKENS = 32  # what a chat template adds around a prompt, roughly
WARM_WAIT_S = 5.0  # a job waits this long on a busy worker's own queue before the shared one
_HF_ID = re.compile(rf"^{MODEL_NAME}/{MODEL_NAME}$")


def model_key(model_id: str) -> str:
    """How queue names name a model: a name as is, org/name as org:name (rq-dashboard's URLs
    hold queue names; ':' is in no model name), an absolute path by its hash."""
    if model_id.startswith("/"):
        return "path-" + hashlib.sha256(os.path.normpath(model_id).encode()).hexdigest()[:16]
    return model_id.replace("/", ":")


def is_hub_id(model_id: str) -> bool:
    """A Hugging Face id (org/name): a worker with --hub can download it."""
    return bool(_HF_ID.fullmatch(model_id))


def memory_class(need_gb: float | None) -> int:
    """The smallest power of two GB >= need (1 when unknown)."""
    if not need_gb or need_gb <= 1:
        return 1
    return min(2 ** math.ceil(math.log2(need_gb)), MAX_MEMORY_CLASS_GB)


def memory_classes(memory_gb: float | None) -> list[int]:
    """The classes a worker with this much memory listens to, largest first."""
    classes, c = [], 1
    while memory_gb and c <= min(memory_gb, MAX_MEMORY_CLASS_GB):
        classes.append(c)
        c *= 2
    return classes[::-1]


def model_queue(lane: str, model_id: str, memory_gb: int) -> str:
    return f"{lane}@{model_key(model_id)}@{memory_gb}gb"  # the same names as worker_queues


def hub_queue(lane: str, memory_gb: int) -> str:
    return f"{lane}@hub@{memory_gb}gb"


def is_hub_queue(queue: str) -> bool:
    return "@hub@" in queue


def own_queue(lane: str, worker: str) -> str:
    return f"{lane}@worker:{worker}"


def queue_owner(queue: str) -> str | None:
    """The worker whose own queue this is (None for a shared queue)."""
    return queue.split("@worker:", 1)[1] if "@worker:" in queue else None


def worker_queues(name: str, lanes: list[str], model_ids: list[str], memory_gb: float | None, hub: bool) -> list[str]:
    """Every queue a worker listens to, in the order rq should serve them."""
    classes = memory_classes(memory_gb)
    keys = sorted({model_key(m) for m in model_ids})
    queues = []
    for lane in lanes:
        queues.append(own_queue(lane, name))
        queues += [f"{lane}@{key}@{c}gb" for c in classes for key in keys]
        if hub:
            queues += [hub_queue(lane, c) for c in classes]
    return queues


def served_models(worker: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """model key -> what the worker advertises about the model ({} when only its id is known):
    its models on disk, the models it holds loaded, and those it was told to offer (--models)."""
    served: dict[str, dict[str, Any]] = {model_key(m): {} for m in worker.get("declared", []) + worker.get("loaded", [])}
    for m in worker.get("models", []):
        served[model_key(m["model_id"])] = m
    return served


# --------------------------------------------------------------------------- the estimate


def step_of(spec) -> dict[str, Any]:
    """What the memory estimate reads of a job: the rows a step holds, their width in tokens,
    and whether its loss step recomputes activations. GRPO: B*G rows of the longest prompt
    (CHARS_PER_TOKEN characters a token, plus a chat template's tokens) and max_completion_len
    (a multi-turn job's: its episode_len; checkpointing unless the job turns it off: the plan may
    turn it on). Supervised kinds: batch_size x rows_per_example rows of max_seq_length,
    checkpointing planned by the worker unless the job asks for it (shared/memory_estimate.py
    supervised_checkpointing), whether it trains with QAT, the blocks it fine-tunes whole
    (full_layers: fine_tune_type full's lora_layers, else 0) and its optimizer's arrays per trained
    weight (optimizer_states). A session: one row of
    max_seq_len. An export: no rows; whether it dequantizes."""
    kind, cfg = kinds.KINDS[spec.kind], spec.config
    if kind.family == "grpo":
        chars = max(prompt_chars(p) for p in spec.prompts)
        chat = cfg.use_chat_template or any(isinstance(p, list) for p in spec.prompts)
        chat = chat or spec.multi_turn
        width = (math.ceil(chars / CHARS_PER_TOKEN) + (CHAT_TEMPLATE_TOKENS if chat else 0)
                 + (cfg.episode_len if spec.multi_turn else cfg.max_completion_len))
        return {"rows": cfg.batch_size * cfg.group_size, "width": width,
                "checkpointing": cfg.use_gradient_checkpointing is not False}
    if kind.family == "session":
        return {"rows": 1, "width": cfg.max_seq_len, "checkpointing": False}
    if kind.family == "export":  # no step: the base and its fused (dequantized) copy
        return {"rows": 0, "width": 0, "checkpointing": False, "dequantize": spec.dequantize or spec.quantize}
    return {"rows": cfg.batch_size * kind.rows_per_example, "width": cfg.max_seq_length,
            "checkpointing": True if cfg.gradient_checkpointing else None,  # None: the worker plans it
            "qat": cfg.qat_enable,
            "full_layers": cfg.lora_layers if getattr(cfg, "fine_tune_type", "lora") == "full" else 0,
            "optimizer_states": OPTIMIZER_STATES[cfg.optimizer]}


def spec_summary(spec) -> dict[str, Any]:
    """What a job record keeps of its spec besides the spec itself (its `summary` field,
    shared/lifecycle.py spec_fields): the model, adapter name and config, which the job list
    shows, and the step the estimate reads (`step_of`). A worker routes and sizes a job from
    it without reading the spec, which may hold megabytes of prompts or rows."""
    summary = {"model_id": spec.model_id, "adapter_name": spec.adapter_name, "config": spec.config.model_dump(),
               "step": step_of(spec)}
    if getattr(spec, "teacher_model_id", None):  # GKD's: its worker loads the teacher too
        summary["teacher_model_id"] = spec.teacher_model_id
    return summary


# A gang member of a supervised kind takes rows by its measured speed (worker/runtime/gang_group.py
# apportion), at most this many times its even share: what routing sizes it for.
SPEED_SHARE_MAX = 1.5


def max_share(rows: int, gang: int, by_speed: bool = True) -> int:
    """The most of a step's `rows` one of `gang` members takes: the even share, rank 0's
    ceil(rows / gang), or by speed up to SPEED_SHARE_MAX times that."""
    even = math.ceil(rows / gang)
    return min(rows, math.ceil(SPEED_SHARE_MAX * even)) if by_speed else even


def member_step(summary: dict[str, Any], by_speed: bool = False) -> dict[str, Any]:
    """The step one worker holds (`step_of`): a gang's member (config.workers > 1,
    worker/runtime/gang_group.py) holds its share of the batch's examples with their rows
    (`max_share`; by_speed: a supervised kind's, whose shares follow the members' speeds)."""
    step, cfg = summary["step"], summary["config"]
    gang, batch = cfg.get("workers", 1), cfg.get("batch_size")
    if gang == 1 or not batch or not step["rows"]:
        return step
    return {**step, "rows": step["rows"] // batch * max_share(batch, gang, by_speed)}


def job_need_gb(kind: str, summary: dict[str, Any], model: dict[str, Any], device: str = "gpu",
                teacher: dict[str, Any] | None = None) -> float | None:
    """Estimated memory (GB) of the step of a job of `kind` (its summary, `spec_summary`; a
    gang member's share of it: `member_step`) on the model of this advertisement (its shape and size), on `device`; None when the model's shape
    is not known. A job with a teacher (GKD) holds the teacher's weights too (teacher: its
    advertisement; None when its size is not known); its forward pass keeps no activations."""
    if not model.get("shape") or model.get("size_bytes") is None:
        return None
    family = kinds.KINDS[kind].family
    need = need_bytes(family, ModelShape(**model["shape"]), int(model["size_bytes"]),
                      **member_step(summary, by_speed=family == "supervised"),
                      device=device)
    if "teacher_model_id" in summary:
        if not teacher or teacher.get("size_bytes") is None:
            return None
        need += int(teacher["size_bytes"])
    return need / GB


# --------------------------------------------------------------------------- routing a job


def receivers(live: list[dict[str, Any]], holders: list[dict[str, Any]], model_id: str, teacher: str | None,
              capable) -> list[dict[str, Any]]:
    """Workers without the model that a gang's leader can stage it to (worker/runtime/model_staging.py),
    by name: capable otherwise, with the model's size free on their disk. A model named by
    an absolute path is not staged (another machine's directory), nor a teacher."""
    sizes = [served_models(w)[model_key(model_id)].get("size_bytes") for w in holders]
    if model_id.startswith("/") or teacher or not holders or None in sizes:
        return []
    return sorted((w for w in live if w not in holders and capable(w) and (w.get("models_free_bytes") or 0) >= max(sizes)),
                  key=lambda w: w["name"])


@dataclass(frozen=True)
class Route:
    queue: str
    need_gb: float | None
    waiting_for_worker: str | None  # why no live worker can run it now (None: some can)
    free: tuple[dict[str, Any], ...] = ()  # a gang job's (config.workers > 1): the free workers that can run it


def route(kind: str, job, live: list[dict[str, Any]], floor_gb: float | None = None, warm: bool = True,
          finished=lambda job_id: True) -> Route:
    """The queue for a job of `kind` (shared/kinds.py), given the live workers' advertisements
    (shared/workers.py). job: its spec (the API has it), or its record's summary
    (`spec_summary`: a worker reads no more). floor_gb: a need measured by a worker that could
    not fit the job. warm: prefer the own queue of a capable worker that holds the model loaded
    and is free (finished(job_id) says whether the job a worker advertises as its current one
    has ended meanwhile). A gang job (config.workers > 1, worker/supervisor/gang_claims.py)
    waits until that many capable workers are free at once."""
    summary = job if isinstance(job, dict) else spec_summary(job)
    model_id, cfg = summary["model_id"], summary["config"]
    lane = cfg.get("queue", DEFAULT_LANE)
    key = model_key(model_id)
    teacher = summary.get("teacher_model_id")  # a GKD job's workers need its teacher too
    teacher_key = teacher and model_key(teacher)
    holders = [w for w in live if key in served_models(w) and (not teacher or teacher_key in served_models(w))]
    sizes = [job_need_gb(kind, summary, served_models(w)[key], teacher=served_models(w).get(teacher_key))
             for w in holders]
    need = max([n for n in sizes if n is not None] + [floor_gb or 0.0]) or None
    cls = memory_class(need)

    def capable(w):
        return lane in w.get("lanes", [DEFAULT_LANE]) and cls <= (w.get("memory_gb") or 0)

    if not holders and is_hub_id(model_id):
        queue, candidates = hub_queue(lane, cls), [w for w in live if w.get("hub")]
        missing = f"no live worker has model {model_id!r}, and none has hub access (mtq worker --hub)"
    else:
        queue, candidates = model_queue(lane, model_id, cls), holders
        missing = f"no live worker has model {model_id!r}" + (f" and teacher {teacher!r}" if teacher else "")
    able = [w for w in candidates if capable(w)]
    waiting = None
    if not candidates:
        waiting = missing
    elif not able and not any(lane in w.get("lanes", [DEFAULT_LANE]) for w in candidates):
        waiting = f"no live worker that can run it takes jobs of queue {lane!r} (mtq worker --lanes)"
    elif not able:
        largest = max((w.get("memory_gb") or 0) for w in candidates)
        waiting = (f"needs about {need:.2f} GB (memory class {cls} GB); the largest live worker that can run it "
                   f"has {largest:g} GB")
    gang = cfg.get("workers", 1)
    if gang > 1:  # worker/supervisor/gang_claims.py: the leader that takes it needs gang - 1 more, free, at once
        # A member may lack the model: its leader stages it (worker/runtime/model_staging.py).
        able = sorted(able, key=lambda w: w["name"]) + receivers(live, holders, model_id, teacher, capable)
        free = tuple(w for w in able if w.get("gang_address") and (not w.get("current_job") or finished(w["current_job"])))
        if waiting is None and len(free) < gang:
            names = ", ".join(w["name"] for w in free) or "none"
            waiting = (f"needs {gang} free workers that can run it at once (config.workers); has {len(free)} "
                       f"({names}) of {len(able)} live that can run it")
        return Route(queue, need, waiting, free)
    if warm:
        for w in sorted(able, key=lambda w: w["name"]):
            if key in {model_key(m) for m in w.get("loaded", [])} and (not w.get("current_job") or finished(w["current_job"])):
                return Route(own_queue(lane, w["name"]), need, None)
    return Route(queue, need, waiting)
