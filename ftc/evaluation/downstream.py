"""Downstream accuracy through lm-evaluation-harness: run the `ftc_<task>` configs on a loaded
model and reduce lm-eval's results to one row per task plus their average.

Prompts, answer choices and scoring are lm-eval's (`ftc/evaluation/tasks/`); nothing here scores anything.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from torch import nn

from ftc.evaluation.tasks import GROUPS, PREFIX, TASK_DIR, task_file

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


def document_scores(task: str, samples: list[dict[str, Any]]) -> str:
    """Each scored document's headline score (0 or 1), in document order, as one string ("0110..."):
    lm-eval's per-document `acc` (exact match for GSM8K) from its logged samples, compact enough to
    keep beside the task's row so that two models scored on the same documents can be compared
    pairwise (`paired_difference`)."""
    metric, kept = score_key(task)
    scores = sorted((sample["doc_id"], sample[metric]) for sample in samples if sample["filter"] == kept)
    return "".join("1" if score else "0" for _, score in scores)


def paired_difference(rows: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]]) -> dict[str, float]:
    """avg(rows) - avg(reference) over the tasks of `rows`, with the standard error of that
    difference from the per-document differences of the two models on the same documents.

    Why paired: both models meet the same documents, so the documents' own difficulty cancels out of
    the differences instead of entering both scores' errors. How much that buys depends on how alike
    the two models answer; on SmolLM2 at 200 documents a task it came out close to the unpaired
    error, because BoolQ answers flip with a model's yes/no bias. Per task it is stdev(d) / sqrt(n) of the
    differences d (lm-eval's sample-stdev convention for its `acc_stderr`); tasks hold different
    documents, so they combine as independent estimates, as in `average`.
    """
    deltas, errors = [], []
    for task, row in rows.items():
        mine, theirs = row.get("documents"), reference.get(task, {}).get("documents")
        if mine is None or theirs is None or len(mine) != len(theirs):
            raise ValueError(f"{task}: both rows need per-document scores on the same documents")
        diffs = [int(a) - int(b) for a, b in zip(mine, theirs, strict=True)]
        deltas.append(statistics.fmean(diffs))
        errors.append(statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan)
    return {"avg_diff": sum(deltas) / len(deltas), "stderr": math.sqrt(sum(e * e for e in errors)) / len(errors)}


def average(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Mean of each task's headline score (`acc`; exact match for GSM8K), and the standard error of
    that mean for independent task estimates, sqrt(sum se_i^2) / k (None if a task has none)."""
    metrics = [score_key(task)[0] for task in rows]
    scores = [row[metric] for row, metric in zip(rows.values(), metrics, strict=True)]
    errors = [row[f"{metric}_stderr"] for row, metric in zip(rows.values(), metrics, strict=True)]
    spread = None if None in errors else math.sqrt(sum(e * e for e in errors)) / len(errors)
    return {"avg": sum(scores) / len(scores), "avg_stderr": spread}


def group_averages(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """`average` over each task group (`avg5`, `avg6`) whose tasks were all scored: a run of avg6
    gives the avg5 headline too, without scoring anything twice."""
    return {name: average({task: rows[task] for task in tasks})
            for name, tasks in GROUPS.items() if all(task in rows for task in tasks)}


def evaluate_tasks(
    model: nn.Module,
    tokenizer: Any,
    tasks: Sequence[str],
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    per_document: bool = False,
) -> dict[str, Any]:
    """`{"tasks": {name: row}, "avg", "avg_stderr", "groups", "limit", "num_fewshot", "batch_size"}` for
    known task names; `groups` holds the average of each task group covered (`group_averages`), and
    `batch_size` the documents per forward used (`FTCLM` may lower it: `task_batch_size`).

    `limit` scores the first N documents of each task (lm-eval's `--limit`); `num_fewshot` None
    keeps each config's own (0, and 5 for GSM8K). Every data file is checked before any work.
    `per_document` adds each row's `documents` (`document_scores`), for `paired_difference`.
    """
    from ftc.evaluation.harness import FTCLM, offline

    if not tasks:
        raise ValueError("no tasks to evaluate")
    for task in tasks:
        task_file(task)
    with offline():
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        lm = FTCLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        output = simple_evaluate(
            model=lm,
            tasks=[PREFIX + task for task in tasks],
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
            log_samples=per_document,
        )
    rows = {task: task_row(task, output["results"], output["n-samples"]) for task in tasks}
    if per_document:
        for task, row in rows.items():
            row["documents"] = document_scores(task, output["samples"][PREFIX + task])
    return {"tasks": rows, **average(rows), "groups": group_averages(rows), "limit": limit,
            "num_fewshot": num_fewshot, "batch_size": lm.batch_size}
