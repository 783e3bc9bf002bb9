"""The training process: a long-lived child of the supervisor (worker/supervisor/child.py).

Its main thread owns MLX (streams are per thread: the seed bug), runs one job at a time and
keeps models loaded between jobs. It takes jobs from the supervisor over a pipe, with the
lease epoch the supervisor took, and makes every write for the job itself, fenced by that
epoch. It leaves progress marks in memory shared with the supervisor, which ends it when the
marks stop (a stall), and tells it through the same memory to hand its job back.

A job runs in the job loop (worker/runtime/job_loop.py), with its kind's `load` from the kind's worker
module (shared/kinds.py names it); a session's job in its own loop (worker/kinds/session_job.py), an
export in its one pass (worker/kinds/export_job.py). Only the training process imports this module and MLX: the
supervisor starts it in a fresh interpreter.
"""

import importlib
import logging
import math
import os
import platform
import shutil
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Callable, TypeVar

import mlx.core as mx

from shared import jobstore, kinds, lifecycle, workers
from shared.jobstore import connect
from shared.keys import adapter_key, checkpoint_key, events_key
from shared.metrics import recorder
from shared.routing import model_key
from shared.settings import Settings, load_settings
from worker.runtime import gang_group, job_loop, model_staging, request_loop
from worker.runtime.memory_plan import device_description
from worker.runtime.models import ModelNotFound, forget_loaded, loaded_model_ids, resolve_model
from worker.runtime.train_core import Cancelled
from worker.runtime.warm_up import warm_up_all
from worker.supervisor import kernel_cache
from worker.supervisor.gang_claims import GANG_LOST
from worker.supervisor.kernel_share import KernelShare
from worker.supervisor.lease import Lease, LeaseLost, retrying
from worker.supervisor.marks import Marks

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_WAIT_S = 0.5  # an idle process waits this long for a scoring request before looking for a job again
# Shown instead of sampling/updating during the first step of a training process that found
# MLX's kernel cache empty: that step compiles the kernels (minutes on a fresh machine).
COMPILING_NOTE = ("first step on this machine: MLX is compiling its kernels (about a minute on a CPU, "
                  "several on a fresh CUDA machine); they are cached, so this happens once")
_first_step_compiles = False  # set at start (main): this process found the kernel cache empty


def kernel_backend() -> str | None:
    """Which of MLX's disk caches of compiled kernels this process uses: "cpu", "cuda", or None
    (Metal keeps none on disk)."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else None


def kernel_cache_is_fresh() -> bool:
    """Whether this process's kernel cache (worker/supervisor/kernel_cache.py) holds no compiled kernel
    yet. Metal keeps none on disk: there every training process's first step compiles."""
    backend = kernel_backend()
    return backend is None or not kernel_cache.compiled_kernels(mx.__version__, backend)


def shared_kernels(r, settings) -> KernelShare | None:
    """This process's side of the kernels its fleet shares (worker/supervisor/kernel_share.py): the
    workers of this MLX version on this kind of device. None on Metal (no disk cache)."""
    backend = kernel_backend()
    if backend is None:
        return None
    device = device_description()
    fleet = {"mlx": mx.__version__, "device": device["device"], "device_name": device["device_name"],
             "machine": platform.machine()}
    return KernelShare(r, kernel_cache.kernel_dir(mx.__version__, backend), backend, fleet, settings.kernel_share_mb)


