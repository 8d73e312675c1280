"""Dense export: a stock checkpoint of the base architecture with the factorized model's outputs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from ftc.runtime import export
from ftc.runtime.artifact import load_artifact
from ftc.runtime.export import INDEX, export_dense

IDS = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(11))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _stock(folder):
    """Loaded with no custom code at all: a transformers class of the base family."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__module__.startswith("transformers.models.")
    return model


@pytest.mark.parametrize("layout", ["gqa", "qwen2_bias", "qwen3_qk_norm", "gemma_mqa", "gptj"])
def test_dense_export_loads_stock_with_the_factorized_logits(layout, tiny_artifact, tmp_path):
    source = tiny_artifact(layout)
    summary = export_dense(source, tmp_path / "dense", dtype="float32")
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert "ftc" not in config and "auto_map" not in config and not config["model_type"].startswith("ftc")
    assert summary["files"] == ["model.safetensors"]
    assert (tmp_path / "dense" / "tokenizer_config.json").is_file()
    factorized, _, _ = load_artifact(source)
    assert _rel(_logits(_stock(tmp_path / "dense")), _logits(factorized)) < 1e-2


def test_a_float16_export_differs_only_by_storage_rounding(tiny_artifact, tmp_path):
    source = tiny_artifact("gqa")
    export_dense(source, tmp_path / "dense", dtype="float16")
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32)
    factorized, _, _ = load_artifact(source)
    assert _rel(_logits(dense), _logits(factorized)) < 1e-2


def test_large_exports_are_sharded_with_an_index(tiny_artifact, tmp_path):
    source = tiny_artifact("mha")
    summary = export_dense(source, tmp_path / "dense", dtype="float32", max_shard_bytes=400_000)
    index = json.loads((tmp_path / "dense" / INDEX).read_text())
    assert len(summary["files"]) > 1 and set(index["weight_map"].values()) == set(summary["files"])
    assert not (tmp_path / "dense" / "model.safetensors").exists()
    factorized, _, _ = load_artifact(source)
    assert _rel(_logits(_stock(tmp_path / "dense")), _logits(factorized)) < 1e-2


def test_greedy_generation_is_identical_to_the_factorized_model(tiny_artifact, tmp_path):
    source = tiny_artifact("gqa")
    export_dense(source, tmp_path / "dense", dtype="float32")
    factorized, _, _ = load_artifact(source)
    prompt = IDS[:1, :8]
    expected = factorized.generate(prompt, max_new_tokens=16, do_sample=False)
    got = _stock(tmp_path / "dense").generate(prompt, max_new_tokens=16, do_sample=False)
    assert got.shape[1] == 24 and torch.equal(got, expected)


def test_a_failed_export_leaves_nothing_behind(tiny_artifact, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = export.dense_weights

    def fails_on_the_second_layer(group, head_dim):
        calls["n"] += 1
        if calls["n"] > 2:  # two groups per layer
            raise RuntimeError("disk full")
        return real(group, head_dim)

    monkeypatch.setattr(export, "dense_weights", fails_on_the_second_layer)
    with pytest.raises(RuntimeError, match="disk full"):
        export_dense(tiny_artifact("gqa"), tmp_path / "dense")
    assert list(tmp_path.iterdir()) == []


def test_the_export_rebuilds_one_layer_at_a_time(tiny_artifact, tmp_path, monkeypatch):
    """Streaming: each layer's groups are rebuilt once, in order, and dropped for the next."""
    seen: list[int] = []
    real = export._DenseLayers.get

    def get(self, layer, proj):
        if layer != self.index:
            seen.append(layer)
        return real(self, layer, proj)

    monkeypatch.setattr(export._DenseLayers, "get", get)
    export_dense(tiny_artifact("gqa"), tmp_path / "dense")
    assert seen == [0, 1]
