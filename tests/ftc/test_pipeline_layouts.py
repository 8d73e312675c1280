"""Every attention layout compresses and reloads; storage matches the budget and the file."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from ftc.arch import layout_of
from ftc.artifact import WEIGHTS, load_artifact, write_artifact
from ftc.methods import make_method
from ftc.pipeline import compress_model
from ftc.stored import stored_values
from tests.support.tiny import LAYOUTS, tiny_model


def _compress(layout_name: str, method: str, ratio: float, dtype=torch.float32, ablations=()):
    model = tiny_model(layout_name)
    layout = layout_of(model.config)
    calib = torch.randint(0, model.config.vocab_size, (8, 48), generator=torch.Generator().manual_seed(1))
    dense_biases = {n: p.clone() for n, p in model.named_parameters() if n.endswith("_proj.bias")}
    result = compress_model(
        model, layout, make_method(method, ratio, dtype, ablations), calib,
        device=torch.device("cpu"), batch_size=4, progress=False,
    )
    return model, layout, result, dense_biases


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("method", ["ftc", "svd_llm"])
def test_layout_compresses_and_reloads_with_the_same_logits(layout_name, method, tmp_path):
    model, layout, result, dense_biases = _compress(layout_name, method, 0.5)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
    write_artifact(tmp_path / "a", model, None, layout, result.layers, {"method": method}, torch.float32)
    reloaded, _, _ = load_artifact(tmp_path / "a")
    with torch.no_grad():
        got = reloaded(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4
    # Q/K/V/O biases stay dense and unchanged
    for name, bias in dense_biases.items():
        torch.testing.assert_close(reloaded.get_parameter(name), bias)


@pytest.mark.parametrize("method", ["ftc", "per_matrix", "svd", "asvd", "svd_llm"])
@pytest.mark.parametrize("ratio", [0.2, 0.6])
def test_stored_size_is_within_budget_and_equals_the_file(method, ratio, tmp_path):
    model, layout, result, _ = _compress("gqa", method, ratio, dtype=torch.float16)
    manifest = write_artifact(tmp_path / "a", model, None, layout, result.layers, {}, torch.float16)
    with safe_open(tmp_path / "a" / WEIGHTS, "pt") as f:
        for layer, entry in zip(result.layers, manifest["layers"], strict=True):
            qkv = 0
            for (spec, tensors), written in zip(layer.groups, entry["groups"], strict=True):
                prefix = f"{layout.layers_path}.{layer.index}.ftc.{''.join(spec['proj'])}."
                on_disk = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
                assert set(on_disk) == set(tensors)
                nbytes = sum(t.numel() * t.element_size() for t in on_disk.values())
                assert nbytes == written["bytes"]
                values = stored_values(spec, on_disk)
                # 16-bit values: bytes = 2 * values, up to the mask's final half-filled unit
                assert 0 <= 2 * values - nbytes <= 1
                if spec["proj"] == ["o"]:
                    assert values <= ratio * layout.o_params
                else:
                    qkv += values
            assert qkv <= ratio * layout.qkv_params


@pytest.mark.parametrize("ablation", ["no_whiten", "no_sequential", "no_slice_norm", "no_wo_target",
                                      "no_anchor", "fixed_ranks", "kv_repeat"])
def test_every_ablation_runs_and_reloads(ablation, tmp_path):
    model, layout, result, _ = _compress("gqa", "ftc", 0.4, ablations=(ablation,))
    write_artifact(tmp_path / "a", model, None, layout, result.layers, {}, torch.float32)
    reloaded, _, _ = load_artifact(tmp_path / "a")
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_output_error_falls_as_the_keep_ratio_rises():
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense = tiny_model("gqa")(ids).logits
    errors = []
    for ratio in (0.2, 0.5, 0.9):
        compressed, *_ = _compress("gqa", "ftc", ratio)
        with torch.no_grad():
            errors.append(((compressed(ids).logits - dense).norm() / dense.norm()).item())
    assert errors[0] > errors[1] > errors[2]
