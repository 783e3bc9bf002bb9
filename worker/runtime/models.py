"""Loading models: the shared ones, kept loaded between jobs, and a job's private copy (full and
quantized fine-tuning change the base weights); and gradient checkpointing of a loaded model."""

import contextlib
import logging
import socket
import threading
from collections import OrderedDict
from pathlib import Path
from urllib.parse import urlsplit

import mlx.core as mx
import mlx.nn as nn
from huggingface_hub import constants, snapshot_download
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.tuner.trainer import grad_checkpoint
from mlx_lm.utils import quantize_model

from shared.model_ids import model_id_error, under_roots
from shared.settings import Settings
from worker.runtime.projection_groups import fuse_shared_inputs

log = logging.getLogger(__name__)
MAX_LOADED_MODELS = 2
HUB_PROBE_S = 3.0  # how long a worker tries to reach the Hugging Face hub before saying it cannot

_loaded: "OrderedDict[str, tuple[nn.Module, object, str]]" = OrderedDict()  # where -> (model, tokenizer, model_id)


class ModelNotFound(Exception):
    pass


def resolve_model(model_id: str, settings: Settings) -> str:
    """Where to load the model from (shared/model_ids.py says what a model_id may be): a
    directory under MTQ_MODELS_DIR, an absolute path under MTQ_MODEL_ROOTS (symlinks
    resolved), or a Hugging Face id from the local cache, else from the hub if this worker has
    hub access (--hub) and reaches it. Errors name the model, never the worker's directories."""
    error = model_id_error(model_id, settings)
    if error:
        raise ModelNotFound(error)
    if model_id.startswith("/"):
        path = Path(model_id).resolve()
        if not under_roots(path, settings.model_roots) or not path.is_dir():
            raise ModelNotFound(f"model not found: {model_id!r} (no such model directory under MTQ_MODEL_ROOTS)")
        return str(path)
    local = settings.models_dir / model_id
    if local.is_dir():
        return str(local.resolve())
    if "/" not in model_id:
        raise ModelNotFound(f"model not found: {model_id!r} (no model of that name in the models directory)")
    return _hub_snapshot(model_id, settings.hub)


def _hub_snapshot(repo_id: str, hub: bool) -> str:
    """A Hugging Face id: the local cache if it has it; else the hub, only on a worker with hub
    access (mtq worker --hub: MTQ_HUB) and only after a short probe, so that a worker without
    network says so at once instead of retrying for minutes."""
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception:
        pass  # not in the cache
    if not hub:  # whatever asked for it: a job, a log-prob or reward-score request, a reward model
        raise ModelNotFound(f"model not found: {repo_id!r} (not in the models directory or the local Hugging Face "
                            "cache, and this worker has no hub access: mtq worker --hub)")
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFound(f"model not found: {repo_id!r} (not in the models directory or the local Hugging Face cache, and HF_HUB_OFFLINE is set)")
    if not _reaches(constants.ENDPOINT):
        raise ModelNotFound(
            f"model not found: {repo_id!r} (not in the models directory or the local Hugging Face cache, and this "
            f"worker cannot reach the Hugging Face hub within {HUB_PROBE_S:.0f} s)"
        )
    return repo_id


def _reaches(endpoint: str) -> bool:
    """Can we open a TCP connection to the hub within HUB_PROBE_S? (In a thread: a DNS lookup
    has no timeout of its own.)"""
    parts = urlsplit(endpoint)
    result: list[bool] = []

    def probe():
        try:
            socket.create_connection((parts.hostname, parts.port or 443), timeout=HUB_PROBE_S).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_S)
    return bool(result and result[0])


def get_model(model_id: str, settings: Settings) -> tuple[nn.Module, object, bool]:
    """(model, tokenizer, was_already_loaded); loads on first use and keeps the last few loaded."""
    where = resolve_model(model_id, settings)
    if where in _loaded:
        _loaded.move_to_end(where)
        model, tokenizer, _ = _loaded[where]
        return model, tokenizer, True
    model, tokenizer = _load(model_id, where)
    fuse_shared_inputs(model)  # a shared model's base never changes: one matmul for q/k/v, one for gate/up
    _loaded[where] = (model, tokenizer, model_id)
    while len(_loaded) > MAX_LOADED_MODELS:
        _loaded.popitem(last=False)
    return model, tokenizer, False


