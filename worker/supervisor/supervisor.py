"""`mtq worker`: a supervisor process without MLX, and the training process it runs.

Liveness must not depend on the training interpreter: a reward function stuck in native
code, a kernel that never returns, or an out-of-memory kill would take a heartbeat thread in
the same process down with it. So `mtq worker` is two processes:

- the supervisor (this module): an rq worker (worker/supervisor/rq_worker.py). It dequeues a
  job, asks admission whether to take it (worker/supervisor/admission.py), takes its lease
  (worker/supervisor/lease.py), hands it to its training process and watches that process
  (worker/supervisor/watchdog.py). A heartbeat thread renews the lease and rq's heartbeats,
  advertises the worker and runs the reconciler (worker/supervisor/reconciler.py). It never
  imports MLX, so it always answers.
- the training process (worker/supervisor/child.py starts it; its code is
  worker/runtime/training_process.py): a long-lived child whose main thread owns MLX, keeps
  models loaded between jobs and runs one job at a time.

A gang job (worker/supervisor/gang_claims.py) runs as one rank per worker, each in a training
process watched as any job's that has never joined a group (MLX forms one per process: after a
gang's attempt the process is replaced); the worker that took its rq job leads (rank 0,
`lead_gang`), the others run the rank jobs it pushes on their own queues (`run_rank`).
"""

import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import redis

from shared import jobstore, lifecycle, routing, workers
from shared.jobstore import connect
from shared.keys import job_key
from shared.settings import load_settings
from worker.supervisor import admission, gang_claims, openblas, trackers, watchdog
from worker.supervisor.child import TrainingProcess
from worker.supervisor.lease import Lease, LeaseLost, retrying
from worker.supervisor.reconciler import Reconciler
from worker.supervisor.rq_worker import RQWorker

log = logging.getLogger(__name__)

NO_LONGER_QUEUED = "not started: the job is no longer queued"


