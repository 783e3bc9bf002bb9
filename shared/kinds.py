"""The job kinds: the one registry of what varies by kind. The API's routes, the job records,
the lifecycle, routing and the worker read it; everything else is the same for every kind.

    kind    routes                            spec             worker module                  family
    grpo    /admin/api/fine-tune/grpo/jobs    JobCreate        worker.kinds.grpo_job          grpo
    rloo    /admin/api/fine-tune/rloo/jobs    RLOOJobCreate    worker.kinds.rloo              grpo
    reinforce /admin/api/fine-tune/reinforce/jobs ReinforceJobCreate worker.kinds.reinforce   grpo
    sft     /admin/api/fine-tune/jobs         SFTJobCreate     worker.kinds.sft_job           supervised
    dpo     /admin/api/fine-tune/dpo/jobs     DPOJobCreate     worker.kinds.dpo_job           supervised
    orpo    /admin/api/fine-tune/orpo/jobs    ORPOJobCreate    worker.kinds.dpo_job           supervised
    cpo     /admin/api/fine-tune/cpo/jobs     CPOJobCreate     worker.kinds.cpo_job           supervised
    kto     /admin/api/fine-tune/kto/jobs     KTOJobCreate     worker.kinds.kto_job           supervised
    reward  /admin/api/fine-tune/reward/jobs  RewardJobCreate  worker.kinds.reward_model_job  supervised
    ppo     /admin/api/fine-tune/ppo/jobs     PPOJobCreate     worker.kinds.ppo               grpo
    gkd     /admin/api/fine-tune/gkd/jobs     GKDJobCreate     worker.kinds.gkd_job           supervised
    session /admin/api/fine-tune/session/jobs SessionJobCreate worker.kinds.session_job       session
    export  /admin/api/fine-tune/export/jobs  ExportJobCreate  worker.kinds.export_job        export
    online_dpo /admin/api/fine-tune/online-dpo/jobs OnlineDPOJobCreate worker.kinds.online_dpo grpo
    xpo     /admin/api/fine-tune/xpo/jobs     XPOJobCreate     worker.kinds.online_dpo        grpo

A job record without a `kind` (written before there were kinds) is GRPO's (`of_record`).
PPO is of GRPO's family: it samples and scores its completions as GRPO does.

The family says how a kind's jobs are checked, estimated and answered: GRPO samples its own
completions from prompts (its memory estimate reads the prompts and group_size; its invalid
input gets the seed server's GRPO messages); the supervised kinds train on rows given as
datasets (the estimate reads batch_size x rows_per_example rows of max_seq_length); a session
(shared/session_specs.py) is made by the Tinker API, not posted, and serves its client's calls
until the session ends, in a loop of its own (worker/kinds/session_job.py), never resumed (the
estimate reads one row of max_seq_len); an export (shared/export_specs.py) fuses a completed
job's adapter into its base in one pass of its own (worker/kinds/export_job.py): no steps, no
curves (the estimate reads the base's size: shared/memory_estimate.py).

A kind's step events are `<kind>_step`; their `iter` counts from `first_step`: the seed
server's GRPO, DPO, ORPO and reward jobs number a step's event by its 0-based index, mlx_lm
reports completed steps. What the seed's clients read besides this project's fields is here
too: a kind's `seed_aliases` (its metrics under the seed's names, in progress and step
events), an SFT job's mlx_lm reports (`mlx_reports`: worker/runtime/reports.py), its progress at
creation and its times before they happen (`unset_time`); and the kinds whose jobs its routes
read (`route_kinds`: the seed serves ORPO jobs under /dpo/jobs too).
Its `charts` are the curves `mtq plot` and the web page draw from them (and from the `eval`
events, whose `iter` counts completed steps); the first chart's first metric is the one
`mtq jobs` and `mtq watch` show (`headline`). The client commands and the web page (through
GET /admin/api/kinds) read all of this here.
"""

from dataclasses import dataclass

from pydantic import BaseModel

