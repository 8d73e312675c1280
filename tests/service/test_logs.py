"""The logging setup: text or JSON lines, the job context on every line (threads included), uvicorn
routed through the same handler, and a clear refusal of an unknown format."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import logging.config
from collections.abc import Iterator

import pytest

from service.logs import (
    ContextFilter,
    JsonFormatter,
    TextFormatter,
    current_context,
    log_context,
    logging_config,
    set_log_context,
)
from service.settings import Settings


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO, logging.StreamHandler]]:
    """A private logger writing into a buffer through the service's context filter."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.addFilter(ContextFilter())
    logger = logging.getLogger("tests.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, buffer, handler
    logger.removeHandler(handler)


def test_json_lines_carry_the_job_context_and_null_outside_a_job(captured) -> None:
    logger, buffer, handler = captured
    handler.setFormatter(JsonFormatter())
    logger.info("outside")
    with log_context(job_id="job_1", team="team-a"):
        set_log_context(layer=3)
        logger.info("layer %d done", 3)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed")
    logger.info("after")
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["outside", "layer 3 done", "failed", "after"]
    assert {k: lines[0][k] for k in ("job_id", "team", "layer")} == {"job_id": None, "team": None, "layer": None}
    assert {k: lines[1][k] for k in ("job_id", "team", "layer", "level", "logger")} == {
        "job_id": "job_1", "team": "team-a", "layer": 3, "level": "INFO", "logger": "tests.logs"
    }
    assert lines[1]["time"].endswith("+00:00")
    assert "RuntimeError: boom" in lines[2]["exception"] and lines[2]["level"] == "ERROR"
    assert lines[3]["job_id"] is None, "the context ends with its block"


def test_text_lines_are_tagged_inside_a_job_with_the_traceback_below(captured) -> None:
    logger, buffer, handler = captured
    handler.setFormatter(TextFormatter())
    logger.info("plain")
    with log_context(job_id="job_2", team="team-b", layer=1):
        try:
            raise ValueError("bad")
        except ValueError:
            logger.exception("failed")
    first, second, *traceback = buffer.getvalue().splitlines()
    assert first.endswith("INFO tests.logs: plain")
    assert second.endswith("ERROR tests.logs: failed [job=job_2 team=team-b layer=1]")
    assert traceback[-1] == "ValueError: bad"


def test_the_context_follows_a_job_into_its_thread_and_stays_there() -> None:
    """The worker compresses in `asyncio.to_thread`: the job's fields go with it, and what the thread
    sets (the layer) does not leak back into the event loop's context."""

    def in_thread() -> dict:
        set_log_context(layer=2)
        return current_context()

    async def job() -> tuple[dict, dict]:
        with log_context(job_id="job_3", team="team-a"):
            seen = await asyncio.to_thread(in_thread)
            return seen, current_context()

    seen, after = asyncio.run(job())
    assert seen == {"job_id": "job_3", "team": "team-a", "layer": 2}
    assert after == {"job_id": "job_3", "team": "team-a"}
    with pytest.raises(ValueError, match="unknown log context fields"):
        with log_context(jobid="x"):
            pass


def test_uvicorn_lines_go_through_the_same_json_handler(capsys: pytest.CaptureFixture) -> None:
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate)
             for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access")}
    saved_level = logging.getLogger().level
    try:
        logging.config.dictConfig(logging_config("json"))
        logging.getLogger("uvicorn.access").info('127.0.0.1:1 - "GET /healthz HTTP/1.1" 200')
        logging.getLogger("uvicorn.error").info("Application startup complete.")
    finally:
        for name, (handlers, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.handlers[:] = handlers
            logger.propagate = propagate
        logging.getLogger().setLevel(saved_level)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["logger"], line["message"][:8]) for line in lines] == [
        ("uvicorn.access", "127.0.0."), ("uvicorn.error", "Applicat")
    ]


def test_an_unknown_format_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="FTC_LOG_FORMAT must be one of text, json"):
        logging_config("yaml")
    with pytest.raises(ValueError, match="log_format"):
        Settings(log_format="yaml")
    assert Settings().log_format == "text"
