"""How much one kind of attention projection costs the model when SVD-LLM truncates it alone.

    .venv/bin/python benchmarks/projection_sensitivity.py                    # both models, rho 0.4
    .venv/bin/python benchmarks/projection_sensitivity.py --models gemma3-270m --ratio 0.8
    .venv/bin/python benchmarks/projection_sensitivity.py --method ftc       # FTC's parts, both models

SVD-LLM (`svd_llm`, ftc-method.md §11: Cholesky whitening of the original model's input Gram, the
rank that keeps `rho` of each matrix's values) loses 3.2x dense perplexity on Gemma-3-270M at rho
0.8 and 7.9x at 0.4, against 2.1x at 0.4 on SmolLM2-135M-Instruct. This asks why: for every model,
the method's own truncation (`SVDLLM.factor`, statistics of the tables' calibration on the original
model) is applied to Q only, K only, V only, `W_O` only and all four, in every decoder layer, and
each model is scored on the `wikitext2-tune` windows (the validation text calibration never
reads), never the test file. Beside each part: the share of its output energy `||X W||^2` the
truncation removes, averaged over layers (the error SVD-LLM minimises). Writes
benchmarks/results/projection_sensitivity.{json,md}.

`--method ftc` asks the same of FTC (its default allocation, the quality tables' plans): the model is
compressed whole, exported to dense weights, and each part of it put back into the original model
alone, which shows where FTC's loss sits on each model. Its `W_O` is calibrated toward the original
attention output given the compressed Q/K/V (§8), so its `o` column, with the original Q/K/V, is
that matrix out of its setting; `qkv` (the compressed Q/K/V under the original `W_O`) is added.
Writes benchmarks/results/projection_sensitivity_ftc.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from quality import CALIBRATION_SAMPLES, PLANS, _write, model_label

from ftc.compression.compress import CompressOptions, calibration_batch, compress
from ftc.compression.methods import SVDLLM
from ftc.compression.sensitivity import CACHE_ENV
from ftc.evaluation.data import bos_prefix, load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.models.arch import decoder_layers, get_module, layout_of
from ftc.models.registry import resolve_model
from ftc.numerics.lowrank import weighted_error
from ftc.numerics.metric import Moments
from ftc.runtime.export import export_dense
from ftc.runtime.loading import load_model

RESULTS = Path(__file__).parent / "results"
PARTS = {"svd_llm": ("q", "k", "v", "o", "qkvo"), "ftc": ("q", "k", "v", "qkv", "o", "qkvo")}
TITLES = {"svd_llm": "SVD-LLM's truncation one projection kind at a time",
          "ftc": "FTC's compressed projections one kind at a time"}


@torch.no_grad()
def input_statistics(model, layout, calib: torch.Tensor, batch: int) -> dict[tuple[int, str], Moments]:
    """Per layer, the Moments of Q/K/V's input (`"in"`) and of `W_O`'s (`"ctx"`) on the original model."""
    stats: dict[tuple[int, str], Moments] = {}
    handles = []
    for index, layer in enumerate(decoder_layers(model, layout)):
        for key, name, width in (("in", layout.q, layout.hidden), ("ctx", layout.o, layout.heads * layout.head_dim)):
            stats[index, key] = Moments(width)
            handles.append(get_module(layer, name).register_forward_pre_hook(
                lambda _m, args, m=stats[index, key]: m.update(args[0])))
    try:
        for start in range(0, calib.shape[0], batch):
            model(input_ids=calib[start : start + batch], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return stats


def input_of(p: str) -> str:
    """Which statistics a projection reads: `W_O` the attention context, the others the layer input."""
    return "ctx" if p == "o" else "in"


def attention_weights(model, layout) -> dict[tuple[int, str], torch.Tensor]:
    """A copy of every attention projection's weight, `(out, in)`, keyed by layer and projection."""
    return {(index, p): get_module(layer, getattr(layout, p)).weight.detach().clone()
            for index, layer in enumerate(decoder_layers(model, layout)) for p in "qkvo"}


def svd_llm_weights(model, layout, stats: dict, ratio: float) -> dict[tuple[int, str], torch.Tensor]:
    """SVD-LLM's truncation of every attention projection, `(out, in)` like the modules' weights."""
    method = SVDLLM(keep_ratio=ratio)
    found = {}
    for index, layer in enumerate(decoder_layers(model, layout)):
        for p in "qkvo":
            w = get_module(layer, getattr(layout, p)).weight.detach().T  # (in, out)
            a, b, _ = method.factor(w, stats[index, input_of(p)], method.rank(p, *w.shape))
            found[index, p] = (a @ b).T.to(w.dtype)
    return found


