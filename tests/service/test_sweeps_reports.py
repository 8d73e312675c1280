"""Report pieces on their own: reading metrics.json, the CSV and Markdown tables, the comparison
between runs, and the plot files. No Redis, no store: plain data in, files out."""

from __future__ import annotations

import csv
import io
import time
import xml.etree.ElementTree as ElementTree

import pytest

from service.reports.compare import compare, comparison_markdown
from service.reports.plots import render_plots
from service.reports.publish import build_report
from service.reports.rows import ResultRow, parse_metrics
from service.reports.tables import csv_table, failures, markdown_table
from service.sweeps.schemas import SweepRequest, variant_label
from service.sweeps.store import RunContext
from tests.support.sweeps import SWEEP_REQUEST

DENSE = {"tiny": {"wikitext2": 20.0}}


def row(method: str, ratio: float, ppl: float | None, status: str = "succeeded", **extra) -> ResultRow:
    perplexity = {} if ppl is None else {"wikitext2": ppl}
    return ResultRow(model="tiny", method=method, ratio=ratio, status=status, perplexity=perplexity, **extra)


ROWS = [
    row(
        "ftc",
        0.8,
        21.0,
        ratio_to_dense={"wikitext2": 1.05},
        allocation="sensitivity",
        scope="model",
        bytes_written=5 * 2**19,
        source_bytes=4 * 2**20,
        attention_bytes=3 * 2**20,
        linear_reduction=0.2,
        model_reduction=0.06,
        seconds=41.2,
        job_id="job_a",
    ),
    row("ftc", 0.4, 30.0, ratio_to_dense={"wikitext2": 1.5}),
    row("svd_llm", 0.8, 40.0),
    row("svd_llm", 0.4, None, status="failed", error="CUDA out of memory | layer 3", job_id="job_d"),
]


def test_metrics_are_read_from_the_documented_shape_and_tolerate_bare_numbers() -> None:
    metrics = parse_metrics(
        {
            "perplexity": {"wikitext2": {"ppl": 31.5, "windows": 4}, "ptb": 44.0, "broken": {"ppl": "n/a"}},
            "dense_perplexity": {"wikitext2": {"ppl": 29.9}},
            "storage": {"attention_bytes_written": 123456, "model_reduction": 0.12, "scope": "model",
                        "linear_reduction": 0.4, "source_bytes": 270_000_000},
            "allocation": "sensitivity", "scope": "model", "bytes_written": 160_000_000,
            "timings": {"total_seconds": 95.3},
        }
    )
    assert metrics.perplexity == {"wikitext2": 31.5, "ptb": 44.0}
    assert metrics.dense_perplexity == {"wikitext2": 29.9}
    assert (metrics.attention_bytes, metrics.model_reduction, metrics.seconds) == (123456, 0.12, 95.3)
    assert (metrics.allocation, metrics.scope, metrics.linear_reduction) == ("sensitivity", "model", 0.4)
    assert (metrics.bytes_written, metrics.source_bytes) == (160_000_000, 270_000_000)
    empty = parse_metrics({"perplexity": "nonsense", "storage": [1, 2], "bytes_written": "n/a", "allocation": 3})
    assert (empty.perplexity, empty.attention_bytes, empty.seconds) == ({}, None, None)
    assert (empty.bytes_written, empty.allocation, empty.scope) == (None, None, None)
    assert parse_metrics(["not", "a", "document"]).perplexity == {}


def test_csv_has_a_dense_row_then_each_method_by_decreasing_rho() -> None:
    table = list(csv.DictReader(io.StringIO(csv_table(reversed(ROWS), DENSE, ["wikitext2"]))))
    assert [(r["method"], r["rho"], r["status"]) for r in table] == [
        ("dense", "1.0", "succeeded"),
        ("svd_llm", "0.8", "succeeded"),
        ("svd_llm", "0.4", "failed"),
        ("ftc", "0.8", "succeeded"),
        ("ftc", "0.4", "succeeded"),
    ]
    assert table[0]["ppl_wikitext2"] == "20" and table[0]["ratio_to_dense_wikitext2"] == "1"
    ftc = table[3]
    assert (ftc["ppl_wikitext2"], ftc["ratio_to_dense_wikitext2"], ftc["attention_bytes"]) == ("21", "1.05", "3145728")
    assert (ftc["model_reduction"], ftc["seconds"], ftc["job_id"]) == ("0.06", "41.2", "job_a")
    assert (ftc["allocation"], ftc["scope"], ftc["linear_reduction"]) == ("sensitivity", "model", "0.2")
    assert (ftc["bytes_written"], ftc["source_bytes"]) == ("2621440", "4194304")
    assert table[2]["ppl_wikitext2"] == "" and table[2]["error"] == "CUDA out of memory | layer 3"


