"""Propagation that reuses the statistics pass's attention context equals a full layer forward."""

from __future__ import annotations

import copy

import pytest
import torch

from ftc.compression.pipeline import context_stats, layer_inputs, propagate
from ftc.models.arch import decoder_layers, layout_of
from tests.support.tiny import LAYOUTS, tiny_model


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_replayed_attention_context_gives_the_full_forward(layout_name):
    model = tiny_model(layout_name)
    layout = layout_of(model.config)
    ids = torch.randint(0, model.config.vocab_size, (6, 24), generator=torch.Generator().manual_seed(0))
    stream = layer_inputs(model, layout, ids, 4, torch.device("cpu"))
    layer = decoder_layers(model, layout)[0]
    full = copy.copy(stream)
    full.hidden = list(stream.hidden)
    propagate(layer, full)
    _, contexts = context_stats(layer, layout, stream, None, keep="teacher")
    assert len(contexts) == 2
    propagate(layer, stream, layout, contexts)
    assert contexts == [None, None]  # each context released once used
    for replayed, forward in zip(stream.hidden, full.hidden, strict=True):
        torch.testing.assert_close(replayed, forward, rtol=1e-5, atol=1e-6)


def test_a_batch_replayed_in_pieces_equals_the_batch_replayed_whole(monkeypatch):
    import ftc.compression.pipeline

    model = tiny_model("gqa")
    layout = layout_of(model.config)
    ids = torch.randint(0, model.config.vocab_size, (5, 24), generator=torch.Generator().manual_seed(0))
    layer = decoder_layers(model, layout)[0]
    results = []
    for tokens in (10_000, 48):  # one piece; then two sequences a piece, the last piece one
        monkeypatch.setattr(ftc.compression.pipeline, "REPLAY_TOKENS", tokens)
        stream = layer_inputs(model, layout, ids, 5, torch.device("cpu"))
        _, contexts = context_stats(layer, layout, stream, None, keep="teacher")
        propagate(layer, stream, layout, contexts)
        results.append(stream.hidden[0])
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-6)


def test_a_16bit_layer_stays_16bit_and_computes_as_its_float32_copy(tmp_path):
    from ftc.models.weights import BlockwiseLinear, SafetensorsSource, materialize, skeleton

    model = tiny_model("gqa").half()
    model.save_pretrained(tmp_path)
    reference = tiny_model("gqa").half().float()  # the same 16-bit values, held in float32
    streamed = skeleton(model.config)
    name = "model.layers.0"
    materialize(streamed, name, SafetensorsSource(tmp_path, model.config), torch.device("cpu"), torch.float32)
    layer = streamed.get_submodule(name)
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is BlockwiseLinear and m.weight.dtype == torch.float16 for m in linears)
    assert layer.input_layernorm.weight.dtype == torch.float32
    layout = layout_of(model.config)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    (h,), (kw,) = (s := layer_inputs(reference, layout, ids, 2, torch.device("cpu"))).hidden, s.kwargs
    expected = decoder_layers(reference, layout)[0](h, **kw)
    torch.testing.assert_close(layer(h, **kw), expected, rtol=1e-5, atol=1e-6)


def test_a_streamed_layer_loads_its_mlp_only_after_the_attention_math(tmp_path):
    from ftc.compression.methods import make_method
    from ftc.compression.pipeline import after_attention, compress_layers
    from ftc.models.weights import SafetensorsSource, skeleton

    model = tiny_model("gqa", layers=2)
    model.save_pretrained(tmp_path)
    layout = layout_of(model.config)
    streamed = skeleton(model.config)
    later = after_attention(decoder_layers(streamed, layout)[0], layout)
    names = [n for n, _ in decoder_layers(streamed, layout)[0].named_parameters()]
    assert sorted(n for n in names if later(n)) == [f"mlp.{p}_proj.weight" for p in ("down", "gate", "up")]

    method = make_method("svd", 0.5, torch.float32)
    seen: list[tuple[str, bool]] = []
    qkv = method.qkv

    def record(weights, x, lay):
        mlp = decoder_layers(streamed, layout)[len(seen)].mlp
        seen.append(("qkv", all(p.is_meta for p in mlp.parameters())))
        return qkv(weights, x, lay)

    object.__setattr__(method, "qkv", record)
    layers_seen = []
    compress_layers(streamed, layout, method, None, device=torch.device("cpu"),
                    weights=SafetensorsSource(tmp_path, model.config), progress=False,
                    on_layer=lambda result, layer: layers_seen.append(
                        torch.equal(layer.mlp.up_proj.weight, model.get_submodule(
                            f"model.layers.{result.index}.mlp.up_proj").weight)))
    assert seen == [("qkv", True), ("qkv", True)]  # no MLP weight resident during the Q/K/V math
    assert layers_seen == [True, True]  # and every one of them loaded before the layer is written
