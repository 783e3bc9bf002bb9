"""Job specs of the supervised kinds: SFT, DPO, ORPO, CPO, KTO, reward models and GKD (GRPO's are in schemas.py).

Config fields and defaults follow the seed server's configs: SFT's (mlx_lm's LoRA trainer:
`lora_alpha` is mlx_lm's LoRA `scale`, as the seed passes it), and for DPO, ORPO and reward
models its DPO / reward config (iters 50, batch_size 2, max_seq_length 1024, `method`,
`lambda_odds`). The preference kinds add TRL's knobs (`beta`, DPO's `loss_type`, `loss_weights` and
`label_smoothing`, CPO's (TRL's CPOConfig), KTO's `desirable_weight` and `undesirable_weight`); the optimizer is TRL's
for every kind (OptimizerConfig: bias-corrected AdamW, gradient clipping, lr_scheduler), with
`bias_correction: false, max_grad_norm: null` as the seed server's (mlx_lm's) optimizer.
Datasets (shared/datasets.py) are inline rows, an uploaded file's id, or a path under
MTQ_DATA_ROOTS on the workers.
"""

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.datasets import (
    PREFERENCE_ROWS,
    SFT_ROWS,
    DatasetRef,
    PreferencePair,
    RowFormat,
    fields_error,
    rows_errors,
    sft_format,
    sft_loss_error,
)
from shared.model_ids import MODEL_ID_RE
from shared.report_specs import ReportConfig
from shared.schemas import (
    DEFAULT_LANE,
    GANG_DESCRIPTION,
    LANE_PATTERN,
    MAX_GANG,
    SEED_MAX,
    InitAdapter,
    JobRecord,
    OptimizerConfig,
    check_gang,
    check_json_values,
)

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SCHEDULES = ("cosine_decay", "linear_schedule", "exponential_decay", "step_decay")
# MLX's quantization modes a base or QAT can use: the group size each fixes, and the bits an MX mode fixes
# (affine: any of AFFINE_BITS). mx.quantize's table, nvfp4 left out.
QUANT_MODES = {"affine": (64, None), "mxfp4": (32, 4), "mxfp8": (32, 8)}
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
QuantMode = Literal[tuple(QUANT_MODES)]  # type: ignore[valid-type]
QuantBits = Literal[AFFINE_BITS]  # type: ignore[valid-type]


def quantization(bits: int, mode: str) -> dict:
    """mlx_lm's quantize_model arguments (its config.json's "quantization") for bits in a mode: the
    mode's group size, and its own bits for an MX mode."""
    group_size, mode_bits = QUANT_MODES[mode]
    return {"group_size": group_size, "bits": mode_bits or bits, "mode": mode}


