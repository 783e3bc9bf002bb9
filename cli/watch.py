"""`mtq watch ID`: a live progress bar from the job's event stream (rich).

Shows step/total, reward, loss, tokens/s, ETA, a reward sparkline and the job's phase (read
from the job record once a second: phases are not events). Survives a dropped connection or
an API restart (the client reconnects with Last-Event-ID). Returns the exit code: 0 when the
job completed, 1 when it failed, 2 when it was cancelled.
"""

import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from cli.client import ApiClient

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 30
EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 2}
PHASE_POLL_S = 1.0


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo
    return "".join(SPARK[0 if span == 0 else round((v - lo) / span * (len(SPARK) - 1))] for v in values)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def stats_text(event: dict, rewards: list[float]) -> str:
    return (f"reward {_fmt(event.get('reward', event.get('mean_reward')), '.3f')}  "
            f"loss {_fmt(event.get('loss'), '+.4f')}  "
            f"{_fmt(event.get('tokens_per_second'), '.0f')} tok/s  {sparkline(rewards)}")


def phase_text(job: dict) -> str:
    phase = job.get("phase")
    return f"{job['status']}" + (f" · {phase}" if phase and phase != job["status"] else "")


def watch(client: ApiClient, job_id: str, console: Console | None = None) -> int:
    console = console or Console()
    job = client.job(job_id)
    total = (job.get("progress") or {}).get("total_iters") or job["config"]["iters"]
    rewards: list[float] = []
    seen_steps: set[int] = set()
    done = threading.Event()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[stats]}"), TimeRemainingColumn(compact=True))

    with Progress(*columns, console=console, refresh_per_second=4, transient=False) as bar:
        task = bar.add_task(phase_text(job), total=total, completed=(job.get("progress") or {}).get("iter", 0),
                            stats="")
        shown_notes: set[str] = set()

        def poll_phase() -> None:  # the phase lives in the job record
            while not done.wait(PHASE_POLL_S):
                try:
                    current = client.job(job_id)
                except Exception:  # the API is restarting: the stream reconnects, we try again
                    continue
                bar.update(task, description=phase_text(current))
                note = current.get("phase_note")
                if note and note not in shown_notes:
                    shown_notes.add(note)
                    bar.console.print(f"[yellow]{note}")

        poller = threading.Thread(target=poll_phase, name="mtq-watch-phase", daemon=True)
        poller.start()
        try:
            for _, event in client.events(job_id):
                kind = event.get("type")
                if kind == "grpo_step":
                    value = event.get("reward", event.get("mean_reward"))
                    if value is not None:
                        rewards.append(value)
                    # Steps done = distinct steps seen (events may number them from 0 or 1, and a
                    # step re-run after a lost worker appears twice).
                    seen_steps.add(event["iter"])
                    bar.update(task, completed=len(seen_steps), total=event.get("total_iters") or total,
                               stats=stats_text(event, rewards))
                elif kind == "started":
                    bar.console.print(f"started on worker {event.get('worker')}")
                elif kind == "requeued":
                    bar.console.print(f"[yellow]re-queued: {event.get('reason')}")
                elif kind == "resumed":
                    bar.console.print(f"resumed from the checkpoint of step {event.get('from_step')}")
        finally:
            done.set()
            poller.join()
        job = client.job(job_id)
        progress = job.get("progress") or {}
        bar.update(task, description=job["status"], completed=max(len(seen_steps), progress.get("iter") or 0))

    if job["status"] == "completed":
        console.print(f"[green]completed[/]: adapter {job.get('adapter_path')}")
    elif job["status"] == "failed":
        console.print(f"[red]failed[/]: {job.get('error')}")
    else:
        console.print(f"[yellow]{job['status']}[/]")
    return EXIT_CODES.get(job["status"], 1)