class Supervisor(RQWorker):
    """Listens to the queues of what it offers (shared/routing.py): for each lane, its own
    queue, then every model it can load in every memory class up to its memory, then (--hub)
    the hub's. The heartbeat refreshes that list (models appear, get loaded)."""

    def __init__(self, *args, lanes: list[str], models: list[str], memory_gb: float | None, hub: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.lanes, self.declared_models, self.declared_memory_gb, self.hub = lanes, models, memory_gb, hub
        self.training = TrainingProcess(self.name, self.declared_models)
        self.lease: Lease | None = None  # of the job being run, for the heartbeat thread
        self.current_job: str | None = None
        self.held: str | None = None  # this worker's hold for its job (gang_claims.hold), for the heartbeat
        self.models: dict[str, dict] = {}  # model key -> what it advertises of the models it has on disk
        self._advertising = threading.Lock()
        self._started_at = time.time()
        settings = load_settings()
        self.gang_address = f"{settings.gang_host}:{settings.gang_port or _free_port(settings.gang_host)}"

    @property
    def memory_gb(self) -> float | None:
        """What jobs may use here: as declared (--memory-gb), else as the training process detected."""
        if self.declared_memory_gb:
            return self.declared_memory_gb
        return None if self.training.device is None else self.training.device["memory_gb"]

    def work(self, *args, **kwargs):
        """Start the heartbeat and the training process, then rq's work loop; on the way out,
        end the child and withdraw the advertisement."""
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat_loop, args=(stop,), name="mtq-heartbeat", daemon=True)
        beat.start()
        try:
            self.training.start()
            self._advertise()  # now with the device's memory: the queues of every memory class that fits
            return super().work(*args, **kwargs)
        finally:
            stop.set()
            self.training.stop()
            beat.join(5)  # no advertisement after the withdrawal
            try:
                workers.withdraw(self.connection, self.name)
                if self.held:  # after the withdrawal: a leader picks only advertised workers
                    gang_claims.release(self.connection, [self.name], self.held)
            except redis.RedisError:
                pass  # they expire on their own

    # ------------------------------------------------------------------ one job

    def run(self, job_id: str) -> str:
        """rq's job function (worker/jobs.py) calls this: admit the job, take its lease, let the
        child run it, watch."""
        kind, summary, unreadable = self._read(job_id)
        decision = admission.admit(self.connection, self._here(), job_id, self.running_rq_job_id, kind, summary)
        if isinstance(decision, admission.NotStarted):
            return f"not started: {decision.reason}"
        if isinstance(decision, admission.LeadGang):
            return self.lead_gang(job_id, summary, decision)
        lease = Lease.start(self.connection, job_id, self.name)
        if lease is None:
            retrying(lambda: gang_claims.release(self.connection, [self.name], decision.token), "gang claim")
            return NO_LONGER_QUEUED
        return self._run_leased(lease, summary, unreadable, held=decision.token)

    def lead_gang(self, job_id: str, summary: dict, gang: admission.LeadGang) -> str:
        """Start the gang job admission formed, this worker as rank 0, and push the other ranks."""
        lease = Lease.start(self.connection, job_id, self.name, gang=gang.names)
        if lease is None:
            gang_claims.release(self.connection, gang.names, gang.token)
            return NO_LONGER_QUEUED
        hosts = admission.push_ranks(self.connection, job_id, lease.epoch, gang, summary["config"]["queue"])
        return self._run_leased(lease, summary, gang=(0, hosts), held=gang.token)

    def run_rank(self, job_id: str, epoch: int, rank: int, hosts: list[list[str]], token: str) -> str:
        """rq's rank job (worker/jobs.py): this worker's part of a gang job its leader started
        under `epoch`; watched as any job, so that its death or stall ends the gang's attempt."""
        ttl = load_settings().lease_ttl_s
        # The gang's claim (token) becomes this rank's hold while it runs (held afresh if it lapsed).
        held = retrying(lambda: token if gang_claims.renew(self.connection, self.name, token, ttl)
                        else gang_claims.hold(self.connection, self.name, job_id, ttl), "gang claim")
        lease = Lease(self.connection, job_id, self.name, epoch)
        if held is None or not lease.renew():
            if held:
                retrying(lambda: gang_claims.release(self.connection, [self.name], held), "gang claim")
            return "not started: the gang's attempt is over"
        _, summary, unreadable = self._read(job_id)
        return self._run_leased(lease, summary, unreadable, gang=(rank, hosts), held=held)

    def _read(self, job_id: str) -> tuple[str | None, dict | None, str | None]:
        """(kind, summary, why it cannot be read): no summary when the job is gone or its record
        cannot be read (the job then fails once its lease is taken, never retried)."""
        try:
            found = retrying(lambda: jobstore.load_summary(self.connection, job_id), "job read")
        except ValueError as e:
            return None, None, lifecycle.unreadable(e)
        return (None, None, None) if found is None else (found[0].name, found[1], None)

    def _here(self) -> admission.Here:
        device = self.training.device
        return admission.Here(self.name, self.memory_gb, None if device is None else device["device"], self.models)

    def _run_leased(self, lease: Lease, summary: dict | None, unreadable: str | None = None,
                    gang: tuple[int, list[list[str]]] | None = None, held: str | None = None) -> str:
        """Run the job (or its gang rank) under the lease this worker holds (and its hold:
        gang_claims.hold); watch its child."""
        self.held = held
        self._begin(lease)
        try:
            if summary is None:
                lease.finish("failed", {"type": "failed", "error": unreadable}, error=unreadable)
                return "failed"
            settings = load_settings()
            # The server's cap too: a record written around the API (or before the cap) may ask for a day.
            stall_timeout_s = min(summary["config"]["stall_timeout_s"], settings.max_stall_timeout_s)
            reports = gang is None or gang[0] == 0  # a gang's rank 0 reports for it
            tracking = trackers.start(lease.job_id, lease.epoch, summary["config"], settings) if reports else []
            try:
                return watchdog.watch(self.training, lease, stall_timeout_s, gang, lambda: self.stop_requested)
            finally:
                trackers.end(self.connection, lease.job_id, lease.epoch, tracking, settings.tracker_grace_s)
        except LeaseLost:
            return "lease lost"
        except BaseException:  # e.g. a cold shutdown (second Ctrl-C): end the child, give the job back now
            self._give_back(lease)
            raise
        finally:
            self._end()

    def _begin(self, lease: Lease) -> None:
        self.lease = lease
        self.current_job = lease.job_id
        self._advertise()

    def _give_back(self, lease: Lease) -> None:
        self.training.kill()
        try:
            lease.hand_back("worker stopped")
        except Exception:
            log.exception("job %s: could not hand it back; the reconciler will re-queue it", lease.job_id)

    def _end(self) -> None:
        self.lease = None
        self.current_job = None
        if self.stopping:  # retired (handle_warm_shutdown_request): held until it is gone; no fresh process
            self._advertise()
            return
        held, self.held = self.held, None
        if held:
            try:
                gang_claims.release(self.connection, [self.name], held)
            except redis.RedisError:
                pass  # it expires after the lease's TTL
        if self.training.in_gang:  # its process is in the attempt's group for good: a fresh one for the next job
            self.training.kill()
            self.training.start()
        self._advertise()

    def handle_warm_shutdown_request(self):
        """rq's hook on SIGTERM / Ctrl-C: before the watchdog asks the child to hand the job back,
        this worker holds itself for no job (gang_claims.retire), so that no gang, its job's next
        one included, claims it on its way out (rq's own hook writes to Redis here too)."""
        super().handle_warm_shutdown_request()
        try:
            self.held = gang_claims.retire(self.connection, self.name, load_settings().lease_ttl_s)
        except redis.RedisError:
            log.warning("could not mark this worker as shutting down in Redis; a gang may still claim it")

    # ------------------------------------------------------------------ the heartbeat thread

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        ttl = load_settings().lease_ttl_s
        reconciler = Reconciler(self.connection, grace_s=ttl / 2)
        self._advertise()
        while not stop.wait(ttl / 4):
            self._advertise()
            try:
                self._beat(reconciler)
            except redis.RedisError as e:
                log.warning("heartbeat: redis error %s", e)
            except Exception:
                log.exception("heartbeat failed")

    def _beat(self, reconciler: Reconciler) -> None:
        """Renew the running job's lease (a lost one never comes back) and rq's heartbeats, show
        its progress, and repair what lost workers left."""
        lease, held = self.lease, self.held
        if lease is not None and not lease.lost.is_set() and not lease.renew():
            log.warning("job %s: lease lost to another worker; dropping it", lease.job_id)
        if held is not None:
            gang_claims.renew(self.connection, self.name, held, load_settings().lease_ttl_s)
        running = self.running
        if running is not None:
            self.renew_rq_heartbeats()
            if lease is not None:
                self._mirror_progress(running[0], lease.job_id)
        for job_id in reconciler.scan():
            log.warning("job %s: re-queued or routed again by the reconciler (see its events)", job_id)

    def _mirror_progress(self, rq_job, job_id: str) -> None:
        """Copy the job's progress into its rq job's meta, for rq-dashboard's job page."""
        raw = self.connection.hget(job_key(job_id), "progress")
        progress = json.loads(raw) if raw else {}
        done, total = progress.get("iter", 0), progress.get("total_iters")
        eta = None if not (done and total and progress.get("step_time")) else (total - done) * progress["step_time"]
        rq_job.meta.update({"mtq_job_id": job_id, "step": f"{done}/{total}", "reward": progress.get("mean_reward"),
                            "loss": progress.get("loss"), "eta_s": None if eta is None else round(eta, 1),
                            "phase": self.training.marks.phase})
        rq_job.save_meta()

    def _advertise(self) -> None:
        """What this worker offers (shared/workers.py), read by the router and GET /admin/api/workers;
        and the queues that follow from it. Called from the heartbeat and when a job starts or
        ends (the router prefers a free worker holding the model), one at a time."""
        settings = load_settings()
        with self._advertising:
            try:
                loaded = json.loads(self.connection.get(workers.loaded_key(self.name)) or "[]")
                models = workers.all_local_models(settings.models_dir, settings.model_roots)
                self.models = {routing.model_key(m["model_id"]): m for m in models}
                queues = routing.worker_queues(self.name, self.lanes, [*self.models, *self.declared_models, *loaded],
                                               self.memory_gb, self.hub)
                self.listen(queues)
                workers.advertise(self.connection, self._record(settings, models, queues), ttl_s=settings.lease_ttl_s)
            except (redis.RedisError, OSError) as e:
                log.warning("heartbeat: could not advertise this worker: %s", e)

    def _record(self, settings, models: list[dict], queues: list[str]) -> dict:
        """This worker's advertisement (shared/workers.py record)."""
        device = self.training.device or {}
        return workers.record(
            self.name, settings.models_dir, models, self._started_at, queues=queues,
            lanes=self.lanes, hub=self.hub, declared=self.declared_models, current_job=self.current_job,
            device=device.get("device"), device_name=device.get("device_name"),
            memory_total_gb=device.get("memory_total_gb"), memory_gb=self.memory_gb,
            memory_declared=self.declared_memory_gb is not None,
            # No gang address where the training process cannot join its backend: no gang picks it.
            gang_address=None if device.get("gang_error") else self.gang_address,
            gang_backend=device.get("gang_backend"), gang_error=device.get("gang_error"),
            gang_rdma=dict(item.split("=", 1) for item in settings.gang_rdma if "=" in item),
            models_free_bytes=_free_bytes(settings.models_dir),
        )