class LRSchedule(BaseModel):
    """mlx_lm's `lr_schedule`: an mlx.optimizers schedule by name, its arguments (the first
    is the initial learning rate), and optional linear warmup steps."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: Literal[SCHEDULES]  # type: ignore[valid-type]
    arguments: list[float] = Field(..., min_length=1, max_length=4)
    warmup: int = Field(0, ge=0, le=1_000_000)
    warmup_init: float = Field(0.0, ge=0.0)


class TrainConfig(OptimizerConfig, ReportConfig):
    """Fields every supervised kind shares (the seed's SFT names and defaults)."""

    lora_layers: int = Field(16, ge=-1, le=4096, description="Transformer blocks (from the top) that get LoRA; -1 = all.")
    lora_rank: int = Field(8, ge=1, le=1024)
    lora_alpha: float = Field(16.0, gt=0.0, le=1e4, description="mlx_lm's LoRA scale (as the seed server passes it).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    optimizer: Literal["adamw", "adam", "muon", "sgd", "adafactor"] = Field("adamw", description=(
        "mlx.optimizers' AdamW (TRL's, with the adam_* fields), Adam, Muon, SGD or Adafactor (worker/runtime/train_core.py "
        "make_optimizer); each one's state is in the checkpoint."))
    momentum: float | None = Field(None, ge=0.0, lt=1.0, description="SGD's and Muon's momentum; null: theirs (SGD 0, Muon 0.95).")
    learning_rate: float = Field(1e-5, ge=0.0, le=10.0)
    lr_schedule: LRSchedule | None = Field(None, description="mlx_lm's schedule, in place of lr_scheduler and warmup_steps.")
    batch_size: int = Field(4, ge=1, le=1024)
    iters: int = Field(100, ge=1, le=1_000_000, description="Optimizer steps.")
    grad_accumulation_steps: int = Field(1, ge=1, le=1024, description="Micro-batches per optimizer step.")
    max_seq_length: int = Field(2048, ge=2, le=131_072, description="Longer rows are cut (a `truncated` event says how many).")
    val_batches: int = Field(25, ge=-1, le=100_000, description="Validation batches per evaluation; -1 = the whole valid set.")
    steps_per_report: int = Field(10, ge=1, le=1_000_000, description="A step event every N steps (progress: every step).")
    steps_per_eval: int = Field(200, ge=1, le=1_000_000, description="Evaluate on the valid set every N steps (and at the last).")
    steps_per_save: int = Field(100, ge=1, le=1_000_000, description="Checkpoint (LoRA + optimizer state) every N steps.")
    gradient_checkpointing: bool = Field(False, description=(
        "Recompute each block's activations in the backward pass. false: on only where the worker's memory needs it "
        "(the step's estimate without it exceeds the worker's memory and with it does not: a memory_plan event says so)."))
    # Quantization-aware training, mlx-lm-lora's flags (docs/quantization.md).
    qat_enable: bool = Field(False, description="Fake-quantize every unquantized linear and embedding weight in the "
                             "forward (straight-through gradients): the model trains as it will run once quantized.")
    qat_bits: QuantBits = Field(8, description="The bits QAT simulates (affine; an MX qat_mode has its own: 4 or 8).")
    qat_group_size: Literal[32, 64, 128] = Field(64, description="Affine QAT's group size (an MX qat_mode's is 32).")
    qat_mode: QuantMode = Field("affine", description="MLX's quantization mode QAT simulates.")
    qat_start_step: int = Field(1, ge=0, le=1_000_000, description="Fake quantization after this many optimizer steps.")
    qat_interval: int = Field(1, ge=1, le=1_000_000, description="Then every N-th step (1: every step).")
    seed: int = Field(0, ge=0, le=SEED_MAX)
    queue: str = Field(DEFAULT_LANE, pattern=LANE_PATTERN, description="The job's lane (as GRPO's: shared/routing.py).")
    workers: int = Field(1, ge=1, le=MAX_GANG, description=GANG_DESCRIPTION)
    # Durability (as GRPO's).
    checkpoint_interval_s: float = Field(300.0, gt=0.0, le=86_400.0, description="...and at least this often.")
    max_attempts: int = Field(3, ge=1, le=100)
    stall_timeout_s: float = Field(600.0, ge=1.0, le=86_400.0)

    _a_share_per_worker = model_validator(mode="after")(check_gang)

    @property
    def qat(self) -> dict | None:
        """QAT's quantization (mx.quantize's arguments), or None without QAT."""
        if not self.qat_enable:
            return None
        q = quantization(self.qat_bits, self.qat_mode)
        return {**q, "group_size": self.qat_group_size} if self.qat_mode == "affine" else q

    @model_validator(mode="after")
    def _momentum_of_its_optimizer(self):
        if self.momentum is not None and self.optimizer not in ("sgd", "muon"):
            raise ValueError(f"momentum applies to optimizer sgd or muon, not {self.optimizer}")
        return self

    @model_validator(mode="after")
    def _one_schedule(self):
        if self.lr_schedule is not None and (self.lr_scheduler != "constant" or self.warmup_steps):
            raise ValueError("give lr_schedule (mlx_lm's) or lr_scheduler and warmup_steps (TRL's), not both")
        return self