from shared.export_specs import ExportJob, ExportJobCreate
from shared.online_specs import OnlineDPOJob, OnlineDPOJobCreate, XPOJob, XPOJobCreate
from shared.ppo_specs import PPOJob, PPOJobCreate
from shared.reinforce_specs import ReinforceJob, ReinforceJobCreate, RLOOJob, RLOOJobCreate
from shared.schemas import Job, JobCreate
from shared.session_specs import SessionJob, SessionJobCreate
from shared.train_specs import (
    CPOJobCreate,
    DPOJobCreate,
    GKDJob,
    GKDJobCreate,
    KTOJobCreate,
    ORPOJobCreate,
    PreferenceJob,
    RewardJobCreate,
    SFTJob,
    SFTJobCreate,
    SFTProgress,
    TrainJob,
)

LORA_SHAPE = ("lora_rank", "lora_layers", "lora_alpha")


@dataclass(frozen=True)
class Chart:
    """One panel of curves against step. A metric with `*` stands for every metric it matches
    (`rewards/*/mean`: each reward source's mean)."""

    title: str
    metrics: tuple[str, ...]


# val_*: a job's evaluations on its validation_prompts.
GRPO_CHARTS = (
    Chart("reward", ("reward", "val_reward")), Chart("reward std", ("reward_std",)), Chart("loss", ("loss",)),
    Chart("KL", ("kl",)), Chart("entropy", ("entropy",)), Chart("completion length", ("completions/mean_length",)),
    Chart("learning rate", ("learning_rate",)), Chart("rewards by source", ("rewards/*/mean", "val_rewards/*/mean")),
)
# PPO's (worker/kinds/ppo.py), under TRL's names.
PPO_CHARTS = (
    Chart("reward", ("reward", "val_reward")), Chart("RLHF reward", ("objective/rlhf_reward", "objective/scores")),
    Chart("loss", ("loss/policy_avg", "loss/value_avg")), Chart("KL", ("objective/kl", "policy/approxkl_avg")),
    Chart("clip fraction", ("policy/clipfrac_avg", "val/clipfrac_avg")), Chart("completion length", ("completions/mean_length",)),
    Chart("learning rate", ("learning_rate",)), Chart("rewards by source", ("rewards/*/mean", "val_rewards/*/mean")),
)
# The supervised kinds': validation metrics (val_*) beside the training ones.
LOSS = Chart("loss", ("loss", "val_loss"))
OPTIMIZER = (Chart("learning rate", ("learning_rate",)), Chart("gradient norm", ("grad_norm",)))
MARGINS = Chart("reward margin", ("rewards/margins", "val_rewards/margins"))
REWARDS = Chart("rewards", ("rewards/chosen", "rewards/rejected"))
LOGPS = Chart("log-probs", ("logps/chosen", "logps/rejected"))
SFT_CHARTS = (LOSS, Chart("token accuracy", ("mean_token_accuracy", "val_mean_token_accuracy")), *OPTIMIZER,
              Chart("tokens per second", ("tokens_per_second",)), Chart("peak memory (GB)", ("peak_memory_gb",)))
DPO_CHARTS = (LOSS, MARGINS, Chart("reward accuracy", ("rewards/accuracies", "val_rewards/accuracies")), REWARDS,
              LOGPS, *OPTIMIZER)
NLL = Chart("NLL", ("nll_loss", "val_nll_loss"))
ORPO_CHARTS = (*DPO_CHARTS[:4], Chart("log odds ratio", ("log_odds_ratio", "log_odds_chosen")), NLL, *OPTIMIZER)
CPO_CHARTS = (*DPO_CHARTS[:4], NLL, LOGPS, *OPTIMIZER)
KTO_CHARTS = (LOSS, MARGINS, REWARDS, Chart("KL estimate", ("kl", "val_kl")), LOGPS, *OPTIMIZER)
REWARD_MODEL_CHARTS = (LOSS, Chart("accuracy", ("accuracy", "val_accuracy")), Chart("margin", ("margin", "val_margin")),
                       *OPTIMIZER)
# Online DPO and XPO: the judge's scores of the policy's samples first (worker/kinds/online_dpo.py).
JUDGED = (MARGINS, Chart("reward accuracy", ("rewards/accuracies",)), REWARDS, Chart("KL", ("objective/kl",)), LOGPS,
          *OPTIMIZER)
ONLINE_DPO_CHARTS = (Chart("judge score", ("objective/scores", "val_reward")), Chart("score margin", ("objective/scores_margin",)),
                     Chart("loss", ("loss",)), *JUDGED)
