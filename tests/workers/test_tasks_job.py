"""A job that asks for downstream tasks: the worker scores the artifact (and the dense model when
the request asks) through lm-eval and writes per-task accuracy and the average into metrics.json."""

from __future__ import annotations

import json

import pytest

from tests.support.workers import worker_job_request
from tests.workers.test_job import _keep_torch_threads, job_folder, run_job

pytestmark = pytest.mark.timeout(600)
__all__ = ["_keep_torch_threads"]  # the autouse fixture applies here too


def test_a_job_with_tasks_writes_per_task_accuracy_and_the_average(worker_settings, models_dir) -> None:
    settings = worker_settings()
    _root, model = models_dir(layers=2, hidden=64)
    request = worker_job_request(
        model, eval={"datasets": [], "tasks": ["arc_easy", "boolq"], "limit": 3, "dense_reference": True}
    )

    record = run_job(settings, request, timeout=540)
    assert record.status == "succeeded", record.error
    metrics = json.loads((job_folder(settings, record.id) / "metrics.json").read_text())
    assert metrics["eval"]["tasks"] == ["arc_easy", "boolq"] and metrics["eval"]["limit"] == 3
    assert metrics["perplexity"] == {} and metrics["dense_perplexity"] == {}
    for section in ("downstream", "dense_downstream"):
        scores = metrics[section]
        assert set(scores["tasks"]) == {"arc_easy", "boolq"} and scores["limit"] == 3
        assert all(row["n"] == 3 and 0 <= row["acc"] <= 1 for row in scores["tasks"].values())
        accuracies = [row["acc"] for row in scores["tasks"].values()]
        assert scores["avg"] == pytest.approx(sum(accuracies) / 2)
