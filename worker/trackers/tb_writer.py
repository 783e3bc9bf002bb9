"""TensorBoard: event files written with tensorboardX under $MTQ_HOME/trackers/<job id>/tensorboard,
scalars named as transformers' TensorBoardCallback names them (`train/loss`, `eval/loss`), stored
in the job's trackers hash at most every STORE_EVERY_S and when the run ends (GET
.../{id}/tensorboard serves them). Each run writes a file of its own (its lease epoch in the name):
a run resumed on another worker adds its file beside the earlier runs' in Redis. A run resumed
from a checkpoint older than the last step logged runs those steps again: its file starts with
TensorBoard's SessionLog START at its first step (tensorboardX's purge_step), so TensorBoard
keeps those steps' latest values only, as `mtq plot` and the web page do."""

import time

from tensorboardX import SummaryWriter

from shared import trackers

STORE_EVERY_S = 30.0
MAX_BYTES = 64 * 2**20  # a job's event files in Redis, together


class Writer:
    def __init__(self, job):
        self.job = job
        self.dir = job.dir / "tensorboard"
        self.last_step = job.state.get("step")  # the last step an earlier run logged
        self.writer: SummaryWriter | None = None  # made at the first step: it may purge the steps from there on
        self.stored_at = time.monotonic()

    def log(self, step: int, logs: dict[str, float]) -> None:
        if self.writer is None:
            again = self.last_step is not None and step <= self.last_step
            self.writer = SummaryWriter(str(self.dir), filename_suffix=f".run{self.job.epoch}",
                                        purge_step=step if again else None)
        for name, value in trackers.rewrite_logs(logs).items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            if time.monotonic() - self.stored_at >= STORE_EVERY_S:
                self.store()

    def close(self, outcome: str) -> None:
        if self.writer is not None:
            self.writer.close()
            self.store()

    def store(self) -> None:
        files = {p.name: p.read_bytes() for p in self.dir.iterdir() if trackers.TB_FILE.fullmatch(p.name)}
        size = sum(map(len, files.values()))
        if size > MAX_BYTES:
            raise RuntimeError(f"the event files ({size} bytes) are past the {MAX_BYTES} bytes a job may store")
        trackers.store_tensorboard(self.job.r, self.job.job_id, files)
        self.stored_at = time.monotonic()
