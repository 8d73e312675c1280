"""What a job left in the object store, with a download link for each file."""

from __future__ import annotations

from collections.abc import Callable

from service.schemas import Artifact, ArtifactList
from service.store import ObjectStore
from service.store.layout import MANIFEST, job_prefix

_MEDIA_TYPES = {
    ".json": "application/json",
    ".txt": "text/plain; charset=utf-8",
    ".jsonl": "application/x-ndjson",
}


def list_artifacts(
    store: ObjectStore, team: str, job_id: str, stream_url: Callable[[str], str], presign_seconds: int
) -> ArtifactList:
    """Every file under the job's folder; links are presigned where the store can, else `stream_url(name)`."""
    prefix = job_prefix(team, job_id)
    artifacts = []
    for info in store.list(prefix):
        name = info.key[len(prefix) :]
        url = store.presigned_url(info.key, presign_seconds) or stream_url(name)
        artifacts.append(Artifact(name=name, size=info.size, modified=info.modified, url=url))
    complete = any(a.name == MANIFEST for a in artifacts)
    return ArtifactList(job_id=job_id, complete=complete, artifacts=artifacts)


def media_type(name: str) -> str:
    suffix = name[name.rfind(".") :] if "." in name else ""
    return _MEDIA_TYPES.get(suffix, "application/octet-stream")
