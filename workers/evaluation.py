"""The job's evaluation: perplexity of the compressed artifact, reloaded from disk, on each dataset.

The artifact is evaluated exactly as a user would load it (`load_artifact` from the written
folder), so the numbers describe the file that is uploaded, not the model left in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from ftc.data import load_text, tokenize
from ftc.evaluate import perplexity
from ftc.loading import load_model
from ftc.models import resolve_model

log = logging.getLogger(__name__)


def evaluate(
    model: str | Path,
    datasets: dict[str, str],
    seq_len: int,
    max_windows: int | None,
    device: str,
    check: Callable[[], None],
) -> dict[str, dict]:
    """Perplexity per dataset of a model given as `--model` accepts it: the written artifact
    folder, or the dense base model as the reference a keep ratio is judged against.

    `datasets` maps the name the job used to the file or name to read. `check` runs before each
    dataset, so a cancelled job does not sit through a long evaluation.
    """
    loaded, tokenizer = load_model(resolve_model(str(model)), torch.float32, device)
    results = {}
    for name, local in datasets.items():
        check()
        ids = tokenize(tokenizer, load_text(local, "test"))
        results[name] = perplexity(loaded, ids, seq_len, max_windows, device=device, progress=False)
        log.info("perplexity on %s: %.4f over %d windows of %d", name, results[name]["ppl"],
                 results[name]["windows"], seq_len)
    return results
