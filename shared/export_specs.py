"""The export kind's spec (shared/kinds.py): a completed job's adapter fused into its base model.

The base's weights live on the workers, and the API never imports MLX, so an export is a job:
routed like any job to a worker that has the base (its memory estimate: the base, and the
fused copy or, with `dequantize`, its unquantized copy: shared/memory_estimate.py), fused
there as mlx_lm's fuse does (worker/kinds/export_job.py), and its model directory stored as
the job's artefact (GET {prefix}/{id}/adapter), as a full fine-tune's is. `mtq export` submits
one, follows it and unpacks the result (docs/export.md).

`source` is a job id, an OpenAI job id (ftjob-...) or a fine-tuned model's name (ft:...); the
API resolves it to the job's id and sets `model_id` to that job's base (api/submission.py
export_source), so the stored spec names both.
"""

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.model_ids import MODEL_ID_RE
from shared.schemas import DEFAULT_LANE, LANE_PATTERN, JobRecord
from shared.train_specs import ADAPTER_NAME, QuantBits, QuantMode, quantization


class ExportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    queue: str = Field(DEFAULT_LANE, pattern=LANE_PATTERN, description="The job's lane (as GRPO's: shared/routing.py).")
    workers: int = Field(1, ge=1, le=1, description="An export runs on one worker.")
    max_attempts: int = Field(3, ge=1, le=100)
    stall_timeout_s: float = Field(600.0, ge=1.0, le=86_400.0, description="The supervisor ends an export whose "
                                   "process makes no progress mark for this long (loading, fusing, saving each mark).")


class ExportJobCreate(BaseModel):
    """POST body of an export: which job's adapter, and how the fused model is written."""

    kind: ClassVar[str] = "export"
    model_config = ConfigDict(extra="forbid")

    source: str = Field(..., min_length=1, max_length=200, description="The completed job whose adapter is fused: its "
                        "id, its OpenAI job id (ftjob-...) or its fine-tuned model's name (ft:...).")
    model_id: str | None = Field(None, max_length=512, pattern=MODEL_ID_RE.pattern, description=(
        "Set by the API: the source job's base model (given, it must be that one)."))
    adapter_name: str | None = Field(None, pattern=ADAPTER_NAME, description="The exported model's name "
                                     "(default export-<job id prefix>): $MTQ_HOME/adapters/<model_id>/<name> on the worker.")
    dequantize: bool = Field(False, description="A quantized base (or a QLoRA job's) fused and written unquantized "
                             "(mlx_lm fuse --dequantize); otherwise a quantized base stays quantized.")
    gguf: bool = Field(False, description="Also write ggml-model-f16.gguf (mlx_lm's convert_to_gguf): only for the "
                       "families it converts (llama, mixtral, mistral), unquantized (or with dequantize).")
    quantize: bool = Field(False, description="Quantize the fused model (fused unquantized first, as with dequantize): "
                           "to the source's QAT (its qat_bits, qat_group_size, qat_mode), or to quant_bits / quant_mode.")
    quant_bits: QuantBits | None = Field(None, description="With quantize: the bits (affine; an MX mode has its own; "
                                         "null: the QAT's, else 4).")
    quant_mode: QuantMode | None = Field(None, description="With quantize: the mode (null: the QAT's, else affine).")
    config: ExportConfig = Field(default_factory=ExportConfig)

    @model_validator(mode="after")
    def _quantize(self):
        if not self.quantize and (self.quant_bits is not None or self.quant_mode is not None):
            raise ValueError("quant_bits and quant_mode say how to quantize: give quantize: true with them")
        if self.quantize and self.gguf:
            raise ValueError("gguf: mlx_lm converts only unquantized models to GGUF: give quantize or gguf, not both")
        return self

    def quantization(self, qat: dict | None) -> dict | None:
        """quantize_model's arguments for the fused model (None: not quantized), given the source
        job's QAT quantization (its adapter_config.json's "qat"; None: it had none)."""
        if not self.quantize:
            return None
        if self.quant_bits is None and self.quant_mode is None and qat:
            return qat
        return quantization(self.quant_bits or 4, self.quant_mode or "affine")


class ExportJob(JobRecord):
    """An export job as its routes show it."""

    source: str = Field(description="The id of the job whose adapter it fuses.")
    dequantize: bool
    gguf: bool
    quantize: bool = False
    quant_bits: int | None = None
    quant_mode: str | None = None
    config: ExportConfig
