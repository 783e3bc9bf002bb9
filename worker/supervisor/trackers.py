"""The supervisor's tracker processes (docs/trackers.md): one per tracker a job reports to,
started when the job's run starts (a gang's: by its rank 0 only), each running
worker/trackers/process.py, named as a module: the supervisor never imports a tracker library.

They end on their own once the run is over and its events are logged. A tracker still there
MTQ_TRACKER_GRACE_S after the run ended (a server that does not answer, a hang) is killed and
its state says so. The wait happens on a thread of its own: the next job never waits for a
tracker, and the heartbeat thread has nothing to do with them.
"""

import logging
import subprocess
import sys
import threading
import time

import redis

from shared import trackers
from shared.settings import Settings

log = logging.getLogger(__name__)

TRACKER_MAIN = "worker.trackers.process"  # run as `python -m`


def start(job_id: str, epoch: int, config: dict, settings: Settings) -> list[tuple[str, subprocess.Popen]]:
    """A process for each tracker of the job's config (its summary's: shared/trackers.py report_to)."""
    procs = []
    for name in trackers.report_to(config, settings.report_to):
        try:
            procs.append((name, subprocess.Popen([sys.executable, "-m", TRACKER_MAIN, job_id, str(epoch), name])))
        except OSError as e:  # no process to spare: the job runs without it
            log.warning("job %s: could not start tracker %s: %s", job_id, name, e)
    return procs


def end(r: redis.Redis, job_id: str, epoch: int, procs: list[tuple[str, subprocess.Popen]], grace_s: float) -> None:
    """The run is over: let its trackers finish, kill those left after grace_s (on a thread)."""
    if procs:
        threading.Thread(target=_reap, args=(r, job_id, epoch, procs, grace_s), name="mtq-trackers",
                         daemon=True).start()


def _reap(r: redis.Redis, job_id: str, epoch: int, procs: list[tuple[str, subprocess.Popen]], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for name, proc in procs:
        try:
            code = proc.wait(max(0.0, deadline - time.monotonic()))
            status, error = "failed", f"its process exited with code {code}"  # if it could not say so itself
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log.warning("job %s: tracker %s was still running %gs after the job's run ended; killed",
                        job_id, name, grace_s)
            code, status = None, "killed"
            error = f"still running {grace_s:g} s (MTQ_TRACKER_GRACE_S) after the job's run ended; killed"
        if code == 0:
            continue
        try:
            was = trackers.state(r, job_id).get(name, {})
            if was.get("status") == "running" and was.get("epoch") == epoch:  # not a later run's tracker
                error = f"{error} (at step {was.get('step')})"
                trackers.save_state(r, job_id, name, {**was, "status": status, "error": error})
        except redis.RedisError as e:
            log.warning("job %s: could not record tracker %s's end: %s", job_id, name, e)
