"""Every attention layout compresses through `compress()` and reloads; storage matches the budget
and the file."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open

from ftc.compression.methods import Method, make_method
from ftc.evaluation.data import load_text
from ftc.models.arch import layout_of
from ftc.options import ABLATIONS, MLP_ABLATIONS
from ftc.runtime.artifact import WEIGHTS
from ftc.runtime.stored import stored_values
from tests.support.pipeline import compress_loaded, compress_model, method_of
from tests.support.tiny import LAYOUTS, tiny_model

BATCH = 4


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, smollm2_tokenizer):
    """`(tokenizer, calibration options)`: a few KB of WikiText-2 validation text in a file, so
    each run tokenises what it needs rather than the whole split."""
    path = tmp_path_factory.mktemp("calib") / "wikitext2-head.txt"
    path.write_text(load_text("wikitext2", "validation")[:20_000])
    return smollm2_tokenizer, dict(calib=str(path), calib_samples=8, seq_len=48, batch_size=BATCH)


def _scope(ablations) -> str:
    """The scope an ablation applies to: the MLP's ablations need the whole model's."""
    return "model" if set(ablations) & set(MLP_ABLATIONS) else "attention"


def _compress(tiny_run, out, layout_name: str, method: str, ratio: float, dtype: str = "float32", ablations=()):
    """The artifact `compress()` writes for a tiny model, reloaded, and the dense model it came from."""
    tokenizer, calibration = tiny_run
    model = tiny_model(layout_name, vocab_size=len(tokenizer))
    reloaded, manifest, calib = compress_loaded(model, tokenizer, out, method=method, ratio=ratio, dtype=dtype,
                                                ablate=tuple(ablations), scope=_scope(ablations), **calibration)
    return model, reloaded, manifest, calib


def _in_memory(model, method: Method, calib: torch.Tensor):
    """The same compression with every layer resident: what the artifact must reproduce."""
    model = copy.deepcopy(model)
    compress_model(model, layout_of(model.config), method, calib, device=torch.device("cpu"), batch_size=BATCH)
    return model


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("method", ["ftc", "svd_llm"])
def test_layout_compresses_and_reloads_with_the_same_logits(layout_name, method, tmp_path, tiny_run):
    model, reloaded, manifest, calib = _compress(tiny_run, tmp_path / "a", layout_name, method, 0.5)
    dense_biases = {n: p.clone() for n, p in model.named_parameters() if n.endswith("_proj.bias")}
    expected_model = _in_memory(model, method_of(manifest), calib)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = expected_model(ids).logits
        got = reloaded(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4
    # Q/K/V/O biases stay dense and unchanged
    for name, bias in dense_biases.items():
        torch.testing.assert_close(reloaded.get_parameter(name), bias)


@pytest.mark.parametrize("layout_name", ["gqa", "phi3"])
def test_asvd_rank_search_reloads_with_the_in_memory_logits(layout_name, tmp_path, tiny_run):
    """ASVD plans on the whole model (ftc.compression.sensitivity); one plain and one fused Q/K/V layout."""
    model, reloaded, manifest, calib = _compress(tiny_run, tmp_path / "a", layout_name, "asvd", 0.4)
    expected_model = _in_memory(model, make_method("asvd", 0.4, torch.float32), calib)  # its own search
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = expected_model(ids).logits, reloaded(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4
    assert len({str(b) for b in manifest["allocation"]["layer_budgets"]}) > 1


@pytest.mark.parametrize("method", ["ftc", "per_matrix", "svd", "asvd", "svd_llm"])
@pytest.mark.parametrize("ratio", [0.2, 0.6])
def test_stored_size_is_within_budget_and_equals_the_file(method, ratio, tmp_path, tiny_run):
    model, _, manifest, _ = _compress(tiny_run, tmp_path / "a", "gqa", method, ratio, dtype="float16")
    layout = layout_of(model.config)
    assert len(manifest["layers"]) == model.config.num_hidden_layers
    model_wide = manifest["allocation"]["layer_budgets"] is not None  # asvd, sensitivity: budgets per layer
    total = 0
    with safe_open(tmp_path / "a" / WEIGHTS, "pt") as f:
        for entry in manifest["layers"]:
            qkv = 0
            for written in entry["groups"]:
                prefix = f"{layout.layers_path}.{entry['index']}.ftc.{''.join(written['proj'])}."
                on_disk = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
                assert {k: list(t.shape) for k, t in on_disk.items()} == written["shapes"]
                nbytes = sum(t.numel() * t.element_size() for t in on_disk.values())
                assert nbytes == written["bytes"]
                values = stored_values(written, on_disk)
                assert values == written["values"]
                # 16-bit values: bytes = 2 * values, up to the mask's final half-filled unit
                assert 0 <= 2 * values - nbytes <= 1
                total += values
                if written["proj"] == ["o"]:
                    assert model_wide or values <= ratio * layout.o_params
                else:
                    qkv += values
            assert model_wide or qkv <= ratio * layout.qkv_params
    assert total <= ratio * len(manifest["layers"]) * (layout.qkv_params + layout.o_params)


@pytest.mark.parametrize("ablation", ABLATIONS)
def test_every_ablation_runs_and_reloads(ablation, tmp_path, tiny_run):
    model, reloaded, manifest, calib = _compress(tiny_run, tmp_path / "a", "gqa", "ftc", 0.4, ablations=(ablation,))
    expected_model = _in_memory(model, method_of(manifest), calib)
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected_model(ids).logits, rtol=1e-4, atol=1e-5)


def test_output_error_falls_as_the_keep_ratio_rises(tmp_path, tiny_run):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense = tiny_model("gqa", vocab_size=len(tiny_run[0]))(ids).logits
    errors = []
    for ratio in (0.2, 0.5, 0.9):
        _, compressed, _, _ = _compress(tiny_run, tmp_path / f"r{ratio}", "gqa", "ftc", ratio)
        with torch.no_grad():
            errors.append(((compressed(ids).logits - dense).norm() / dense.norm()).item())
    assert errors[0] > errors[1] > errors[2]
