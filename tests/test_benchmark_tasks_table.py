"""The tasks benchmark's table file, filled by one process per core: a save merges into what the
others have written instead of overwriting it."""

from __future__ import annotations

from tests.support.benchmarks import load_benchmark

quality_tasks = load_benchmark("quality_tasks")


def _cell(method: str, avg: float) -> dict:
    return {"method": method, "ratio": 0.4, "limit": 10, "avg": avg}


def test_a_save_keeps_the_other_process_cells_and_commands() -> None:
    # the file as the other process (--methods cp) left it, in the layout of files written before merging
    on_disk = {"command": "quality.py --methods cp", "dense": {"avg": 0.5}, "notes": ["kept"],
               "cells": {"cp@0.4": _cell("cp", 0.3), "ftc@0.4": _cell("ftc", 0.1)}}
    finished = {"ftc@0.4": _cell("ftc", 0.4)}
    results = quality_tasks.merged(on_disk, finished, "quality.py --methods ftc")
    assert results["cells"] == {"cp@0.4": _cell("cp", 0.3), "ftc@0.4": _cell("ftc", 0.4)}
    assert results["dense"] == {"avg": 0.5} and results["notes"] == ["kept"]
    assert results["commands"] == ["quality.py --methods cp", "quality.py --methods ftc"]
    assert "command" not in results and on_disk["cells"]["ftc@0.4"]["avg"] == 0.1  # the input is not changed
    # a resumed run adds its command once, and its own dense replaces the file's
    again = quality_tasks.merged(results, {"dense": {"avg": 0.6}}, "quality.py --methods ftc")
    assert again["commands"] == results["commands"] and again["dense"] == {"avg": 0.6}
    assert "dense" not in again["cells"]


def test_boolq_yes_is_the_share_of_documents_answered_yes() -> None:
    labels = [1, 1, 0, 0]  # "yes", "yes", "no", "no"
    assert quality_tasks.boolq_yes("1111", labels) == 0.5  # every answer right: the labels' share
    assert quality_tasks.boolq_yes("1100", labels) == 1.0  # always "yes"
    assert quality_tasks.boolq_yes("0011", labels) == 0.0  # always "no"
    assert quality_tasks.boolq_yes("1000", labels) == 0.75  # yes, no (wrong), yes (wrong), yes (wrong)


def _scored(accuracies: dict[str, str]) -> dict:
    """A cell's task rows from per-document scores ("0110..."), acc their mean."""
    return {"tasks": {task: {"acc": docs.count("1") / len(docs), "acc_stderr": 0.1, "documents": docs}
                      for task, docs in accuracies.items()}}


def test_avg5_is_the_headline_and_boolq_stands_apart_with_its_yes_share() -> None:
    five = {task: "1100" for task in quality_tasks.COLUMNS}
    dense = {**_scored({**five, "boolq": "0011"}), "avg": 0.5, "avg_stderr": 0.04, "limit": 4}
    # the same answers on the five, BoolQ flipped to always "yes": avg6 moves, avg5 does not
    yes = {**_scored({**five, "boolq": "1100"}), "method": "asvd", "ratio": 0.4, "avg": 0.5, "avg_stderr": 0.04,
           "limit": 4}
    results = {"dense": dense, "cells": {"asvd@0.4": yes}}
    text = quality_tasks.render(results, "M (source)", ["asvd"], "t.png", boolq_labels=[1, 1, 0, 0])
    assert "| ARC-e | ARC-c | HellaSwag | PIQA | MathQA | avg5 | vs dense | vs ftc | BoolQ | BoolQ yes | avg6 |" in text
    assert "| 0.4 | asvd | 50.0 ±10.0 | 50.0 ±10.0 | 50.0 ±10.0 | 50.0 ±10.0 | 50.0 ±10.0 | 50.0 ±4.5 | +0.0 ±0.0 " \
           "| - | 50.0 ±10.0 | 100.0 | 50.0 ±4.0 |" in text
    assert "| 1.0 | dense |" in text and "| 50.0 ±10.0 | 0.0 | 50.0 ±4.0 |" in text  # dense always says "no"
    assert "BoolQ is not in the headline" in text and "![avg5 against rho](t.png)" in text
