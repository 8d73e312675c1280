"""Test configuration shared by the whole suite; the job-service fixtures live in conftest_service.py."""

import pytest

pytest_plugins = ["tests.conftest_service", "tests.conftest_ftc", "tests.conftest_workers"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow (make test-slow)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow test: run with `pytest --run-slow` or `make test-slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
