"""The export kind (shared/export_specs.py): a completed job's adapter fused into its base model,
as mlx_lm's fuse (mlx_lm/fuse.py) does it, and the fused model directory stored as the job's
artefact.

    the source job's adapter files, from their copy in Redis, into this machine's cache
    a private copy of the base (never the shared one the worker keeps loaded: its layers stay
    the base's), quantized as the source job quantized it (a QLoRA job's adapter_config.json
    says how), with the adapter's LoRA / DoRA layers on it (mlx_lm's load_adapters)
    each adapter layer's fuse(dequantize), then with dequantize mlx_lm's dequantize_model; with
    quantize, the fused model quantized (mlx_lm's quantize_model) as its QAT job trained it, or as asked
    mlx_lm's save: weights, config.json, tokenizer; with gguf, mlx_lm's convert_to_gguf
    the directory committed through the job's lease (GET .../export/jobs/{id}/adapter)

What cannot be exported fails the job before any weight is read, saying why (UnsupportedBase):
GGUF of a family mlx_lm does not convert, GGUF of a quantized model without dequantize, fused
weights above MTQ_EXPORT_MAX_GB (the directory is stored in Redis).
"""

import json
import logging
import time
from pathlib import Path

from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.gguf import convert_to_gguf
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import dequantize_model, quantize_model, save

from shared import adapters
from shared.adapters import CONFIG_FILE, WEIGHTS_FILE, AdapterFileError, adapter_dir, cached_copy
from shared.export_specs import ExportJobCreate
from shared.settings import load_settings
from worker.runtime.models import UnsupportedBase, load_private, prepare_private, resolve_model
from worker.supervisor.lease import retrying

log = logging.getLogger(__name__)

GGUF_MODEL_TYPES = ("llama", "mixtral", "mistral")  # the families mlx_lm's fuse converts to GGUF (mlx_lm/fuse.py)
GGUF_FILE = "ggml-model-f16.gguf"  # mlx_lm fuse's default --gguf-path


def run(job, spec: ExportJobCreate) -> dict:
    """Fuse, save and store; the completed record's fields."""
    settings = load_settings()
    t0 = time.perf_counter()
    job.mark("loading_model")
    stored = retrying(lambda: adapters.files(job.lease.r, spec.source), "adapter read")
    if WEIGHTS_FILE not in stored or CONFIG_FILE not in stored:
        raise AdapterFileError(f"the adapter of job {spec.source} is gone (deleted, or expired after MTQ_JOB_RETENTION_S)")
    adapter = cached_copy(settings, f"adapters/{spec.source}", stored)
    trained = json.loads(stored[CONFIG_FILE])
    quantization = trained.get("quantization")  # a QLoRA job's base, as it quantized it
    target = spec.quantization(trained.get("qat"))  # the fused model's, with quantize
    where = resolve_model(spec.model_id, settings)
    model, tokenizer, config = load_private(spec.model_id, settings)  # lazily: nothing read yet
    job.publish_loaded()  # the shared copy, if this process held one, was dropped
    check_gguf(spec, config, quantization)
    if quantization:
        config, _ = prepare_private(model, config, spec.model_id, "qlora", quantization, settings.full_finetune_max_gb)
    load_adapters(model, str(adapter))
    job.write(event={"type": "model_ready", "cached": False, "private_copy": True, "load_s": time.perf_counter() - t0})

    job.mark("fusing")
    dequantize = spec.dequantize or target is not None
    fused = [(name, m.fuse(dequantize=dequantize)) for name, m in model.named_modules() if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    if dequantize:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    if target is not None:  # the fused weights rounded as a QAT job trained through them (worker/runtime/qat.py)
        model, config = quantize_model(model, config, **target)
    weights = dict(tree_flatten(model.parameters()))  # lazy: sizes known, nothing computed yet
    size = sum(v.nbytes for v in weights.values())
    stored_size = size * (2 if spec.gguf else 1)  # the GGUF file holds the weights again
    if stored_size > settings.export_max_gb * 1e9:
        raise UnsupportedBase(f"the fused model of job {spec.source} takes {stored_size / 1e9:.3g} GB"
                              f"{' with its GGUF file' if spec.gguf else ''}, above MTQ_EXPORT_MAX_GB "
                              f"({settings.export_max_gb} GB; the export is stored in Redis)")

    def write(out: Path) -> None:
        save(out, where, model, tokenizer, config, donate_model=False)
        job.mark("saving")
        if spec.gguf:
            convert_to_gguf(out, weights, config, str(out / GGUF_FILE))

    out = adapter_dir(settings, spec.model_id, spec.adapter_name or job.job_id)
    job.commit_adapter(out, write)
    log.info("job %s: exported job %s's adapter into %s (%d layers fused, %.3g GB)", job.job_id, spec.source,
             spec.model_id, len(fused), size / 1e9)
    return {"adapter_path": str(out), "adapter": None, "history": [],
            "events": [{"type": "exported", "source": spec.source, "fused_layers": len(fused), "size_bytes": size,
                        "dequantize": spec.dequantize, "gguf": spec.gguf, "quantized": "quantization" in config,
                        **({"quantization": target} if target else {}),
                        "export_s": time.perf_counter() - t0}]}


def check_gguf(spec: ExportJobCreate, config: dict, quantization: dict | None) -> None:
    """UnsupportedBase unless mlx_lm can write this export as GGUF (or none was asked for)."""
    if not spec.gguf:
        return
    model_type = config.get("model_type")
    if model_type not in GGUF_MODEL_TYPES:
        raise UnsupportedBase(f"gguf: mlx_lm converts only {', '.join(GGUF_MODEL_TYPES)} models to GGUF; "
                              f"{spec.model_id!r} is {model_type!r} (export it without gguf)")
    if (quantization or "quantization" in config) and not spec.dequantize:
        raise UnsupportedBase(f"gguf: mlx_lm converts only unquantized models to GGUF, and {spec.model_id!r} "
                              f"{'is quantized' if 'quantization' in config else 'was quantized by its QLoRA job'} "
                              "(export with dequantize)")
