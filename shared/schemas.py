"""Pydantic models of the REST API and of the job record stored in Redis.

Field names and defaults of JobCreate/GRPOConfig follow the seed's server so its
clients work unchanged; the extra knobs follow Hugging Face TRL's GRPOTrainer.
"""

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from shared.agentic_specs import OpenEnvEnvironment, PythonTool
from shared.model_ids import MODEL_ID_RE
from shared.report_specs import ReportConfig
from shared.reward_specs import RewardSource

SEED_MAX = 2**32 - 1
MAX_GANG = 8  # workers one job may span (docs/distributed.md): ring's all_sum is rarely reliable beyond
GANG_DESCRIPTION = ("Workers that train the job together, data-parallel over mx.distributed (docs/distributed.md): "
                    "it starts once this many capable workers are free, each taking 1/N of a step's rows.")
DEFAULT_LANE = "default"
LANE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"  # a job's queue (lane): part of rq queue names
MAX_VALIDATION_PROMPTS = 1024  # a GRPO job's validation_prompts: every evaluation samples them all
MAX_EVAL_SAMPLES = 64  # completions per validation prompt


def json_value_error(value: Any, where: str = "body") -> str | None:
    """Why a decoded JSON value cannot be stored (None if it can): a non-finite number
    (JSON has none; Python's parser reads 1e999 as inf and accepts NaN) or a string with a
    lone surrogate (not encodable as UTF-8). Checked on the whole input, extra fields too."""
    stack = [(value, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return f"{path}: non-finite number {node!r} (JSON numbers must be finite)"
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return f"{path}: string with a lone surrogate (not valid Unicode)"
        elif isinstance(node, dict):
            for k, v in node.items():
                stack += [(k, f"{path} (a key)"), (v, f"{path}.{k}" if isinstance(k, str) and k.isascii() else path)]
        elif isinstance(node, list):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(node)]
    return None


MAX_JSON_DEPTH = 32
TOO_DEEP = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"


def json_size_error(value: Any, max_values: int | None = None) -> str | None:
    """Why a decoded JSON value is too large to take in (None if it is not): nested deeper than
    MAX_JSON_DEPTH, or (max_values) holding more values than that, every object, array, string
    and number counted. Stops counting at the limit."""
    count, stack = 1, [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:  # containers only: a scalar is counted by its container's length
        node, level = stack.pop()
        if level > MAX_JSON_DEPTH:
            return TOO_DEEP
        children = node.values() if isinstance(node, dict) else node
        count += len(children)
        if max_values is not None and count > max_values:
            return f"the body holds more than {max_values} JSON values (MTQ_MAX_JSON_VALUES)"
        stack += [(v, level + 1) for v in children if isinstance(v, (dict, list))]
    return None


def check_json_values(data: Any) -> Any:
    """A `mode="before"` model validator: json_value_error as a ValueError (the API answers 400)."""
    error = json_value_error(data)
    if error:
        raise ValueError(error)
    return data

JobStatus = Literal["queued", "running", "completed", "failed", "cancelled"]  # the transitions: shared/lifecycle.py


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class PromptItem(BaseModel):
    """A prompt with extra fields (e.g. `answer`) that reward functions receive."""

    model_config = ConfigDict(extra="allow")
    prompt: str | list[ChatMessage] = Field(..., min_length=1)


Prompt = str | list[ChatMessage] | PromptItem


def prompt_chars(prompt: Prompt) -> int:
    """Characters of a prompt: the text, or the messages' contents together."""
    if isinstance(prompt, PromptItem):
        prompt = prompt.prompt
    return len(prompt) if isinstance(prompt, str) else sum(len(m.content) for m in prompt)


def check_gang(cfg):
    """Every worker of a gang takes at least one of a step's batch_size prompts or rows."""
    if cfg.workers > cfg.batch_size:
        raise ValueError(f"workers ({cfg.workers}) must be at most batch_size ({cfg.batch_size}): each takes a share of a step's batch")
    return cfg


class OptimizerConfig(BaseModel):
    """The optimizer of every kind: AdamW as PyTorch's and TRL's (bias-corrected), TRL's names
    and defaults (worker/runtime/train_core.py make_optimizer)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0.0, le=1.0, description="AdamW epsilon.")
    bias_correction: bool = Field(True, description="Adam's bias correction, as PyTorch's (TRL's); false: MLX's "
                                  "AdamW as mlx_lm's trainer and the seed server run it (early updates several times larger).")
    weight_decay: float = Field(0.0, ge=0.0, le=10.0, description="Decoupled weight decay (AdamW).")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Clip the gradients' global norm (TRL's default 1.0); "
                                        "null = off (mlx_lm's trainer and the seed server do not clip).")
    lr_scheduler: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="The learning rate after warmup: constant, or decaying to 0 at the last update.")
    warmup_steps: int = Field(0, ge=0, le=1_000_000, description="Updates of linear warmup from 0.")


class GRPOConfig(OptimizerConfig, ReportConfig):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    # The seed server's fields and defaults.
    group_size: int = Field(4, ge=1, le=256, description="Completions sampled per prompt (G).")
    iters: int = Field(50, ge=1, le=1_000_000, description="Optimizer steps (each samples a new batch).")
    batch_size: int = Field(2, ge=1, le=1024, description="Prompts per step (B).")
    learning_rate: float = Field(1e-5, ge=0.0, allow_inf_nan=False)
    lora_layers: int = Field(16, ge=-1, le=4096, description="Transformer blocks (from the top) that get LoRA; -1 = all.")
    lora_rank: int = Field(8, ge=1, le=1024)
    lora_alpha: float = Field(16.0, gt=0.0, le=1e6, description="The LoRA scale, passed to mlx_lm as is (as the seed server does; not alpha / rank).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    max_completion_len: int = Field(64, ge=1, le=32768)
    clip_ratio: float = Field(
        0.2, ge=0.0, le=10.0, validation_alias=AliasChoices("clip_ratio", "epsilon"),
        description="PPO clip epsilon (TRL: epsilon).",
    )
    reward_endpoint: str = Field("", description="Seed-compatible: POST {prompt, completions} -> {rewards}.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy.")
    seed: int = Field(0, ge=0, le=SEED_MAX)
    reward_timeout: float = Field(30.0, gt=0.0, le=3600.0)

    # TRL's GRPO knobs.
    num_iterations: int = Field(1, ge=1, le=64, description="Optimizer updates per sampled batch (mu).")
    epsilon_high: float | None = Field(None, ge=0.0, le=10.0, description="Upper clip (clip-higher); default = clip_ratio.")
    beta: float = Field(0.0, ge=0.0, description="KL coefficient (k3 estimator) against the base model (LoRA off).")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    importance_sampling_level: Literal["token", "sequence"] = "token"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    mask_truncated_completions: bool = False
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000, description="0 = off; at most the model's vocabulary (checked at job start).")
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=16, description="Stop strings (besides EOS).")
    use_chat_template: bool = Field(False, description="Render string prompts with the tokenizer's chat template (default: raw text, `tokenizer.encode`, as the seed server). Chat-message prompts always use the template.")

    # Multi-turn episodes (docs/agentic.md): tools and an environment answer the model's turns.
    max_turns: int = Field(1, ge=1, le=64, description="Model turns per episode; 1: one completion, as without tools.")
    max_tool_calls: int = Field(8, ge=0, le=256, description="Tool calls per episode; past it a call is answered "
                                "with an error message.")
    max_episode_len: int | None = Field(
        None, ge=1, le=131072, description="Tokens after the prompt: the model's turns and what tools and the "
        "environment appended (max_completion_len counts the model's tokens only). Default: "
        "max_completion_len + (max_turns - 1) * (max_tool_output_tokens + 32).")
    max_tool_output_tokens: int = Field(256, ge=1, le=32768, description="Tokens of one tool result or observation "
                                        "(its text is cut to fit).")
    tool_timeout_s: float = Field(10.0, gt=0.0, le=600.0, description="Seconds one tool call may run.")
    tool_parallelism: int = Field(4, ge=1, le=64, description="Tool calls and environment steps run at once.")

    # Memory of the loss step (worker/runtime/memory_plan.py).
    micro_batch_size: int | None = Field(
        None, ge=1, le=262_144,
        description="Rows per forward/backward of the loss step (gradients accumulate over the step's B*G rows). "
        "Default: chosen from max_memory_gb; a value that does not divide B*G is lowered to a divisor.",
    )
    gradient_checkpointing: bool | None = Field(
        None, description="Recompute each layer's activations in the backward pass. Default: on where it allows "
        "a larger micro-batch (TRL defaults to on), off when lora_dropout > 0 (MLX would draw new dropout masks "
        "when recomputing).",
    )
    max_memory_gb: float | None = Field(
        None, gt=0.0, le=1_000_000.0, description="A budget of memory the job spends on speed (larger micro-batches, "
        "no checkpointing). At most the worker's --memory-gb if it declares one, else the device's recommended working "
        "set on Metal, else 90% of the GPU's memory, else 75% of RAM. Default: on CUDA 75% of the GPU's free memory, "
        "elsewhere none (memory first: the loss step within sampling's memory).",
    )

    # Routing (shared/routing.py).
    queue: str = Field(DEFAULT_LANE, pattern=LANE_PATTERN, description="The job's lane: workers serve the lanes they "
                       "are given in their order (mtq worker --lanes high,default).")

    workers: int = Field(1, ge=1, le=MAX_GANG, description=GANG_DESCRIPTION)

    # Validation (the job's validation_prompts; OpenAI's reinforcement hyperparameters).
    eval_interval: int = Field(10, ge=1, le=1_000_000, description="With validation_prompts: evaluate every N steps "
                               "(also before the first step, after the first and after the last).")
    eval_samples: int = Field(1, ge=1, le=MAX_EVAL_SAMPLES, description="Completions sampled per validation prompt "
                              "at each evaluation.")

    # Durability.
    checkpoint_every: int = Field(10, ge=1, le=1_000_000, description="Save a checkpoint every N steps.")
    checkpoint_interval_s: float = Field(300.0, gt=0.0, description="...and at least this often.")
    max_attempts: int = Field(
        3, ge=1, le=100,
        description="Fail the job once this many of its runs ended their worker (crash, kill, stall); "
        "capped by the server's MTQ_MAX_ATTEMPTS. A clean worker shutdown does not count.",
    )
    stall_timeout_s: float = Field(
        600.0, ge=1.0, le=86_400.0,
        description="The worker's supervisor ends a training process that made no progress (decode chunk, "
        "reward call, optimizer step) for this long; the first step gets MTQ_COMPILE_GRACE_S more.",
    )

    @model_validator(mode="after")
    def _checkpointing_without_dropout(self):
        if self.gradient_checkpointing and self.lora_dropout > 0:
            raise ValueError("gradient_checkpointing needs lora_dropout = 0 (recomputed layers would draw new dropout masks)")
        return self

    _a_share_per_worker = model_validator(mode="after")(check_gang)

    @property
    def use_gradient_checkpointing(self) -> bool | None:
        """None: decided by the memory plan (worker/runtime/memory_plan.py)."""
        if self.gradient_checkpointing is None and self.lora_dropout > 0:
            return False
        return self.gradient_checkpointing

    @property
    def episode_len(self) -> int:
        """Tokens after the prompt (max_episode_len, or its default)."""
        if self.max_episode_len is not None:
            return self.max_episode_len
        return self.max_completion_len + (self.max_turns - 1) * (self.max_tool_output_tokens + 32)

    @property
    def epsilon_low(self) -> float:
        return self.clip_ratio

    @property
    def epsilon_upper(self) -> float:
        return self.clip_ratio if self.epsilon_high is None else self.epsilon_high


class InitAdapter(BaseModel):
    """Where a job's adapter starts, instead of a fresh LoRA: the adapter of a completed job (by
    its id, or by the model and adapter name it was saved under: the newest job of that name)
    or an uploaded mlx_lm adapter (POST /admin/api/fine-tune/files?purpose=adapter). The API
    resolves a name to its job id and stores both, so the record says where the job started;
    its shape (lora_rank, lora_layers, lora_alpha, fine_tune_type) must be the job's."""

    model_config = ConfigDict(extra="forbid")
    job_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$", description="A completed job's id.")
    model_id: str | None = Field(None, min_length=1, max_length=512)
    adapter_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    file_id: str | None = Field(None, pattern=r"^file-[0-9a-f]{32}$", description="An uploaded adapter's id.")

    @model_validator(mode="after")
    def _one_source(self):
        named = self.model_id is not None or self.adapter_name is not None
        if named and (self.model_id is None or self.adapter_name is None):
            raise ValueError("give both model_id and adapter_name")
        if (self.file_id is not None) == (self.job_id is not None or named):
            raise ValueError("give {job_id}, {model_id, adapter_name} or {file_id}")
        return self


class JobCreate(BaseModel):
    """A GRPO job's spec (the seed server's create body)."""

    kind: ClassVar[str] = "grpo"
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model_id: str = Field(
        ..., min_length=1, max_length=512, pattern=MODEL_ID_RE.pattern,
        description="A name under MTQ_MODELS_DIR, a Hugging Face id (org/name), or an absolute path under MTQ_MODEL_ROOTS.",
    )
    prompts: list[Prompt] = Field(..., min_length=1, max_length=100_000)
    validation_prompts: list[Prompt] | None = Field(
        None, min_length=1, max_length=MAX_VALIDATION_PROMPTS,
        description="Held-out prompts (the forms of `prompts`): every config.eval_interval steps the policy samples "
        "config.eval_samples completions of each and the job's reward sources score them (`eval` events: val_reward).")
    adapter_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    config: GRPOConfig = Field(default_factory=GRPOConfig)
    reward: list[RewardSource] | None = Field(
        None, min_length=1, max_length=32,
        description="Reward sources, summed with their weights. Default: config.reward_endpoint if set, else length in characters.",
    )
    init_adapter: InitAdapter | None = Field(None, description="Start from this adapter instead of a fresh LoRA.")
    tools: list[PythonTool] | None = Field(None, min_length=1, max_length=32,
                                           description="Python functions the model may call (docs/agentic.md).")
    environment: OpenEnvEnvironment | None = Field(None, description="An OpenEnv server that drives the episodes.")

    _json_values = model_validator(mode="before")(check_json_values)

    @property
    def multi_turn(self) -> bool:
        """Its rows are episodes (docs/agentic.md): tokens after the prompt count to episode_len."""
        return self.config.max_turns > 1 or self.environment is not None

    @model_validator(mode="after")
    def _turns(self):
        cfg = self.config
        if self.tools and cfg.max_turns < 2:
            raise ValueError("tools answer the model's turns: set config.max_turns to 2 or more")
        if cfg.max_turns > 1 and not (self.tools or self.environment):
            raise ValueError("config.max_turns > 1 needs tools or an environment to answer the model's turns")
        if cfg.max_turns > 1 and cfg.stop:
            raise ValueError("config.stop: stop strings are not supported with max_turns > 1 (a turn ends at EOS)")
        if self.tools and len({t.function.rpartition(":")[2] for t in self.tools}) < len(self.tools):
            raise ValueError("tools: two tools have the same function name")
        if self.validation_prompts and self.multi_turn:
            raise ValueError("validation_prompts: not supported for multi-turn jobs (tools or an environment)")
        return self

    @model_validator(mode="after")
    def _no_empty_prompt(self):
        for name in ("prompts", "validation_prompts"):
            for i, p in enumerate(getattr(self, name) or []):
                if isinstance(p, str) and not p.strip():
                    raise ValueError(f"{name}[{i}] is empty")
        return self


WAITING_DOC = ("Why no live worker could run the queued job when it was queued (the model, or the memory it needs "
               "against the largest worker's); it starts as soon as a capable worker appears. null once it starts.")


class JobRecord(BaseModel):
    """What every kind's job object holds besides its spec: the lifecycle's fields (shared/lifecycle.py)."""

    job_id: str
    kind: str = Field(description="The job's kind (shared/kinds.py).")
    model_id: str
    adapter_name: str
    adapter_path: str = Field(description="Where the worker writes the adapter: $MTQ_HOME/adapters/<model_id>/<adapter_name>.")
    status: JobStatus
    created_at: float
    started_at: float = Field(0.0, description="0.0 until a worker starts it (as the seed server).")
    finished_at: float = Field(0.0, description="0.0 until it finishes.")
    error: str = ""
    progress: dict[str, Any] = Field(default_factory=dict, description="{} until the first step, then the last "
                                     "step's: {iter (completed steps), total_iters, loss, ...metrics}.")
    phase: str | None = Field(None, description="What the job is doing now (null once finished): waiting_for_worker, "
                              "starting, loading_model, compiling (first step on a fresh machine), sampling, scoring, "
                              "updating, checkpointing, saving; a session: serving (between its calls); an "
                              "export: fusing.")
    phase_note: str | None = Field(None, description="A sentence about the phase, e.g. why compiling takes long.")
    phase_s: float | None = Field(None, description="Seconds the job has been in its phase so far (running jobs).")
    memory_plan: dict[str, Any] | None = Field(None, description="GRPO: the memory plan its worker chose (worker/runtime/memory_plan.py): "
                                               "micro_batch_size, gradient_checkpointing, estimated_peak_gb, memory_limit_gb, "
                                               "budget (max_memory_gb, or on CUDA its default, spent on speed) and the reason; null until it starts.")
    waiting_for_worker: str | None = Field(None, description=WAITING_DOC)
    worker: str | None = Field(None, description="The worker running (or that last ran) the job.")
    checkpoint_step: int | None = Field(None, description="Step of the last checkpoint (resume starts there).")
    attempts: int = Field(0, description="Runs of the job started by workers (a clean hand-back included).")
    failed_attempts: int = Field(0, description="Runs that ended their worker (crash, kill, stall) since creation or resume.")
    max_attempts: int = Field(3, description="The job fails when failed_attempts reaches this.")
    resumed_from: int | None = Field(None, description="Step the current run resumed from, if it did.")
    owner: str | None = Field(None, description="Name of the token that created the job.")


class Job(JobRecord):
    """A GRPO job (the seed server's job object)."""

    prompts: list[Prompt]
    validation_prompts: list[Prompt] | None = None
    config: GRPOConfig
    reward: list[RewardSource] | None = None
    init_adapter: InitAdapter | None = Field(None, description="Where the adapter started (null: a fresh LoRA).")


class JobSummary(JobRecord):
    """A job of any kind in the list's summary form (GET ...?view=summary: the web page's and
    `mtq jobs`'): its record and config, without its prompts, datasets or reward sources."""

    config: dict[str, Any]
    started_at: float | None = Field(0.0, description="0.0 until a worker starts it (an SFT job's: null, as the seed's).")
    finished_at: float | None = Field(0.0, description="0.0 until it finishes (an SFT job's: null).")


class UnreadableJob(BaseModel):
    """A stored record this version cannot load (written by another version, say): listed
    as such, so that one bad record never breaks the list. Delete it to get rid of it."""

    job_id: str
    status: Literal["unreadable"] = "unreadable"
    error: str
    owner: str | None = None


class ErrorBody(BaseModel):
    detail: Any


class Deleted(BaseModel):
    """What a DELETE answers (the seed server's shape)."""

    status: str = "deleted"
