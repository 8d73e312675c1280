"""One logging setup for every process of the service: `ftc serve` (uvicorn included), the sweep
scheduler, the worker supervisor and its Ray actors.

`FTC_LOG_FORMAT=text` (the default) prints the familiar `time LEVEL logger: message` lines;
`FTC_LOG_FORMAT=json` prints one JSON object a line for log collectors (Loki, Elasticsearch,
Cloud Logging). Either way, lines written while a worker runs a job carry the job id, the team and
the layer being compressed: `log_context` sets them in a context variable, which follows the job
into the thread that compresses it (`asyncio.to_thread` copies the context), so no call site has
to pass them along.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import logging.config
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any, Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = ("text", "json")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONTEXT_FIELDS: tuple[str, ...] = ("job_id", "team", "layer")
"""What `log_context` may set; every JSON line has these keys (null outside a job)."""

_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "ftc_log_context", default=MappingProxyType({})
)


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Add `fields` (job_id, team, layer) to every line logged in this context until the block ends."""
    unknown = set(fields) - set(CONTEXT_FIELDS)
    if unknown:
        raise ValueError(f"unknown log context fields {sorted(unknown)}; use {', '.join(CONTEXT_FIELDS)}")
    token = _context.set({**_context.get(), **fields})
    try:
        yield
    finally:
        _context.reset(token)


def set_log_context(**fields: Any) -> None:
    """Change fields of the current context in place (e.g. the layer, as a job moves on), where a
    `with` block does not fit; the enclosing `log_context` still restores the outer values."""
    _context.set({**_context.get(), **fields})


def current_context() -> dict[str, Any]:
    return dict(_context.get())


class ContextFilter(logging.Filter):
    """Copies the context fields onto each record (None where unset), for either formatter."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _context.get()
        for name in CONTEXT_FIELDS:
            if not hasattr(record, name):
                setattr(record, name, context.get(name))
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, with `[job=... team=... layer=...]` appended inside a job."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = [(name, getattr(record, name, None)) for name in CONTEXT_FIELDS]
        tags = " ".join(f"{name.removesuffix('_id')}={value}" for name, value in fields if value is not None)
        if not tags:
            return line
        head, newline, rest = line.partition("\n")  # keep a traceback below the tagged first line
        return f"{head} [{tags}]{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, the context fields,
    and `exception` (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            entry[name] = getattr(record, name, None)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            entry["exception"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def formatter(log_format: str) -> logging.Formatter:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"FTC_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}; got {log_format!r}")
    return JsonFormatter() if log_format == "json" else TextFormatter()


def logging_config(log_format: str, level: str = "INFO") -> dict[str, Any]:
    """A `logging.config.dictConfig` that sends the root logger and uvicorn's loggers to stderr in
    `log_format`. `ftc serve` hands it to uvicorn, which applies it in each of its worker processes."""
    formatter(log_format)  # refuse an unknown format here, in the parent
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "ftc", "filters": ["ftc"]}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"ftc": {"()": formatter, "log_format": log_format}},
        "filters": {"ftc": {"()": ContextFilter}},
        "handlers": {"ftc": handler},
        "root": {"handlers": ["ftc"], "level": level.upper()},
        "loggers": {
            name: {"handlers": [], "level": level.upper(), "propagate": True}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }


def configure_logging(log_format: str = "text", level: str = "INFO") -> None:
    """Route every logger of this process through one stderr handler in `log_format` (idempotent)."""
    logging.config.dictConfig(logging_config(log_format, level))


def attach_context(handler: logging.Handler) -> logging.Handler:
    """Give another handler (e.g. a job's log file) the context fields and the text format."""
    handler.addFilter(ContextFilter())
    handler.setFormatter(TextFormatter())
    return handler

