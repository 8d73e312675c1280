"""`--method cp` end to end: stored within budget, the file holds exactly the group, and the
artifact computes what the compressor held in memory, through the loader, transformers and the
dense export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from ftc.compression.compress import CompressOptions, calibration_batch, compress
from ftc.compression.methods import make_method
from ftc.compression.pipeline import compress_layers, layer_inputs
from ftc.models.arch import layout_of
from ftc.runtime.artifact import WEIGHTS, load_artifact
from ftc.runtime.export import export_dense
from ftc.runtime.stored import stored_values

RATIO = 0.4
IDS = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(5))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def cp_run(tiny_folder, tmp_path_factory):
    """`(folder, artifact, manifest, in-memory compressed model)` for a tiny GQA model."""
    folder = tiny_folder("gqa")
    options = CompressOptions(model=str(folder), method="cp", ratio=RATIO, calib_samples=4, seq_len=64,
                              dtype="float32", device="cpu", batch_size=4)
    artifact = tmp_path_factory.mktemp("cp") / "artifact"
    manifest = compress(options, artifact, progress=False)
    # the reference: the same method and calibration on a model held whole in memory
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    layout = layout_of(model.config)
    calib = calibration_batch(AutoTokenizer.from_pretrained(folder), options, layout.hidden)
    stream = layer_inputs(model, layout, calib, options.batch_size, torch.device("cpu"))
    compress_layers(model, layout, make_method("cp", RATIO, torch.float32), stream, device=torch.device("cpu"),
                    progress=False)
    return folder, artifact, manifest, model


def test_cp_layers_are_stored_within_budget_and_equal_to_the_file(cp_run):
    folder, artifact, manifest, _ = cp_run
    layout = layout_of(AutoModelForCausalLM.from_pretrained(folder).config)
    budget = RATIO * layout.qkv_params
    with safe_open(artifact / WEIGHTS, "pt") as f:
        for entry in manifest["layers"]:
            (qkv,) = [g for g in entry["groups"] if g["proj"] == ["q", "k", "v"]]
            assert qkv["kind"] == "cp"
            prefix = f"{layout.layers_path}.{entry['index']}.ftc.qkv."
            on_disk = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
            rank = entry["R"]
            assert {n: tuple(t.shape) for n, t in on_disk.items()} == {
                "A": (layout.hidden, rank), "B": (layout.head_dim, rank), "C": (layout.slices, rank)}
            values = stored_values(qkv, on_disk)
            assert values == qkv["values"] == rank * (layout.hidden + layout.head_dim + layout.slices) <= budget
            assert sum(t.numel() * t.element_size() for t in on_disk.values()) == qkv["bytes"] == 4 * values
            assert 0 < entry["error_fit"] <= entry["error_init"] and entry["sweeps"] >= 1


def test_reloaded_cp_artifact_computes_the_in_memory_logits(cp_run):
    _, artifact, _, model = cp_run
    reloaded, _, manifest = load_artifact(artifact)
    assert manifest["method"] == "cp"
    assert _rel(_logits(reloaded), _logits(model)) < 1e-5


def test_transformers_and_the_dense_export_load_a_cp_artifact(cp_run, tmp_path):
    _, artifact, _, model = cp_run
    remote = AutoModelForCausalLM.from_pretrained(artifact, trust_remote_code=True)
    assert any(type(m).__name__ == "CPGroup" for m in remote.modules())
    assert _rel(_logits(remote), _logits(model)) < 1e-5
    export_dense(artifact, tmp_path / "dense", dtype="float32")
    assert "ftc" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    assert _rel(_logits(stock), _logits(model)) < 1e-5
