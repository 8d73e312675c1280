"""benchmarks/projection_sensitivity.py: FTC's parts are exactly what its compressed model computes,
and both committed tables render from their JSON as committed."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.benchmarks import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def sensitivity():
    return load_benchmark("projection_sensitivity")


@pytest.mark.parametrize("name", ["projection_sensitivity", "projection_sensitivity_ftc"])
def test_the_committed_tables_render_from_their_json_as_committed(sensitivity, name) -> None:
    results = json.loads((BENCHMARKS / "results" / f"{name}.json").read_text())
    assert sensitivity.render(results) == (BENCHMARKS / "results" / f"{name}.md").read_text()


def test_ftc_parts_put_back_together_compute_what_the_artifact_computes(sensitivity, tiny_folder, tmp_path) -> None:
    from ftc.compression.compress import CompressOptions, compress
    from ftc.models.arch import decoder_layers, get_module, layout_of
    from ftc.models.registry import resolve_model
    from ftc.runtime.artifact import load_artifact
    from ftc.runtime.loading import load_model

    folder = tiny_folder("gqa")
    source = resolve_model(str(folder))
    model, tokenizer = load_model(source)
    options = CompressOptions(model=str(folder), ratio=0.4, calib_samples=4, seq_len=64, dtype="float32",
                              device="cpu", batch_size=4, allocation="uniform")
    parts = sensitivity.ftc_weights((model, tokenizer, source), options)
    compress(options, tmp_path / "artifact", progress=False)  # the same compression, kept as an artifact
    layout = layout_of(model.config)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        for index, layer in enumerate(decoder_layers(model, layout)):
            for p in "qkvo":
                get_module(layer, getattr(layout, p)).weight.copy_(parts[index, p])
        rebuilt = model(input_ids=ids).logits
        compressed, _, _ = load_artifact(tmp_path / "artifact")
        expected = compressed(input_ids=ids).logits
    assert not torch.allclose(rebuilt, dense, atol=1e-3)  # the parts are compressed, not the originals
    torch.testing.assert_close(rebuilt, expected, atol=1e-4, rtol=1e-4)
