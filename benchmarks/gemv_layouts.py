"""Which layout and kernel a runtime form's matrices read fastest with, per dtype: the measurement
behind float32 forms being held input-major, and 16-bit ones output-major with one-row products on
PyTorch's own kernel (ftc-method.md §9).

    .venv/bin/python benchmarks/gemv_layouts.py            # under a minute, alone on the machine

A product `x @ W` can be run from `W` held input-major (`in x out`, applied with `@`) or
output-major (`out x in`, as `nn.Linear` holds its weight, applied with `F.linear`). The
arithmetic is the same; the kernels are not, and at a few tokens (decoding) the difference is
large. Per dtype and token count (1 and 8: decoding at batch 1 and 8; 2048: a prefill), each
shape is timed in both layouts over enough distinct matrices (about 600 MB) that they stream from
memory as a served model's weights do, not from the cache. Shapes: those of SmolLM2-135M's groups
(`x @ U1` and `M` of a Q/K/V and of a gate/up group, the two factors of `W_O` and `W_down`).

A third column runs the output-major product with oneDNN switched off (`torch.backends.mkldnn`):
a 16-bit product on the CPU then goes to PyTorch's own kernel, which at one row is a dot product
per output streamed at memory speed, where oneDNN's matmul runs far below it (this machine's CPU
has AVX512-BF16); at a few rows and more that kernel is slower than oneDNN's. In float32 both
columns run MKL's GEMM, so the column shows the noise.

Writes benchmarks/results/gemv_layouts.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ((576, 3072), (483, 3072), (576, 483), (190, 960), (576, 190), (576, 158), (158, 576), (1536, 230))
TOKENS = (1, 8, 2048)
STREAMED_BYTES = 600e6


def seconds_per_product(fn, count: int, repeats: int) -> float:
    """Median over `repeats` of one pass over the `count` matrices, per matrix."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) / count)
    return statistics.median(samples)


def measure(dtype: torch.dtype, rows: int, cols: int, tokens: int, repeats: int) -> dict:
    size = rows * cols * dtype.itemsize
    count = 2 if tokens > 8 else max(4, int(STREAMED_BYTES / (2 * size)))
    inputs = [torch.randn(rows, cols, dtype=dtype) for _ in range(count)]
    outputs = [w.T.contiguous() for w in inputs]
    x = torch.randn(tokens, rows, dtype=dtype)
    t_in = seconds_per_product(lambda: [x @ w for w in inputs], count, repeats)
    t_out = seconds_per_product(lambda: [F.linear(x, w) for w in outputs], count, repeats)
    with torch.backends.mkldnn.flags(enabled=False):
        t_own = seconds_per_product(lambda: [F.linear(x, w) for w in outputs], count, repeats)
    return {"dtype": str(dtype).removeprefix("torch."), "shape": [rows, cols], "tokens": tokens,
            "input_major_us": round(t_in * 1e6, 2), "output_major_us": round(t_out * 1e6, 2),
            "output_major_speedup": round(t_in / t_out, 3), "own_kernel_us": round(t_own * 1e6, 2),
            "own_kernel_speedup": round(t_in / t_own, 3)}


def render(results: dict) -> str:
    lines = ["# Layouts of a form's matrices: input-major (`x @ W`) against output-major (`F.linear`), "
             "with oneDNN and with PyTorch's own kernel", "",
             f"Command: `{results['command']}`", "", f"Machine: {results['machine']}", "",
             "Each cell: microseconds per product, the median of the repeats, matrices streamed from memory "
             "for 1 and 8 tokens. Speedup > 1: faster than input-major. \"own kernel\": output-major with oneDNN "
             "off (`torch.backends.mkldnn.flags(enabled=False)`).", ""]
    for dtype in sorted({r["dtype"] for r in results["rows"]}):
        lines += [f"## {dtype}", "", "| shape (in x out) | tokens | input-major us | output-major us | speedup "
                  "| own kernel us | speedup |", "|---|---|---|---|---|---|---|"]
        for r in results["rows"]:
            if r["dtype"] == dtype:
                lines.append(f"| {r['shape'][0]} x {r['shape'][1]} | {r['tokens']} | {r['input_major_us']} | "
                             f"{r['output_major_us']} | {r['output_major_speedup']:.2f}x | "
                             f"{r['own_kernel_us']} | {r['own_kernel_speedup']:.2f}x |")
        for tokens in TOKENS:
            for key, label in (("output_major_speedup", "output-major"), ("own_kernel_speedup", "own kernel")):
                ratios = [r[key] for r in results["rows"] if r["dtype"] == dtype and r["tokens"] == tokens]
                lines.append(f"\n{tokens} token(s): {label} speedup, median over the shapes "
                             f"{statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}x)")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "gemv_layouts.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loads = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            for tokens in TOKENS:
                rows.append(measure(dtype, *shape, tokens, args.repeats))
                print(rows[-1], flush=True)
    command = f".venv/bin/python benchmarks/gemv_layouts.py --threads {args.threads} --repeats {args.repeats}"
    results = {"command": command,
               "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
                          f"torch {torch.__version__}, {args.threads} threads; load average before {loads}",
               "rows": rows}
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(results))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
