"""`mtq plot ID`: the job's curves against step, as one PNG (matplotlib, Agg backend: no display).
The curves are its kind's (shared/kinds.py `charts`), as the web page draws them."""

import fnmatch
import math
from pathlib import Path

from shared.kinds import Chart

COLUMNS = 4


def metric_keys(metric: str, steps: list[dict]) -> list[str]:
    """The metric, or every recorded metric that a pattern with `*` matches."""
    if "*" not in metric:
        return [metric]
    return sorted({k for s in steps for k in s if fnmatch.fnmatchcase(k, metric)})


def plot(steps: list[dict], out: Path, title: str, charts: tuple[Chart, ...]) -> Path:
    import matplotlib  # here: the other client commands start without it (it takes a while to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(charts) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(16, 3.5 * rows), constrained_layout=True, squeeze=False)
    fig.suptitle(title)
    for ax, chart in zip(axes.flat, charts):
        keys = [k for metric in chart.metrics for k in metric_keys(metric, steps)]
        drawn = 0
        for key in keys:
            points = [(s["iter"], s[key]) for s in steps if isinstance(s.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=key)
                drawn += 1
        ax.set_title(chart.title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn > 1:
            ax.legend(fontsize="small")
        if not drawn:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes.flat[len(charts):]:
        ax.axis("off")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
