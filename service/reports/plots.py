"""Perplexity against keep ratio: one panel per model and evaluation dataset, one line per method;
and when the run scored downstream tasks, one more panel row with the average task accuracy.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, so no global figure state and no
display), and imported only when a report is written: the API process never loads matplotlib.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence

from service.reports.rows import AVERAGE, ResultRow

PANEL_INCHES = (4.8, 3.6)
LOG_SCALE_SPREAD = 5.0
"""Use a log axis when the largest perplexity on a panel is this many times the smallest."""


def render_plots(
    rows: Iterable[ResultRow],
    dense: dict[str, dict[str, float]],
    datasets: list[str],
    title: str,
    tasks: Sequence[str] = (),
    dense_accuracy: dict[str, dict[str, float]] | None = None,
) -> dict[str, bytes]:
    """`{"plot.png": ..., "plot.svg": ...}` of one figure."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [row for row in rows if row.status == "succeeded"]
    models = list(dict.fromkeys(row.model for row in rows)) or ["(no results)"]
    datasets = datasets or ([] if tasks else ["(no evaluation)"])
    panels = len(datasets) + (1 if tasks else 0)
    figure = Figure(figsize=(PANEL_INCHES[0] * len(models), PANEL_INCHES[1] * panels + 0.6))
    FigureCanvasAgg(figure)
    axes = figure.subplots(panels, len(models), squeeze=False)
    # A method keeps its colour on every panel, even where some of its cells gave no result.
    colours = {method: f"C{i % 10}" for i, method in enumerate(dict.fromkeys(row.method for row in rows))}
    for i, dataset in enumerate(datasets):
        for j, model in enumerate(models):
            mine = [r for r in rows if r.model == model]
            _panel(axes[i][j], mine, colours, dense.get(model, {}).get(dataset), model, dataset)
    if tasks:
        label = f"mean accuracy, {len(tasks)} task{'s' if len(tasks) > 1 else ''}"
        for j, model in enumerate(models):
            mine = [r for r in rows if r.model == model]
            _panel(axes[-1][j], mine, colours, (dense_accuracy or {}).get(model, {}).get(AVERAGE), model, label,
                   accuracy=True)
    figure.suptitle(title)
    figure.tight_layout()
    files = {}
    # SVG text stays text (searchable, selectable, small), and ids are stable from run to run.
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "ftc-sweep"}):
        for name, fmt, extra in (("plot.png", "png", {"dpi": 110}), ("plot.svg", "svg", {"metadata": {"Date": None}})):
            out = io.BytesIO()
            figure.savefig(out, format=fmt, **extra)
            files[name] = out.getvalue()
    return files


def _panel(
    axis, rows: list[ResultRow], colours: dict[str, str], dense: float | None, model: str, dataset: str,
    accuracy: bool = False,
) -> None:
    """Perplexity on `dataset` against rho or, with `accuracy`, the average task accuracy."""
    values = []
    for method in dict.fromkeys(row.method for row in rows):
        measured = [(r.ratio, r.accuracy.get(AVERAGE) if accuracy else r.perplexity.get(dataset))
                    for r in rows if r.method == method]
        points = sorted((x, y) for x, y in measured if y is not None)
        if points:
            axis.plot([x for x, _ in points], [y for _, y in points], marker="o", color=colours[method], label=method)
            values += [y for _, y in points]
    if dense is not None:
        axis.axhline(dense, color="0.4", linestyle="--", linewidth=1, label="dense")
        values.append(dense)
    if not values:
        axis.text(0.5, 0.5, "no results", ha="center", va="center", transform=axis.transAxes)
    elif not accuracy and max(values) / min(values) >= LOG_SCALE_SPREAD:
        axis.set_yscale("log")
    axis.set_title(f"{model} · {dataset}", fontsize=10)
    axis.set_xlabel("keep ratio ρ")
    axis.set_ylabel("accuracy" if accuracy else "perplexity")
    axis.grid(True, alpha=0.3)
    if values:
        axis.legend(fontsize=8)