class SFTConfig(TrainConfig):
    fine_tune_type: Literal["lora", "dora", "full", "qlora"] = Field("lora", description=(
        "lora / dora: an adapter on the shared base; full: the last lora_layers blocks' own weights "
        "(mlx_lm's full fine-tuning), the result a complete model directory; qlora: LoRA on a copy of the base "
        "quantized to quant_bits in quant_mode. full and qlora train on a private copy of the model."))
    quantize_base: bool = Field(False, description="Quantize a private copy of the base before attaching LoRA / DoRA (qlora implies it).")
    quant_bits: QuantBits = Field(4, description="The quantized base's bits (affine; an MX quant_mode has its own: 4 or 8).")
    quant_mode: QuantMode | None = Field(None, description="MLX's quantization mode of the quantized base: affine "
                                         "(group size 64), mxfp4 or mxfp8 (group size 32); null: affine (mxfp8 with mxfp8).")
    mxfp8: bool = Field(False, description="The seed server's field: QLoRA on an MXFP8 copy of the base "
                        "(quant_mode mxfp8 and quantize_base).")
    loss_type: Literal["nll", "chunked_nll", "dft"] = Field("nll", description=(
        "nll: the masked mean cross-entropy; chunked_nll: the same, the vocabulary projection and log-softmax "
        "32 positions at a time (a large vocabulary's logits never exist whole); dft: TRL's Dynamic "
        "Fine-Tuning, each token's NLL weighted by its probability (no gradient through the weight)."))
    mask_prompt: bool = Field(False, description="Train only on completions / the last assistant message "
                              "(of the rows that assistant_only_loss leaves to mlx_lm).")
    assistant_only_loss: bool | None = Field(None, description=(
        "Train a messages row on its assistant messages of weight 1 only (content, tool calls, end of turn). "
        "null: on for rows with tools, tool calls, tool messages, weights or several assistant messages; "
        "the other rows as mlx_lm tokenises them (mask_prompt). true: every row (messages rows only); "
        "false: none (weight 0 is then refused)."))
    packing: bool = Field(False, description=(
        "Pack each micro-batch's rows end to end (best-fit-decreasing) into sequences as long as its longest row, "
        "each row attending only to itself from position 0: the same rows, loss and gradients as unpacked, "
        "in fewer, denser sequences. Attention-only models (not recurrent / SSM layers)."))

    @model_validator(mode="after")
    def _full_is_not_quantized(self):
        if self.fine_tune_type == "full" and self.quantize_base:
            raise ValueError("fine_tune_type 'full' trains the base weights themselves: quantize_base does not apply")
        if self.mxfp8 and self.fine_tune_type == "full":
            raise ValueError("mxfp8 trains LoRA on an MXFP8 copy of the base: fine_tune_type 'full' does not apply")
        if self.mxfp8 and self.quant_mode not in (None, "mxfp8"):
            raise ValueError(f"mxfp8 with quant_mode {self.quant_mode}: mxfp8 is quant_mode mxfp8")
        if self.quant_mode not in (None, "affine") and not self.quantized:
            raise ValueError(f"quant_mode {self.quant_mode} quantizes a copy of the base: give fine_tune_type qlora "
                             "or quantize_base")
        if self.qat_enable and self.quantized:
            raise ValueError("qat_enable fake-quantizes unquantized weights: a quantized base (qlora, quantize_base, "
                             "mxfp8) has none; quantize after training instead (mtq export --quantize)")
        return self

    @property
    def quantized(self) -> bool:
        return self.fine_tune_type == "qlora" or self.quantize_base or self.mxfp8

    @property
    def base_mode(self) -> str:
        return "mxfp8" if self.mxfp8 else self.quant_mode or "affine"

    @property
    def base_quantization(self) -> dict | None:
        """The quantized base's quantize_model arguments, or None (unquantized)."""
        return quantization(self.quant_bits, self.base_mode) if self.quantized else None


class PreferenceConfig(TrainConfig):
    """The seed server's DPO / reward-model defaults, and one step event per step."""

    iters: int = Field(50, ge=1, le=1_000_000, description="Optimizer steps.")
    batch_size: int = Field(2, ge=1, le=1024, description="Preference pairs per step.")
    max_seq_length: int = Field(1024, ge=2, le=131_072, description="Longer rows are cut (a `truncated` event says how many).")
    steps_per_report: int = Field(1, ge=1, le=1_000_000, description="A step event every N steps (progress: every step).")


