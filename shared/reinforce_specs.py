"""The specs of the two REINFORCE kinds built on GRPO's sampler and reward sources (the math:
worker/kinds/rloo.py, worker/kinds/reinforce.py). Each is a GRPO spec (shared/schemas.py: its
prompts, reward sources, sampling, memory, routing and durability fields) with its own kind,
KL default and the GRPO knobs that mean nothing to its loss refused away from their defaults."""

from typing import ClassVar

from pydantic import Field, model_validator

from shared.schemas import GRPOConfig, Job, JobCreate

# GRPO's advantage and aggregation knobs: RLOO and REINFORCE have their own.
GRPO_ONLY = ("loss_type", "importance_sampling_level", "scale_rewards")


def refuse_set(cfg: GRPOConfig, fields: tuple[str, ...], kind: str) -> GRPOConfig:
    """Refuse these fields away from their defaults (a stored spec holds every field at its value)."""
    given = [f for f in fields if getattr(cfg, f) != GRPOConfig.model_fields[f].default]
    if given:
        raise ValueError(f"{', '.join(given)}: GRPO's, not used by {kind} (docs/kinds.md)")
    return cfg


class RLOOConfig(GRPOConfig):
    """TRL's RLOOTrainer: leave-one-out baseline, KL as a reward penalty, sequence-level ratio."""

    group_size: int = Field(4, ge=2, le=256, description="Completions sampled per prompt (G; the leave-one-out "
                            "baseline needs 2 or more).")
    beta: float = Field(0.05, ge=0.0, description="KL coefficient (TRL's RLOO default): beta times the completion's "
                        "summed log-ratio to the base model (LoRA off) is taken off its reward.")
    normalize_advantages: bool = Field(False, description="Scale the step's advantages to mean 0, std 1 (TRL's "
                                       "normalize_advantages).")

    @model_validator(mode="after")
    def _no_grpo_knobs(self):
        return refuse_set(self, GRPO_ONLY, "RLOO")


class ReinforceConfig(GRPOConfig):
    """mlx-lm-lora's rlhf_reinforce: reward minus beta times the KL, times the completion's log-likelihood."""

    beta: float = Field(0.1, ge=0.0, description="KL coefficient (mlx-lm-lora's default): beta times the "
                        "completion's summed log-ratio to the base model (LoRA off) is taken off its reward.")
    num_iterations: int = Field(1, ge=1, le=1, description="One update per sampled batch: REINFORCE's gradient is "
                                "on-policy (it has no importance ratio).")

    @model_validator(mode="after")
    def _no_grpo_knobs(self):
        return refuse_set(self, (*GRPO_ONLY, "clip_ratio", "epsilon_high"), "REINFORCE")


class RLOOJobCreate(JobCreate):
    """An RLOO job's spec: a GRPO job's fields with RLOO's config."""

    kind: ClassVar[str] = "rloo"
    config: RLOOConfig = Field(default_factory=RLOOConfig)


class ReinforceJobCreate(JobCreate):
    """A REINFORCE job's spec: a GRPO job's fields with REINFORCE's config."""

    kind: ClassVar[str] = "reinforce"
    config: ReinforceConfig = Field(default_factory=ReinforceConfig)


class RLOOJob(Job):
    config: RLOOConfig


class ReinforceJob(Job):
    config: ReinforceConfig
