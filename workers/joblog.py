"""The job log: every log line a worker writes while it runs a job, kept as `log.txt` with the job.

A job may run on several workers in turn (a lost lease re-delivers it), so each attempt starts from
the log the previous ones left in the store and appends to it; the store copy is refreshed after
every layer, which keeps a killed worker's last words.
"""

from __future__ import annotations

import logging
from pathlib import Path

from service.logs import attach_context
from service.store import ObjectMissing, ObjectStore
from service.store.layout import LOG

log = logging.getLogger(__name__)


class JobLog:
    """Captures the process's log records into a local file while a job runs (one job per process)."""

    def __init__(self, store: ObjectStore, job_prefix: str, path: Path) -> None:
        self.store = store
        self.key = job_prefix + LOG
        self.path = Path(path)
        self._handler: logging.Handler | None = None

    def open(self) -> JobLog:
        """Start capturing, after the lines earlier attempts left in the store."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        earlier, problem = b"", None
        try:
            earlier = self.store.get_bytes(self.key)
        except ObjectMissing:
            pass
        except Exception as error:  # the store is down: this attempt's lines are still worth keeping
            problem = error
        self.path.write_bytes(earlier)
        handler = attach_context(logging.FileHandler(self.path, encoding="utf-8"))  # text, with the layer
        handler.setLevel(logging.INFO)
        root = logging.getLogger()
        root.addHandler(handler)
        if root.level > logging.INFO:
            root.setLevel(logging.INFO)
        self._handler = handler
        if problem is not None:
            log.warning("could not read the log of earlier attempts: %s", problem)
        return self

    def close(self) -> None:
        if self._handler is not None:
            logging.getLogger().removeHandler(self._handler)
            self._handler.close()
            self._handler = None

    def __enter__(self) -> JobLog:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def upload(self) -> None:
        """Copy the log to the store; a failure is logged, never raised (the log must not fail a job)."""
        if self._handler is not None:
            self._handler.flush()
        try:
            self.store.put_file(self.key, self.path, "text/plain; charset=utf-8")
        except Exception as error:
            log.warning("could not upload the job log: %s", error)
