"""What the supervisor (worker/supervisor/supervisor.py) and its training process share, without MLX:
progress marks one way, the hand-back request the other, in shared memory. The supervisor
ends a training process whose marks stop (a stall) and shows its phase."""

import ctypes
import time

PHASES = ("idle", "joining", "loading_model", "compiling", "sampling", "scoring", "updating", "checkpointing", "saving",
          "serving",  # serving: a session's job between its client's calls (worker/kinds/session_job.py)
          "fusing",  # an export's adapter going into its base (worker/kinds/export_job.py)
          "staging")  # a gang's rank sending or receiving the job's model (worker/runtime/model_staging.py)


class Marks:
    """Plain doubles, no lock: one writer each, and a reader that only needs a recent value."""

    def __init__(self, ctx):
        self._a = ctx.RawArray(ctypes.c_double, 4)  # [last mark (monotonic), phase, steps done, hand back]

    def mark(self, phase: str | None = None) -> None:
        if phase is not None:
            self._a[1] = PHASES.index(phase)
        self._a[0] = time.monotonic()

    def step_done(self) -> None:
        self._a[2] += 1
        self.mark()

    def reset(self) -> None:
        self._a[0], self._a[1], self._a[2], self._a[3] = time.monotonic(), 0, 0, 0

    @property
    def last(self) -> float:
        return self._a[0]

    @property
    def phase(self) -> str:
        return PHASES[int(self._a[1])]

    @property
    def steps(self) -> int:
        return int(self._a[2])

    def request_hand_back(self) -> None:
        self._a[3] = 1

    @property
    def hand_back_requested(self) -> bool:
        return self._a[3] == 1
