"""benchmarks/plan_estimates.py: its estimates rest on the gradient at each decoder layer's output and on
each unit's output as the layer list hands it on; both checked here against independent routes, so a
plan that comes out worse is the estimate's doing, not a wrong gradient or a misread output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftc.compression.methods import make_method
from ftc.models.arch import decoder_layers, layout_of
from ftc.models.weights import ModuleSource
from tests.support.benchmarks import load_benchmark
from tests.support.tiny import tiny_model

plan_estimates = load_benchmark("plan_estimates")


def _outputs_and_gradients(model, ids: torch.Tensor, labels: torch.Tensor | None):
    """Every decoder layer's output and the gradient there of the summed next-token log-loss of each
    sequence (or of `labels` at every position), by one ordinary backward pass through the whole model."""
    outputs = []
    hooks = [layer.register_forward_hook(lambda _m, _a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
             for layer in decoder_layers(model, layout_of(model.config))]
    try:
        logits = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        for hook in hooks:
            hook.remove()
    for out in outputs:
        out.retain_grad()
    if labels is None:
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    else:
        loss = -F.log_softmax(logits, -1).gather(2, labels[..., None]).sum()
    loss.backward()
    return [o.detach() for o in outputs], [o.grad for o in outputs]


@pytest.mark.parametrize("layout_name", ["gqa", "gemma3"])
def test_the_gradients_at_every_layer_output_are_the_whole_model_s(layout_name):
    """The streamed pass (one layer resident, each layer's forward recomputed from its kept input) gives
    the gradient of one ordinary backward pass at every layer's output, for the true next tokens, and
    the layer outputs themselves."""
    model = tiny_model(layout_name, layers=3)
    layout = layout_of(model.config)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    grads, outputs = plan_estimates.layer_output_gradients(ModuleSource(model), layout, ids, None)
    want_outputs, want_grads = _outputs_and_gradients(model, ids, None)
    for layer in range(3):
        got_out = torch.cat([o.reshape(1, 12, -1) for o in outputs[layer]])
        got_grad = torch.cat([g.reshape(1, 12, -1) for g in grads[layer]])
        torch.testing.assert_close(got_out, want_outputs[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_grad, want_grads[layer], rtol=1e-4, atol=1e-6)


def test_drawn_labels_give_the_gradient_of_those_labels():
    """With a seed, the labels are drawn from the model's own next-token distribution at every position:
    the gradient is that of the drawn labels' log-loss, and the same seed draws the same labels."""
    model = tiny_model("gqa", layers=2)
    layout = layout_of(model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(4))
    first, _ = plan_estimates.layer_output_gradients(ModuleSource(model), layout, ids, 7)
    again, _ = plan_estimates.layer_output_gradients(ModuleSource(model), layout, ids, 7)
    other, _ = plan_estimates.layer_output_gradients(ModuleSource(model), layout, ids, 8)
    with torch.no_grad():
        probs = F.softmax(model(input_ids=ids).logits[0].float(), -1)
    labels = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(7))[:, 0]
    _, want = _outputs_and_gradients(model, ids, labels[None])
    torch.testing.assert_close(first[0][0].reshape(1, 10, -1), want[0], rtol=1e-4, atol=1e-6)
    assert torch.equal(first[0][0], again[0][0])
    assert not torch.equal(first[0][0], other[0][0])


def test_each_recorded_output_is_the_layer_output_with_that_unit_alone_compressed():
    """The list's unit outputs as the benchmark records them: for the last layer (whose output goes
    straight to the head) the recorded output gives, through the final norm and head, the list's own
    divergence for that unit; the records come one per unit, in the list's order."""
    model = tiny_model("gqa", layers=2)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)
    layout = layout_of(model.config)
    calib = torch.randint(0, model.config.vocab_size, (8, 24), generator=torch.Generator().manual_seed(5))
    method = make_method("ftc", 0.4, torch.float32, allocation="sensitivity", scope="model")
    curves, outputs, _ = plan_estimates.list_with_outputs(method, ModuleSource(model), layout, calib)
    assert [(c.layer, c.unit) for c in curves] == [(0, "attention"), (0, "mlp"), (1, "attention"), (1, "mlp")]
    ids = calib[:4]
    with torch.no_grad():
        reference = F.log_softmax(model(input_ids=ids).logits.double(), -1)
        for curve in curves[2:]:
            hidden = torch.cat(outputs[curve.layer, curve.unit])
            mine = F.log_softmax(model.lm_head(model.model.norm(hidden)).double(), -1)
            kl = float((reference.exp() * (reference - mine)).sum(-1).mean())
            assert curve.divergence == pytest.approx(kl, rel=2e-3, abs=1e-7)
