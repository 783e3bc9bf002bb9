"""Job specs of the supervised kinds: SFT, DPO, ORPO, KTO and reward models (GRPO's are in schemas.py).

Config fields and defaults follow the seed server's SFT config (mlx_lm's LoRA trainer:
`lora_alpha` is mlx_lm's LoRA `scale`, as the seed passes it); the preference kinds add TRL's
knobs (`beta`, DPO's `loss_type` and `label_smoothing`, KTO's `desirable_weight` and
`undesirable_weight`). Datasets (shared/datasets.py) are
inline rows, an uploaded file's id, or a path under MTQ_DATA_ROOTS on the workers.
"""

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.datasets import (
    PREFERENCE_ROWS, SFT_ROWS, DatasetRef, PreferencePair, RowFormat, fields_error, rows_errors, sft_format,
)
from shared.model_ids import MODEL_ID_RE
from shared.schemas import (
    DEFAULT_LANE, GANG_DESCRIPTION, LANE_PATTERN, MAX_GANG, SEED_MAX, JobRecord, check_gang, check_json_values,
)

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SCHEDULES = ("cosine_decay", "linear_schedule", "exponential_decay", "step_decay")


class LRSchedule(BaseModel):
    """mlx_lm's `lr_schedule`: an mlx.optimizers schedule by name, its arguments (the first
    is the initial learning rate), and optional linear warmup steps."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: Literal[SCHEDULES]  # type: ignore[valid-type]
    arguments: list[float] = Field(..., min_length=1, max_length=4)
    warmup: int = Field(0, ge=0, le=1_000_000)
    warmup_init: float = Field(0.0, ge=0.0)


class TrainConfig(BaseModel):
    """Fields every supervised kind shares (the seed's SFT names and defaults)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    lora_layers: int = Field(16, ge=-1, le=4096, description="Transformer blocks (from the top) that get LoRA; -1 = all.")
    lora_rank: int = Field(8, ge=1, le=1024)
    lora_alpha: float = Field(16.0, gt=0.0, le=1e4, description="mlx_lm's LoRA scale (as the seed server passes it).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    optimizer: Literal["adamw", "adam"] = "adamw"
    learning_rate: float = Field(1e-5, ge=0.0, le=10.0)
    weight_decay: float = Field(0.0, ge=0.0, le=10.0)
    lr_schedule: LRSchedule | None = None
    batch_size: int = Field(4, ge=1, le=1024)
    iters: int = Field(100, ge=1, le=1_000_000, description="Optimizer steps.")
    grad_accumulation_steps: int = Field(1, ge=1, le=1024, description="Micro-batches per optimizer step.")
    max_seq_length: int = Field(2048, ge=2, le=131_072, description="Longer rows are cut (a `truncated` event says how many).")
    val_batches: int = Field(25, ge=-1, le=100_000, description="Validation batches per evaluation; -1 = the whole valid set.")
    steps_per_report: int = Field(10, ge=1, le=1_000_000, description="A step event every N steps (progress: every step).")
    steps_per_eval: int = Field(200, ge=1, le=1_000_000, description="Evaluate on the valid set every N steps (and at the last).")
    steps_per_save: int = Field(100, ge=1, le=1_000_000, description="Checkpoint (LoRA + optimizer state) every N steps.")
    gradient_checkpointing: bool = False
    seed: int = Field(0, ge=0, le=SEED_MAX)
    queue: str = Field(DEFAULT_LANE, pattern=LANE_PATTERN, description="The job's lane (as GRPO's: shared/routing.py).")
    workers: int = Field(1, ge=1, le=MAX_GANG, description=GANG_DESCRIPTION)
    # Durability (as GRPO's).
    checkpoint_interval_s: float = Field(300.0, gt=0.0, le=86_400.0, description="...and at least this often.")
    max_attempts: int = Field(3, ge=1, le=100)
    stall_timeout_s: float = Field(600.0, ge=1.0, le=86_400.0)

    _a_share_per_worker = model_validator(mode="after")(check_gang)


class SFTConfig(TrainConfig):
    fine_tune_type: Literal["lora", "dora", "full", "qlora"] = Field("lora", description=(
        "lora / dora: an adapter on the shared base; full: the last lora_layers blocks' own weights "
        "(mlx_lm's full fine-tuning), the result a complete model directory; qlora: LoRA on a copy of the base "
        "quantized to quant_bits. full and qlora train on a private copy of the model."))
    quantize_base: bool = Field(False, description="Quantize a private copy of the base before attaching LoRA / DoRA (qlora implies it).")
    quant_bits: Literal[4, 8] = 4
    mask_prompt: bool = Field(False, description="Train only on completions / the last assistant message.")

    @model_validator(mode="after")
    def _full_is_not_quantized(self):
        if self.fine_tune_type == "full" and self.quantize_base:
            raise ValueError("fine_tune_type 'full' trains the base weights themselves: quantize_base does not apply")
        return self

    @property
    def quantized(self) -> bool:
        return self.fine_tune_type == "qlora" or self.quantize_base


class DPOConfig(TrainConfig):
    beta: float = Field(0.1, gt=0.0, le=1e3, description="DPO temperature (TRL's beta).")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="Conservative DPO: assumed label-flip rate (sigmoid).")


class ORPOConfig(TrainConfig):
    beta: float = Field(0.1, gt=0.0, le=1e3, description="ORPO's lambda (TRL's beta): weight of the odds-ratio term.")
    workers: int = Field(1, ge=1, le=1, description="1: its loss mixes a per-token and a per-pair mean, which a gang's "
                         "weighted sum of shares does not reproduce (docs/distributed.md).")


class KTOConfig(TrainConfig):
    batch_size: int = Field(4, ge=2, le=1024, description="At least 2: the KL estimate pairs each row's prompt "
                            "with another row's completion (TRL's check).")
    beta: float = Field(0.1, gt=0.0, le=1e3, description="KTO's beta (TRL's).")
    desirable_weight: float = Field(1.0, gt=0.0, le=1e3, description="Weight of the desirable rows' losses (lambda_D).")
    undesirable_weight: float = Field(1.0, gt=0.0, le=1e3, description="Weight of the undesirable rows' losses (lambda_U).")
    workers: int = Field(1, ge=1, le=1, description="1: the KL estimate pairs rows across the whole batch, which a "
                         "gang would split (docs/distributed.md).")


class RewardConfig(TrainConfig):
    pass


class _JobSpec(BaseModel):
    """A supervised kind's spec; each sets `kind` and `row_format` (shared/datasets.py: how its rows look)."""

    row_format: ClassVar[RowFormat]
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model_id: str = Field(..., min_length=1, max_length=512, pattern=MODEL_ID_RE.pattern)
    adapter_name: str | None = Field(None, pattern=ADAPTER_NAME)
    dataset: DatasetRef | None = Field(None, description="Training rows: inline, {\"file_id\"} of an upload, or a path under MTQ_DATA_ROOTS.")
    valid_dataset: DatasetRef | None = Field(None, description="Validation rows, same forms (a data directory's valid.jsonl otherwise).")

    _json_values = model_validator(mode="before")(check_json_values)

    @model_validator(mode="after")
    def _inline_rows(self):
        for name in ("dataset", "valid_dataset"):
            value = getattr(self, name)
            if isinstance(value, list):
                errors = rows_errors(self.row_format, value, name)
                if errors:
                    raise ValueError("; ".join(errors[:5]))
        return self


class SFTJobCreate(_JobSpec):
    kind: ClassVar[str] = "sft"
    row_format: ClassVar[RowFormat] = SFT_ROWS
    config: SFTConfig = Field(default_factory=SFTConfig)

    @model_validator(mode="after")
    def _has_dataset(self):
        if self.dataset is None:
            raise ValueError("dataset is required")
        rows = [r for ref in (self.dataset, self.valid_dataset) if isinstance(ref, list) for r in ref]
        if self.config.mask_prompt and any(sft_format(r) == "text" for r in rows):
            raise ValueError("mask_prompt needs prompt/completion or messages rows (text rows have no prompt)")
        return self


class _PreferenceSpec(_JobSpec):
    row_format: ClassVar[RowFormat] = PREFERENCE_ROWS
    preference_pairs: list[PreferencePair] | None = Field(None, min_length=1, max_length=1_000_000)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.preference_pairs is None) == (self.dataset is None):
            raise ValueError("give the training pairs as preference_pairs or as dataset (one of them)")
        return self


