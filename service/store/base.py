"""The object store interface: where job artifacts, checkpoints and uploaded calibration files live.

Two backends implement it (a local folder and S3). Both write each object atomically, so a reader
never sees half a file, and `finalise` writes a job's manifest last: a job's artifacts are complete
exactly when its manifest exists.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from service.errors import StoreUnavailable
from service.store.layout import MANIFEST, check_key

__all__ = ["StoreUnavailable"]  # defined with the other service errors, so the retry policy can name it


class ObjectMissing(KeyError):
    """No object under that key."""


class IncompleteArtifacts(Exception):
    """finalise found files named by the manifest missing or of the wrong size."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: datetime


class ObjectStore(ABC):
    """Objects under `/`-separated keys such as `{team}/jobs/{job_id}/manifest.json`."""

    url: str
    """Where this store lives: a folder path or s3://bucket/prefix."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes, content_type: str | None = None) -> None: ...

    @abstractmethod
    def put_file(self, key: str, path: Path, content_type: str | None = None) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The whole object; raises ObjectMissing."""

    @abstractmethod
    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        """The object in pieces, for streaming large artifacts; raises ObjectMissing before the first."""

    @abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, sorted by key."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; removing a missing one is not an error."""

    @abstractmethod
    def presigned_url(self, key: str, expires_seconds: int) -> str | None:
        """A URL anyone can download the object from until it expires; None when the backend has none
        (the API then streams the object itself)."""

    @abstractmethod
    def uri(self, key: str) -> str:
        """The object's URI as jobs refer to it (file:///... or s3://bucket/...)."""

    @abstractmethod
    def key_for_uri(self, uri: str) -> str | None:
        """The key of an object URI of this store, or None when the URI points elsewhere."""

    @abstractmethod
    def check(self) -> None:
        """Raise StoreUnavailable unless the store answers now (one try: this is for /readyz)."""

    def finalise(self, prefix: str, manifest: Mapping[str, Any]) -> None:
        """Publish a finished set of artifacts by writing `{prefix}manifest.json` last.

        `manifest["files"]` maps each artifact name to at least its `size`; every one must already
        be in the store with that size, so that a manifest never promises a file that is not there.
        """
        check_key(prefix + MANIFEST)
        present = {info.key[len(prefix) :]: info.size for info in self.list(prefix)}
        files: Mapping[str, Mapping[str, Any]] = manifest.get("files", {})
        wrong = [name for name, meta in files.items() if present.get(name) != int(meta.get("size", -1))]
        if wrong:
            raise IncompleteArtifacts(
                f"cannot finalise {prefix}: missing or wrong size: {', '.join(sorted(wrong))}; "
                "upload them before the manifest"
            )
        self.put_bytes(prefix + MANIFEST, json.dumps(manifest, indent=2).encode(), "application/json")
