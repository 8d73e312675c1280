"""Saving what the service made: `ftc jobs download` (a job's model folder, ready to load) and
`ftc sweep download` (a run's tables and plots, and optionally every cell's model).

Files are written into a hidden folder beside the target and renamed onto it once all of them are
in and agree with the manifest's sizes and sha256, so an interrupted or corrupted download leaves
nothing half-written. A progress bar on stderr counts the bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from cli.client import ApiClient
from cli.common import UsageError

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Remote:
    """One file to fetch: where it goes under the target folder, its size, and its link."""

    name: str
    size: int
    url: str


def human_bytes(size: float) -> str:
    """1536 -> '1.5 KiB': small files stay readable (not '0.00 MiB')."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _safe_name(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or not path.parts or any(part in ("", ".", "..") for part in path.parts):
        raise UsageError(f"the API listed a file named {name!r}, which cannot be saved safely; nothing was written")
    return path


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet or None, file=sys.stderr,
                leave=False)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_against_manifest(folder: Path) -> None:
    """Every downloaded file the manifest's `files` table names must have its size and sha256."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return
    listed: dict[str, Any] = json.loads(manifest.read_text()).get("files", {})
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            continue  # not asked for (dense/ without --include dense)
        size = path.stat().st_size
        if "size" in expected and size != expected["size"]:
            raise UsageError(f"{name} arrived with {size} bytes, the manifest says {expected['size']}; "
                             "nothing was written, download again")
        if "sha256" in expected and _sha256(path) != expected["sha256"]:
            raise UsageError(f"{name} does not match the manifest's sha256; nothing was written, download again")


def prepare_target(to: Path, overwrite: bool, flag: str = "--to") -> Path:
    """Fail before any transfer when the target cannot be written."""
    target = to.resolve()
    if target.exists() and not target.is_dir():
        raise UsageError(f"{flag} {to} is a file; give a folder path")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise UsageError(f"{flag} {to} exists and is not empty; pass --overwrite or pick a new folder")
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {to}: {parent} is not writable; choose another folder")
    return target


def save_folder(client: ApiClient, files: Iterable[Remote], to: Path, *, overwrite: bool, quiet: bool) -> int:
    """Download `files` into the folder `to` (atomically); returns the bytes written."""
    files = list(files)
    target = prepare_target(to, overwrite)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    written = 0
    try:
        with _progress(sum(f.size for f in files), quiet) as bar:
            for remote in files:
                path = partial / _safe_name(remote.name)
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as sink:
                    written += client.stream_to(remote.url, sink, bar.update)
        check_against_manifest(partial)
        if target.exists():
            previous = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(target, previous)
            os.replace(partial, target)
            shutil.rmtree(previous, ignore_errors=True)
        else:
            os.replace(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return written


def save_file(client: ApiClient, remote: Remote, out: Path, *, quiet: bool) -> int:
    """Download one file to `out` (written beside it, then renamed); returns its size."""
    out = out.resolve()
    if out.is_dir():
        out = out / PurePosixPath(remote.name).name
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.partial-")
    try:
        with os.fdopen(handle, "wb") as sink, _progress(remote.size, quiet) as bar:
            written = client.stream_to(remote.url, sink, bar.update)
        os.replace(partial, out)
    finally:
        Path(partial).unlink(missing_ok=True)
    return written
