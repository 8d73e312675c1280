"""Downstream-task accuracy in job requests and sweep reports: the request fields, reading the
`downstream` section of metrics.json, the accuracy columns, the run-to-run comparison and the plot."""

from __future__ import annotations

import csv
import io
import xml.etree.ElementTree as ElementTree

import pytest
from pydantic import ValidationError

from ftc.evaluation.tasks import AVG6
from service.reports.compare import compare, comparison_markdown
from service.reports.plots import render_plots
from service.reports.rows import ResultRow, parse_metrics
from service.reports.tables import csv_table, markdown_table
from service.schemas import Evaluation, JobRequest

TASKS = ["arc_easy", "gsm8k"]
DENSE_ACCURACY = {"tiny": {"arc_easy": 0.6, "gsm8k": 0.1, "avg": 0.35}}


def row(method: str, ratio: float, accuracy: dict[str, float]) -> ResultRow:
    return ResultRow(model="tiny", method=method, ratio=ratio, status="succeeded", accuracy=accuracy)


ROWS = [row("ftc", 0.4, {"arc_easy": 0.55, "gsm8k": 0.05, "avg": 0.3}), row("svd", 0.4, {"arc_easy": 0.4})]


def test_requests_take_known_tasks_expand_avg6_and_leave_unset_fields_out_of_stored_requests() -> None:
    evaluation = Evaluation(tasks=["avg6", "gsm8k"], limit=50)
    assert evaluation.tasks == [*AVG6, "gsm8k"] and evaluation.limit == 50
    assert "tasks" not in Evaluation().model_dump() and "limit" not in Evaluation().model_dump()
    with pytest.raises(ValidationError, match="unknown task winogrande"):
        JobRequest.model_validate({"model": "smollm2-135m", "ratio": 0.4, "eval": {"tasks": ["piqa", "winogrande"]}})
    with pytest.raises(ValidationError, match="limit"):
        Evaluation(tasks=["piqa"], limit=0)


def test_accuracy_is_read_from_the_downstream_sections() -> None:
    metrics = parse_metrics({
        "downstream": {"tasks": {"arc_easy": {"acc": 0.61, "acc_norm": 0.58}, "gsm8k": {"exact_match": 0.02},
                                 "piqa": {"acc": "n/a"}, "boolq": "broken"}, "avg": 0.315},
        "dense_downstream": {"tasks": {"arc_easy": {"acc": 0.7}}, "avg": 0.7},
    })
    assert metrics.accuracy == {"arc_easy": 0.61, "gsm8k": 0.02, "avg": 0.315}
    assert metrics.dense_accuracy == {"arc_easy": 0.7, "avg": 0.7}
    assert parse_metrics({"downstream": [1]}).accuracy == {}


def test_tables_gain_a_column_per_task_and_the_average_with_the_dense_row_first() -> None:
    table = list(csv.DictReader(io.StringIO(csv_table(ROWS, {}, [], TASKS, DENSE_ACCURACY))))
    assert [r["method"] for r in table] == ["dense", "ftc", "svd"]
    assert [table[0][f"acc_{t}"] for t in (*TASKS, "avg")] == ["0.6", "0.1", "0.35"]
    assert (table[1]["acc_avg"], table[2]["acc_gsm8k"]) == ("0.3", "")
    lines = markdown_table(ROWS, {}, [], TASKS, DENSE_ACCURACY).splitlines()
    assert "| acc arc_easy % | acc gsm8k % | acc avg % |" in lines[0]
    assert lines[3].startswith("| tiny | ftc |  | 0.4 | 55.0 | 5.0 | 30.0 |")
    assert "acc" not in markdown_table(ROWS, {}, [])  # no tasks asked: no accuracy columns


def test_comparison_flags_accuracy_moves_beyond_the_threshold_in_points() -> None:
    before = [row("ftc", 0.4, {"arc_easy": 0.55, "avg": 0.40}), row("svd", 0.4, {"avg": 0.30})]
    after = [row("ftc", 0.4, {"arc_easy": 0.50, "avg": 0.39}), row("svd", 0.4, {"avg": 0.34})]
    comparison = compare(before, after, threshold=0.02, previous_run="run_1")
    assert [(c.method, c.dataset, round(c.gain, 3)) for c in comparison.worse] == [("ftc", "arc_easy", -0.05)]
    assert [(c.method, c.dataset, round(c.gain, 3)) for c in comparison.better] == [("svd", "avg", 0.04)]
    assert comparison.unchanged == 1 and comparison.worse[0].to_json()["points"] == pytest.approx(-0.05)
    assert "| tiny | ftc | 0.4 | acc arc_easy | 55.0% | 50.0% | -5.0 pts |" in comparison_markdown(comparison)


def test_the_plot_gains_an_accuracy_panel_per_model() -> None:
    files = render_plots(ROWS, {}, [], "tiny sweep", TASKS, DENSE_ACCURACY)
    text = " ".join(t.strip() for t in ElementTree.fromstring(files["plot.svg"]).itertext() if t.strip())
    assert "tiny · mean accuracy, 2 tasks" in text and "accuracy" in text and "dense" in text
