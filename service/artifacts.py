"""What a job left in the object store, with a download link for each file.

The listing separates a job's outputs from its checkpoints: a 30-layer job leaves a few model
files and dozens of per-layer checkpoints (kept to resume an interrupted attempt), and only the
outputs are what a person downloads. Checkpoints are listed on request and always counted.
"""

from __future__ import annotations

from collections.abc import Callable

from service.schemas import Artifact, ArtifactKind, ArtifactList, CheckpointSummary
from service.store import ObjectStore
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
