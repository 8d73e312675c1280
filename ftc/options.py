"""Names shared by the library, the CLI and the job service.

This module imports nothing heavy so the API process can validate requests without torch.
"""

from __future__ import annotations


class InputError(ValueError):
    """A problem with what the user asked for; the message says what to change."""


METHODS: tuple[str, ...] = ("ftc", "svd", "asvd", "svd_llm", "per_matrix")
"""Compression methods: FTC (ftc-method.md §1-§9) and the baselines of §11."""

ABLATIONS: tuple[str, ...] = (
    "no_whiten",
    "no_sequential",
    "no_slice_norm",
    "no_wo_target",
    "no_anchor",
    "fixed_ranks",
    "kv_repeat",
)
"""One-at-a-time removals of FTC components (ftc-method.md §3-§8)."""

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")
MODEL_ALIASES: tuple[str, ...] = ("smollm2-135m",)
DATASETS: tuple[str, ...] = ("wikitext2", "ptb")
"""Built-in dataset names; a path to a .txt or .jsonl file is accepted too."""


def validate_ratio(ratio: float) -> float:
    """Keep ratio rho must lie in (0, 1] (ftc-method.md §1)."""
    if not (0.0 < ratio <= 1.0):
        raise InputError(f"ratio must be in (0, 1]; got {ratio}")
    return ratio


def parse_ablations(text: str | list[str] | None) -> tuple[str, ...]:
    """Parse `a,b,c` into known ablation names, rejecting unknown ones with the valid list."""
    if not text:
        return ()
    items = text.split(",") if isinstance(text, str) else list(text)
    names = tuple(dict.fromkeys(s.strip() for s in items if s.strip()))
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        raise InputError(f"unknown ablation {', '.join(unknown)}; choose from {', '.join(ABLATIONS)}")
    return names
