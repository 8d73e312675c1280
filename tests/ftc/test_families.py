"""Families whose layers are not all alike (Gemma 3: sliding-window and global layers with their own
mask and rotary base) or whose attention norms sit elsewhere (OLMo 2): every method compresses them,
the artifact reproduces the in-memory compression, transformers loads it, and the dense export is a
stock checkpoint with the same outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from ftc.arch import UnsupportedModel, decoder_layers, layer_types, layout_of
from ftc.artifact import load_artifact
from ftc.export import export_dense
from ftc.methods import make_method
from ftc.options import METHODS
from ftc.pipeline import layer_inputs, propagate
from tests.support.pipeline import compress_loaded, compress_model
from tests.support.tiny import tiny_model

FAMILIES = ["gemma3", "olmo2"]
IDS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def test_gemma3_layers_get_the_kwargs_of_their_own_type():
    """Layer by layer through the captured stream ends where the model's own forward does; with
    layer 0's kwargs everywhere the global layer would see the sliding-window mask and local rope."""
    model = tiny_model("gemma3", layers=4)
    layout = layout_of(model.config)
    layers = decoder_layers(model, layout)
    assert len(set(layer_types(model.config, len(layers)))) == 2
    ends: list[torch.Tensor] = []
    hook = layers[-1].register_forward_hook(lambda _m, _a, out: ends.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        model(IDS, use_cache=False)
    hook.remove()
    stream = layer_inputs(model, layout, IDS, 1, torch.device("cpu"))
    assert len(stream.hidden) == 2 and len(stream.typed) == 2 and set(stream.typed[0]) == set(layer_types(
        model.config, 4))
    for index, layer in enumerate(layers):
        propagate(layer, stream.at(index))
    assert _rel(torch.cat(stream.hidden), ends[0]) < 1e-5
    # the types really differ, so reusing layer 0's kwargs could not pass the check above
    sliding, full = stream.typed[0]["sliding_attention"], stream.typed[0]["full_attention"]
    assert not torch.equal(sliding["position_embeddings"][0], full["position_embeddings"][0])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_compresses_and_reloads_with_the_in_memory_logits(family, method, tmp_path,
                                                                         smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    calib_file = tmp_path / "calib.txt"
    calib_file.write_text(" ".join(f"word{i % 37} and text {i}." for i in range(400)))
    model = tiny_model(family, vocab_size=len(tokenizer), layers=3)
    reloaded, manifest, calib = compress_loaded(model, tokenizer, tmp_path / "a", method=method, ratio=0.5,
                                                calib=str(calib_file), calib_samples=4, seq_len=32, batch_size=2,
                                                dtype="float32")
    assert manifest["base_model"]["model_type"] == model.config.model_type
    expected = copy.deepcopy(model)
    compress_model(expected, layout_of(model.config), make_method(method, 0.5, torch.float32, ()), calib,
                   device=torch.device("cpu"), batch_size=2)
    assert _rel(_logits(reloaded), _logits(expected)) < 1e-4
    assert _rel(_logits(reloaded), _logits(model)) > 1e-4  # compressed for real


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_the_artifact_and_the_dense_export_is_stock(family, tiny_artifact, tmp_path):
    folder = tiny_artifact(family)
    reference, _, _ = load_artifact(folder)
    remote = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(remote).__module__.startswith("transformers_modules.")
    assert _rel(_logits(remote), _logits(reference)) < 1e-4
    export_dense(folder, tmp_path / "dense", dtype="float32")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    assert type(stock).__module__.startswith("transformers.models.")
    assert stock.config.model_type == reference.config.model_type.removeprefix("ftc_")
    assert _rel(_logits(stock), _logits(reference)) < 1e-4


def test_an_unsupported_family_names_the_supported_ones():
    config = copy.deepcopy(tiny_model("gqa").config)
    config.model_type = "bloom"
    with pytest.raises(UnsupportedModel, match=r"gemma3_text.*olmo2"):
        layout_of(config)


def test_the_dry_run_shows_the_family_its_layer_types_and_projections(tiny_folder):
    from ftc.compress import CompressOptions, plan

    shown = plan(CompressOptions(model=str(tiny_folder("gemma3", layers=4)), ratio=0.3, device="cpu"))
    assert shown["model_type"] == "gemma3_text" and shown["layers"] == 4
    assert shown["layer_types"] == {"sliding_attention": 2, "full_attention": 2}
    assert shown["projections"]["q"] == "self_attn.q_proj" and shown["heads"] == 2 and shown["kv_heads"] == 1
