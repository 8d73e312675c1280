"""Downstream tasks: lm-evaluation-harness task configs that read local JSONL files.

The configs in this folder keep lm-eval's own prompts, answer choices and metrics for each task
and change only where the documents come from (`$FTC_DATA_DIR/tasks/*.jsonl`, see `utils.py`).
They are named `ftc_<task>` so they never shadow lm-eval's hub-backed tasks when this folder is
given to `lm_eval --include_path`.

This module imports nothing heavy: the job API validates task names with it without torch.
"""

from __future__ import annotations

from pathlib import Path

from ftc.options import InputError

TASK_FILES: dict[str, str] = {
    "arc_easy": "arc_easy_test.jsonl",
    "arc_challenge": "arc_challenge_test.jsonl",
    "hellaswag": "hellaswag_validation.jsonl",
    "piqa": "piqa_validation.jsonl",
    "boolq": "boolq_validation.jsonl",
    "mathqa": "mathqa_test.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
}
"""Task name -> its file under `$FTC_DATA_DIR/tasks/` (the split lm-eval scores for that task)."""

TASKS: tuple[str, ...] = tuple(TASK_FILES)
AVG5: tuple[str, ...] = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "mathqa")
"""The headline average: tasks a small model answers by reading the question. BoolQ is left out
because on SmolLM2-135M its accuracy follows how often the model says "yes", not what it read
(every cell within 4 points of what its yes share alone gives: benchmarks/results/tasks_limit400.md)."""
AVG6: tuple[str, ...] = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "boolq", "mathqa")
"""The six zero-shot tasks the paper averages as "avg6" (AVG5 and BoolQ), kept to compare with papers."""
GROUPS: dict[str, tuple[str, ...]] = {"avg5": AVG5, "avg6": AVG6}
"""Names that stand for several tasks in a task list (`ftc eval --tasks avg5`, jobs' `eval.tasks`)."""

PREFIX = "ftc_"
TASK_DIR = Path(__file__).parent


class TaskDataError(InputError):
    pass


def parse_tasks(text: str | list[str] | None) -> tuple[str, ...]:
    """`arc_easy,piqa` or a list into known task names in order, groups (`avg5`, `avg6`) expanded;
    unknown names fail."""
    if not text:
        return ()
    items = text.split(",") if isinstance(text, str) else list(text)
    names: list[str] = []
    for item in (s.strip() for s in items):
        names.extend(GROUPS.get(item, [item] if item else []))
    unknown = [n for n in dict.fromkeys(names) if n not in TASKS]
    if unknown:
        raise InputError(f"unknown task {', '.join(unknown)}; choose from {', '.join(TASKS)} or a group "
                         f"({', '.join(GROUPS)})")
    return tuple(dict.fromkeys(names))


def task_file(task: str) -> Path:
    """The JSONL file `task` reads, or a `TaskDataError` naming the file and `FTC_DATA_DIR`."""
    from ftc.evaluation.data import data_dir  # torch is imported there; only callers that evaluate need it

    root = data_dir()
    path = (root / "tasks" / TASK_FILES[task]) if root else None
    if path is None or not path.is_file():
        where = path or Path("$FTC_DATA_DIR") / "tasks" / TASK_FILES[task]
        raise TaskDataError(
            f"task {task} needs {where}; set FTC_DATA_DIR to the folder that holds tasks/{TASK_FILES[task]}"
        )
    return path
