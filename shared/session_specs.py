"""The session kind's spec (shared/kinds.py): a Tinker training session's hold on a worker.

A session job is made by the Tinker-compatible API (api/routes/tinker_*.py, docs/sessions.md)
when a session first needs a base model (create_model, a sampling session, a load): one job per
(session, base model). It is routed as any job (its model, its memory), runs on its worker until
the session finishes, its client stops heartbeating for idle_timeout_s, or it is cancelled, and
serves the session's calls in between (worker/kinds/session_job.py). Its clients' weights and
optimizer state live in that worker's memory, so a lost worker ends the session's job (one
attempt): the pending futures fail with a message that says to load the last save_state.
"""

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from shared.model_ids import MODEL_ID_RE
from shared.report_specs import ReportConfig
from shared.schemas import DEFAULT_LANE, LANE_PATTERN, JobRecord

SESSION_ID_PATTERN = r"^[a-z0-9]{1,64}$"


class SessionConfig(ReportConfig):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    queue: str = Field(DEFAULT_LANE, pattern=LANE_PATTERN, description="The job's lane (as GRPO's: shared/routing.py).")
    workers: int = Field(1, ge=1, le=1, description="A session runs on one worker.")
    max_attempts: int = Field(1, ge=1, le=1, description="Its clients' state lives in its worker's memory: a lost "
                              "worker ends the session's job (load the last save_state in a new one).")
    stall_timeout_s: float = Field(600.0, ge=1.0, le=86_400.0, description="The supervisor ends a session whose "
                                   "training process stops making progress marks for this long.")
    idle_timeout_s: float = Field(60.0, ge=5.0, le=86_400.0, description="The session ends when its client has "
                                  "sent no heartbeat and no call for this long (the SDK heartbeats every 10 s).")
    max_seq_len: int = Field(8192, ge=1, le=1_048_576, description="Tokens of one datum (a sequence) of a call: more "
                             "is a 400. The memory estimate routes the session by one row of it; the worker splits "
                             "a call's datums into micro-batches that fit.")


class SessionJobCreate(BaseModel):
    """What the Tinker API stores for a session's job on one base model (never posted directly)."""

    kind: ClassVar[str] = "session"
    model_config = ConfigDict(extra="forbid")

    model_id: str = Field(..., min_length=1, max_length=512, pattern=MODEL_ID_RE.pattern,
                          description="The base model (as a job's model_id).")
    session_id: str = Field(..., pattern=SESSION_ID_PATTERN, description="The Tinker session it serves.")
    adapter_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    config: SessionConfig = Field(default_factory=SessionConfig)


class SessionJob(JobRecord):
    """A session job as the job routes show it."""

    session_id: str
    config: SessionConfig
