"""What a job left in the object store, with a download link for each file.

The listing separates a job's outputs from its checkpoints: a 30-layer job leaves a few model
files and dozens of per-layer checkpoints (kept to resume an interrupted attempt), and only the
outputs are what a person downloads. Checkpoints are listed on request and always counted.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterator

from service.schemas import Artifact, ArtifactKind, ArtifactList, CheckpointSummary
from service.store import ObjectInfo, ObjectStore
from service.store.layout import CHECKPOINTS, DENSE, LOG, MANIFEST, METRICS, job_prefix

_MEDIA_TYPES = {
    ".json": "application/json",
    ".txt": "text/plain; charset=utf-8",
    ".jsonl": "application/x-ndjson",
}

KIND_ORDER: tuple[ArtifactKind, ...] = ("model", "dense", "record", "checkpoint")
"""The order of the listing: what loads first, what resumes last."""


def artifact_kind(name: str) -> ArtifactKind:
    """What a file of a job's folder is: part of the compressed model (the folder that loads), of
    its dense export, the job's own record (metrics, log), or a checkpoint to resume from."""
    if name.startswith(CHECKPOINTS):
        return "checkpoint"
    if name.startswith(DENSE):
        return "dense"
    if name in (METRICS, LOG):
        return "record"
    return "model"


def list_artifacts(
    store: ObjectStore,
    team: str,
    job_id: str,
    stream_url: Callable[[str], str],
    presign_seconds: int,
    include_checkpoints: bool = False,
) -> ArtifactList:
    """The job's files, outputs first; checkpoints only counted unless `include_checkpoints`.

    Links are presigned where the store can, else `stream_url(name)`."""
    prefix = job_prefix(team, job_id)
    artifacts, checkpoints = [], CheckpointSummary(files=0, bytes=0)
    for info in store.list(prefix):
        name = info.key[len(prefix) :]
        kind = artifact_kind(name)
        if kind == "checkpoint":
            checkpoints = CheckpointSummary(files=checkpoints.files + 1, bytes=checkpoints.bytes + info.size)
            if not include_checkpoints:
                continue
        url = store.presigned_url(info.key, presign_seconds) or stream_url(name)
        artifacts.append(Artifact(name=name, kind=kind, size=info.size, modified=info.modified, url=url))
    artifacts.sort(key=lambda a: (KIND_ORDER.index(a.kind), a.name))
    complete = any(a.name == MANIFEST for a in artifacts)
    return ArtifactList(job_id=job_id, complete=complete, artifacts=artifacts, checkpoints=checkpoints)


def media_type(name: str) -> str:
    suffix = name[name.rfind(".") :] if "." in name else ""
    return _MEDIA_TYPES.get(suffix, "application/octet-stream")


TAR_BLOCK = 512


def model_files(store: ObjectStore, team: str, job_id: str, with_dense: bool = False) -> list[ObjectInfo]:
    """The files of a job's model folder (with its metrics and log, and on request its dense export)."""
    prefix = job_prefix(team, job_id)
    kinds = {"model", "record"} | ({"dense"} if with_dense else set())
    return [info for info in store.list(prefix) if artifact_kind(info.key[len(prefix):]) in kinds]


def tar_stream(store: ObjectStore, prefix: str, files: list[ObjectInfo], folder: str) -> Iterator[bytes]:
    """A tar of `files` under `folder/`, streamed from the store a chunk at a time (nothing is held
    whole in memory, so a many-GB model streams as a small one does)."""
    for info in files:
        entry = tarfile.TarInfo(f"{folder}/{info.key[len(prefix):]}")
        entry.size, entry.mtime, entry.mode = info.size, int(info.modified.timestamp()), 0o644
        yield entry.tobuf(tarfile.PAX_FORMAT)
        sent = 0
        for chunk in store.iter_chunks(info.key):
            sent += len(chunk)
            yield chunk
        if sent != info.size:  # the listing and the object disagree: a truncated tar beats a wrong one
            raise OSError(f"{info.key} changed while it was being sent ({sent} bytes, listed {info.size})")
        yield b"\0" * (-sent % TAR_BLOCK)
    yield b"\0" * (2 * TAR_BLOCK)
