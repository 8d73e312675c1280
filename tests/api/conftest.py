"""Fixtures of the API tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.service import Api


@pytest.fixture(params=["local", "s3"])
def any_store_api(request: pytest.FixtureRequest, api_factory: Callable[..., Api]) -> Api:
    """The API once on a local-folder store and once on S3 (moto over HTTP)."""
    return api_factory(request.param)
