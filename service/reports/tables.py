"""The result table of a run as CSV (for scripts) and Markdown (for people).

Columns: model, method, the allocation it ran, rho, then per evaluation dataset the perplexity and
its ratio to the dense model, then per downstream task its accuracy and their average (`avg`), then
storage (the weights written, the attention's share of them, the reduction of the decoder's linear
projections: the ratio the SVD papers quote, and of the whole checkpoint) and seconds. The CSV also
has the scope and the source checkpoint's bytes. Each model's dense reference comes first as a
`dense` row at rho 1.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence

from service.reports.rows import AVERAGE, ResultRow


def accuracy_columns(tasks: Sequence[str]) -> list[str]:
    """The accuracy columns of a run that asked for `tasks`: each task, then their average."""
    return [*tasks, AVERAGE] if tasks else []


def _ordered(
    rows: Iterable[ResultRow], dense: dict[str, dict[str, float]], dense_accuracy: dict[str, dict[str, float]]
) -> list[ResultRow]:
    """Dense rows first per model, then the model's cells by method and decreasing rho."""
    rows = list(rows)
    methods = list(dict.fromkeys(row.method for row in rows))
    ordered = []
    for model in dict.fromkeys(row.model for row in rows):
        if model in dense or model in dense_accuracy:
            ordered.append(
                ResultRow(
                    model=model,
                    method="dense",
                    ratio=1.0,
                    status="succeeded",
                    perplexity=dense.get(model, {}),
                    ratio_to_dense=dict.fromkeys(dense.get(model, {}), 1.0),
                    accuracy=dense_accuracy.get(model, {}),
                )
            )
        mine = [row for row in rows if row.model == model]
        ordered += sorted(mine, key=lambda row: (methods.index(row.method), -row.ratio))
    return ordered


def csv_table(
    rows: Iterable[ResultRow],
    dense: dict[str, dict[str, float]],
    datasets: list[str],
    tasks: Sequence[str] = (),
    dense_accuracy: dict[str, dict[str, float]] | None = None,
) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    columns = accuracy_columns(tasks)
    storage = ["scope", "bytes_written", "source_bytes", "attention_bytes", "linear_reduction", "model_reduction"]
    writer.writerow(
        ["model", "method", "allocation", "rho", "status"]
        + [f"ppl_{d}" for d in datasets]
        + [f"ratio_to_dense_{d}" for d in datasets]
        + [f"acc_{t}" for t in columns]
        + [*storage, "seconds", "job_id", "error"]
    )
    for row in _ordered(rows, dense, dense_accuracy or {}):
        writer.writerow(
            [row.model, row.method, row.allocation or "", row.ratio, row.status]
            + [_plain(row.perplexity.get(d)) for d in datasets]
            + [_plain(row.ratio_to_dense.get(d)) for d in datasets]
            + [_plain(row.accuracy.get(t)) for t in columns]
            + [row.scope or ""] + [_plain(getattr(row, name)) for name in storage[1:]]
            + [_plain(row.seconds), row.job_id or "", row.error or ""]
        )
    return out.getvalue()


def _plain(value: float | int | str | None) -> str:
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{value:.10g}"  # full precision, without float noise


def markdown_table(
    rows: Iterable[ResultRow],
    dense: dict[str, dict[str, float]],
    datasets: list[str],
    tasks: Sequence[str] = (),
    dense_accuracy: dict[str, dict[str, float]] | None = None,
) -> str:
    header = ["model", "method", "allocation", "rho"]
    for d in datasets:
        header += [f"ppl {d}", "x dense"]
    columns = accuracy_columns(tasks)
    header += [f"acc {t} %" for t in columns]
    header += ["weights MiB", "attention MiB", "linear reduction", "model reduction", "seconds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in _ordered(rows, dense, dense_accuracy or {}):
        cells = [_escape(row.model), _escape(row.method), _escape(row.allocation or ""), f"{row.ratio:g}"]
        for d in datasets:
            value = row.perplexity.get(d)
            cells.append(f"{value:.3f}" if value is not None else row.status if row.status != "succeeded" else "-")
            ratio = row.ratio_to_dense.get(d)
            cells.append(f"{ratio:.2f}x" if ratio is not None else "")
        for t in columns:
            accuracy = row.accuracy.get(t)
            cells.append(f"{100 * accuracy:.1f}" if accuracy is not None else "-")
        for size in (row.bytes_written, row.attention_bytes):
            cells.append(f"{size / 2**20:.2f}" if size is not None else "")
        for reduction in (row.linear_reduction, row.model_reduction):
            cells.append(f"{reduction:.1%}" if reduction is not None else "")
        cells.append(f"{row.seconds:.0f}" if row.seconds is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def failures(rows: Iterable[ResultRow]) -> list[str]:
    """One Markdown list item per cell that did not give a result, with its reason."""
    return [
        f"- {_escape(row.model)} {_escape(row.method)} rho {row.ratio:g}: {row.status}"
        + (f" ({_escape(row.error)})" if row.error else "")
        + (f", job `{row.job_id}`" if row.job_id else "")
        for row in rows
        if row.status != "succeeded" or row.error
    ]


def _escape(text: str) -> str:
    """Keep a value inside its table cell."""
    return text.replace("|", "\\|").replace("\n", " ")