class JobRun:
    """What a job kind gets: fenced writes for its job, progress marks, stop checks,
    checkpoints and the adapter commit."""

    def __init__(self, lease: Lease, marks: Marks, parent_pid: int, tenant: str | None = None,
                 part: gang_group.Gang = gang_group.SOLO):
        self.lease, self.marks, self.parent_pid = lease, marks, parent_pid
        self.gang = part  # worker/runtime/gang_group.py: this process's rank of the job's gang (SOLO: the whole job)
        self.job_id = lease.job_id
        self.tenant = tenant  # a trainer's job uses only that trainer's adapters and files (None: anyone's)
        self.shown_phase: str | None = None  # the phase in the job record
        self.kept: dict[str, deque] = {}  # event type -> stream ids of the kept events of that type
        self.handing_back = False  # the worker (a gang: any rank's) is shutting down: the job goes back

    def mark(self, phase: str | None = None) -> None:
        """A progress mark; a new phase is also written to the job record (a few writes per
        step, never per decode chunk)."""
        self.marks.mark(phase)
        if phase is None:
            return
        compiling = _first_step_compiles and phase in ("sampling", "updating")
        shown = "compiling" if compiling else phase
        if shown != self.shown_phase:
            self.shown_phase = shown
            self.write(phase=shown, phase_note=COMPILING_NOTE if compiling else None, phase_since=repr(time.time()))

    def step_done(self) -> None:
        global _first_step_compiles
        _first_step_compiles = False  # the kernels are compiled (and cached) now
        self.marks.step_done()

    def should_stop(self) -> bool:
        """Checked at every decode chunk and between optimizer updates: a progress mark, and
        True on a cancel or a shutdown. Raises LeaseLost when the job moved to another worker."""
        self.marks.mark()
        if os.getppid() != self.parent_pid:  # the supervisor died: its lease lapses, someone else resumes
            os._exit(1)
        if self.lease.lost.is_set():
            raise LeaseLost(f"job {self.job_id}: lease lost")
        if self.gang.size == 1 and self.marks.hand_back_requested:  # a gang's ranks stop together: stop_before_step
            self.handing_back = True
        return self.handing_back or self.lease.cancel_requested()

    def stop_before_step(self) -> bool:
        """should_stop, checked before each step. A gang's ranks agree on it (one sum across
        them), so that a warm shutdown of any rank's worker stops every rank before the same
        step and rank 0 checkpoints it (worker/runtime/job_loop.py): the next gang redoes no step."""
        stop = self.should_stop()
        if self.gang.size == 1:
            return stop
        asked = self.gang.sum(mx.array([float(self.marks.hand_back_requested), float(stop)])).tolist()
        self.handing_back = asked[0] > 0
        return self.handing_back or asked[1] > 0

    def write(self, event: dict | None = None, **fields) -> None:
        self.lease.write(event, **fields)

    def write_kept(self, event: dict, keep: int) -> None:
        """Append an event of which the stream keeps only the last `keep` of its type that this
        run wrote (large per-step payloads; the stream's own cap counts entries, not bytes)."""
        ids = self.kept.setdefault(event["type"], deque())
        ids.append(self.lease.write(event))
        while len(ids) > keep:
            old = ids.popleft()
            retrying(lambda: self.lease.r.xdel(events_key(self.job_id), old), "drop an old event")

    def between_steps(self, model_id: str) -> None:
        """Answer waiting scoring and completion requests for the model this job trains (worker/runtime/request_loop.py)."""
        self.marks.mark()
        retrying(lambda: request_loop.serve_waiting(self.lease.r, load_settings(), model_id), "scoring")
        self.marks.mark()

    def serving_while(self, model_id: str, call: Callable[[], T]) -> T:
        """call() (a step's wait on a reward server) on a helper thread, while this main thread
        answers the scoring and completion requests waiting for the job's model, in the turns
        between_steps takes (worker/runtime/request_loop.py while_serving)."""
        settings, queues = load_settings(), [model_key(model_id)]

        def turn() -> None:
            self.marks.mark()
            retrying(lambda: request_loop.serve_waiting(self.lease.r, settings, queues=queues,
                                                        wait_s=request_loop.WAITING_LOOK_S), "scoring")

        return request_loop.while_serving(call, turn)

    def publish_loaded(self) -> None:
        """Tell the worker's advertisement which models this process holds loaded now."""
        publish_loaded(self.lease.r, self.lease.worker, loaded_model_ids())

    def load_checkpoint(self) -> dict[bytes, bytes]:
        return self.lease.load_checkpoint()

    def save_checkpoint(self, step: int, blobs: dict[str, bytes]) -> None:
        self.mark("checkpointing")
        self.lease.save_blobs(checkpoint_key(self.job_id), blobs, {"type": "checkpoint", "step": step},
                              checkpoint_step=step)

    def commit_adapter(self, out_dir: Path, write_files: Callable[[Path], None]) -> Path:
        """Write the adapter's files with write_files(dir) into a private directory, store them
        in Redis (fenced: a worker that lost the job stops here), then rename the directory
        into place, so the files on disk are only ever the current holder's."""
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.mark("saving")
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{self.job_id}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            write_files(tmp)
            blobs = {f.name: f.read_bytes() for f in tmp.iterdir() if f.is_file()}
            self.lease.save_blobs(adapter_key(self.job_id), blobs, adapter_stored=1)
            old = out_dir.parent / f".{out_dir.name}.old-{self.job_id}"
            if out_dir.exists():
                out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out_dir


