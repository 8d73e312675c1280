"""What a job request names, made concrete on the worker: a model the library can open, local
dataset files, and the `CompressOptions` the CLI would have built.

Everything here is decided before any heavy work starts, so a job that names something the worker
cannot provide fails at once with a message that says what to change.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from ftc.compression.compress import CompressOptions
from ftc.models.hub import parse_hub_id
from ftc.options import MODEL_ALIASES, InputError
from service.schemas import UPLOAD_SCHEME, JobRequest, is_upload_uri
from service.store import ObjectMissing, ObjectStore
from service.uploads import upload_key_for


def model_spec(name: str, revision: str | None, models_dir: str | None) -> str:
    """The `--model` value for a job's model: an alias as is, a hub id from `models_dir` or the hub.

    A deployment may mount models it offers under one folder: `org/name` (or `org/name@revision`)
    is first looked up there, as a Hugging Face folder or a `.gguf` file. Any other hub id is left
    to `ftc.models.registry.resolve_model`, which reads the shared Hugging Face cache (`HF_HOME`) and
    downloads into it unless `HF_HUB_OFFLINE` is set.
    """
    if name in MODEL_ALIASES:
        if revision:
            raise InputError(f"model {name!r} is a built-in alias and has no revisions; drop 'revision'")
        return name
    entry = f"{name}@{revision}" if revision else name
    if parse_hub_id(entry) is None:
        raise InputError(
            f"model {entry!r}: use one of {', '.join(MODEL_ALIASES)} or a hub id such as org/name "
            "(with 'revision' for a branch, tag or commit), not a path"
        )
    if models_dir:
        root = Path(models_dir)
        for candidate in (root / entry, root / f"{entry}.gguf"):
            if candidate.is_dir() or (candidate.is_file() and candidate.suffix == ".gguf"):
                return str(candidate)
    return entry


def local_dataset(store: ObjectStore, name: str, cache_dir: Path, team: str) -> str:
    """A dataset name the library reads: built-in names as they are, `team`'s uploads downloaded once.

    An upload is cached under a name derived from its URI (uploads never change; an `upload://`
    name is the team's own, so the team is part of it), keeping its suffix so the library knows how
    to read it. The path is the same on every attempt, which keeps the resumable run's fingerprint
    (it includes the calibration source) stable across workers.
    """
    if not is_upload_uri(name):
        return name
    key = upload_key_for(store, team, name)
    if key is None:
        raise InputError(f"dataset {name} is not one of this team's uploads in this deployment's object store")
    source = key if name.startswith(UPLOAD_SCHEME) else name
    target = cache_dir / hashlib.sha256(source.encode()).hexdigest()[:24] / key.rsplit("/", 1)[-1]
    if target.is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=".download-")
    try:
        with os.fdopen(handle, "wb") as out:
            for chunk in store.iter_chunks(key):
                out.write(chunk)
        os.replace(partial, target)
    except ObjectMissing:
        raise InputError(f"dataset {name} is no longer in the object store; upload it again") from None
    finally:
        Path(partial).unlink(missing_ok=True)
    return str(target)


def compress_options(request: JobRequest, model: str, calibration: str, device: str) -> CompressOptions:
    """The options `ftc compress` would get for this request (library defaults for the rest)."""
    if request.ratio is None:
        raise InputError("a job runs one keep ratio; this request has none (was it stored unsplit?)")
    return CompressOptions(
        model=model,
        method=request.method,
        ratio=request.ratio,
        calib=calibration,
        calib_samples=request.calibration.samples,
        seq_len=request.calibration.seq_len,
        seed=request.calibration.seed,
        device=device,
        ablate=tuple(request.ablate),
        allocation=request.allocation,
        scope=request.scope,
        dtype=request.dtype,
    ).validate()
