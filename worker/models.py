"""Loading models (kept loaded between jobs), attaching a fresh LoRA per job, writing adapters."""

import json
import logging
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.tuner.utils import linear_to_lora_layers, remove_lora_layers

from shared.schemas import GRPOConfig
from shared.settings import Settings

log = logging.getLogger(__name__)
MAX_LOADED_MODELS = 2

_loaded: "OrderedDict[str, tuple[nn.Module, object]]" = OrderedDict()


class ModelNotFound(Exception):
    pass


def resolve_model(model_id: str, settings: Settings) -> str:
    """A path, else a directory under MTQ_MODELS_DIR, else a Hugging Face id (for mlx_lm)."""
    for candidate in (Path(model_id).expanduser(), settings.models_dir / model_id):
        if candidate.is_dir():
            return str(candidate.resolve())
    return model_id


def get_model(model_id: str, settings: Settings) -> tuple[nn.Module, object, bool]:
    """(model, tokenizer, was_already_loaded); loads on first use and keeps the last few loaded."""
    where = resolve_model(model_id, settings)
    if where in _loaded:
        _loaded.move_to_end(where)
        return (*_loaded[where], True)
    log.info("loading model %s from %s", model_id, where)
    try:
        model, tokenizer = mlx_lm_load(where)
    except Exception as e:  # mlx_lm raises a variety (hub errors, missing files, bad config)
        raise ModelNotFound(
            f"model not found: {model_id!r} (not a directory, not under {settings.models_dir}, "
            f"and mlx_lm could not load it as a Hugging Face id: {type(e).__name__}: {e})"
        ) from e
    _loaded[where] = (model, tokenizer)
    while len(_loaded) > MAX_LOADED_MODELS:
        _loaded.popitem(last=False)
    return model, tokenizer, False


def lora_config(cfg: GRPOConfig) -> dict:
    """mlx_lm's adapter_config.json content for this job's LoRA."""
    return {
        "fine_tune_type": "lora",
        "num_layers": cfg.lora_layers,
        "lora_parameters": {"rank": cfg.lora_rank, "scale": cfg.lora_alpha / cfg.lora_rank, "dropout": cfg.lora_dropout},
    }


def attach_lora(model: nn.Module, cfg: GRPOConfig) -> None:
    """Replace any previous job's LoRA with a fresh one; only LoRA weights stay trainable."""
    remove_lora_layers(model)
    model.freeze()
    conf = lora_config(cfg)
    linear_to_lora_layers(model, conf["num_layers"], conf["lora_parameters"])
    model.eval()
    mx.eval(model.trainable_parameters())


def lora_weights(model: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.trainable_parameters()))


def save_adapter(model: nn.Module, cfg: GRPOConfig, out_dir: Path) -> Path:
    """adapters.safetensors + adapter_config.json, as mlx_lm writes and loads them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "adapters.safetensors"), lora_weights(model))
    (out_dir / "adapter_config.json").write_text(json.dumps(lora_config(cfg), indent=2))
    return out_dir
