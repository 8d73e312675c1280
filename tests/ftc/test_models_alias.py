"""Built-in model aliases: each names a GGUF file inside a package, found without importing the
package; a missing one fails in one line naming the `make` target that installs it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ftc.models.hub import ModelError
from ftc.models.registry import ALIASES, Alias, alias_source, resolve_model
from ftc.options import MODEL_ALIASES

GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"


def _package(root: Path, name: str, file: str | None) -> None:
    """A package `name` under `root` whose import would fail loudly, with `file` inside it (if any)."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("raise RuntimeError('an alias must not import its package')\n")
    if file:
        (root / name / file).parent.mkdir(parents=True, exist_ok=True)
        (root / name / file).write_bytes(b"GGUF" + bytes(12))


def test_the_library_and_the_torch_free_options_name_the_same_aliases():
    assert set(ALIASES) == set(MODEL_ALIASES) == {"smollm2-135m", "gemma3-270m"}
    assert ALIASES["gemma3-270m"].installed_by == "make models"
    assert ALIASES["smollm2-135m"].installed_by == "make setup"


def test_an_alias_resolves_to_its_file_inside_the_package_without_importing_it(tmp_path, monkeypatch):
    _package(tmp_path, "ftc_test_weights", "data/model.gguf")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ALIASES, "test-model", Alias("ftc_test_weights", "data/model.gguf", "make models", "T", "o"))
    source = resolve_model("test-model")
    assert (source.kind, source.gguf_file) == ("gguf", "model.gguf")
    assert source.path == tmp_path / "ftc_test_weights" / "data"
    assert "ftc_test_weights" not in sys.modules


@pytest.mark.parametrize("installed", [False, True], ids=["no package", "package without the joined file"])
def test_a_missing_model_names_the_make_target_that_installs_it(installed, tmp_path, monkeypatch):
    package = ALIASES["gemma3-270m"].package
    if installed:  # the chunk wheels are there but `make models` has not joined them yet
        _package(tmp_path, package, None)
        spec = importlib.util.spec_from_file_location(package, tmp_path / package / "__init__.py",
                                                      submodule_search_locations=[str(tmp_path / package)])
    else:
        spec = None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == package else real(name, *a))
    with pytest.raises(ModelError) as error:
        alias_source("gemma3-270m")
    assert str(error.value) == (f"model 'gemma3-270m' needs {GEMMA_FILE} (package {package}); run `make models`")


def test_smollm2_resolves_from_the_package_make_setup_installs():
    source = resolve_model("smollm2-135m")
    assert source.kind == "gguf" and (source.path / source.gguf_file).is_file()


def _gemma_installed() -> bool:
    try:
        alias_source("gemma3-270m")
    except ModelError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _gemma_installed(), reason="Gemma-3-270M is not installed: run `make models`")
def test_gemma3_270m_loads_with_its_own_tokenizer_and_predicts_wikitext():
    import torch

    from ftc.evaluation.data import bos_prefix, load_text, tokenize
    from ftc.evaluation.evaluate import perplexity
    from ftc.runtime.loading import load_model

    model, tokenizer = load_model(resolve_model("gemma3-270m"))
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("gemma3_text", 18, 640)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert len(tokenizer) == config.vocab_size == 262144
    text = "The capital of France is Paris."
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    ids = tokenize(tokenizer, load_text("wikitext2", "test"))
    # every window starts with <bos>, as the model always saw: without it the same tokens score
    # far worse; a wrong norm offset or attention scale gives thousands
    assert bos_prefix(tokenizer) == (tokenizer.bos_token_id,)
    result = perplexity(model.to(torch.float32), ids, 512, 2, progress=False, prefix=bos_prefix(tokenizer))
    without = perplexity(model, ids, 512, 2, progress=False)
    print(f"Gemma-3-270M, 2 windows: {result['ppl']:.2f} after <bos>, {without['ppl']:.2f} without")
    assert 10 < result["ppl"] < 40 and without["ppl"] > 1.5 * result["ppl"]
