"""Task groups: `avg5` (the headline, tasks a small model answers by reading) and `avg6` (the
paper's six, BoolQ too), in task lists, in lm-eval's own tags, and in the averages of a run."""

from __future__ import annotations

import pytest
from lm_eval.tasks import TaskManager

from ftc.evaluation.downstream import average, group_averages
from ftc.evaluation.tasks import AVG5, AVG6, GROUPS, PREFIX, TASK_DIR, parse_tasks
from ftc.options import InputError


def test_avg5_is_avg6_without_boolq():
    assert set(AVG6) - set(AVG5) == {"boolq"} and set(AVG5) < set(AVG6)
    assert GROUPS == {"avg5": AVG5, "avg6": AVG6}


def test_task_lists_expand_either_group_and_name_the_groups_when_a_name_is_unknown():
    assert parse_tasks("avg5") == AVG5
    assert parse_tasks("avg5,boolq") == (*AVG5, "boolq")
    assert parse_tasks(["avg6", "avg5"]) == AVG6  # each task once, in first-seen order
    assert parse_tasks("gsm8k, avg5") == ("gsm8k", *AVG5)
    with pytest.raises(InputError, match=r"unknown task avg4; choose from .* or a group \(avg5, avg6\)"):
        parse_tasks("avg4")


@pytest.mark.parametrize("group", GROUPS)
def test_lm_eval_tags_of_the_shipped_configs_hold_the_same_tasks(group):
    # what `lm_eval --include_path $(ftc eval --task-dir) --tasks ftc_avg5` runs
    index = TaskManager(include_path=str(TASK_DIR), include_defaults=False).task_index
    assert index[PREFIX + group].tags == {PREFIX + task for task in GROUPS[group]}


def _row(acc: float) -> dict:
    return {"acc": acc, "acc_stderr": 0.01}


def test_a_run_reports_the_average_of_every_group_it_covers():
    rows = {task: _row(0.3 + 0.1 * i) for i, task in enumerate(AVG6)}
    groups = group_averages(rows)
    assert groups["avg6"] == average(rows)
    assert groups["avg5"] == average({task: rows[task] for task in AVG5})
    assert groups["avg5"]["avg"] != groups["avg6"]["avg"]  # BoolQ is left out of avg5, not averaged in
    five = {task: rows[task] for task in AVG5}
    assert set(group_averages(five)) == {"avg5"}  # avg6 needs BoolQ
    assert group_averages({"piqa": _row(0.5)}) == {}