class _MethodConfig(PreferenceConfig):
    """DPO's and ORPO's: the seed server's one config for both (`method` is set by the route)."""

    method: Literal["dpo", "orpo"] = Field("dpo", description="Set by the route (/dpo/jobs or /orpo/jobs), as the seed server.")
    beta: float = Field(0.1, gt=0.0, le=1e3, description="DPO's temperature (TRL's beta); ORPO: the scale of its rewards/* metrics.")
    lambda_odds: float = Field(1.0, ge=0.0, le=1e3, description="ORPO's weight of the odds-ratio term (the seed's name; "
                               "TRL's ORPO calls it beta); DPO ignores it.")

    @model_validator(mode="after")
    def _orpo_alone(self):
        if self.method == "orpo" and self.workers > 1:
            raise ValueError("ORPO runs on one worker (workers: 1): its loss mixes a mean over tokens and one over "
                             "pairs, which a gang's weighted sum of shares does not reproduce")
        return self


# TRL's DPO loss types that are a mean over pairs of each pair's own loss (worker/kinds/dpo_job.py):
# not aot / aot_unpaired (they sort the batch) nor sft (a mean over tokens), which a gang's shares would not reproduce.
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "sigmoid_norm")
DPOLossType = Literal[DPO_LOSS_TYPES]  # type: ignore[valid-type]


class DPOConfig(_MethodConfig):
    loss_type: DPOLossType | list[DPOLossType] = Field("sigmoid", description=(
        "TRL's DPO loss type, or a list of them summed with loss_weights (e.g. [sigmoid, bco_pair] and [0.8, 0.2])."))
    loss_weights: list[float] | None = Field(None, description="One weight per loss_type (TRL's; null: 1 each).")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description=(
        "The assumed label-flip rate: robust's and exo_pair's epsilon; sigmoid's too (conservative DPO, TRL before 1.0)."))

    @model_validator(mode="after")
    def _losses(self):
        types = self.loss_types
        if not 1 <= len(types) <= len(DPO_LOSS_TYPES):
            raise ValueError(f"loss_type: a loss type or a list of 1 to {len(DPO_LOSS_TYPES)} of them")
        if self.loss_weights is not None and (len(self.loss_weights) != len(types)
                                              or not all(abs(w) <= 1e3 for w in self.loss_weights)):
            raise ValueError(f"loss_weights: one weight (|w| <= 1000) per loss_type ({len(types)})")
        if "exo_pair" in types and self.label_smoothing == 0:
            raise ValueError("loss_type exo_pair needs label_smoothing > 0 (its epsilon; the EXO paper suggests 1e-3)")
        return self

    @property
    def loss_types(self) -> list[str]:
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    @property
    def weights(self) -> list[float]:
        return self.loss_weights if self.loss_weights is not None else [1.0] * len(self.loss_types)


class ORPOConfig(_MethodConfig):
    method: Literal["dpo", "orpo"] = Field("orpo", description="Set by the route (/dpo/jobs or /orpo/jobs), as the seed server.")


class CPOConfig(PreferenceConfig):
    """TRL's CPOConfig: reference-free, a preference loss on the policy's log-probs plus cpo_alpha x the chosen NLL."""

    beta: float = Field(0.1, gt=0.0, le=1e3, description="The preference loss's temperature (TRL's beta).")
    loss_type: Literal["sigmoid", "hinge", "ipo", "simpo"] = Field("sigmoid", description=(
        "sigmoid (CPO), hinge, ipo, or simpo (per-token mean log-probs, target margin simpo_gamma)."))
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="Assumed label-flip rate (sigmoid and simpo).")
    cpo_alpha: float = Field(1.0, ge=0.0, le=1e3, description="Weight of the chosen completions' NLL (SimPO: 0).")
    simpo_gamma: float = Field(0.5, ge=0.0, le=1e3, description="SimPO's target reward margin gamma (simpo only).")

    @model_validator(mode="after")
    def _gang_without_nll(self):
        if self.workers > 1 and self.cpo_alpha > 0:
            raise ValueError("CPO with cpo_alpha > 0 runs on one worker (workers: 1): its NLL is a mean over tokens "
                             "beside a mean over pairs, which a gang's weighted sum of shares does not reproduce")
        return self


