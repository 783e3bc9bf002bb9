"""wandb: one run per job (its id the job's, so a resumed run resumes it) in project
MTQ_WANDB_PROJECT, logged as transformers' WandbCallback logs (`train/loss`, `eval/loss`, against
`train/global_step`). Without WANDB_API_KEY (or with WANDB_MODE=offline) it runs offline: the
run's files go under $MTQ_HOME/trackers/<job id>/wandb, for `wandb sync`."""

import os

if not os.environ.get("WANDB_API_KEY"):  # read when wandb is imported
    os.environ.setdefault("WANDB_MODE", "offline")

import wandb  # noqa: E402

from shared import trackers  # noqa: E402


class Writer:
    def __init__(self, job):
        job.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(init_timeout=job.settings.tracker_timeout_s, console="off", x_disable_stats=True,
                                  silent=True)
        self.run = wandb.init(project=job.settings.wandb_project, name=job.run_name, id=job.job_id, resume="allow",
                              dir=str(job.dir), config=job.summary["config"], settings=settings, tags=[job.kind.name])
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(self, step: int, logs: dict[str, float]) -> None:
        self.run.log({**trackers.rewrite_logs(logs), "train/global_step": step})

    def flush(self) -> None:
        pass  # wandb's own process writes as it goes

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome in ("completed", "queued") else 1)
