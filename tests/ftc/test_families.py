"""Families whose layers are not all alike (Gemma 3: sliding-window and global layers with their own
mask and rotary base), whose attention norms sit elsewhere (OLMo 2) or whose Q, K and V are one
fused projection (Phi-3): every method compresses them, the artifact reproduces the in-memory
compression, transformers loads it, and the dense export is a stock checkpoint with the same outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from ftc.compression.pipeline import layer_inputs, propagate
from ftc.models.arch import UnsupportedModel, decoder_layers, layer_types, layout_of, projection_weights
from ftc.options import METHODS
from ftc.runtime.artifact import load_artifact
from ftc.runtime.export import export_dense
from ftc.runtime.hf.modeling_ftc import place
from tests.support.pipeline import compress_loaded, compress_model, method_of
from tests.support.tiny import tiny_model

FAMILIES = ["gemma3", "olmo2", "phi3"]
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
    compress_model(expected, layout_of(model.config), method_of(manifest), calib,
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
    from ftc.compression.compress import CompressOptions, plan

    shown = plan(CompressOptions(model=str(tiny_folder("gemma3", layers=4)), ratio=0.3, device="cpu"))
    assert shown["model_type"] == "gemma3_text" and shown["layers"] == 4
    assert shown["layer_types"] == {"sliding_attention": 2, "full_attention": 2}
    assert shown["projections"]["q"] == "self_attn.q_proj" and shown["heads"] == 2 and shown["kv_heads"] == 1


def test_the_dry_run_names_phi3s_fused_projection(tiny_folder):
    from ftc.compression.compress import CompressOptions, plan

    shown = plan(CompressOptions(model=str(tiny_folder("phi3")), ratio=0.3, device="cpu"))
    assert shown["model_type"] == "phi3" and shown["fused_qkv"] == "self_attn.qkv_proj"
    assert {shown["projections"][p] for p in "qkv"} == {"self_attn.qkv_proj"}
    assert shown["projections"]["o"] == "self_attn.o_proj" and shown["heads"] == 4 and shown["kv_heads"] == 2


def test_phi3s_fused_rows_split_into_q_k_v_and_installed_back_compute_the_same_layer():
    """The split the methods see, put back as three modules, is Phi-3's own attention again."""
    model = tiny_model("phi3")
    layout = layout_of(model.config)
    layer = decoder_layers(model, layout)[0]
    stream = layer_inputs(model, layout, IDS, 2, torch.device("cpu"))
    (h,), (kw,) = stream.hidden, stream.kwargs
    with torch.no_grad():
        expected = layer(h, **kw)
        weights, _ = projection_weights(layer, layout)
        assert [tuple(weights[p].shape) for p in "qkv"] == [(64, 64), (32, 64), (32, 64)]
        parts = {p: torch.nn.Linear(64, weights[p].shape[0], bias=False) for p in "qkv"}
        for p, module in parts.items():
            module.weight.copy_(weights[p])
        place(layer, layout.projections, parts)
        torch.testing.assert_close(layer(h, **kw), expected)


def test_phi3s_fused_projection_is_one_module_of_q_k_v_rows_in_every_form(tiny_artifact, tmp_path):
    """The artifact runs one module where `qkv_proj` stood (its Tucker group computed once per
    forward) and the dense export writes back one `qkv_proj.weight` of Q, K and V rows."""
    from safetensors import safe_open

    folder = tiny_artifact("phi3")
    model, _, _ = load_artifact(folder)
    layer = model.get_submodule("model.layers.0")
    fused = layer.get_submodule("self_attn.qkv_proj")
    assert type(fused).__name__ == "FusedProjection" and fused.out_features == 4 * 16 + 2 * 2 * 16
    calls: list[int] = []
    layer.ftc["qkv"].register_forward_hook(lambda *_: calls.append(1))
    _logits(model)
    assert calls == [1]
    export_dense(folder, tmp_path / "dense", dtype="float32")
    with safe_open(tmp_path / "dense" / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.qkv_proj.weight").get_shape() == [128, 64]
    assert not {n.split(".")[-2] for n in names} & {"q_proj", "k_proj", "v_proj"}