def ftc_weights(loaded: tuple, options: CompressOptions) -> dict[tuple[int, str], torch.Tensor]:
    """FTC's compressed attention projections as dense `(out, in)` weights: the artifact exported to a
    stock checkpoint and read back, so each part is exactly what the compressed model computes."""
    with tempfile.TemporaryDirectory() as tmp:
        compress(options, Path(tmp) / "artifact", loaded=loaded, progress=False)
        export_dense(Path(tmp) / "artifact", Path(tmp) / "dense", dtype="float32")
        exported, _ = load_model(resolve_model(str(Path(tmp) / "dense")))
    return attention_weights(exported, layout_of(exported.config))


@torch.no_grad()
def measure(alias: str, method: str, ratio: float, windows: int) -> dict:
    source = resolve_model(alias)
    model, tokenizer = load_model(source)
    layout = layout_of(model.config)
    options = CompressOptions(model=alias, ratio=ratio, calib_samples=CALIBRATION_SAMPLES, seq_len=512, seed=0)
    stats = input_statistics(model, layout, calibration_batch(tokenizer, options, layout.hidden), options.batch_size)
    layers = decoder_layers(model, layout)
    original = attention_weights(model, layout)
    compressed = (svd_llm_weights(model, layout, stats, ratio) if method == "svd_llm"
                  else ftc_weights((model, tokenizer, source), options))
    lost = {p: [weighted_error(original[index, p].T, compressed[index, p].T,
                               stats[index, input_of(p)].gram) for index in range(len(layers))]
            for p in "qkvo"}
    ids = tokenize(tokenizer, load_text("wikitext2-tune", "test"))

    def scored() -> float:
        return perplexity(model, ids, 512, windows, progress=False, prefix=bos_prefix(tokenizer))["ppl"]

    found = {"model": model_label(alias), "kv_heads": layout.kv_heads, "heads": layout.heads,
             "dense": scored(), "parts": {}}
    for parts in PARTS[method]:
        for index, layer in enumerate(layers):
            for p in "qkvo":
                get_module(layer, getattr(layout, p)).weight.copy_(
                    compressed[index, p] if p in parts else original[index, p])
        found["parts"][parts] = {"ppl": scored(),
                                 "energy_lost": None if len(parts) > 1 else sum(lost[parts]) / len(lost[parts])}
        print(alias, method, parts, f"{found['parts'][parts]['ppl']:.3f}", flush=True)
    return found


def render(results: dict) -> str:
    method = results.get("method", "svd_llm")
    parts = PARTS[method]
    what = (f"`svd_llm` at rho {results['ratio']}" if method == "svd_llm" else
            f"FTC's compressed projections (default allocation, the quality tables' plans) at rho "
            f"{results['ratio']}, exported to dense weights and")
    lines = [f"# {TITLES[method]}", "",
             f"{what} applied to one kind of attention projection in every decoder "
             f"layer, the rest of the model original; perplexity on the first {results['windows']} windows of 512 "
             "tokens of `wikitext2-tune` (never the test file); calibration as the quality tables' (32 x 512, "
             "seed 0), on the original model. \"energy lost\": the share of the part's output energy "
             "`||X W||^2` the compression removes, mean over layers. Produced by "
             f"`{results['command']}`.", "",
             "| model | heads (query / key-value) | dense | " + " | ".join(parts) + " |",
             "|---|---|---|" + "---|" * len(parts)]
    for entry in results["models"].values():
        cells = []
        for part in parts:
            cell = entry["parts"][part]
            lost = "" if cell["energy_lost"] is None else f", {100 * cell['energy_lost']:.1f}% lost"
            cells.append(f"{cell['ppl']:.2f} ({cell['ppl'] / entry['dense']:.2f}x{lost})")
        lines.append(f"| {entry['model']} | {entry['heads']} / {entry['kv_heads']} | {entry['dense']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--method", choices=sorted(PARTS), default="svd_llm", help="whose compression to take apart")
    parser.add_argument("--ratio", type=float, default=0.4, help="keep ratio rho of the compression")
    parser.add_argument("--windows", type=int, default=16, help="wikitext2-tune windows of 512 tokens scored")
    parser.add_argument("--out", type=Path, help="results file (default: results/projection_sensitivity[_ftc].json)")
    args = parser.parse_args()
    if not 0 < args.ratio <= 1:
        parser.error(f"--ratio must be in (0, 1]; got {args.ratio}")
    out = args.out or RESULTS / ("projection_sensitivity.json" if args.method == "svd_llm"
                                 else f"projection_sensitivity_{args.method}.json")
    torch.manual_seed(0)
    os.environ.setdefault(CACHE_ENV, str(PLANS))  # FTC's default allocation plans as the quality tables' did
    command = " ".join([".venv/bin/python benchmarks/projection_sensitivity.py", *sys.argv[1:]])
    results = {"method": args.method, "ratio": args.ratio, "windows": args.windows, "command": command,
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "models": {alias: measure(alias, args.method, args.ratio, args.windows) for alias in args.models}}
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(out, json.dumps(results, indent=2))
    _write(out.with_suffix(".md"), render(results))
    print(render(results))


if __name__ == "__main__":
    main()
