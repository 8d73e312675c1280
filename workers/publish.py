"""Putting a finished job's results into the object store: artifact files, metrics, manifest last.

The uploaded `manifest.json` is the library's manifest plus a `files` table (size and sha256 of
every other file), written by `ObjectStore.finalise` only once all of them are in place, so the
job folder is a complete artifact exactly when its manifest exists. Downloading the folder (without
`checkpoints/` and `dense/`) gives what `ftc.runtime.artifact.load_artifact` and transformers (with
`trust_remote_code=True`) read; `dense/`, when the job asked for it, is a stock checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftc.runtime.artifact import MANIFEST
from service.artifacts import media_type
from service.store import ObjectStore
from service.store.layout import DENSE, METRICS


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def upload_artifact(store: ObjectStore, job_prefix: str, folder: Path) -> dict[str, dict[str, Any]]:
    """Upload every file of the artifact folder but its manifest; returns `{name: {size, sha256}}`."""
    files = {}
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file() and p.name != MANIFEST):
        store.put_file(job_prefix + path.name, path, media_type(path.name))
        files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return files


def upload_outputs(store: ObjectStore, job_prefix: str, folder: Path, outputs: list[str]) -> dict[str, dict[str, Any]]:
    """Upload the artifact and, if `outputs` asks for it, its dense export under `dense/`.

    The export is written next to the artifact folder (streamed, one layer in memory) and
    removed once uploaded; its files join the manifest's table as `dense/<name>`.
    """
    files = upload_artifact(store, job_prefix, folder)
    if "dense" in outputs:
        from ftc.runtime.export import export_dense

        dense = Path(folder).parent / "dense"
        try:
            export_dense(folder, dense, overwrite=True)
            uploaded = upload_artifact(store, job_prefix + DENSE, dense)
            files.update({DENSE + name: info for name, info in uploaded.items()})
        finally:
            shutil.rmtree(dense, ignore_errors=True)
    return files


def finalise(
    store: ObjectStore,
    job_prefix: str,
    manifest: Mapping[str, Any],
    files: Mapping[str, Mapping[str, Any]],
    metrics: Mapping[str, Any],
) -> dict[str, Any]:
    """Upload `metrics.json`, then the manifest naming every file; returns the manifest as stored."""
    body = json.dumps(metrics, indent=2).encode()
    store.put_bytes(job_prefix + METRICS, body, "application/json")
    listed = {**files, METRICS: {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}}
    stored = {**manifest, "files": listed}
    store.finalise(job_prefix, stored)
    return stored
