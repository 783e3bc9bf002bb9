"""The specs of Online DPO and XPO jobs (worker/kinds/online_dpo.py): a GRPO job's spec (prompts,
reward sources, sampling, memory, durability), its reward sources the judge that ranks each
prompt's two completions, and TRL's OnlineDPOConfig / XPOConfig knobs (names and defaults)
in place of GRPO's surrogate. The API checks them as GRPO's (shared/kinds.py family "grpo")."""

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from shared.schemas import GRPOConfig, Job, JobCreate

# GRPO's surrogate and advantage knobs: no part of a DPO loss; other than their defaults, refused rather than ignored.
GRPO_ONLY = ("clip_ratio", "epsilon_high", "importance_sampling_level", "scale_rewards", "mask_truncated_completions")


class OnlineDPOConfig(GRPOConfig):
    group_size: Literal[2] = Field(2, description="Completions the policy samples per prompt: the pair the judge ranks.")
    beta: float = Field(0.1, gt=0.0, le=1000.0, description="DPO's beta: the strength of the pull to the reference "
                        "(the base model, LoRA off).")
    loss_type: Literal["sigmoid", "ipo"] = Field("sigmoid", description="DPO's loss on the ranked pair (TRL's).")
    missing_eos_penalty: float | None = Field(None, ge=0.0, le=1e6, description="Subtracted from the judge's score of "
                                              "a completion that did not end (cut at max_completion_len).")
    num_iterations: Literal[1] = Field(1, description="One update per sampled batch (on-policy, as TRL's).")
    max_turns: Literal[1] = Field(1, description="One completion per row.")

    @model_validator(mode="after")
    def _no_grpo_knobs(self):
        given = [name for name in GRPO_ONLY if getattr(self, name) != GRPOConfig.model_fields[name].default]
        if given:
            raise ValueError(f"{', '.join(given)}: GRPO's surrogate knobs, not this kind's (it trains DPO's loss)")
        return self


class XPOConfig(OnlineDPOConfig):
    group_size: Literal[1] = Field(1, description="Completions the policy samples per prompt; the reference samples "
                                   "the pair's other one.")
    alpha: float = Field(1e-5, ge=0.0, le=1000.0, description="XPO's exploration weight: alpha x log pi_theta of the "
                         "reference's completion is added to the loss (TRL's XPOConfig.alpha).")


class OnlineDPOJobCreate(JobCreate):
    """An Online DPO job: GRPO's spec; its reward sources are the judge."""

    kind: ClassVar[str] = "online_dpo"
    config: OnlineDPOConfig = Field(default_factory=OnlineDPOConfig)

    @model_validator(mode="after")
    def _one_turn(self):
        if self.tools or self.environment:
            raise ValueError(f"{self.kind} samples one completion per row: no tools or environment")
        return self


class XPOJobCreate(OnlineDPOJobCreate):
    kind: ClassVar[str] = "xpo"
    config: XPOConfig = Field(default_factory=XPOConfig)


class OnlineDPOJob(Job):
    config: OnlineDPOConfig


class XPOJob(Job):
    config: XPOConfig