XPO_CHARTS = (Chart("judge score", ("objective/model_scores", "objective/ref_scores", "val_reward")),
              Chart("score margin", ("objective/scores_margin",)), Chart("loss", ("loss", "loss/dpo", "loss/xpo")), *JUDGED)
# GKD's loss is the generalized JSD to the teacher; on_policy: 1 for a step on the student's own samples.
GKD_CHARTS = (LOSS, Chart("student entropy", ("entropy", "val_entropy")), Chart("on-policy steps", ("on_policy",)),
              Chart("completion length", ("completions/mean_length",)), *OPTIMIZER)
# A session's steps are its clients' optim_steps (the loss: of the forward_backward calls before each).
SESSION_CHARTS = (Chart("loss", ("loss",)), *OPTIMIZER)


@dataclass(frozen=True)
class Kind:
    name: str  # the job record's `kind`
    prefix: str  # its routes (api/routes/job_routes.py)
    tag: str  # its routes' OpenAPI tag
    what: str  # "a GRPO job", in its routes' summaries
    spec_model: type[BaseModel]  # the create body, and the spec stored in the record
    job_model: type[BaseModel]  # the job object the API answers with
    shape_fields: tuple[str, ...]  # config fields that fix the adapter's shape: a resume cannot change them
    worker_module: str  # where its `load` is (worker/runtime/job_loop.py)
    family: str  # "grpo", "supervised", "session" or "export" (above)
    charts: tuple[Chart, ...]  # its curves (above)
    rows_per_example: int = 1  # supervised: token rows a training example takes in a step (a pair: 2)
    first_step: int = 1  # the `iter` of its first step event
    seed_aliases: tuple[tuple[str, str], ...] = ()  # (the seed's name, this project's metric), in progress and step events
    mlx_reports: bool = False  # mlx_lm's reports: the seed SFT's progress and train_loss / val_loss / completed events
    unset_time: float | None = 0.0  # started_at / finished_at before they happen
    also_reads: tuple[str, ...] = ()  # other kinds whose jobs its routes read, list and stream

    @property
    def step_event(self) -> str:
        return f"{self.name}_step"

    @property
    def route_kinds(self) -> tuple[str, ...]:
        return (self.name, *self.also_reads)

    @property
    def initial_progress(self) -> dict:
        return SFTProgress().model_dump() if self.mlx_reports else {}

    @property
    def headline(self) -> str:
        return self.charts[0].metrics[0] if self.charts else ""  # an export has none

    @property
    def own_loop(self) -> bool:
        """Its worker module's `run` runs its jobs (a session's calls, an export's one pass), not the job loop."""
        return self.family in ("session", "export")


def _supervised(spec_model: type[BaseModel], prefix: str, tag: str, what: str, worker_module: str,
                charts: tuple[Chart, ...], rows_per_example: int, shape_fields: tuple[str, ...] = LORA_SHAPE,
                job_model: type[BaseModel] = PreferenceJob, **seed) -> Kind:
    return Kind(spec_model.kind, prefix, tag, what, spec_model, job_model, shape_fields, worker_module, "supervised",
                charts, rows_per_example, **seed)


# The seed's DPO / ORPO / reward step events and progress: {iter, total_iters, loss, reward_margin, acc_chosen} (+ n_pairs).
PAIR_METRICS = (("reward_margin", "rewards/margins"), ("acc_chosen", "rewards/accuracies"), ("n_pairs", "examples"))
PREFERENCE_SEED = dict(first_step=0, seed_aliases=PAIR_METRICS)

