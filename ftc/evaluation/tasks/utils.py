"""Document loaders and processing for the `ftc_<task>` configs beside this file.

lm-eval loads this file by path when a config names `!function utils.<name>`. Each loader reads a
local JSONL file and returns the rows in the layout of the Hugging Face dataset the upstream
lm-eval config reads, so the prompt templates stay lm-eval's, word for word. Where lm-eval's
config calls a helper of its own (HellaSwag's `preprocess`, MathQA's `doc_to_choice`), that
helper is imported from lm-eval rather than copied.
"""

from __future__ import annotations

import json
from typing import Any

import datasets
from lm_eval.tasks.hellaswag.utils import preprocess
from lm_eval.tasks.mathqa.utils import doc_to_choice

from ftc.evaluation.tasks import task_file

__all__ = ["doc_to_choice", "load_arc", "load_boolq", "load_hellaswag", "load_rows"]


def _read(task: str) -> list[dict[str, Any]]:
    path = task_file(task)
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _splits(rows: list[dict[str, Any]], split: str) -> datasets.DatasetDict:
    # Built in memory: no Hugging Face cache is written and nothing is fetched.
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})


def arc_row(record: dict[str, Any]) -> dict[str, Any]:
    """AI2's native nested layout -> the `allenai/ai2_arc` layout lm-eval's ARC config reads."""
    choices = record["question"]["choices"]
    return {
        "id": record["id"],
        "question": record["question"]["stem"],
        "choices": {"text": [c["text"] for c in choices], "label": [c["label"] for c in choices]},
        "answerKey": record["answerKey"],
    }


def boolq_row(record: dict[str, Any]) -> dict[str, Any]:
    """This copy stores the label as the string "true"/"false"; SuperGLUE's is 1/0 (choices no, yes)."""
    label = record["label"]
    truth = label.strip().lower() == "true" if isinstance(label, str) else bool(label)
    return {"question": record["question"], "passage": record["passage"], "idx": record["idx"], "label": int(truth)}


def hellaswag_row(record: dict[str, Any]) -> dict[str, Any]:
    """The local file is already `activity_label: ctx_a ctx_b`; lm-eval's `preprocess` is applied as in
    its own `process_docs`, giving the `query`, `choices` and `gold` fields its config reads."""
    return {
        "query": preprocess(record["ctx"]),
        "choices": [preprocess(ending) for ending in record["endings"]],
        "gold": int(record["label"]),
        "label": str(record["label"]),
    }


def load_arc(task: str, split: str, **_: Any) -> datasets.DatasetDict:
    return _splits([arc_row(r) for r in _read(task)], split)


def load_boolq(task: str, split: str, **_: Any) -> datasets.DatasetDict:
    return _splits([boolq_row(r) for r in _read(task)], split)


def load_hellaswag(task: str, split: str, **_: Any) -> datasets.DatasetDict:
    return _splits([hellaswag_row(r) for r in _read(task)], split)


def load_rows(task: str, split: str, **_: Any) -> datasets.DatasetDict:
    """PIQA, MathQA and GSM8K: the local fields are already those of the upstream datasets."""
    return _splits(_read(task), split)
