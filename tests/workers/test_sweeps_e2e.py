"""A small sweep end to end with real parts: redis-server, moto's S3 server over HTTP, the API
process, `ftc worker` (local Ray, one CPU actor) and `ftc scheduler`, on a tiny model: 2 keep
ratios x 2 methods. The table is checked against the jobs' metrics and an independent evaluation
of the dense model, and the plots are read back from S3."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from ftc.evaluation.data import load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.models.registry import resolve_model
from ftc.runtime.loading import load_model
from service.store.layout import METRICS, job_prefix
from service.sweeps.files import sweep_prefix
from tests.support.servers import ServerProcess
from tests.support.workers import Stack, WorkerProcess

pytestmark = pytest.mark.timeout(600)

EVAL = {"datasets": ["wikitext2"], "seq_len": 64, "max_windows": 2}
REPORT_WAIT_SECONDS = 420.0


@pytest.fixture(scope="module")
def scheduler(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`ftc scheduler` as its own process, active once it holds the lock."""
    env = {**stack.worker_env, "FTC_S3_ENDPOINT_URL": stack.settings.s3_endpoint_url}
    command = [sys.executable, "-m", "cli", "scheduler", "--interval", "0.5", "--name", "e2e"]
    lock = f"{stack.settings.key_prefix}:scheduler:lock"

    def active() -> bool:
        with redis.Redis.from_url(stack.settings.redis_url) as client:
            return bool(client.exists(lock))

    process = ServerProcess("scheduler", command, 0, tmp_path_factory.mktemp("scheduler"), env=env).start(active)
    yield process
    process.stop()


def test_a_small_sweep_runs_end_to_end_and_leaves_its_table_and_plots_in_s3(
    stack: Stack, worker: WorkerProcess, scheduler: ServerProcess, models_dir
) -> None:
    root, model = models_dir()
    request = {
        "name": "e2e",
        "models": [model],
        "ratios": [0.6, 0.3],
        "methods": ["ftc", "svd_llm"],
        "calibration": {"dataset": "wikitext2", "samples": 4, "seq_len": 64, "seed": 0},
        "eval": EVAL,
    }
    with stack.client() as client:
        sweep = client.create_sweep(request)
        deadline = time.monotonic() + REPORT_WAIT_SECONDS
        while not (record := client.get_sweep(sweep["id"]))["run"]["report"]:
            assert time.monotonic() < deadline, f"no report in time; cells: {record['run']['cells']}\n" + (
                worker.log_text()[-3000:] + scheduler.log_tail()
            )
            time.sleep(1)
    run = record["run"]
    assert (record["status"], run["status"], run["counts"]) == ("succeeded", "succeeded", {"succeeded": 4})

    store, team = stack.store(), "team-a"
    prefix = sweep_prefix(team, sweep["id"])
    names = {info.key[len(prefix) :] for info in store.list(prefix)}
    assert {"results.csv", "results.md", "results.json", "plot.png", "plot.svg"} <= names
    assert {f"runs/{run['id']}/plot.svg", f"runs/{run['id']}/results.csv"} <= names

    # The table: a dense row, then each cell, with the numbers the jobs measured.
    table = list(csv.DictReader(io.StringIO(store.get_bytes(prefix + "results.csv").decode())))
    assert [(r["model"], r["method"], r["rho"]) for r in table] == [
        (model, "dense", "1.0"),
        (model, "ftc", "0.6"),
        (model, "ftc", "0.3"),
        (model, "svd_llm", "0.6"),
        (model, "svd_llm", "0.3"),
    ]
    dense = float(table[0]["ppl_wikitext2"])
    for cell in run["cells"]:
        metrics = json.loads(store.get_bytes(job_prefix(team, cell["job_id"]) + METRICS))
        row = next(r for r in table if (r["method"], float(r["rho"])) == (cell["method"], cell["ratio"]))
        measured = metrics["perplexity"]["wikitext2"]["ppl"]
        assert float(row["ppl_wikitext2"]) == pytest.approx(measured, rel=1e-5)
        assert float(row["ratio_to_dense_wikitext2"]) == pytest.approx(measured / dense, rel=1e-5)
        assert int(row["attention_bytes"]) == metrics["storage"]["attention_bytes_written"] > 0
        assert int(row["bytes_written"]) == metrics["bytes_written"] > 0
        assert float(row["linear_reduction"]) == pytest.approx(metrics["storage"]["linear_reduction"], rel=1e-9)
        assert (row["allocation"], row["scope"]) == (metrics["allocation"], "attention")
        assert float(row["seconds"]) > 0 and row["status"] == "succeeded"
        assert ("dense_perplexity" in metrics) == cell["dense_reference"] == (cell["method"] == "ftc")

    # The dense reference is the real thing: the same windows, evaluated here independently.
    tiny, tokenizer = load_model(resolve_model(str(root / model)), torch.float32, "cpu")
    ids = tokenize(tokenizer, load_text("wikitext2", "test"))
    independent = perplexity(tiny, ids, EVAL["seq_len"], EVAL["max_windows"], progress=False)["ppl"]
    assert dense == pytest.approx(independent, rel=1e-4)
    assert all(math.isfinite(float(r["ppl_wikitext2"])) and float(r["ppl_wikitext2"]) > 1 for r in table)

    # The plots: a PNG, and an SVG with a panel for the model and a line per method plus the dense level.
    assert store.get_bytes(prefix + "plot.png").startswith(b"\x89PNG\r\n\x1a\n")
    svg = ElementTree.fromstring(store.get_bytes(prefix + "plot.svg"))
    text = " ".join(t.strip() for t in svg.itertext() if t.strip())
    for label in (f"{model} · wikitext2", "ftc", "svd_llm", "dense", "keep ratio"):
        assert label in text
    markdown = store.get_bytes(prefix + "results.md").decode()
    [dense_line] = [line for line in markdown.splitlines() if line.startswith(f"| {model} | dense |  | 1 | ")]
    assert float(dense_line.split(" | ")[4]) == pytest.approx(dense, abs=5e-4) and "| 1.00x |" in dense_line
    assert "4 cells, 4 succeeded" in markdown
    assert Path(scheduler.log_path).read_text().count("report written") == 1
