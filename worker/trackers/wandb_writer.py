"""wandb: one run per job (its id the job's, so a resumed run resumes it) in its config's
wandb_project (default MTQ_WANDB_PROJECT), logged as transformers' WandbCallback logs (`train/loss`, `eval/loss`, against
`train/global_step`). Without WANDB_API_KEY (or with WANDB_MODE=offline) it runs offline: the
run's files go under $MTQ_HOME/trackers/<job id>/wandb, for `wandb sync`. Only this process
imports wandb, so the environment it reads is set here."""

import os
import tempfile

from shared import trackers
from shared.settings import load_settings

# Read when wandb is imported: offline without a key, and its cache, config, artifacts and
# temporary files under $MTQ_HOME/trackers/wandb, not the user's home or /tmp.
if not os.environ.get("WANDB_API_KEY"):
    os.environ.setdefault("WANDB_MODE", "offline")
_OWN = load_settings().home / "trackers" / "wandb"
for _var, _sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data"),
                   ("WANDB_ARTIFACT_DIR", "artifacts"), ("TMPDIR", "tmp")):
    os.environ[_var] = str(_OWN / _sub)
    (_OWN / _sub).mkdir(parents=True, exist_ok=True)
tempfile.tempdir = os.environ["TMPDIR"]

import wandb  # noqa: E402


class Writer:
    def __init__(self, job):
        job.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(init_timeout=job.settings.tracker_timeout_s, console="off", x_disable_stats=True,
                                  silent=True)
        project = job.summary["config"].get("wandb_project") or job.settings.wandb_project
        self.run = wandb.init(project=project, name=job.run_name, id=job.job_id, resume="allow",
                              dir=str(job.dir), config=job.summary["config"], settings=settings, tags=[job.kind.name])
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(self, step: int, logs: dict[str, float]) -> None:
        self.run.log({**trackers.rewrite_logs(logs), "train/global_step": step})

    def flush(self) -> None:
        pass  # wandb's own process writes as it goes

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome in ("completed", "queued") else 1)
