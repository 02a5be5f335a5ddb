"""Pictures of the benchmarks' results (their ``--plot`` option), drawn with matplotlib, an optional
extra (``pip install -e '.[plots]'``): the library never imports it."""

import json
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # (files; no screen)
    import matplotlib.pyplot as plt

    return plt


def bars(path, title, panels):
    """Grouped bar charts side by side, saved to ``path``: ``panels`` is ``[(ylabel, groups, {series:
    [a value per group, or None]})]``, each bar labelled with its value."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.8 * len(panels), 4.0), squeeze=False)
    for ax, (ylabel, groups, series) in zip(axes[0], panels):
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(series.items()):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            drawn = ax.bar(xs, [0 if v is None else v for v in values], width, label=name)
            ax.bar_label(drawn, labels=["" if v is None else f"{v:.3g}" for v in values], fontsize=7)
        ax.set_xticks(range(len(groups)), groups, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.25)  # (room for the legend above the bars)
        ax.legend(fontsize=8, loc="upper left", ncols=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lines(path, title, curves: dict, xlabel, ylabel):
    """One line per curve, saved to ``path``: ``curves`` is ``{name: [(x, y), ...]}``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for name, points in curves.items():
        ax.plot([x for x, _ in points], [y for _, y in points], label=name, linewidth=1.4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def remembered(path, key, value) -> dict:
    """Every result stored beside the picture ``path`` (in ``path`` + ".json"), ``value`` under ``key``
    now among them: runs of one benchmark (one per backend, say) draw one picture together."""
    store = Path(str(path) + ".json")
    results = json.loads(store.read_text()) if store.exists() else {}
    results[key] = value
    store.write_text(json.dumps(results, indent=1) + "\n")
    return results
