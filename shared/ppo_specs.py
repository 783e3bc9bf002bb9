"""A PPO job's spec: a GRPO job's prompts, reward sources, sampling and optimizer fields
(shared/schemas.py), with TRL's PPOConfig knobs in place of GRPO's loss fields. The math is in
worker/kinds/ppo.py; docs/kinds.md#ppo says what each field does.

GRPO's loss and multi-turn fields mean nothing to PPO: one set off its default is a 400, not a job that
silently ignores it. So are LoRA dropout (TRL's PPO turns dropout off: the rollout's log-probs
and values must be the ones the first update sees) and a gang (workers > 1: the whitening of
the advantages and the minibatch shuffle would need the ranks' sums; not done)."""

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from shared.schemas import GRPOConfig, Job, JobCreate

# GRPOConfig's fields that PPO has no use for (its loss is its own; its rows are one turn).
GRPO_ONLY = ("clip_ratio", "num_iterations", "epsilon_high", "beta", "loss_type", "importance_sampling_level",
             "scale_rewards", "mask_truncated_completions", "max_turns", "max_tool_calls", "max_episode_len",
             "max_tool_output_tokens", "tool_timeout_s", "tool_parallelism")


class PPOConfig(GRPOConfig):
    group_size: int = Field(1, ge=1, le=256, description="Completions sampled per prompt (TRL's PPO: 1).")
    kl_coef: float = Field(0.05, ge=0.0, le=100.0, description="Per-token KL penalty on the reward: -kl_coef * KL_t.")
    kl_estimator: Literal["k1", "k3"] = Field("k1", description="KL_t = logp - ref (k1) or exp(r) - 1 - r, r = ref - logp (k3).")
    cliprange: float = Field(0.2, gt=0.0, le=10.0, description="Policy ratio clip: [1 - cliprange, 1 + cliprange].")
    cliprange_value: float = Field(0.2, gt=0.0, le=1e6, description="Value clip around the rollout's values.")
    vf_coef: float = Field(0.1, ge=0.0, le=1e3, description="Weight of the value loss.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount (GAE).")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    num_ppo_epochs: int = Field(4, ge=1, le=64, description="Passes over a step's rollout.")
    num_mini_batches: int = Field(1, ge=1, le=1024, description="Minibatches per pass (one optimizer update each).")
    whiten_rewards: bool = Field(False, description="Whiten the per-token rewards over the rollout's tokens first.")
    missing_eos_penalty: float | None = Field(None, ge=0.0, le=1e6, description="Subtracted from the score of a "
                                              "completion cut at max_completion_len (no EOS or stop string).")

    @model_validator(mode="after")
    def _ppo_fields(self):
        # Against the defaults, not model_fields_set: a stored spec comes back with every field.
        grpo = [f for f in GRPO_ONLY if getattr(self, f) != GRPOConfig.model_fields[f].default]
        if grpo:
            raise ValueError(f"{', '.join(grpo)}: GRPO's, not PPO's (docs/kinds.md#ppo)")
        if self.lora_dropout > 0:
            raise ValueError("lora_dropout: PPO trains without dropout (as TRL's PPOTrainer)")
        if self.workers > 1:
            raise ValueError("workers: a PPO job runs on one worker")
        if (self.batch_size * self.group_size) % self.num_mini_batches:
            raise ValueError(f"num_mini_batches {self.num_mini_batches} must divide batch_size x group_size "
                             f"({self.batch_size * self.group_size})")
        return self


class PPOJobCreate(JobCreate):
    """A PPO job's spec: prompts, reward sources, PPOConfig. One turn: no tools or environment."""

    kind: ClassVar[str] = "ppo"
    config: PPOConfig = Field(default_factory=PPOConfig)

    @model_validator(mode="after")
    def _one_turn(self):
        if self.tools or self.environment:
            raise ValueError("tools, environment: PPO jobs are of one turn")
        return self


class PPOJob(Job):
    """A PPO job object: a GRPO job's with PPO's config."""

    kind: Literal["ppo"] = Field(description="The job's kind (shared/kinds.py).")  # a GRPO record is never read as one
    config: PPOConfig
