"""`mtq watch ID`: a live progress bar from the job's event stream (rich), for a job of any kind.

Shows step/total (from the kind's step events), the kind's headline metric (shared/kinds.py:
GRPO's reward, the supervised kinds' loss) with its sparkline, the loss, tokens/s, ETA and the
job's phase (read from the job record once a second: phases are not events). Survives a dropped connection or
an API restart (the client reconnects with Last-Event-ID). Returns the exit code: 0 when the
job completed, 1 when it failed, 2 when it was cancelled.
"""

import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from cli.client import ApiClient
from shared.kinds import Kind

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


def stats_text(kind: Kind, event: dict, values: list[float]) -> str:
    """The step's headline metric (values: its curve so far), its loss, tokens/s."""
    headline = "" if kind.headline == "loss" else f"{kind.headline} {_fmt(event.get(kind.headline), '.3f')}  "
    return (f"{headline}loss {_fmt(event.get('loss'), '+.4f')}  "
            f"{_fmt(event.get('tokens_per_second'), '.0f')} tok/s  {sparkline(values)}")


def phase_text(job: dict) -> str:
    phase = job.get("phase")
    return f"{job['status']}" + (f" · {phase}" if phase and phase != job["status"] else "")


def watch(client: ApiClient, job_id: str, console: Console | None = None) -> int:
    console = console or Console()
    job, kind = client.job(job_id), client.kind_of(job_id)
    total = (job.get("progress") or {}).get("total_iters") or job["config"].get("iters")  # None: no steps (an export)
    values: dict[int, float] = {}  # step iter -> headline metric (a step re-run after a lost worker: its latest)
    steps_done = (job.get("progress") or {}).get("iter", 0)
    done = threading.Event()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[stats]}"), TimeRemainingColumn(compact=True))

    with Progress(*columns, console=console, refresh_per_second=4, transient=False) as bar:
        task = bar.add_task(phase_text(job), total=total, completed=steps_done, stats="")
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
                event_type = event.get("type")
                if event_type == kind.step_event:
                    if isinstance(event.get(kind.headline), (int, float)):
                        values[event["iter"]] = event[kind.headline]
                    steps_done = event["iter"] - kind.first_step + 1  # its iter counts from the kind's first step
                    bar.update(task, completed=steps_done, total=event.get("total_iters") or total,
                               stats=stats_text(kind, event, [values[i] for i in sorted(values)]))
                elif event_type == "started":
                    bar.console.print(f"started on worker {event.get('worker')}")
                elif event_type == "requeued":
                    bar.console.print(f"[yellow]re-queued: {event.get('reason')}")
                elif event_type == "resumed":
                    bar.console.print(f"resumed from the checkpoint of step {event.get('from_step')}")
        finally:
            done.set()
            poller.join()
        job = client.job(job_id)
        progress = job.get("progress") or {}
        bar.update(task, description=job["status"], completed=progress.get("iter") or steps_done)

    if job["status"] == "completed":
        console.print(f"[green]completed[/]: adapter {job.get('adapter_path')}")
    elif job["status"] == "failed":
        console.print(f"[red]failed[/]: {job.get('error')}")
    else:
        console.print(f"[yellow]{job['status']}[/]")
    return EXIT_CODES.get(job["status"], 1)
