"""A job's compression work folder mirrored to `{team}/jobs/{id}/checkpoints/` in the object store.

The library checkpoints every finished layer into a local work folder and resumes from it; copying
that folder to the store after each layer, and back into a fresh folder before a run, is what lets
a job re-delivered to another machine resume at its first unfinished layer.

Uploads follow the library's commit rule: a layer counts as finished when its `.json` entry exists,
so the calibration stream that continues from it and its tensors go up first and the entry last. A
worker killed between two uploads therefore leaves the store at an older, consistent point. The
layer files keep their names, so `layer-XXX.safetensors` sits at `layout.checkpoint_name(XXX)`.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

from service.store import ObjectStore
from service.store.layout import CHECKPOINTS

log = logging.getLogger(__name__)

FOLDER = CHECKPOINTS
_LAYER_FILE = re.compile(r"^layer-(\d{3,})\.(json|safetensors)$")
_STREAM_FILE = re.compile(r"^stream-\d{3,}\.safetensors$")


def _upload_rank(name: str) -> tuple[int, str] | None:
    """Where a work-folder file goes in the upload order; None for files that are not synced.

    The untouched weights (`extra-*`) are written only after the last layer and are cheap to read
    again from the model, so they stay local.
    """
    if name == "fingerprint.json":
        return (0, name)
    if _STREAM_FILE.match(name):
        return (1, name)
    if match := _LAYER_FILE.match(name):
        return (2 if match.group(2) == "safetensors" else 3, name)
    return None


def finished_layers(names: set[str]) -> int:
    """Leading layers whose tensors and entry are both present (the library's own rule)."""
    count = 0
    while f"layer-{count:03d}.json" in names and f"layer-{count:03d}.safetensors" in names:
        count += 1
    return count


class CheckpointSync:
    """Copies one job's work folder to and from the store."""

    def __init__(self, store: ObjectStore, job_prefix: str, folder: Path) -> None:
        self.store = store
        self.prefix = job_prefix + FOLDER
        self.folder = Path(folder)
        self._sent: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) as uploaded

    def restore(self) -> int:
        """Download every checkpoint of the job into the (fresh) folder; returns the finished layers."""
        self.folder.mkdir(parents=True, exist_ok=True)
        names = set()
        for info in self.store.list(self.prefix):
            name = info.key[len(self.prefix) :]
            if "/" in name or _upload_rank(name) is None:
                continue
            self._download(info.key, self.folder / name)
            self._remember(name)
            names.add(name)
        return finished_layers(names)

    def _download(self, key: str, target: Path) -> None:
        handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        try:
            with os.fdopen(handle, "wb") as out:
                for chunk in self.store.iter_chunks(key):
                    out.write(chunk)
            os.replace(partial, target)
        finally:
            Path(partial).unlink(missing_ok=True)

    def _remember(self, name: str) -> None:
        stat = (self.folder / name).stat()
        self._sent[name] = (stat.st_size, stat.st_mtime_ns)

    def push(self) -> list[str]:
        """Upload what changed since the last push, in commit order; drop streams the folder no longer has.

        Returns the names uploaded.
        """
        local = {path.name for path in self.folder.iterdir() if path.is_file()}
        changed = []
        for name in local:
            rank = _upload_rank(name)
            stat = (self.folder / name).stat()
            if rank is not None and self._sent.get(name) != (stat.st_size, stat.st_mtime_ns):
                changed.append((rank, name))
        for _rank, name in sorted(changed):
            self.store.put_file(self.prefix + name, self.folder / name)
            self._remember(name)
        for name in [n for n in self._sent if _STREAM_FILE.match(n) and n not in local]:
            self.store.delete(self.prefix + name)  # only after the entry that supersedes it is up
            del self._sent[name]
        return [name for _rank, name in sorted(changed)]

    def drop_streams(self) -> None:
        """Remove the calibration streams from the store: once the job succeeded nothing resumes it."""
        for info in self.store.list(self.prefix):
            if _STREAM_FILE.match(info.key[len(self.prefix) :]):
                self.store.delete(info.key)
        self._sent = {name: sent for name, sent in self._sent.items() if not _STREAM_FILE.match(name)}