class RankRun(JobRun):
    """A gang's rank other than 0: it trains its share of every step, and writes nothing of the
    job (rank 0 writes progress, events, checkpoints and the adapter)."""

    def mark(self, phase: str | None = None) -> None:
        self.marks.mark(phase)

    def write(self, event: dict | None = None, **fields) -> None:
        pass

    def write_kept(self, event: dict, keep: int) -> None:
        pass

    def between_steps(self, model_id: str) -> None:
        self.marks.mark()

    def serving_while(self, model_id: str, call: Callable[[], T]) -> T:
        return call()

    def save_checkpoint(self, step: int, blobs: dict[str, bytes]) -> None:
        pass

    def commit_adapter(self, out_dir: Path, write_files: Callable[[Path], None]) -> Path:
        return out_dir


def run_one(r, job_id: str, epoch: int, worker: str, marks: Marks, parent_pid: int,
            ranks: tuple[int, list[list[str]]] | None = None) -> str:
    """Run one job whose lease the supervisor holds; every outcome is written by this process.
    ranks: (rank, hostfile) of this worker's part of a gang job (worker/supervisor/gang_claims.py)."""
    lease = Lease(r, job_id, worker, epoch)
    rank = 0 if ranks is None else ranks[0]
    job = None
    try:
        stored = retrying(lambda: jobstore.load_job(r, job_id), "job read")
    except ValueError as e:  # a record this version cannot load: failed (by rank 0), never retried
        return "rank done" if rank > 0 else _fail(lease, lifecycle.unreadable(e))
    if stored is None:
        return "deleted"
    try:
        if ranks is not None:
            settings = load_settings()
            stage_model(r, lease, stored.spec.model_id, rank, len(ranks[1]), marks, settings)
            marks.mark("joining")  # the supervisor bounds this phase (MTQ_GANG_JOIN_S)
            part = gang_group.join(*ranks, gang_group.backend_of(settings.gang_backend), settings.gang_shares == "speed")
            job = (JobRun if rank == 0 else RankRun)(lease, marks, parent_pid, stored.tenant, part)
        else:
            job = JobRun(lease, marks, parent_pid, stored.tenant)
        kind = stored.kind
        job.write(event={"type": "started", "worker": worker, "pid": os.getpid(), "supervisor_pid": parent_pid,
                         "main_thread": threading.current_thread() is threading.main_thread(),
                         **({} if ranks is None else {"rank": rank, "gang_size": len(ranks[1])})})
        module = importlib.import_module(kind.worker_module)
        # A session serves its client's calls until it ends (worker/kinds/session_job.py), an export fuses
        # (worker/kinds/export_job.py); every other kind steps.
        fields = (module.run(job, stored.spec) if kind.own_loop
                  else job_loop.run(job, kind, stored.spec, module.load))
        if rank > 0:
            return "rank done"
        events = [*fields.pop("events"), {"type": "done", "adapter_path": fields.get("adapter_path")}]
        lease.finish("completed", events, adapter=fields.pop("adapter", None), **fields)
        return "completed"
    except Cancelled:
        if job is not None and job.handing_back:  # a worker is shutting down: keep what was done
            if rank == 0:  # for the gang
                lease.hand_back("worker shutting down" if marks.hand_back_requested else
                                "a worker of its gang shutting down")
            return "handed back"
        return "cancelled"  # the cancel itself ended the job (shared/lifecycle.py)
    except LeaseLost as e:
        log.warning("%s; leaving the job to its new owner", e)
        return "lease lost"
    except job_loop.USER_ERRORS as e:
        return "rank done" if rank > 0 else _fail(lease, str(e))  # every rank meets it: rank 0 says so
    except Exception as e:
        log.error("job %s failed:\n%s", job_id, traceback.format_exc())
        forget_loaded()  # the models it used may be broken: the next job loads its own
        if ranks is not None:  # e.g. "[ring] connection to a peer was lost": the attempt's, not the job's
            return f"{GANG_LOST}rank {rank}: {type(e).__name__}: {e}"
        return _fail(lease, f"{type(e).__name__}: {e}")
    finally:
        recorder.flush(r)  # what the job measured since its last step (e.g. the reward errors that failed it)


