"""How much one kind of attention projection costs the model when SVD-LLM truncates it alone.

    .venv/bin/python benchmarks/projection_sensitivity.py                    # both models, rho 0.4
    .venv/bin/python benchmarks/projection_sensitivity.py --models gemma3-270m --ratio 0.8

SVD-LLM (`svd_llm`, ftc-method.md §11: Cholesky whitening of the original model's input Gram, the
rank that keeps `rho` of each matrix's values) loses 3.2x dense perplexity on Gemma-3-270M at rho
0.8 and 7.9x at 0.4, against 2.1x at 0.4 on SmolLM2-135M-Instruct. This asks why: for every model,
the method's own truncation (`SVDLLM.factor`, statistics of the tables' calibration on the original
model) is applied to Q only, K only, V only, `W_O` only and all four, in every decoder layer, and
each model is scored on the `wikitext2-tune` windows (the validation text calibration never
reads), never the test file. Beside each part: the share of its output energy `||X W||^2` the
truncation removes, averaged over layers (the error SVD-LLM minimises). Writes
benchmarks/results/projection_sensitivity.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from quality import CALIBRATION_SAMPLES, _write, model_label

from ftc.compression.compress import CompressOptions, calibration_batch
from ftc.compression.methods import SVDLLM
from ftc.evaluation.data import bos_prefix, load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.models.arch import decoder_layers, get_module, layout_of
from ftc.models.registry import resolve_model
from ftc.numerics.lowrank import weighted_error
from ftc.numerics.metric import Moments
from ftc.runtime.loading import load_model

RESULTS = Path(__file__).parent / "results" / "projection_sensitivity.json"
PARTS = ("q", "k", "v", "o", "qkvo")


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


@torch.no_grad()
def measure(alias: str, ratio: float, windows: int) -> dict:
    model, tokenizer = load_model(resolve_model(alias))
    layout = layout_of(model.config)
    options = CompressOptions(model=alias, calib_samples=CALIBRATION_SAMPLES, seq_len=512, seed=0)
    stats = input_statistics(model, layout, calibration_batch(tokenizer, options, layout.hidden), options.batch_size)
    method = SVDLLM(keep_ratio=ratio)
    layers = decoder_layers(model, layout)
    original, truncated, lost = {}, {}, {p: [] for p in "qkvo"}
    for index, layer in enumerate(layers):
        for p in "qkvo":
            module = get_module(layer, getattr(layout, p))
            w = module.weight.detach().T  # (in, out)
            moments = stats[index, "ctx" if p == "o" else "in"]
            a, b, _ = method.factor(w, moments, method.rank(p, *w.shape))
            lost[p].append(weighted_error(w, (a, b), moments.gram))
            original[index, p], truncated[index, p] = module.weight.detach().clone(), (a @ b).T.to(w.dtype)
    ids = tokenize(tokenizer, load_text("wikitext2-tune", "test"))

    def scored() -> float:
        return perplexity(model, ids, 512, windows, progress=False, prefix=bos_prefix(tokenizer))["ppl"]

    found = {"model": model_label(alias), "kv_heads": layout.kv_heads, "heads": layout.heads,
             "dense": scored(), "parts": {}}
    for parts in PARTS:
        for index, layer in enumerate(layers):
            for p in "qkvo":
                get_module(layer, getattr(layout, p)).weight.copy_(
                    truncated[index, p] if p in parts else original[index, p])
        found["parts"][parts] = {"ppl": scored(),
                                 "energy_lost": None if len(parts) > 1 else sum(lost[parts]) / len(lost[parts])}
        print(alias, parts, f"{found['parts'][parts]['ppl']:.3f}", flush=True)
    return found


def render(results: dict) -> str:
    lines = ["# SVD-LLM's truncation one projection kind at a time", "",
             f"`svd_llm` at rho {results['ratio']} applied to one kind of attention projection in every decoder "
             f"layer, the rest of the model original; perplexity on the first {results['windows']} windows of 512 "
             "tokens of `wikitext2-tune` (never the test file); calibration as the quality tables' (32 x 512, "
             "seed 0), on the original model. \"energy lost\": the share of the part's output energy "
             "`||X W||^2` the truncation removes, mean over layers. Produced by "
             "`benchmarks/projection_sensitivity.py`.", "",
             "| model | heads (query / key-value) | dense | " + " | ".join(PARTS) + " |",
             "|---|---|---|" + "---|" * len(PARTS)]
    for entry in results["models"].values():
        cells = []
        for part in PARTS:
            cell = entry["parts"][part]
            lost = "" if cell["energy_lost"] is None else f", {100 * cell['energy_lost']:.1f}% lost"
            cells.append(f"{cell['ppl']:.2f} ({cell['ppl'] / entry['dense']:.2f}x{lost})")
        lines.append(f"| {entry['model']} | {entry['heads']} / {entry['kv_heads']} | {entry['dense']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--ratio", type=float, default=0.4, help="keep ratio rho of every truncated projection")
    parser.add_argument("--windows", type=int, default=16, help="wikitext2-tune windows of 512 tokens scored")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not 0 < args.ratio <= 1:
        parser.error(f"--ratio must be in (0, 1]; got {args.ratio}")
    torch.manual_seed(0)
    command = " ".join(["benchmarks/projection_sensitivity.py", *sys.argv[1:]])
    results = {"ratio": args.ratio, "windows": args.windows, "command": command,
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "models": {alias: measure(alias, args.ratio, args.windows) for alias in args.models}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _write(args.out, json.dumps(results, indent=2))
    _write(args.out.with_suffix(".md"), render(results))
    print(render(results))


if __name__ == "__main__":
    main()