def test_markdown_table_formats_values_and_keeps_cells_apart() -> None:
    lines = markdown_table(ROWS, DENSE, ["wikitext2"]).splitlines()
    assert lines[0] == ("| model | method | allocation | rho | ppl wikitext2 | x dense | weights MiB | attention MiB "
                        "| linear reduction | model reduction | seconds |")
    assert lines[2] == "| tiny | dense |  | 1 | 20.000 | 1.00x |  |  |  |  |  |"
    assert lines[3] == "| tiny | ftc | sensitivity | 0.8 | 21.000 | 1.05x | 2.50 | 3.00 | 20.0% | 6.0% | 41 |"
    assert lines[6] == "| tiny | svd_llm |  | 0.4 | failed |  |  |  |  |  |  |"
    assert failures(ROWS) == ["- tiny svd_llm rho 0.4: failed (CUDA out of memory \\| layer 3), job `job_d`"]


def test_comparison_flags_changes_beyond_the_threshold_and_lost_or_new_cells() -> None:
    before = [row("ftc", 0.8, 20.0), row("ftc", 0.4, 30.0), row("svd_llm", 0.8, 40.0), row("svd_llm", 0.4, 80.0)]
    after = [
        row("ftc", 0.8, 20.3),  # +1.5%: within 2%
        row("ftc", 0.4, 27.0),  # -10%: better
        row("svd_llm", 0.8, 44.0),  # +10%: worse
        row("svd_llm", 0.4, None, status="failed"),  # lost
        row("ftc", 0.2, 50.0),  # new
    ]
    comparison = compare(before, after, threshold=0.02, previous_run="run_1")
    assert [(c.method, c.ratio, round(c.relative, 3)) for c in comparison.better] == [("ftc", 0.4, -0.1)]
    assert [(c.method, c.ratio, round(c.relative, 3)) for c in comparison.worse] == [("svd_llm", 0.8, 0.1)]
    assert comparison.unchanged == 1
    assert comparison.lost == [("tiny", "svd_llm", 0.4)] and comparison.gained == [("tiny", "ftc", 0.2)]
    text = comparison_markdown(comparison)
    assert "1 worse, 1 better, 1 within the threshold" in text
    assert "| tiny | svd_llm | 0.8 | wikitext2 | 40.000 | 44.000 | +10.0% |" in text
    assert "- tiny svd_llm rho 0.4" in text.split("### No result any more")[1]
    assert compare(before, after, threshold=0.2, previous_run="run_1").worse == []  # a looser threshold
    assert "nothing to compare" in comparison_markdown(compare([], after, 0.02, None))


def test_plots_are_a_png_and_an_svg_with_a_line_per_method_and_the_dense_reference() -> None:
    files = render_plots(ROWS, DENSE, ["wikitext2"], "tiny sweep")
    assert set(files) == {"plot.png", "plot.svg"}
    assert files["plot.png"].startswith(b"\x89PNG\r\n\x1a\n") and len(files["plot.png"]) > 5000
    svg = ElementTree.fromstring(files["plot.svg"])
    text = " ".join(t.strip() for t in svg.itertext() if t.strip())
    for label in ("ftc", "svd_llm", "dense", "tiny · wikitext2", "keep ratio"):
        assert label in text


def test_a_whole_report_names_its_run_settings_and_failures() -> None:
    request = SweepRequest.model_validate({**SWEEP_REQUEST, "models": ["org/tiny"]})
    context = RunContext(
        team="team-a",
        sweep_id="swp_x",
        run_id="run_y",
        request=request,
        trigger="manual",
        created_at=time.time(),
        cancelled=False,
        cells=[],
        previous_run=None,
    )
    files, comparison = build_report(context, ROWS, DENSE, previous=[])
    assert set(files) == {"results.csv", "results.md", "results.json", "plot.png", "plot.svg"}
    markdown = files["results.md"].decode()
    assert markdown.startswith("# Sweep nightly: run run_y")
    assert "4 cells, 1 failed, 3 succeeded" in markdown
    assert "Calibration: wikitext2, 8 x 256 tokens, seed 0. Evaluation: wikitext2, windows of 256 tokens" in markdown
    assert "## Cells without a result" in markdown and comparison.previous_run is None


@pytest.mark.parametrize(
    ("method", "ablate", "label"),
    [("ftc", (), "ftc"), ("ftc", ("no_whiten", "kv_repeat"), "ftc-no_whiten+kv_repeat"), ("svd", (), "svd")],
)
def test_variant_labels(method: str, ablate: tuple, label: str) -> None:
    assert variant_label(method, ablate) == label