def load_private(model_id: str, settings: Settings) -> tuple[nn.Module, object, dict]:
    """(model, tokenizer, config) for one job alone (full and quantized fine-tuning change the
    base weights): never taken from nor put into the cache of shared models, and freed with the
    job. Loaded lazily (the caller checks its size first). The cache's copy of the same model
    is dropped first, so the process does not hold the model twice."""
    where = resolve_model(model_id, settings)
    if _loaded.pop(where, None) is not None:
        mx.clear_cache()
    return _load(model_id, where, lazy=True, return_config=True)


def _load(model_id: str, where: str, **kwargs):
    log.info("loading model %s from %s", model_id, where)
    try:
        return mlx_lm_load(where, **kwargs)
    except Exception as e:  # mlx_lm raises a variety (hub errors, missing files, bad config)
        # The message may hold the worker's paths: it goes to the worker's log, not to the client.
        log.warning("could not load model %s from %s: %s: %s", model_id, where, type(e).__name__, e)
        raise ModelNotFound(f"model {model_id!r} could not be loaded ({type(e).__name__}; see the worker's log)") from e


def forget_loaded() -> None:
    """Drop every kept model: after a job failed unexpectedly they may be broken (an exception
    while mx.compile traces a function that captures a model's weights leaves placeholders in
    their place: every later use fails "eval an array without a primitive"). The next job loads
    its model afresh."""
    _loaded.clear()
    mx.clear_cache()


def loaded_model_ids() -> list[str]:
    """The model ids of the models this process holds loaded (for its worker's advertisement)."""
    return [model_id for _, _, model_id in _loaded.values()]


@contextlib.contextmanager
def gradient_checkpointing(model: nn.Module, on: bool):
    """Every transformer block keeps only its input for the backward pass and recomputes the
    rest there: mlx_lm's grad_checkpoint, which patches the block's class. The class is
    restored afterwards, since the process keeps the model (and its class) for other jobs."""
    if not on:
        yield
        return
    cls = type(model.layers[0])
    original = cls.__call__
    grad_checkpoint(model.layers[0])
    try:
        yield
    finally:
        cls.__call__ = original


class UnsupportedBase(Exception):
    """The model cannot be fine-tuned or exported the way the job asks (already quantized, too large)."""


def private_base(model_id: str, settings, fine_tune_type: str, quantization: dict | None):
    """(model, tokenizer, config, quantization) for a job that changes the base weights: its own
    copy (worker/runtime/models.py load_private), made ready by prepare_private."""
    model, tokenizer, config = load_private(model_id, settings)
    return (model, tokenizer, *prepare_private(model, config, model_id, fine_tune_type, quantization,
                                                settings.full_finetune_max_gb))


def prepare_private(model: nn.Module, config: dict, name: str, fine_tune_type: str, quantization: dict | None,
                    max_gb: float) -> tuple[dict, dict | None]:
    """Check a lazily loaded private copy and quantize it for qlora, as mlx_lm.convert does
    (quantization: quantize_model's group_size, bits and mode: shared/train_specs.py quantization),
    then fuse its projections that read one input (fuse_shared_inputs); (its config, the
    quantization or None). `full` is bounded by max_gb (MTQ_FULL_FINETUNE_MAX_GB),
    checked before any weight is read."""
    if "quantization" in config or "quantization_config" in config:
        raise UnsupportedBase(f"model {name!r} is already quantized: fine_tune_type lora or dora on it is QLoRA "
                              "as it is; full, qlora and quantize_base need an unquantized model")
    size = sum(v.nbytes for _, v in tree_flatten(model.parameters()))  # lazy: nothing read yet
    if fine_tune_type == "full" and size > max_gb * 1e9:
        raise UnsupportedBase(
            f"full fine-tuning of {name!r}: its weights are {size / 1e9:.3g} GB, above MTQ_FULL_FINETUNE_MAX_GB "
            f"({max_gb} GB; checkpoints hold the weights and twice that of optimizer state in Redis); "
            "use lora, dora or qlora")
    if quantization:
        _, config = quantize_model(model, config, **quantization)
        quantization = {k: config["quantization"][k] for k in ("group_size", "bits", "mode")}
    mx.eval(model.parameters())
    if quantization:
        fuse_shared_inputs(model)  # a qlora copy's base never changes once quantized, as a shared model's
    return config, quantization
