"""`mtq worker`: a supervisor process without MLX, and the training process it runs.

Liveness must not depend on the training interpreter: a reward function stuck in native
code, a kernel that never returns, or an out-of-memory kill would take a heartbeat thread in
the same process down with it. So `mtq worker` is two processes:

- the supervisor (this module): an rq SimpleWorker. It dequeues jobs, takes each job's lease
  (worker/supervisor/lease.py), and from a heartbeat thread renews the lease and rq's heartbeats and runs
  the reconciler (worker/supervisor/reconciler.py). It never imports MLX, so it always answers.
- the training process (worker/runtime/training_process.py): a long-lived child whose main thread
  owns MLX, keeps models loaded between jobs and runs one job at a time.

While a job runs, the supervisor's main thread watches (Supervisor.watch):
  the child exits (crash, os._exit, OOM kill)   -> the job is re-queued, an attempt counted; a fresh child starts
  no progress mark for stall_timeout_s          -> the child is killed, likewise
  SIGTERM / Ctrl-C (warm shutdown)              -> the child checkpoints and hands the job back (no attempt
                                                   counted), or is killed after SHUTDOWN_GRACE_S and the job
                                                   handed back anyway
  the lease is lost (another worker has the job, -> the child drops it at its next check or write, or is
  or it was cancelled)                             killed after LEASE_LOST_GRACE_S (a gang's rank: at once,
                                                   a collective cannot be left)

A gang job (worker/supervisor/gang_claims.py) runs as one rank per worker, each in a training process watched
as above that has never joined a group (MLX forms one per process: after a gang's attempt the
process is replaced); the worker that took its rq job leads (rank 0, `lead_gang`), the others
run the rank jobs it pushes on their own queues (`run_rank`).
"""

import ctypes
import json
import logging
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time

import redis
from pydantic import ValidationError
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.worker import WorkerStatus

from shared import kinds, lifecycle, routing, workers
from shared.jobstore import connect
from shared.keys import job_key
from shared.settings import load_settings
from worker.supervisor import gang_claims as gangs
from worker.supervisor import kernel_cache, openblas
from worker.supervisor.lease import Lease, LeaseLost, retrying
from worker.supervisor.marks import Marks
from worker.supervisor.reconciler import Reconciler

log = logging.getLogger(__name__)

POLL_S = 0.2
SHUTDOWN_GRACE_S = 30.0
LEASE_LOST_GRACE_S = 10.0
READY_TIMEOUT_S = 300.0  # importing MLX and the trainer
MAX_BACKOFF_S = 30.0  # between two tries of rq's work loop while Redis is in trouble
GANG_RETRY_S = 1.0  # a leader that found too few free workers for a gang job waits this long before its next dequeue


def training_entry(conn, marks: Marks, worker: str, parent_pid: int, warm_models: list[str]) -> None:
    """The training process's entry point (multiprocessing 'spawn': a fresh interpreter, no fork
    of MLX). It imports the training process's module, and with it MLX, only here, in the child."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    kernel_cache.use(load_settings().kernel_cache_dir)  # before MLX compiles anything
    from worker.runtime import training_process  # in the child only: the supervisor never loads MLX

    training_process.main(conn, marks, worker, parent_pid, warm_models)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the supervisor dies (even if this one hangs
    in native code). Elsewhere should_stop notices the new parent at its next check."""
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class TrainingProcess:
    """The supervisor's handle on its child."""

    def __init__(self, worker_name: str, warm_models: list[str]):
        self.ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: never fork a process with MLX in it
        self.marks = Marks(self.ctx)
        self.worker_name = worker_name
        self.warm_models = warm_models  # what a child that finds the kernel cache empty warms up (worker/runtime/warm_up.py)
        self.proc = None
        self.conn = None
        self.device: dict | None = None  # the MLX device and its memory, as the child reports it
        self.in_gang = False  # it was given a gang's rank: its MLX group lives as long as it does

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def start(self) -> None:
        """Start the child and wait until it has loaded MLX and the trainers."""
        ours, theirs = self.ctx.Pipe()
        self.in_gang = False
        self.proc = self.ctx.Process(target=training_entry, name="mtq-training", daemon=True,
                                     args=(theirs, self.marks, self.worker_name, os.getpid(), self.warm_models))
        self.proc.start()
        theirs.close()
        self.conn = ours
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ours.poll(POLL_S):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the training process did not start ({self.exit_description()})")
        ready, self.device = ours.recv()
        assert ready == "ready"
        log.info("training process %d ready on %s", self.proc.pid, self.device)

    def exit_description(self) -> str:
        code = None if self.proc is None else self.proc.exitcode
        if code is None:
            return "still running"
        if code < 0:
            name = signal.Signals(-code).name
            return f"was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
        return f"exited with code {code}"

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(10)
        self.proc = None

    def stop(self) -> None:
        """Let the child end on its own (it exits when the pipe closes), else kill it."""
        if self.conn is not None:
            self.conn.close()
        if self.proc is not None:
            self.proc.join(5)
        self.kill()


