"""A PNG of an evaluation report: accuracy and invalid rate by mode, and the
confusion matrices of the choice tasks. Needs matplotlib (``pip install
'formcast[plot]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOT_EXTRA = "formcast[plot]"


def require_matplotlib() -> None:
    """Raise a ``ModuleNotFoundError`` naming the extra when matplotlib is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError(f"plotting needs matplotlib; install it with "
                                  f"pip install '{PLOT_EXTRA}'", name="matplotlib")


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Draw ``report`` (``EvalReport.to_dict()``) into a PNG at ``path`` (writes the file).

    Top: accuracy (normalized match, with its 95% Wilson interval) and exact-match
    accuracy and invalid-output rate per mode. Below: one confusion matrix per choice
    set and mode (rows = answer, columns = prediction).

    Raises
    ------
    ModuleNotFoundError
        matplotlib is not installed; the message names the extra.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    tables = report["confusion"]
    columns = max(len(modes), 2)
    fig = plt.figure(figsize=(4.2 * columns, 3.6 + 3.4 * len(tables)), constrained_layout=True)
    grid = fig.add_gridspec(1 + len(tables), columns)
    _bars(fig.add_subplot(grid[0, :]), report, modes)
    for row, table in enumerate(tables, 1):
        for col, mode in enumerate(m for m in modes if m in table["matrices"]):
            _matrix(fig.add_subplot(grid[row, col]), table, mode)
    fig.suptitle(f"{report['model']} on {Path(report['task']).name} "
                 f"({report['num_items']} items)")
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax: Any, report: dict[str, Any], modes: list[str]) -> None:
    width = 0.27
    xs = range(len(modes))
    acc = [report["modes"][m]["accuracy"] for m in modes]
    lo = [a - report["modes"][m]["ci95"][0] for a, m in zip(acc, modes)]
    hi = [report["modes"][m]["ci95"][1] - a for a, m in zip(acc, modes)]
    series = [("accuracy (normalized, 95% CI)", acc, "tab:blue", (lo, hi)),
              ("exact-match accuracy", [report["modes"][m]["exact_accuracy"] for m in modes],
               "tab:cyan", None),
              ("invalid outputs", [report["modes"][m]["invalid_rate"] for m in modes],
               "tab:red", None)]
    for k, (label, values, colour, err) in enumerate(series):
        pos = [x + (k - 1) * width for x in xs]
        bars = ax.bar(pos, values, width, label=label, color=colour, yerr=err, capsize=4)
        ax.bar_label(bars, labels=[f"{v:.0%}" for v in values], fontsize=8, padding=2)
    ax.set_xticks(list(xs), [f"{m}\n({report['modes'][m]['items']} items)" for m in modes])
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("rate")
    ax.set_title("accuracy and invalid outputs by mode")
    ax.legend(loc="upper right", fontsize=8, ncols=3)


def _matrix(ax: Any, table: dict[str, Any], mode: str) -> None:
    matrix = table["matrices"][mode]
    labels = table["labels"]
    show = len(labels) if any(row[-1] for row in matrix) else len(labels) - 1
    data = [row[:show] for row in matrix]
    ax.imshow(data, cmap="Blues", vmin=0)
    peak = max(max(row) for row in data) or 1
    for r, row in enumerate(data):
        for c, value in enumerate(row):
            ax.text(c, r, str(value), ha="center", va="center", fontsize=9,
                    color="white" if value > peak / 2 else "black")
    ax.set_xticks(range(show), labels[:show], rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(table["choices"])), table["choices"], fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("answer")
    ax.set_title(f"{mode}: {'/'.join(table['choices'])}"[:48], fontsize=9)
