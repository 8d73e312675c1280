"""The object store as a local folder: the embedded default, and what a single machine needs."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import unquote, urlparse

from service.store.base import ObjectInfo, ObjectMissing, ObjectStore, StoreUnavailable
from service.store.layout import check_key


class LocalStore(ObjectStore):
    """Keys are paths below `root`; each write goes to a hidden temporary file, then is renamed in place."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write_atomically(self, key: str, fill) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as out:
                fill(out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def put_bytes(self, key: str, data: bytes, content_type: str | None = None) -> None:
        self._write_atomically(key, lambda out: out.write(data))

    def put_file(self, key: str, path: Path, content_type: str | None = None) -> None:
        def copy(out) -> None:
            with open(path, "rb") as source:
                shutil.copyfileobj(source, out, 1 << 20)

        self._write_atomically(key, copy)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectMissing(key) from None

    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        try:
            source = open(self._path(key), "rb")  # closed by _chunks when the stream ends
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectMissing(key) from None
        return _chunks(source, chunk_size)

    def list(self, prefix: str) -> list[ObjectInfo]:
        # Walk only the folder the prefix names; the remaining part of it filters file names.
        folder = (self.root / prefix.rsplit("/", 1)[0]).resolve() if "/" in prefix else self.root
        if not folder.is_relative_to(self.root):
            raise ValueError(f"invalid prefix {prefix!r}: it leaves the store")
        found = []
        for directory, _subfolders, files in os.walk(folder):
            for name in files:
                path = Path(directory, name)
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix) and not any(part.startswith(".") for part in key.split("/")):
                    stat = path.stat()
                    modified = datetime.fromtimestamp(stat.st_mtime, tz=timezone.utc)
                    found.append(ObjectInfo(key=key, size=stat.st_size, modified=modified))
        return sorted(found, key=lambda info: info.key)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def presigned_url(self, key: str, expires_seconds: int) -> str | None:
        return None

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()

    def key_for_uri(self, uri: str) -> str | None:
        parsed = urlparse(uri)
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            return None
        path = Path(unquote(parsed.path))
        try:
            key = path.relative_to(self.root).as_posix()
            return check_key(key)
        except ValueError:
            return None

    def check(self) -> None:
        if not (self.root.is_dir() and os.access(self.root, os.W_OK)):
            raise StoreUnavailable(f"object store folder {self.root} is missing or not writable")


def _chunks(source, chunk_size: int) -> Iterator[bytes]:
    with source:
        while chunk := source.read(chunk_size):
            yield chunk
