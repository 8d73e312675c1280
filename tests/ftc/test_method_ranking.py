"""On a problem with the structure FTC exploits, FTC beats SVD-LLM beats plain SVD (ftc-method.md §11).

The structure: every Q/K/V head reads the same low-dimensional input subspace at a different
scale (what the shared mode-1 factor and slice balancing are for), and the inputs are strongly
anisotropic (what whitening is for). A regression in any of those parts shows up as a lost order.
"""

from __future__ import annotations

import torch

from ftc.compression.methods import KEY_WEIGHT, make_method
from ftc.models.arch import decoder_layers, get_module, layout_of
from tests.support.pipeline import compress_model
from tests.support.tiny import tiny_config, tiny_model

CALIB = torch.randint(0, 256, (8, 48), generator=torch.Generator().manual_seed(1))
PROBE = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(2))


def _structured_model():
    """One GQA layer: heads `s * P M_h` on a shared rank-12 input subspace `P`, scales a decade apart."""
    model = tiny_model("gqa", layers=1)
    layout = layout_of(model.config)
    g = torch.Generator().manual_seed(0)
    d = layout.hidden
    with torch.no_grad():
        rotation = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
        embedding = model.get_input_embeddings().weight
        embedding.copy_(torch.randn(embedding.shape, generator=g) * torch.logspace(0, -2, d) @ rotation.T)
        layer = decoder_layers(model, layout)[0]
        shared = torch.randn(d, 12, generator=g)
        for p in "qkv":
            module = get_module(layer, layout.projections[p])
            heads = module.weight.shape[0] // layout.head_dim
            w = torch.cat([s * shared @ torch.randn(12, layout.head_dim, generator=g)
                           for s in torch.logspace(0, 1, heads)], dim=1)
            w = w + 0.05 * torch.randn(w.shape, generator=g)
            module.weight.copy_(w.T / w.norm() * 8)
    return model, layout


def _output_error(method: str) -> float:
    reference, _ = _structured_model()
    model, layout = _structured_model()
    compress_model(model, layout, make_method(method, 0.4, torch.float32), CALIB,
                   device=torch.device("cpu"), batch_size=4, progress=False)
    with torch.no_grad():
        want = reference.model(PROBE).last_hidden_state
        got = model.model(PROBE).last_hidden_state
    return float((got - want).norm() / want.norm())


def test_ftc_beats_svd_llm_beats_svd_at_rho_0_4():
    ftc, svd_llm, svd = (_output_error(m) for m in ("ftc", "svd_llm", "svd"))
    assert ftc < 0.9 * svd_llm, (ftc, svd_llm)
    assert svd_llm < 0.5 * svd, (svd_llm, svd)


def test_ftc_counts_each_key_slice_once_per_query_head_it_serves():
    """`KEY_WEIGHT` (§4): a key slice's weight is the size of its query group; queries and values
    count once; nothing is weighted for MHA, under `kv_repeat` (whose copies already repeat keys and
    values) or under `no_key_weight`."""
    ftc = make_method("ftc", 0.4, torch.float16)
    for name, group in (("gqa", 2), ("mqa", 4)):
        layout = layout_of(tiny_config(name))
        weights = ftc.slice_weights(layout, 1)
        assert weights is not None
        expected = [1.0] * layout.heads + [float(group)] * layout.kv_heads + [1.0] * layout.kv_heads
        assert weights.tolist() == expected
        assert ftc.slice_weights(layout, group) is None
        assert make_method("ftc", 0.4, torch.float16, ("no_key_weight",)).slice_weights(layout, 1) is None
    assert ftc.slice_weights(layout_of(tiny_config("mha")), 1) is None
    assert ftc.choices()["key_weight"] == KEY_WEIGHT
    assert make_method("ftc", 0.4, torch.float16, ("no_key_weight",)).choices()["key_weight"] == 0
