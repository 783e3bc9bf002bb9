"""mlx_lm's training reports (its TrainingCallback's figures) as the seed server's SFT job shows
them: the fields of its progress object (shared/train_specs.py SFTProgress) and its events

    train_loss  {step, total_steps, train_loss, val_loss, learning_rate, tokens_per_second, it_sec,
                 trained_tokens, peak_memory_gb, elapsed_seconds, eta_seconds}     every steps_per_report
    val_loss    {step, val_loss, val_time}                                          every evaluation
    completed   {adapter_path, adapter_file}                                        at the end

with mlx_lm's meanings: train_loss is the mean loss of the steps since the previous report,
iterations_per_second (it_sec) and tokens_per_second those steps and their trained tokens over
their step time (evaluations and checkpoints not counted), trained_tokens every step's so far,
elapsed_seconds since this run started, eta_seconds the steps left at iterations_per_second,
val_loss the last evaluation's (null before the first).
"""

import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.adapters import MODEL_WEIGHTS_FILE, WEIGHTS_FILE


@dataclass
class Reports:
    tokens_before: int  # trained tokens before the steps since the last report
    started: float = field(default_factory=time.monotonic)
    losses: list[float] = field(default_factory=list)  # of the steps since the last report
    seconds: float = 0.0  # their step time
    val_loss: float | None = None

    def progress(self, step: int, total: int, metrics: dict) -> dict:
        """The seed's progress object after step `step` (counting this step into the window)."""
        self.losses.append(metrics["loss"])
        self.seconds += metrics["step_time"]
        it_sec = len(self.losses) / max(self.seconds, 1e-9)
        return {"step": step, "total_steps": total, "train_loss": sum(self.losses) / len(self.losses),
                "val_loss": self.val_loss, "learning_rate": metrics["learning_rate"],
                "tokens_per_second": (metrics["num_tokens"] - self.tokens_before) / max(self.seconds, 1e-9),
                "iterations_per_second": it_sec, "trained_tokens": metrics["num_tokens"],
                "peak_memory_gb": metrics["peak_memory_gb"], "elapsed_seconds": round(time.monotonic() - self.started, 1),
                "eta_seconds": round((total - step) / it_sec, 1)}

    def train_loss_event(self, progress: dict) -> dict:
        """The report of a reported step (its progress), which starts the next window."""
        self.losses, self.seconds, self.tokens_before = [], 0.0, progress["trained_tokens"]
        names = ("step", "total_steps", "train_loss", "val_loss", "learning_rate", "tokens_per_second",
                 "trained_tokens", "peak_memory_gb", "elapsed_seconds", "eta_seconds")
        return {"type": "train_loss", **{k: progress[k] for k in names}, "it_sec": progress["iterations_per_second"]}

    def val_loss_event(self, step: int, val_loss: float, seconds: float) -> dict:
        self.val_loss = val_loss
        return {"type": "val_loss", "step": step, "val_loss": val_loss, "val_time": seconds}


def completed_event(out_dir: Path) -> dict:
    """The seed's last SFT event: where the adapter (or a full fine-tune's weights) is."""
    weights = out_dir / (WEIGHTS_FILE if (out_dir / WEIGHTS_FILE).is_file() else MODEL_WEIGHTS_FILE)
    return {"type": "completed", "adapter_path": str(out_dir), "adapter_file": str(weights)}
