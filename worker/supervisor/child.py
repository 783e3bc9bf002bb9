"""The supervisor's child, the training process: the handle the supervisor holds on it, and
the first code the child runs.

The child is started with multiprocessing's 'spawn' (a fresh interpreter: a process with MLX
in it is never forked). Its entry, `child_main`, lives here, in a module without MLX, so that
what must come before MLX loads does: the kernel's promise to kill the child with its parent,
Ctrl-C left to the supervisor, and MLX's kernel cache moved under $MTQ_HOME
(worker/supervisor/kernel_cache.py). It then imports the training process's main by name
(TRAINING_MAIN), as rq's records name the job function: the supervisor never imports the
training code, and tests/test_import_graph.py checks that the name exists.
"""

import ctypes
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import time

from shared.settings import load_settings
from worker.supervisor import kernel_cache, mlx_env
from worker.supervisor.marks import Marks

log = logging.getLogger(__name__)

TRAINING_MAIN = "worker.runtime.training_process.main"  # a name: only the child imports it, and MLX with it
POLL_S = 0.2
READY_TIMEOUT_S = 300.0  # importing MLX and the trainers


def child_main(main: str, *args) -> None:
    """The training process's entry point: what must precede MLX, then `main` (a function's
    dotted name) with args."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    kernel_cache.use(load_settings().kernel_cache_dir)  # before MLX compiles anything
    mlx_env.use()  # before MLX starts
    module, name = main.rsplit(".", 1)
    getattr(importlib.import_module(module), name)(*args)


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the supervisor dies (even if this one hangs
    in native code). Elsewhere should_stop notices the new parent at its next check (the
    tracker processes too: worker/trackers/process.py)."""
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
        self.proc = self.ctx.Process(target=child_main, name="mtq-training", daemon=True,
                                     args=(TRAINING_MAIN, theirs, self.marks, self.worker_name, os.getpid(),
                                           self.warm_models))
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

    def hand(self, job_id: str, epoch: int, gang: tuple[int, list[list[str]]] | None) -> None:
        """Give the child a job (gang: its rank and hostfile), in a fresh child when the last
        one joined a gang (MLX joins one group per process) or died."""
        if self.in_gang:
            self.kill()
        if not self.alive():
            self.start()
        self.marks.reset()
        self.in_gang = gang is not None
        self.conn.send((job_id, epoch, gang))

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