class Supervisor(SimpleWorker):
    """Listens to the queues of what it offers (shared/routing.py): for each lane, its own
    queue, then every model it can load in every memory class up to its memory, then (--hub)
    the hub's. The heartbeat refreshes that list (models appear, get loaded); rq reads
    `_ordered_queues` at every dequeue, which waits at most `dequeue_timeout`."""

    def __init__(self, *args, lanes: list[str], models: list[str], memory_gb: float | None, hub: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.lanes, self.declared_models, self.declared_memory_gb, self.hub = lanes, models, memory_gb, hub
        self.training = TrainingProcess(self.name, self.declared_models)
        self.lease: Lease | None = None  # of the job being run, for the heartbeat thread
        self._running = None  # (rq job, execution) while a job runs
        self.current_job: str | None = None
        self.stopping = False  # a warm shutdown was requested
        self.models: dict[str, dict] = {}  # model key -> what it advertises of the models it has on disk
        self._advertising = threading.Lock()
        self._started_at = time.time()
        settings = load_settings()
        self.gang_address = f"{settings.gang_host}:{settings.gang_port or _free_port(settings.gang_host)}"

    @property
    def dequeue_timeout(self) -> int:
        return max(1, int(load_settings().lease_ttl_s / 4))

    @property
    def memory_gb(self) -> float | None:
        """What jobs may use here: as declared (--memory-gb), else as the training process detected."""
        if self.declared_memory_gb:
            return self.declared_memory_gb
        return None if self.training.device is None else self.training.device["memory_gb"]

    def get_heartbeat_ttl(self, job, working_time: float = 0.0) -> int:
        # rq's registry entries live as long as our lease: a dead worker is noticed quickly,
        # and the heartbeat thread keeps a live one's entries fresh.
        return max(int(load_settings().lease_ttl_s), 1) + 5

    def execute_job(self, job, queue):
        execution = self.prepare_execution(job)
        self._running = (job, execution)
        try:
            self.perform_job(job, queue, execution)
        finally:
            self._running = None
        self.set_state(WorkerStatus.IDLE)

    def work(self, *args, **kwargs):
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat_loop, args=(stop,), name="mtq-heartbeat", daemon=True)
        beat.start()
        try:
            self.training.start()
            self._advertise()  # now with the device's memory: the queues of every memory class that fits
            return self._work_through_redis_trouble(*args, **kwargs)
        finally:
            stop.set()
            self.training.stop()
            beat.join(5)  # no advertisement after the withdrawal
            try:
                workers.withdraw(self.connection, self.name)
            except redis.RedisError:
                pass  # it expires on its own

    def handle_warm_shutdown_request(self):
        # rq's hook on SIGTERM / Ctrl-C; an idle rq worker then leaves its loop by an exception
        # without setting _stop_requested, so the loop below needs its own word for it.
        self.stopping = True
        super().handle_warm_shutdown_request()

    def _work_through_redis_trouble(self, *args, **kwargs) -> bool:
        """rq's work loop, again after a pause when it ends on a Redis error (out of memory, or a
        timeout: rq then quits) rather than on a stop: the worker backs off instead of exiting
        (and being restarted at once, over and over, by `mtq up` or a service manager)."""
        delay = 1.0
        while True:
            try:
                worked = super().work(*args, **kwargs)
            except redis.RedisError as e:  # raised where rq registers or retires the worker
                log.warning("worker loop: redis error %s", e)
                worked = False
            if self.stopping:
                return worked
            self._forget_registration()
            log.warning("worker loop ended on Redis trouble; again in %.0f s", delay)
            try:
                time.sleep(delay)  # rq's signal handlers stay installed: a SIGTERM here ends the wait
            except StopRequested:
                return worked
            delay = min(delay * 2, MAX_BACKOFF_S)

    def _forget_registration(self) -> None:
        """What rq's loop may leave when a Redis error ends it: its pubsub thread, and its worker
        key without a death date (rq would refuse to register the name again)."""
        try:
            self.unsubscribe()
            self.connection.delete(self.key)  # allowed at maxmemory
        except redis.RedisError as e:
            log.warning("worker loop: redis error %s", e)

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        ttl = load_settings().lease_ttl_s
        reconciler = Reconciler(self.connection, grace_s=ttl / 2)
        self._advertise()
        while not stop.wait(ttl / 4):
            self._advertise()
            try:
                lease = self.lease
                if lease is not None and not lease.renew():
                    log.warning("job %s: lease lost to another worker; dropping it", lease.job_id)
                running = self._running
                if running is not None:
                    self.maintain_heartbeats(*running)
                    if lease is not None:
                        self._mirror_progress(running[0], lease.job_id)
                for job_id in reconciler.scan():
                    log.warning("job %s: re-queued or routed again by the reconciler (see its events)", job_id)
            except redis.RedisError as e:
                log.warning("heartbeat: redis error %s", e)
            except Exception:
                log.exception("heartbeat failed")

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
                self._listen(queues)
                device = self.training.device or {}
                rec = workers.record(
                    self.name, settings.models_dir, models, self._started_at, queues=queues,
                    lanes=self.lanes, hub=self.hub, declared=self.declared_models, current_job=self.current_job,
                    device=device.get("device"), device_name=device.get("device_name"),
                    memory_total_gb=device.get("memory_total_gb"), memory_gb=self.memory_gb,
                    memory_declared=self.declared_memory_gb is not None, gang_address=self.gang_address,
                )
                workers.advertise(self.connection, rec, ttl_s=settings.lease_ttl_s)
            except (redis.RedisError, OSError) as e:
                log.warning("heartbeat: could not advertise this worker: %s", e)

    def _listen(self, names: list[str]) -> None:
        """Listen to these queues from the next dequeue on (rq's worker reads `_ordered_queues`
        there), and show them in rq's worker record (rq-dashboard's workers view)."""
        if names == self.queue_names():
            return
        self.queues = [Queue(n, connection=self.connection) for n in names]
        self._ordered_queues = self.queues[:]
        if self.birth_date is not None:  # before its birth, rq writes the record itself
            self.connection.hset(self.key, "queues", ",".join(names))
        log.info("listening to %d queues: %s", len(names), ", ".join(names))

    # ------------------------------------------------------------------ one job

    def run(self, job_id: str) -> str:
        """rq's job function (worker/jobs.py) calls this: take the job, let the child run it, watch."""
        kind, raw = retrying(lambda: self.connection.hmget(job_key(job_id), "kind", "spec"), "job read")
        spec = unreadable = None
        try:
            spec = None if raw is None else lifecycle.read_spec({"kind": kind and kind.decode(), "spec": raw})
        except ValueError as e:  # a record this version cannot load: run() fails it, never retried
            unreadable = f"{e.error_count()} invalid fields" if isinstance(e, ValidationError) else str(e)
        too_big = spec is not None and self._does_not_fit(job_id, kinds.of_record(kind).name, spec)
        if too_big:
            return too_big
        claimed = retrying(lambda: gangs.claimed_by(self.connection, self.name), "gang claim")
        if claimed is not None and claimed != job_id:  # its rank job is on its way: this job goes elsewhere
            reason = f"worker {self.name} is claimed by the gang of job {claimed}"
            rq_job_id = self._running[0].id
            retrying(lambda: lifecycle.reroute(self.connection, job_id, rq_job_id, reason), "reroute")
            time.sleep(GANG_RETRY_S)  # not at once again, should the job come back here
            return f"not started: {reason}"
        if spec is not None and spec.config.workers > 1:
            return self.lead_gang(job_id, kinds.of_record(kind).name, spec)
        lease = Lease.start(self.connection, job_id, self.name)
        if lease is None:
            return "not started: the job is no longer queued"
        return self._run_leased(lease, spec, unreadable)

    def lead_gang(self, job_id: str, kind: str, spec) -> str:
        """Form the job's gang (worker/supervisor/gang_claims.py) with this worker as rank 0, or put the job back
        on its queue, not started, when too few capable workers are free."""
        r, size, rq_job_id = self.connection, spec.config.workers, self._running[0].id
        live = retrying(lambda: workers.live_workers(r), "live workers")
        where = routing.route(kind, spec, live, warm=False,
                              finished=lambda j: r.hget(job_key(j), "status") != b"running")
        members = gangs.pick(self.name, list(where.free), size)
        names = [w["name"] for w in members or []]
        join_s = load_settings().gang_join_s
        token = members and retrying(lambda: gangs.claim(r, names, job_id, join_s), "gang claim")
        if not token:
            retrying(lambda: lifecycle.wait_for_gang(r, job_id, rq_job_id), "wait for gang")
            time.sleep(GANG_RETRY_S)  # the job is back on the queue this worker reads: not at once again
            return f"not started: {where.waiting_for_worker or 'its gang could not be claimed'}"
        lease = Lease.start(r, job_id, self.name, gang=names)
        if lease is None:
            gangs.release(r, names, token)
            return "not started: the job is no longer queued"
        hosts = gangs.hostfile(members)
        for rank, name in enumerate(names[1:], 1):
            queue = Queue(routing.own_queue(spec.config.queue, name), connection=r)
            retrying(lambda: queue.enqueue_call(
                gangs.RANK_JOB_FUNC, args=(job_id, lease.epoch, rank, hosts, token), timeout=-1,
                job_id=f"{job_id}-e{lease.epoch}-rank{rank}", result_ttl=3600, failure_ttl=3600,
                description=f"rank {rank} of {size} of job {job_id} (epoch {lease.epoch})"), "rank job")
        gangs.release(r, [self.name], token)
        log.info("job %s: leading a gang of %d: %s", job_id, size, ", ".join(names))
        return self._run_leased(lease, spec, gang=(0, hosts))

    def run_rank(self, job_id: str, epoch: int, rank: int, hosts: list[list[str]], token: str) -> str:
        """rq's rank job (worker/jobs.py): this worker's part of a gang job its leader started
        under `epoch`; watched as any job, so that its death or stall ends the gang's attempt."""
        gangs.release(self.connection, [self.name], token)
        lease = Lease(self.connection, job_id, self.name, epoch)
        if not lease.renew():
            return "not started: the gang's attempt is over"
        raw = retrying(lambda: self.connection.hmget(job_key(job_id), "kind", "spec"), "job read")
        spec = lifecycle.read_spec({"kind": raw[0] and raw[0].decode(), "spec": raw[1]})
        return self._run_leased(lease, spec, gang=(rank, hosts))

    def _run_leased(self, lease: Lease, spec, unreadable: str | None = None,
                    gang: tuple[int, list[list[str]]] | None = None) -> str:
        """Run the job (or its gang rank) under the lease this worker holds; watch its child."""
        job_id = lease.job_id
        self.lease = lease
        self.current_job = job_id
        self._advertise()
        try:
            if spec is None:
                error = f"the stored job record cannot be loaded: {unreadable}"
                lease.finish("failed", {"type": "failed", "error": error}, error=error)
                return "failed"
            # The server's cap too: a record written around the API (or before the cap) may ask for a day.
            return self.watch(lease, min(spec.config.stall_timeout_s, load_settings().max_stall_timeout_s), gang)
        except LeaseLost:
            return "lease lost"
        except BaseException:  # e.g. a cold shutdown (second Ctrl-C): end the child, give the job back now
            self.training.kill()
            try:
                lease.hand_back("worker stopped")
            except Exception:
                log.exception("job %s: could not hand it back; the reconciler will re-queue it", job_id)
            raise
        finally:
            self.lease = None
            self.current_job = None
            if self.training.in_gang:  # its process is in the attempt's group for good: a fresh one for the next job
                self.training.kill()
                self.training.start()
            self._advertise()

    def _does_not_fit(self, job_id: str, kind: str, spec) -> str | None:
        """The router's memory class is a lower bound (shared/routing.py): check the job against
        this worker's device, model and memory, and route it again, without starting it (no
        attempt spent), when it needs more. The reason, or None when it fits."""
        if self.memory_gb is None or self.training.device is None:
            return None
        model = self.models.get(routing.model_key(spec.model_id), {})
        need = routing.job_need_gb(kind, spec, model, self.training.device["device"])
        if need is None or need <= self.memory_gb:
            return None
        reason = f"worker {self.name} has {self.memory_gb:g} GB; the job needs about {need:.2f} GB there"
        rq_job_id = self._running[0].id
        rerouted = retrying(lambda: lifecycle.reroute(self.connection, job_id, rq_job_id, reason, need_gb=need), "reroute")
        log.info("job %s: %s; %s", job_id, reason, "routed again" if rerouted else "already moved on")
        return f"not started: {reason}"

    def watch(self, lease: Lease, stall_timeout_s: float, gang: tuple[int, list[list[str]]] | None = None) -> str:
        t = self.training
        if t.in_gang:  # MLX joins one group per process: one that has joined one never serves again
            t.kill()
        if not t.alive():
            t.start()
        t.marks.reset()
        t.in_gang = gang is not None
        t.conn.send((lease.job_id, lease.epoch, gang))
        stop_seen = lost_seen = None
        join_s = load_settings().gang_join_s
        while True:
            if t.conn.poll(POLL_S):
                try:
                    result = t.conn.recv()
                except EOFError:
                    pass  # it died: below
                else:
                    if result.startswith(gangs.GANG_LOST):
                        return self._lost(lease, result)
                    return result
            now = time.monotonic()
            if not t.alive():
                t.proc.join(5)
                return self._lost(lease, f"training process {t.exit_description()}")
            if lease.lost.is_set():  # cancelled, or another worker has it: the child stops at its next check
                lost_seen = lost_seen or now
                if gang is not None or now - lost_seen > LEASE_LOST_GRACE_S:
                    t.kill()
                    return "lease lost"
                continue
            silence = now - t.marks.last
            if gang is not None and t.marks.phase == "joining" and silence > join_s:
                t.kill()
                return self._lost(lease, f"rank {gang[0]}: its gang did not form within {join_s:g}s (MTQ_GANG_JOIN_S)")
            allowed = stall_timeout_s
            if t.marks.steps == 0 and t.marks.phase != "scoring":
                allowed += load_settings().compile_grace_s
            if silence > allowed:
                t.kill()
                return self._lost(lease, f"stalled: no progress for {silence:.0f}s in phase {t.marks.phase} "
                                         f"(stall_timeout_s={stall_timeout_s:g}); its training process was ended")
            if self._stop_requested:
                if stop_seen is None:
                    stop_seen = now
                    t.marks.request_hand_back()
                elif now - stop_seen > SHUTDOWN_GRACE_S:
                    t.kill()
                    lease.hand_back(f"worker shutting down (its training process did not stop within "
                                    f"{SHUTDOWN_GRACE_S:g}s and was ended)")
                    return "handed back"

    def _lost(self, lease: Lease, reason: str) -> str:
        phase, steps = self.training.marks.phase, self.training.marks.steps
        reason = f"{reason} (phase {phase}, {steps} steps done in this run)"
        log.error("job %s: %s", lease.job_id, reason)
        self.training.kill()
        status = lease.lose(reason)
        self.lease = None  # nothing left to renew
        self.training.start()  # a fresh child for the next job
        return f"lost: {reason}; job is now {status}"


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