class DPOJobCreate(_PreferenceSpec):
    kind: ClassVar[str] = "dpo"
    config: DPOConfig = Field(default_factory=DPOConfig)


class ORPOJobCreate(_PreferenceSpec):
    kind: ClassVar[str] = "orpo"
    config: ORPOConfig = Field(default_factory=ORPOConfig)


KTO_ROWS = RowFormat(
    lambda row: fields_error(row, {"prompt": str, "completion": str, "label": bool},
                             "KTO rows are {prompt, completion, label: true|false}"),
    lambda rows: None if len(rows) >= 2 else "KTO needs at least 2 rows (its KL estimate pairs a row's prompt "
                                             "with another row's completion)")


class KTOJobCreate(_JobSpec):
    """Unpaired preference rows: a completion of a prompt, desirable (label true) or not."""

    kind: ClassVar[str] = "kto"
    row_format: ClassVar[RowFormat] = KTO_ROWS
    dataset: DatasetRef = Field(..., description="Rows {prompt, completion, label}: inline, {\"file_id\"} of an "
                                "upload, or a path under MTQ_DATA_ROOTS.")
    config: KTOConfig = Field(default_factory=KTOConfig)


class RewardJobCreate(_PreferenceSpec):
    kind: ClassVar[str] = "reward"
    config: RewardConfig = Field(default_factory=RewardConfig)


class TrainJob(JobRecord):
    """The job object of the supervised kinds: the spec as sent, plus the lifecycle's fields."""

    dataset: Any = None
    valid_dataset: Any = None
    preference_pairs: list[PreferencePair] | None = None
    config: dict[str, Any]
