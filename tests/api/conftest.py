"""Fixtures of the API tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.service import Api


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """schemathesis names the test of each API operation `test...[POST /v1/jobs]`, but pytest 9.2 builds a
    node id from the function's own name and parametrize's ids only, so every operation's test gets the
    same id, and pytest-xdist, which schedules and reports by id, ran one of the 22. The operation goes
    back into the id (a private attribute: no public way to set an id after collection)."""
    for item in items:
        label = getattr(item, "operation_label", None)
        if label and "[" not in item.nodeid:
            item._id = item._id.with_params(label)  # type: ignore[attr-defined]


@pytest.fixture(params=["local", "s3"])
def any_store_api(request: pytest.FixtureRequest, api_factory: Callable[..., Api]) -> Api:
    """The API once on a local-folder store and once on S3 (moto over HTTP)."""
    return api_factory(request.param)
