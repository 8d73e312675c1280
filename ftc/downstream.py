"""Downstream accuracy through lm-evaluation-harness: run the `ftc_<task>` configs on a loaded
model and reduce lm-eval's results to one row per task plus their average.

Prompts, answer choices and scoring are lm-eval's (`ftc/tasks/`); nothing here scores anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from ftc.tasks import PREFIX, TASK_DIR, task_file

SCORE_METRIC = {"gsm8k": ("exact_match", "strict-match")}
"""The headline metric and lm-eval filter of a task when it is not `acc` (lm-eval's `none` filter)."""


def score_key(task: str) -> tuple[str, str]:
    return SCORE_METRIC.get(task, ("acc", "none"))


def _number(value: Any) -> float | None:
    """lm-eval writes "N/A" for a standard error it cannot compute (one document)."""
    return float(value) if isinstance(value, int | float) else None


def task_row(task: str, results: dict[str, Any], samples: dict[str, Any]) -> dict[str, Any]:
    """One task's entry from lm-eval's `results`/`n-samples` tables: `acc`, `acc_norm` (None where
    the task has none, as BoolQ), their standard errors, and `n` documents scored. GSM8K's headline
    is exact match after lm-eval's strict `#### answer` filter, its flexible filter alongside."""
    table = results[PREFIX + task]
    n = samples[PREFIX + task]["effective"]
    if task == "gsm8k":
        return {
            "exact_match": table["exact_match,strict-match"],
            "exact_match_stderr": _number(table["exact_match_stderr,strict-match"]),
            "flexible_exact_match": table["exact_match,flexible-extract"],
            "n": n,
        }
    return {
        "acc": table["acc,none"],
        "acc_stderr": _number(table["acc_stderr,none"]),
        "acc_norm": table.get("acc_norm,none"),
        "acc_norm_stderr": _number(table.get("acc_norm_stderr,none")),
        "n": n,
    }


def average(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Mean of each task's headline score (`acc`; exact match for GSM8K), and the standard error of
    that mean for independent task estimates, sqrt(sum se_i^2) / k (None if a task has none)."""
    metrics = [score_key(task)[0] for task in rows]
    scores = [row[metric] for row, metric in zip(rows.values(), metrics, strict=True)]
    errors = [row[f"{metric}_stderr"] for row, metric in zip(rows.values(), metrics, strict=True)]
    spread = None if None in errors else math.sqrt(sum(e * e for e in errors)) / len(errors)
    return {"avg": sum(scores) / len(scores), "avg_stderr": spread}


def evaluate_tasks(
    model: nn.Module,
    tokenizer: Any,
    tasks: Sequence[str],
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
) -> dict[str, Any]:
    """`{"tasks": {name: row}, "avg", "avg_stderr", "limit", "num_fewshot"}` for known task names.

    `limit` scores the first N documents of each task (lm-eval's `--limit`); `num_fewshot` None
    keeps each config's own (0, and 5 for GSM8K). Every data file is checked before any work.
    """
    from ftc.harness import FTCLM, offline

    if not tasks:
        raise ValueError("no tasks to evaluate")
    for task in tasks:
        task_file(task)
    offline()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm = FTCLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    output = simple_evaluate(
        model=lm,
        tasks=[PREFIX + task for task in tasks],
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        log_samples=False,
    )
    rows = {task: task_row(task, output["results"], output["n-samples"]) for task in tasks}
    return {"tasks": rows, **average(rows), "limit": limit, "num_fewshot": num_fewshot}
