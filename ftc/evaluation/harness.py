"""The `ftc` model backend for lm-evaluation-harness, and a launcher for lm-eval's command line.

`FTCLM` is lm-eval's own `HFLM` given the model object this library loads: a compressed artifact
runs in its factorized form, any other `--model` spec (alias, Hugging Face folder, .gguf) runs as
transformers loads it. Loglikelihood, rolling loglikelihood and generation are HFLM's, unchanged.

The package declares `ftc` in lm-eval's plugin entry-point group `lm_eval.models`, which lm-eval
reads from its releases after 0.4.13 on: with those, `lm_eval run --model ftc` works as installed.
lm-eval 0.4.13 does not read it: its registry knows only the models it lists itself and those
registered by `@register_model` in an imported module. Importing this module registers `ftc`;
`ftc-lm-eval` (or `python -m ftc.evaluation.harness`) is lm-eval's own command line with that import done
first, taking exactly lm-eval's arguments:

    ftc-lm-eval run --model ftc --model_args pretrained=DIR \
        --include_path "$(ftc eval --task-dir)" --tasks ftc_arc_easy
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ftc.models.registry import ModelError, pick_device, resolve_model
from ftc.runtime.hf.modeling_ftc import RUNTIMES
from ftc.runtime.loading import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


LOGITS_BYTES = 8 << 30
"""Bytes a batch of lm-eval's loglikelihood requests may spend on logits. lm-eval takes the float32
logits of every position of a padded batch and their log-softmax (8 bytes per position and
vocabulary entry): with Gemma-3-270M's 262,144-entry vocabulary, 16 documents per batch held 23.5 GB
and were killed for memory on a 24 GB machine; at SmolLM2-135M's 49,152 entries, 16 documents of
1024 tokens come to 6.4 GB."""
LOGITS_TOKENS = 1024
"""Padded tokens per document `LOGITS_BYTES` is sized for: a bound on the shipped tasks' longest."""


def task_batch_size(requested: int, vocab: int) -> int:
    """`requested` documents per forward, at most what `LOGITS_BYTES` holds for a `vocab`-entry
    vocabulary (at least one)."""
    return max(1, min(requested, LOGITS_BYTES // (8 * LOGITS_TOKENS * vocab)))


OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextmanager
def offline() -> Iterator[None]:
    """Hub switches off (where the user set none) while tasks run, as they were afterwards.

    Tasks read local files; these switches make sure nothing lm-eval or `datasets` calls reaches
    for the hub. They are restored on exit because a worker that scored tasks for one job may
    compress a hub model id for the next, and the subprocesses it starts inherit its environment.
    `huggingface_hub` and `datasets` read the switches once, at their first import, so only a first
    import inside the block (usually `datasets`, through lm-eval) keeps the offline setting.
    """
    saved = {name: os.environ.get(name) for name in OFFLINE}
    for name in OFFLINE:
        os.environ.setdefault(name, "1")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _device(name: str | None) -> torch.device:
    # lm-eval's command line defaults to cuda:0; like its HFLM, fall back to the CPU without CUDA.
    if not name or (name.startswith("cuda") and not torch.cuda.is_available()):
        return pick_device("auto")
    return torch.device(name)


@register_model("ftc")
class FTCLM(HFLM):
    """`pretrained` is what `ftc eval --model` accepts, or an already loaded model (with `tokenizer`).

    An artifact runs in the runtime `load_artifact` gives it: `runtime=speed` (the default, each
    group in its cheapest form) or `runtime=memory` (the stored form), e.g.
    `--model_args pretrained=DIR,runtime=memory`. A fixed `batch_size` is lowered to what the
    vocabulary's logits allow (`task_batch_size`), whichever route scores: `ftc eval`, the jobs, or
    lm-eval's own command line.
    """

    def __init__(
        self,
        pretrained: str | torch.nn.Module,
        tokenizer: Any = None,
        device: str | None = None,
        dtype: str = "float32",
        batch_size: int | str = 1,
        runtime: str = "speed",
        **kwargs: Any,
    ) -> None:
        if isinstance(pretrained, str):
            if dtype not in DTYPES:
                raise ModelError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
            if runtime not in RUNTIMES:
                raise ModelError(f"runtime must be one of {', '.join(RUNTIMES)}; got {runtime!r}")
            pretrained, loaded = load_model(resolve_model(pretrained), DTYPES[dtype], _device(device), runtime)
            tokenizer = tokenizer or loaded
        if tokenizer is None:
            raise ModelError("the model has no tokenizer; save one with the artifact or pass tokenizer=...")
        if not str(batch_size).startswith("auto"):  # lm-eval's own search sizes an "auto" batch
            vocab = pretrained.config.vocab_size
            if (fitting := task_batch_size(int(batch_size), vocab)) < int(batch_size):
                logging.getLogger(__name__).warning(
                    "scoring %d documents per forward, not %s: the %d-entry vocabulary's logits would exceed "
                    "%d GiB", fitting, batch_size, vocab, LOGITS_BYTES >> 30)
            batch_size = fitting
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, batch_size=batch_size, **kwargs)


def main() -> None:
    """lm-eval's command line, with the `ftc` backend registered by this module's import."""
    from lm_eval.__main__ import cli_evaluate

    with offline():
        cli_evaluate()


if __name__ == "__main__":
    main()
