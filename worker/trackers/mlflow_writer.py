"""MLflow: one run per job in experiment MTQ_MLFLOW_EXPERIMENT at MTQ_MLFLOW_TRACKING_URI, made
by the job's first run (its id kept in the tracker's state, so a resumed run logs to it), with
the job's config as params and tags naming the job, and metrics named as transformers'
MLflowCallback names them (`loss`, `eval_loss`). Every call to the server waits at most
MTQ_TRACKER_TIMEOUT_S and is not retried: a server that does not answer fails this tracker, not
the job. A `file:` URI is MLflow's file store (in maintenance mode: allowed here)."""

import os
import time

from shared import trackers

# Read by mlflow when it is imported: the settings' bounds on every call.
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"

from mlflow.entities import Metric, Param  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

BATCH = 1000  # MLflow's limit of metrics per log_batch
PARAMS_BATCH = 100  # ...and of params
STATUSES = {"completed": "FINISHED", "failed": "FAILED", "cancelled": "KILLED", "deleted": "KILLED"}


class Writer:
    def __init__(self, job):
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, round(job.settings.tracker_timeout_s)))
        self.client = MlflowClient(tracking_uri=job.settings.mlflow_tracking_uri)
        self.pending: list[Metric] = []
        self.run_id = job.state.get("run_id")
        if self.run_id is None:
            self.run_id = self._new_run(job)
            job.state["run_id"] = self.run_id
            trackers.save_state(job.r, job.job_id, "mlflow", job.state)

    def _new_run(self, job) -> str:
        name = job.settings.mlflow_experiment
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                experiment_id = self.client.create_experiment(name)
            except MlflowException:  # another job's tracker made it meanwhile
                experiment_id = self.client.get_experiment_by_name(name).experiment_id
        else:
            experiment_id = experiment.experiment_id
        tags = {"mtq.job_id": job.job_id, "mtq.kind": job.kind.name, "mtq.model_id": job.summary["model_id"]}
        run = self.client.create_run(experiment_id, run_name=job.run_name, tags=tags)
        params = [Param(k, str(v)[:6000]) for k, v in sorted(job.summary["config"].items())]
        for i in range(0, len(params), PARAMS_BATCH):
            self.client.log_batch(run.info.run_id, params=params[i:i + PARAMS_BATCH])
        return run.info.run_id

    def log(self, step: int, logs: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.pending += [Metric(k, v, now, step) for k, v in trackers.mlflow_names(logs).items()]

    def flush(self) -> None:
        for i in range(0, len(self.pending), BATCH):
            self.client.log_batch(self.run_id, metrics=self.pending[i:i + BATCH])
        self.pending = []

    def close(self, outcome: str) -> None:
        self.flush()
        if outcome in STATUSES:  # a re-queued job's run goes on in its next run
            self.client.set_terminated(self.run_id, STATUSES[outcome])