# Each spec model names its kind (its `kind` ClassVar); this is the list of them.
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind(JobCreate.kind, "/admin/api/fine-tune/grpo/jobs", "GRPO jobs", "a GRPO job", JobCreate, Job, LORA_SHAPE,
         "worker.kinds.grpo_job", "grpo", GRPO_CHARTS, first_step=0),
    Kind(RLOOJobCreate.kind, "/admin/api/fine-tune/rloo/jobs", "RLOO jobs", "an RLOO job", RLOOJobCreate, RLOOJob,
         LORA_SHAPE, "worker.kinds.rloo", "grpo", GRPO_CHARTS, first_step=0),
    Kind(ReinforceJobCreate.kind, "/admin/api/fine-tune/reinforce/jobs", "REINFORCE jobs", "a REINFORCE job",
         ReinforceJobCreate, ReinforceJob, LORA_SHAPE, "worker.kinds.reinforce", "grpo", GRPO_CHARTS, first_step=0),
    _supervised(SFTJobCreate, "/admin/api/fine-tune/jobs", "SFT jobs", "an SFT job", "worker.kinds.sft_job", SFT_CHARTS, 1,
                (*LORA_SHAPE, "fine_tune_type", "quantize_base", "quant_bits", "quant_mode", "mxfp8"), SFTJob, mlx_reports=True, unset_time=None),
    _supervised(DPOJobCreate, "/admin/api/fine-tune/dpo/jobs", "DPO jobs", "a DPO job",
                "worker.kinds.dpo_job", DPO_CHARTS, 2, (*LORA_SHAPE, "method"), also_reads=("orpo",), **PREFERENCE_SEED),
    _supervised(ORPOJobCreate, "/admin/api/fine-tune/orpo/jobs", "ORPO jobs", "an ORPO job", "worker.kinds.dpo_job",
                ORPO_CHARTS, 2, (*LORA_SHAPE, "method"), **PREFERENCE_SEED),
    _supervised(CPOJobCreate, "/admin/api/fine-tune/cpo/jobs", "CPO jobs", "a CPO job", "worker.kinds.cpo_job", CPO_CHARTS, 2),
    _supervised(KTOJobCreate, "/admin/api/fine-tune/kto/jobs", "KTO jobs", "a KTO job", "worker.kinds.kto_job", KTO_CHARTS, 1,
                job_model=TrainJob),
    _supervised(RewardJobCreate, "/admin/api/fine-tune/reward/jobs", "Reward-model jobs", "a reward-model job",
                "worker.kinds.reward_model_job", REWARD_MODEL_CHARTS, 2, first_step=0,
                seed_aliases=(("reward_margin", "margin"), ("acc_chosen", "accuracy"), ("n_pairs", "examples"))),
    Kind(PPOJobCreate.kind, "/admin/api/fine-tune/ppo/jobs", "PPO jobs", "a PPO job", PPOJobCreate, PPOJob, LORA_SHAPE,
         "worker.kinds.ppo", "grpo", PPO_CHARTS, first_step=0),
    _supervised(GKDJobCreate, "/admin/api/fine-tune/gkd/jobs", "GKD jobs", "a GKD (distillation) job",
                "worker.kinds.gkd_job", GKD_CHARTS, 1, job_model=GKDJob),
    Kind(SessionJobCreate.kind, "/admin/api/fine-tune/session/jobs", "Training sessions", "a training session",
         SessionJobCreate, SessionJob, (), "worker.kinds.session_job", "session", SESSION_CHARTS),
    Kind(ExportJobCreate.kind, "/admin/api/fine-tune/export/jobs", "Export jobs", "an export job", ExportJobCreate,
         ExportJob, (), "worker.kinds.export_job", "export", ()),
    Kind(OnlineDPOJobCreate.kind, "/admin/api/fine-tune/online-dpo/jobs", "Online DPO jobs", "an Online DPO job",
         OnlineDPOJobCreate, OnlineDPOJob, LORA_SHAPE, "worker.kinds.online_dpo", "grpo", ONLINE_DPO_CHARTS),
    Kind(XPOJobCreate.kind, "/admin/api/fine-tune/xpo/jobs", "XPO jobs", "an XPO job", XPOJobCreate, XPOJob, LORA_SHAPE,
         "worker.kinds.online_dpo", "grpo", XPO_CHARTS),
)}
DEFAULT = KINDS[JobCreate.kind]  # of a record written before there were kinds


def of_record(kind: bytes | str | None) -> Kind:
    """The kind of a job record's `kind` field (bytes as Redis returns it; None: DEFAULT).
    ValueError for a kind this version does not know (a record it cannot read)."""
    if isinstance(kind, bytes):
        kind = kind.decode()
    if kind and kind not in KINDS:
        raise ValueError(f"unknown job kind {kind!r}")
    return KINDS[kind] if kind else DEFAULT