def stage_model(r, lease: Lease, model_id: str, rank: int, size: int, marks: Marks, settings: Settings) -> None:
    """Before a gang forms: a member without the job's model receives it from rank 0 over Redis
    (worker/runtime/model_staging.py), written under its models directory."""
    marks.mark("staging")
    if rank == 0:
        staged = model_staging.lead(r, lease.job_id, lease.epoch, size, Path(resolve_model(model_id, settings)),
                                    settings.gang_join_s, marks.mark)
        if staged:
            lease.write({"type": "model_staged", "model_id": model_id, "ranks": staged})
        return
    try:
        resolve_model(model_id, replace(settings, hub=False))
        target = None
    except ModelNotFound:
        if model_id.startswith("/"):  # a path under MTQ_MODEL_ROOTS: not this worker's to write
            raise
        target = settings.models_dir / model_id
    model_staging.receive(r, lease.job_id, lease.epoch, rank, target, settings.gang_join_s, marks.mark)


def publish_loaded(r, worker: str, model_ids: list[str]) -> None:
    retrying(lambda: workers.publish_loaded(r, worker, model_ids, load_settings().lease_ttl_s), "loaded models")


def _fail(lease: Lease, error: str) -> str:
    try:
        lease.finish("failed", {"type": "failed", "error": error}, error=error)
    except LeaseLost:
        return "lease lost"
    return "failed"


def main(conn, marks: Marks, worker: str, parent_pid: int, warm_models: list[str] = ()) -> None:
    """The child's loop, called by its entry point (worker/supervisor/child.py child_main, by name).
    warm_models: the models its worker offers, warmed up first when the kernel cache is empty."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s [training {os.getpid()}] %(name)s %(levelname)s %(message)s")
    for module in {kind.worker_module for kind in kinds.KINDS.values()}:
        importlib.import_module(module)  # the trainers load now, on this main thread

    global _first_step_compiles
    settings = load_settings()
    r = connect(settings.redis_url)
    was_empty = kernel_cache_is_fresh()  # a new machine: warm its models up, even with the fleet's kernels
    share = shared_kernels(r, settings)
    if share:  # before the first job: the fleet's kernels this cache lacks; then this cache's the fleet lacks
        share.fetch()
        share.publish()
    _first_step_compiles = kernel_cache_is_fresh()
    published: list[str] | None = None

    def publish_changes() -> None:  # the worker's advertisement says which models this process holds
        nonlocal published
        if loaded_model_ids() != published:
            published = loaded_model_ids()
            publish_loaded(r, worker, published)

    publish_changes()  # a fresh process holds none
    # The supervisor advertises the device, routes by its memory, and offers gangs of the backend it can join.
    backend = gang_group.backend_of(settings.gang_backend)
    conn.send(("ready", {**device_description(), "gang_backend": backend, "gang_error": gang_group.backend_error(backend)}))
    if was_empty and warm_models:
        marks.mark("compiling")
        warm_up_all(warm_models, settings, job_waiting=lambda: conn.poll(0), mark=marks.mark)
        _first_step_compiles = kernel_cache_is_fresh()
        publish_changes()
        if share:
            share.publish()
    queues, read_at = [], -math.inf
    while True:
        # Idle: answer scoring requests for the models this worker offers; a job waiting gets the
        # process after the requests already queued (scoring comes before training work).
        try:
            while not conn.poll(0):
                if time.monotonic() - read_at > request_loop.QUEUES_REREAD_S:
                    queues = retrying(lambda: request_loop.idle_queues(r, worker, settings), "scoring queues")
                    read_at = time.monotonic()
                if retrying(lambda: request_loop.serve_waiting(r, settings, queues=queues, wait_s=IDLE_WAIT_S), "scoring"):
                    publish_changes()  # a request may have loaded a model
                if os.getppid() != parent_pid:
                    return
                if share:  # scoring and completions compile kernels too
                    share.publish_if_grown()
            retrying(lambda: request_loop.serve_waiting(r, settings, queues=queues), "scoring")
            job_id, epoch, ranks = conn.recv()
        except (EOFError, OSError):
            return
        marks.mark("idle")
        conn.send(run_one(r, job_id, epoch, worker, marks, parent_pid, ranks))
        published = None  # the job may have published its own list (models loaded, or one dropped): say ours again
        publish_changes()
        if share:
            share.publish()
