"""Test configuration shared by the whole suite; the job-service fixtures live in conftest_service.py."""

pytest_plugins = ["tests.conftest_service", "tests.conftest_ftc"]