class KTOConfig(TrainConfig):
    batch_size: int = Field(4, ge=2, le=1024, description="At least 2: the KL estimate pairs each row's prompt "
                            "with another row's completion (TRL's check).")
    beta: float = Field(0.1, gt=0.0, le=1e3, description="KTO's beta (TRL's).")
    desirable_weight: float = Field(1.0, gt=0.0, le=1e3, description="Weight of the desirable rows' losses (lambda_D).")
    undesirable_weight: float = Field(1.0, gt=0.0, le=1e3, description="Weight of the undesirable rows' losses (lambda_U).")
    workers: int = Field(1, ge=1, le=1, description="1: the KL estimate pairs rows across the whole batch, which a "
                         "gang would split (docs/distributed.md).")


class RewardConfig(PreferenceConfig):
    pass


class GKDConfig(TrainConfig):
    """TRL's GKDConfig's knobs, its names and defaults (worker/kinds/gkd_job.py has the math)."""

    lmbda: float = Field(0.5, ge=0.0, le=1.0, description="The fraction of steps on the student's own samples "
                         "(on-policy); the others train on the dataset's completions.")
    beta: float = Field(0.5, ge=0.0, le=1.0, description="The generalized JSD's interpolation: 0 forward KL "
                        "(teacher || student), 1 reverse KL (student || teacher).")
    temperature: float = Field(0.9, ge=0.0, le=10.0, description="The student's sampling temperature (0: greedy).")
    max_new_tokens: int = Field(128, ge=1, le=32_768, description="Tokens a sampled completion has at most (EOS included).")
    steps_per_report: int = Field(1, ge=1, le=1_000_000, description="A step event every N steps (progress: every step).")
    workers: int = Field(1, ge=1, le=1, description="1: each rank of a gang would draw its own samples, not the "
                         "rows one worker draws (docs/gkd.md).")

    @model_validator(mode="after")
    def _samples_fit(self):
        if self.lmbda > 0 and self.max_new_tokens >= self.max_seq_length:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) must be below max_seq_length "
                             f"({self.max_seq_length}): a sampled row is its prompt and its completion")
        return self


class _JobSpec(BaseModel):
    """A supervised kind's spec; each sets `kind` and `row_format` (shared/datasets.py: how its rows look)."""

    row_format: ClassVar[RowFormat]
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model_id: str = Field(..., min_length=1, max_length=512, pattern=MODEL_ID_RE.pattern)
    adapter_name: str | None = Field(None, pattern=ADAPTER_NAME)
    dataset: DatasetRef | None = Field(None, description="Training rows: inline, {\"file_id\"} of an upload, or a path under MTQ_DATA_ROOTS.")
    valid_dataset: DatasetRef | None = Field(None, description="Validation rows, same forms (a data directory's valid.jsonl otherwise).")
    init_adapter: InitAdapter | None = Field(None, description="Start from this adapter instead of a fresh LoRA.")

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
        for name in ("dataset", "valid_dataset"):
            ref = getattr(self, name)
            errors = [f"{name}[{i}]: {e}" for i, r in enumerate(ref if isinstance(ref, list) else [])
                      if (e := sft_loss_error(r, self.config.assistant_only_loss))]
            if errors:
                raise ValueError("; ".join(errors[:5]))
        return self


class _PreferenceSpec(_JobSpec):
    row_format: ClassVar[RowFormat] = PREFERENCE_ROWS
    preference_pairs: list[PreferencePair] | None = Field(None, min_length=1, max_length=1_000_000)

    @model_validator(mode="after")
    def _one_source(self):
        if self.preference_pairs is None and self.dataset is None:
            raise ValueError("preference_pairs (non-empty list) required")
        if self.preference_pairs is not None and self.dataset is not None:
            raise ValueError("give the training pairs as preference_pairs or as dataset, not both")
        return self


class _MethodSpec(_PreferenceSpec):
    @model_validator(mode="before")
    @classmethod
    def _method_of_the_route(cls, data: Any) -> Any:
        """config.method is the route's, whatever the body says (as the seed server sets it)."""
        if isinstance(data, dict) and isinstance(data.get("config", {}), dict):
            return {**data, "config": {**data.get("config", {}), "method": cls.kind}}
        return data


