"""The config fields every kind shares that say which experiment trackers get its metrics
(docs/trackers.md; what they get: shared/trackers.py)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TRACKERS = ("tensorboard", "mlflow", "wandb")
Tracker = Literal["tensorboard", "mlflow", "wandb"]


class ReportConfig(BaseModel):
    """The config fields of every kind that say where its metrics go besides its event stream."""

    model_config = ConfigDict(extra="forbid")

    report_to: list[Tracker] | None = Field(
        None, max_length=len(TRACKERS), description="Experiment trackers fed from the job's events (TRL's "
        "`report_to`): tensorboard, mlflow, wandb. null: the server's MTQ_REPORT_TO (default none); [] : none.")
    run_name: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[^\x00-\x1f]+$",
                                 description="The run's name in MLflow and wandb (default: the job's adapter name).")
    wandb_project: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$",
                                      description="The wandb project (default: the server's MTQ_WANDB_PROJECT).")
