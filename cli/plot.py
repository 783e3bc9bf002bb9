"""`mtq plot ID`: the job's curves against step, as one PNG (matplotlib, Agg backend: no display)."""

from pathlib import Path

# name, metric keys: the same curves as the web page (api/static/app.js CHARTS).
PANELS = [
    ("reward", ["reward"]),
    ("reward std", ["reward_std"]),
    ("loss", ["loss"]),
    ("KL", ["kl"]),
    ("entropy", ["entropy"]),
    ("completion length", ["completions/mean_length"]),
    ("learning rate", ["learning_rate"]),
    ("rewards by source", []),  # every rewards/<name>/mean
]


def source_keys(steps: list[dict]) -> list[str]:
    return sorted({k for s in steps for k in s if k.startswith("rewards/") and k.endswith("/mean")})


def plot(steps: list[dict], out: Path, title: str) -> Path:
    import matplotlib  # here: the other client commands start without it (it takes a while to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 7), constrained_layout=True)
    fig.suptitle(title)
    x = [s["iter"] for s in steps]
    for ax, (name, keys) in zip(axes.flat, PANELS):
        keys = keys or source_keys(steps)
        drawn = False
        for key in keys:
            points = [(i, s[key]) for i, s in zip(x, steps) if isinstance(s.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=key)
                drawn = True
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn and len(keys) > 1:
            ax.legend(fontsize="small")
        if not drawn:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