def _free_bytes(directory: Path) -> int:
    """Free disk space where models staged from a gang's leader are written (its nearest existing
    parent's while it does not exist yet)."""
    for d in (directory, *directory.parents):
        if d.exists():
            return shutil.disk_usage(d).free
    return 0


def _free_port(host: str) -> int:
    """A port free now on `host`, for this worker's gang ranks to listen on."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_current: Supervisor | None = None


def current() -> Supervisor:
    assert _current is not None, "not running inside `mtq worker`"
    return _current


def run_worker(lanes: list[str], name: str | None = None, models: list[str] = (), memory_gb: float | None = None,
               hub: bool = False) -> None:
    """`mtq worker`: lanes in the order to serve them; models: ids to offer besides those on
    disk (e.g. Hugging Face ids to fetch, with hub); memory_gb: overrides the detected memory
    (the training process plans jobs with it too: MTQ_MEMORY_GB)."""
    global _current
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    openblas.preload_for_children()  # before the training process starts (and imports mlx)
    if memory_gb:
        os.environ["MTQ_MEMORY_GB"] = repr(memory_gb)
    if hub:  # the training process may download models (worker/runtime/models.py), for every kind of request
        os.environ["MTQ_HUB"] = "1"
    settings = load_settings()
    name = name or re.sub(r"[^A-Za-z0-9._-]", "-", f"{socket.gethostname().split('.')[0]}-{os.getpid()}")[-64:]
    # Until the training process has reported its device (and memory), only the worker's own queues.
    _current = Supervisor([routing.own_queue(lane, name) for lane in lanes], connection=connect(settings.redis_url),
                          name=name, lanes=list(lanes), models=list(models), memory_gb=memory_gb or settings.memory_gb,
                          hub=settings.hub)
    _current.work(with_scheduler=False, logging_level="INFO")
