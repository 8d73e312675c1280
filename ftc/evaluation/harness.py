"""The `ftc` model backend for lm-evaluation-harness, and a launcher for lm-eval's command line.

`FTCLM` is lm-eval's own `HFLM` given the model object this library loads: a compressed artifact
runs in its factorized form, any other `--model` spec (alias, Hugging Face folder, .gguf) runs as
transformers loads it. Loglikelihood, rolling loglikelihood and generation are HFLM's; a
loglikelihood forward computes the head only at the positions lm-eval scores (`scored_tail`).

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

import inspect
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


def scored_inputs(requests, max_length: int) -> dict[tuple[int, ...], int]:
    """Each model input of HFLM's loglikelihood `requests` (context and continuation tokens, cut on
    the left to the window, the last token dropped, as HFLM builds it), with the longest
    continuation scored on it."""
    scored: dict[tuple[int, ...], int] = {}
    for _, context, continuation in requests:
        key = tuple((context + continuation)[-(max_length + 1):][:-1])
        scored[key] = max(scored.get(key, 0), len(continuation))
    return scored


def scored_tail(inps: torch.Tensor, scored: dict[tuple[int, ...], int]) -> int | None:
    """How many trailing positions of the right-padded batch `inps` HFLM reads logits at: from the
    first position where any row's continuation is scored to the end. None where a row is not one of
    `scored`'s inputs (then every position is needed).

    Why a tail is enough: HFLM reads a row's logits at `[inplen - contlen, inplen)` counted from the
    end of what the model returns (its `ctx_len` allows for fewer positions than the input), so the
    last `tail` positions serve every row whose continuation starts inside them. A row's length is
    not known from the batch (padding is token 0, which a text may also hold), so every length from
    its last non-zero token to the batch width that is a scored input counts: the tail can only grow.
    """
    width, first = inps.shape[1], inps.shape[1]
    for row in inps.tolist():
        filled = max((i + 1 for i, token in enumerate(row) if token), default=0)
        starts = [length - scored[key] for length in range(filled, width + 1)
                  if (key := tuple(row[:length])) in scored]
        if not starts:
            return None
        first = min(first, *starts)
    return width - first


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
        self._scored: dict[tuple[int, ...], int] = {}
        # transformers' causal LMs take `logits_to_keep`; a model that does not is scored everywhere
        self._tail_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's, with the inputs it will score known to `_model_call` (`scored_inputs`)."""
        tails = self.backend == "causal" and self._tail_logits  # whether a forward may compute a tail only
        self._scored = scored_inputs(requests, self.max_length) if tails else {}
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._scored = {}

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        """HFLM's forward, the head and its logits only at the positions HFLM scores (`scored_tail`).

        Why: lm-eval reads the log-probabilities of the continuation tokens only, but HFLM computes
        the head and a float32 log-softmax at every position of the padded batch; with Gemma-3's
        262,144-entry vocabulary the head is most of a forward's work. transformers' causal LMs take
        `logits_to_keep`, the number of trailing positions to compute logits for, and HFLM already
        reads a shorter output from its end. Scores are those of every position computed (the same
        products, on fewer rows)."""
        tail = scored_tail(inps, self._scored) if self._scored and attn_mask is None and labels is None else None
        if tail is None or tail >= inps.shape[1]:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            return self.model(inps, logits_to_keep=max(tail, 1)).logits


def main() -> None:
    """lm-eval's command line, with the `ftc` backend registered by this module's import."""
    from lm_eval.__main__ import cli_evaluate

    with offline():
        cli_evaluate()


if __name__ == "__main__":
    main()