class DPOJobCreate(_MethodSpec):
    kind: ClassVar[str] = "dpo"
    config: DPOConfig = Field(default_factory=DPOConfig)


class ORPOJobCreate(_MethodSpec):
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


class CPOJobCreate(_PreferenceSpec):
    kind: ClassVar[str] = "cpo"
    config: CPOConfig = Field(default_factory=CPOConfig)


GKD_ROWS = RowFormat(lambda row: fields_error(row, {"prompt": str, "completion": str}, "GKD rows are {prompt, completion}"))


class GKDJobCreate(_JobSpec):
    """Knowledge distillation: the job's model (with LoRA) learns the teacher's next-token
    distributions on the rows' prompts, on its own samples or on the rows' completions."""

    kind: ClassVar[str] = "gkd"
    row_format: ClassVar[RowFormat] = GKD_ROWS
    teacher_model_id: str = Field(..., min_length=1, max_length=512, pattern=MODEL_ID_RE.pattern, description=(
        "The teacher: another model the workers have, with the same tokenizer (the job's model_id itself: its base, "
        "the LoRA off)."))
    dataset: DatasetRef = Field(..., description="Rows {prompt, completion}: inline, {\"file_id\"} of an upload, or a "
                                "path under MTQ_DATA_ROOTS.")
    config: GKDConfig = Field(default_factory=GKDConfig)


class RewardJobCreate(_PreferenceSpec):
    kind: ClassVar[str] = "reward"
    config: RewardConfig = Field(default_factory=RewardConfig)


def dataset_text(ref: Any) -> str | None:
    """A dataset reference as the seed server's job object shows it, a string: the path, the
    uploaded file's id, or "inline" (the rows are under `<field>_rows`)."""
    if isinstance(ref, dict) and "file_id" in ref:
        return ref["file_id"]
    if isinstance(ref, BaseModel):
        return ref.file_id  # a FileRef
    return "inline" if isinstance(ref, list) else ref


class TrainJob(JobRecord):
    """The job object of the supervised kinds: the spec as sent, plus the lifecycle's fields;
    `dataset` and `valid_dataset` as strings (dataset_text)."""

    dataset: str | None = None
    dataset_rows: list[dict[str, Any]] | None = Field(None, description="The training rows, when sent inline.")
    valid_dataset: str | None = None
    valid_dataset_rows: list[dict[str, Any]] | None = Field(None, description="The validation rows, when sent inline.")
    init_adapter: InitAdapter | None = Field(None, description="Where the adapter started (null: a fresh LoRA).")
    config: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _datasets_as_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for name in ("dataset", "valid_dataset"):
                if isinstance(data.get(name), list):
                    data[f"{name}_rows"] = data[name]
                data[name] = dataset_text(data.get(name))
        return data


class GKDJob(TrainJob):
    teacher_model_id: str


class PreferenceJob(TrainJob):
    """DPO's, ORPO's, CPO's and reward models' (the seed's job object: `preference_pairs` is a list,
    empty when the pairs come as `dataset`)."""

    preference_pairs: list[PreferencePair] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _pairs_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preference_pairs") is None:
            data = {**data, "preference_pairs": []}
        return data


class SFTProgress(BaseModel):
    """The seed server's SFT progress (mlx_lm's reports: worker/runtime/reports.py), always every key."""

    step: int = 0
    total_steps: int = 0
    train_loss: float = 0.0
    val_loss: float | None = None
    learning_rate: float = 0.0
    tokens_per_second: float = 0.0
    iterations_per_second: float = 0.0
    trained_tokens: int = 0
    peak_memory_gb: float = 0.0
    elapsed_seconds: float = 0.0
    eta_seconds: float = 0.0


class SFTJob(TrainJob):
    """The seed server's SFT job object: times null until they happen, progress always whole."""

    started_at: float | None = Field(None, description="null until a worker starts it (as the seed server's SFT).")
    finished_at: float | None = Field(None, description="null until it finishes.")
    progress: dict[str, Any] = Field(default_factory=lambda: SFTProgress().model_dump(), description=(
        "SFTProgress's keys always (zeros and val_loss null before the first step), plus this project's "
        "{iter, total_iters, loss, ...metrics} once a step is done."))
