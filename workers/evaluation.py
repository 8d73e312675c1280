"""The job's evaluation of the compressed artifact, reloaded from disk: perplexity on each dataset
and, when the request names tasks, downstream accuracy through lm-eval.

The artifact is evaluated exactly as a user would load it (`load_artifact` from the written
folder), so the numbers describe the file that is uploaded, not the model left in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ftc.evaluation.data import bos_prefix, load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.models.registry import resolve_model
from ftc.runtime.loading import load_model

log = logging.getLogger(__name__)


def evaluate(
    model: str | Path,
    datasets: dict[str, str],
    seq_len: int,
    max_windows: int | None,
    device: str,
    check: Callable[[], None],
    tasks: Sequence[str] = (),
    limit: int | None = None,
) -> dict[str, Any]:
    """`{"perplexity": {dataset: ...}}`, plus `"downstream"` (`ftc.evaluation.downstream.evaluate_tasks`'s
    result: per-task accuracy, avg, limit) when `tasks` is not empty, for a model given as `--model`
    accepts it: the written artifact folder, or the dense base model as the reference.

    `datasets` maps the name the job used to the file or name to read. `check` runs before each
    dataset and before the tasks, so a cancelled job does not sit through a long evaluation.
    """
    loaded, tokenizer = load_model(resolve_model(str(model)), torch.float32, device)
    results: dict[str, Any] = {"perplexity": {}}
    for name, local in datasets.items():
        check()
        ids = tokenize(tokenizer, load_text(local, "test"))
        ppl = results["perplexity"][name] = perplexity(loaded, ids, seq_len, max_windows, device=device,
                                                       progress=False, prefix=bos_prefix(tokenizer))
        log.info("perplexity on %s: %.4f over %d windows of %d", name, ppl["ppl"], ppl["windows"], seq_len)
    if tasks:
        from ftc.evaluation.downstream import evaluate_tasks

        check()
        downstream = results["downstream"] = evaluate_tasks(loaded, tokenizer, tasks, limit=limit)
        log.info("downstream accuracy over %s: avg %.4f (limit %s)", ", ".join(tasks), downstream["avg"], limit)
    return results
