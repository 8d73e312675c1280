"""Write the report of a finished run: table (CSV, Markdown, JSON), plot (PNG, SVG), comparison.

Files go to the run's own folder first, then the same files to the sweep's folder as "the latest".
Writing is idempotent, so a report interrupted half-way (or written twice by two schedulers during
a failover) is simply written again.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from service.reports.compare import Comparison, compare, comparison_markdown
from service.reports.plots import render_plots
from service.reports.rows import ResultRow, result_rows
from service.reports.tables import csv_table, failures, markdown_table
from service.store import ObjectMissing, ObjectStore
from service.sweeps.files import PLOT_PNG, PLOT_SVG, RESULTS_CSV, RESULTS_JSON, RESULTS_MD, run_folder, sweep_prefix
from service.sweeps.schemas import RunReport
from service.sweeps.status import counts
from service.sweeps.store import RunContext

_CONTENT_TYPES = {
    RESULTS_CSV: "text/csv; charset=utf-8",
    RESULTS_MD: "text/markdown; charset=utf-8",
    RESULTS_JSON: "application/json",
    PLOT_PNG: "image/png",
    PLOT_SVG: "image/svg+xml",
}


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def previous_rows(store: ObjectStore, context: RunContext) -> list[ResultRow]:
    """The rows of the previous reported run of the campaign, read back from its results.json."""
    if context.previous_run is None:
        return []
    key = sweep_prefix(context.team, context.sweep_id) + run_folder(context.previous_run) + RESULTS_JSON
    try:
        document = json.loads(store.get_bytes(key))
    except (ObjectMissing, ValueError):
        return []
    return [ResultRow.from_json(row) for row in document.get("rows", [])]


def _tasks_line(tasks: list[str], limit: int | None) -> list[str]:
    if not tasks:
        return []
    scope = f"the first {limit} documents of each" if limit else "every document"
    return [f"Downstream tasks (lm-eval, {scope}): {', '.join(tasks)}; 'acc' columns are accuracy in % "
            "(exact match for gsm8k), 'avg' their mean."]


SCOPE_WORDS = {
    "attention": "the Q, K, V and O projections of every decoder layer (the MLP stays dense)",
    "model": "all seven linear projections of every decoder layer (1 - rho is the compression ratio the SVD "
             "papers quote)",
}


def _scope_line(scope: str) -> str:
    return (f"Scope {scope}: rho is the keep ratio of {SCOPE_WORDS.get(scope, scope)}. \"linear reduction\" is the "
            "share of those seven projections removed, \"model reduction\" that of the whole checkpoint.")


def _markdown(
    context: RunContext, rows: list[ResultRow], dense: dict, dense_accuracy: dict, comparison: Comparison
) -> str:
    request = context.request
    calibration, evaluation = request.calibration, request.evaluation
    title = f"# Sweep {request.name or context.sweep_id}: run {context.run_id}"
    tally = ", ".join(f"{n} {status}" for status, n in counts(r.status for r in rows).items())
    windows = f", at most {evaluation.max_windows} windows" if evaluation.max_windows else ""
    lines = [
        title,
        "",
        f"Sweep `{context.sweep_id}`, run `{context.run_id}` ({context.trigger}, started {_iso(context.created_at)}): "
        f"{len(rows)} cells, {tally}.",
        f"Calibration: {calibration.dataset}, {calibration.samples} x {calibration.seq_len} tokens, seed "
        f"{calibration.seed}. Evaluation: {', '.join(evaluation.datasets) or 'none'}, windows of "
        f'{evaluation.seq_len} tokens{windows}. "x dense" is the perplexity over the dense model\'s.',
        _scope_line(request.scope),
        "",
        *_tasks_line(evaluation.tasks, evaluation.limit),
        "",
        markdown_table(rows, dense, evaluation.datasets, evaluation.tasks, dense_accuracy),
    ]
    missing = [m for m in dict.fromkeys(r.model for r in rows) if m not in dense]  # perplexity reference
    if missing and evaluation.datasets:
        lines += [f"No dense reference for {', '.join(missing)}: its reference job gave no dense_perplexity.", ""]
    failed = failures(rows)
    if failed:
        lines += ["## Cells without a result", "", *failed, ""]
    lines.append(comparison_markdown(comparison))
    return "\n".join(lines)


def build_report(
    context: RunContext,
    rows: list[ResultRow],
    dense: dict,
    previous: list[ResultRow],
    dense_accuracy: dict | None = None,
) -> tuple[dict[str, bytes], Comparison]:
    """The report's files, by name, and its comparison with the previous run."""
    request = context.request
    datasets, tasks = request.evaluation.datasets, request.evaluation.tasks
    dense_accuracy = dense_accuracy or {}
    comparison = compare(previous, rows, request.change_threshold, context.previous_run)
    document = {
        "sweep_id": context.sweep_id,
        "run_id": context.run_id,
        "name": request.name,
        "created_at": context.created_at,
        "datasets": datasets,
        "scope": request.scope,
        "allocation": request.allocation,
        "dense": dense,
        **({"tasks": tasks, "dense_accuracy": dense_accuracy} if tasks else {}),
        "rows": [row.to_json() for row in rows],
        "comparison": comparison.to_json(),
    }
    files = {
        RESULTS_CSV: csv_table(rows, dense, datasets, tasks, dense_accuracy).encode(),
        RESULTS_MD: _markdown(context, rows, dense, dense_accuracy, comparison).encode(),
        RESULTS_JSON: json.dumps(document, indent=2).encode(),
    }
    files |= render_plots(rows, dense, datasets, f"{request.name or context.sweep_id} · run {context.run_id}",
                          tasks, dense_accuracy)
    return files, comparison


def write_report(store: ObjectStore, context: RunContext, now: float | None = None) -> RunReport:
    """Gather the run's metrics, build its report and put it in the store (run folder, then latest)."""
    rows, dense, dense_accuracy = result_rows(store, context.team, context.cells)
    files, comparison = build_report(context, rows, dense, previous_rows(store, context), dense_accuracy)
    prefix, folder = sweep_prefix(context.team, context.sweep_id), run_folder(context.run_id)
    for target in (prefix + folder, prefix):
        for name, data in files.items():
            store.put_bytes(target + name, data, _CONTENT_TYPES[name])
    return RunReport(
        folder=folder,
        files=sorted(files),
        previous_run=context.previous_run,
        better=len(comparison.better),
        worse=len(comparison.worse),
        written_at=datetime.fromtimestamp(time.time() if now is None else now, tz=timezone.utc),
    )
