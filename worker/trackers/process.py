"""`python -m worker.trackers.process JOB_ID EPOCH TRACKER`: one tracker of one run of a job
(the run that holds lease epoch EPOCH).

It reads the job's event stream after its cursor (kept in the job's trackers hash, so a run
resumed on another worker goes on where the last one stopped), logs each step and eval event's
metrics (shared/trackers.py logs_of) and flushes after each read, then moves the cursor. The run
is over once the job is no longer running under EPOCH (completed, failed, cancelled, re-queued);
it then reads what is left, closes the tracker's run and exits. Its failure is its own: its
state says `failed` with the error, a log line says it, and, while the job still runs, a
`tracker_failed` event; the job goes on. The supervisor kills it MTQ_TRACKER_GRACE_S after the
run ended if it is still there (worker/supervisor/trackers.py).
"""

import importlib
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from shared import jobstore, trackers
from shared.events import decode_events
from shared.jobstore import connect
from shared.keys import events_key, job_key
from shared.kinds import Kind
from shared.settings import Settings, load_settings
from worker.supervisor.child import die_with_parent

log = logging.getLogger("mtq.tracker")

WRITERS = {"tensorboard": "worker.trackers.tb_writer", "mlflow": "worker.trackers.mlflow_writer",
           "wandb": "worker.trackers.wandb_writer"}
BLOCK_MS = 1_000  # one XREAD at most: also how late the run's end is noticed
BATCH = 500


@dataclass
class TrackedJob:
    """What a writer is given: the job, its run, and where it may write."""

    job_id: str
    epoch: int
    kind: Kind
    summary: dict[str, Any]  # model_id, adapter_name, config (shared/routing.py spec_summary)
    settings: Settings
    r: redis.Redis
    state: dict[str, Any]  # this tracker's state, as the last run left it (an MLflow run id...)

    @property
    def dir(self) -> Path:
        """The job's tracker files on this machine: $MTQ_HOME/trackers/<job id>."""
        return self.settings.home / "trackers" / self.job_id

    @property
    def run_name(self) -> str:
        return self.summary["config"].get("run_name") or self.summary["adapter_name"] or self.job_id


def main(argv: list[str] | None = None) -> int:
    job_id, epoch_text, name = argv or sys.argv[1:]
    epoch = int(epoch_text)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tracker {name} %(levelname)s %(message)s")
    settings = load_settings()
    r = connect(settings.redis_url)
    found = jobstore.load_summary(r, job_id)
    if found is None:
        return 0  # deleted meanwhile
    kind, summary = found
    state = {**trackers.state(r, job_id).get(name, {}), "status": "running", "epoch": epoch, "error": None}
    trackers.save_state(r, job_id, name, state)
    try:
        writer = importlib.import_module(WRITERS[name]).Writer(TrackedJob(job_id, epoch, kind, summary, settings, r, state))
        outcome = follow(r, job_id, epoch, kind, writer, name, state)
        writer.close(outcome)
    except Exception as e:  # any failure of the tracker's: never the job's
        error = f"{type(e).__name__}: {e}"[:1000]
        if isinstance(e, ModuleNotFoundError):
            error += f" (this worker lacks it: pip install 'mlx-train-queue[{name}]')"
        log.exception("job %s: tracker %s failed", job_id, name)
        trackers.save_state(r, job_id, name, {**state, "status": "failed", "error": error})
        trackers.event_while_running(r, job_id, {"type": "tracker_failed", "tracker": name, "error": error})
        return 1
    trackers.save_state(r, job_id, name, {**state, "status": "finished"})
    return 0


def follow(r: redis.Redis, job_id: str, epoch: int, kind: Kind, writer, name: str, state: dict) -> str:
    """Log the run's events until it is over and they are all read; the job's status then."""
    cursor = state.get("cursor", "0-0")
    while True:
        # The record is read before the events: once the run is over and nothing is left, all is read.
        status, lease_epoch = r.hmget(job_key(job_id), "status", "lease_epoch")
        over = status != b"running" or lease_epoch != str(epoch).encode()
        events = decode_events(r.xread({events_key(job_id): cursor}, count=BATCH, block=None if over else BLOCK_MS))
        for cursor, event in events:
            logged = trackers.logs_of(kind, event)
            if logged is not None:
                writer.log(*logged)
                state["step"] = logged[0]
        if events:
            writer.flush()
            state["cursor"] = cursor
            trackers.save_state(r, job_id, name, state)
        elif over:
            return "deleted" if status is None else status.decode()


if __name__ == "__main__":
    sys.exit(main())
