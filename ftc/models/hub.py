"""Model names as users write them, and hub ids made local through `huggingface_hub`.

A model name is one of three things:

- an alias built into the library (`smollm2-135m`);
- a Hugging Face hub id, `org/name`, optionally pinned as `org/name@revision` (a branch, a tag or a
  commit sha);
- a local path: a Hugging Face folder, a `.gguf` file or a compressed artifact.

`model_kind` tells them apart from the string alone, without torch and without touching the file
system, so the job API can refuse a name at submit time. `snapshot` makes a hub id local the way the
hub's own clients do (`snapshot_download`), so the usual environment applies: `HF_HOME` /
`HF_HUB_CACHE` say where the cache is, `HF_HUB_OFFLINE=1` reads only that cache, `HF_TOKEN` opens
private and gated repositories, `HF_ENDPOINT` names a mirror. Without offline mode a model missing
from the cache is downloaded; an unreachable hub falls back to the cache.

Nothing heavy is imported at module level: the API imports this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ftc.options import MODEL_ALIASES, InputError

ModelKind = Literal["alias", "hub", "path"]

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
"""One part of a repository id, as the hub accepts it: letters, digits, `-`, `_`, `.`, at most 96
characters, not starting or ending with `-` or `.` (`--` and `..` are refused separately)."""
_HUB_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]{{0,199}}))?$")

WEIGHT_PATTERNS: tuple[str, ...] = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt")
"""What a snapshot downloads: config, safetensors weights and tokenizer files. PyTorch `.bin`
pickles, ONNX, GGUF and other copies of the weights are left on the hub."""


class ModelError(InputError):
    """A model name that cannot be opened; the message says what to change."""


@dataclass(frozen=True)
class HubId:
    """`org/name`, and the revision (branch, tag or commit sha) when one is pinned."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def parse_hub_id(spec: str) -> HubId | None:
    """`org/name[@revision]` as a `HubId`, or None when `spec` is not written like a hub id."""
    match = _HUB_ID.match(spec)
    if match is None:
        return None
    repo, revision = match.group("repo"), match.group("revision")
    if "--" in repo or ".." in repo or repo.endswith(".git") or (revision and ".." in revision):
        return None
    return HubId(repo, revision)


def model_kind(spec: str) -> ModelKind:
    """Whether `spec` names a built-in alias, a hub id or (anything else) a local path.

    Decided from the string alone. A relative path written like a hub id (`org/name`) is reported
    as a hub id; where the file system is at hand, `ftc.models.registry.resolve_model` prefers an existing
    local path of that name.
    """
    if spec in MODEL_ALIASES:
        return "alias"
    if parse_hub_id(spec) is not None:
        return "hub"
    return "path"


def snapshot(hub: HubId) -> Path:
    """The local snapshot folder of `hub` (config, safetensors, tokenizer), downloaded if needed.

    Every failure becomes one `ModelError` line naming the model and what to do.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(hub.repo_id, revision=hub.revision, allow_patterns=list(WEIGHT_PATTERNS)))
    except GatedRepoError:
        raise ModelError(
            f"model {hub} is gated on the hub: accept its terms there and set HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"model {hub.repo_id} is not on the hub; check the name (org/name), or set HF_TOKEN if it is private"
        ) from None
    except RevisionNotFoundError:
        raise ModelError(
            f"model {hub.repo_id} has no revision {hub.revision!r}; use one of its branches, tags or commit shas"
        ) from None
    except LocalEntryNotFoundError:
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.HF_HUB_OFFLINE
            else f"the hub ({constants.ENDPOINT}) could not be reached"
        )
        raise ModelError(
            f"model {hub} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}; "
            f"download it into that cache where the hub is reachable (`hf download {hub.repo_id}"
            f"{f' --revision {hub.revision}' if hub.revision else ''}`), or point HF_HOME at a cache that has it"
        ) from None
    except HfHubHTTPError as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelError(f"could not fetch model {hub} from the hub: {first}") from None


def commit_of(folder: Path) -> str | None:
    """The commit sha of a snapshot folder of the hub cache (`.../snapshots/<sha>`), else None."""
    if folder.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", folder.name):
        return folder.name
    return None
