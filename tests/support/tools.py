"""One rule for tests that need a program the project cannot install by itself (Redis, Chromium,
docker compose, validators): skipped locally with the reason, a failure under `CI=true`.

`.ci/run` exports `CI=true`, so CI cannot pass by skipping what it was meant to check.
"""

from __future__ import annotations

import os
import shutil

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require_tool(name: str, why: str, found: str | list[str] | bool | None = None):
    """Return `found` (by default `shutil.which(name)`); when it is empty, skip the calling test
    with `name` and `why` in the reason, or fail it under `CI=true`."""
    if found is None:
        found = shutil.which(name)
    if found:
        return found
    message = f"{name} is not installed here; {why}"
    if under_ci():
        pytest.fail(f"{message} (CI=true: a missing tool fails instead of skipping)", pytrace=False)
    pytest.skip(message)
