"""Peak host memory of a streamed compression, for two layer shapes, at two depths each.

    .venv/bin/python benchmarks/memory.py                                  # the default cases below
    .venv/bin/python benchmarks/memory.py --cases tinyllama-1.1b:2,4      # a quick look
    .venv/bin/python benchmarks/memory.py --steps llama-7b                 # where the peak is
    .venv/bin/python benchmarks/memory.py --steps llama-7b --layers 2      # ... with later layers to stream

Builds synthetic Llama checkpoints (float16, random weights, several safetensors shards,
SmolLM2's tokenizer) with the layer shape of TinyLlama-1.1B (hidden 2048, MLP 5632, 32 query
heads sharing 4 K/V heads) or of a Llama/Mistral 7B (hidden 4096, MLP 14336, 32 query heads
sharing 8 K/V heads), compresses each with `ftc compress` in a child process run under
`/usr/bin/time -v`, and reads the child's peak resident set size from outside. Only one layer
is ever resident, so the peak is one layer's work plus a fixed runtime and must not grow with
depth: each shape runs at two depths to show that. Calibration is 8 x 512 tokens, two batches
of the default 4 sequences: the activation transients are those of a full run; only the stream
itself (tokens x hidden x 4 bytes) grows with more samples.
`--steps` samples one layer's compression in process and charges each sample to the step then
running (memory_steps.json). Writes benchmarks/results/memory.{json,md}.
`--allocation` is passed on (default: the CLI's, `sensitivity` for FTC); each run gets an empty plan
cache of its own, so a `sensitivity` run measures its layer list (§15) inside the peak it reports.
Targets: peak RSS per shape in `SHAPES`, flat in depth.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ftc.compression.sensitivity import CACHE_ENV
from ftc.options import ALLOCATIONS, default_allocation
from ftc.runtime.artifact import MANIFEST

RESULTS = Path(__file__).parent / "results"
SHAPES = {
    "tinyllama-1.1b": {"hidden": 2048, "intermediate": 5632, "heads": 32, "kv_heads": 4, "target_bytes": 1.0e9},
    "llama-7b": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "target_bytes": 1.6e9},
}
"""Layer shapes and their peak-RSS targets (decimal GB, as reported)."""
CASES = ("tinyllama-1.1b:11,22", "llama-7b:2,4")
"""Default `shape:depth,depth` cases: the peak must be the same at both depths."""


def build_checkpoint(folder: Path, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                     shard_bytes: int = 1 << 30) -> int:
    """Write a random float16 Llama checkpoint in shards, one shard in memory at a time."""
    from transformers import AutoTokenizer, LlamaConfig

    from ftc.models.registry import resolve_model

    source = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         tie_word_embeddings=True, max_position_embeddings=4096)
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    kv = kv_heads * hidden // heads
    shapes = {"model.embed_tokens.weight": (len(tokenizer), hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
                   p + "mlp.down_proj.weight": (hidden, intermediate), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(set(weight_map.values())):05d}.safetensors"
        save_file(shard, str(folder / name))
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, shape in shapes.items():
        tensor = (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02).half()
        if size and size + tensor.numel() * 2 > shard_bytes:
            flush()
        shard[name] = tensor
        size += tensor.numel() * 2
        total += tensor.numel() * 2
    flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def peak_rss(command: list[str], env: dict[str, str] | None = None) -> tuple[int, float, str]:
    """Run `command` under /usr/bin/time -v; return (peak RSS bytes, seconds, stderr tail)."""
    t0 = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    kbytes = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    return kbytes * 1024, seconds, done.stderr[-500:]


def render(rows: list[dict], settings: dict) -> str:
    lines = ["# Memory: peak resident memory while compressing", "",
             f"Synthetic Llama-layout checkpoints, float16 safetensors shards, random weights: {settings}.",
             "Peak RSS of the `ftc compress` process, read by `/usr/bin/time -v` from outside "
             "(seconds are wall time on a machine shared with other jobs).", "",
             "| shape | layers | allocation | checkpoint (GB) | peak RSS (GB) | RSS / checkpoint | target | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        target = SHAPES[r["shape"]]["target_bytes"]
        lines.append(f"| {r['shape']} | {r['layers']} | {r.get('allocation', 'uniform')} | "
                     f"{r['checkpoint_bytes'] / 1e9:.2f} | "
                     f"{r['peak_rss_bytes'] / 1e9:.2f} | {r['peak_rss_bytes'] / r['checkpoint_bytes']:.1%} | "
                     f"{'met' if r['peak_rss_bytes'] <= target else 'MISSED'} (<= {target / 1e9:.1f} GB) | "
                     f"{r['seconds']:.0f} |")
    for shape, allocation in dict.fromkeys((r["shape"], r.get("allocation", "uniform")) for r in rows):
        runs = [r for r in rows if r["shape"] == shape and r.get("allocation", "uniform") == allocation]
        if len(runs) >= 2:
            first, last = runs[0], runs[-1]
            lines += ["", f"{shape}, {allocation}: from {first['layers']} to {last['layers']} layers the checkpoint "
                      "grows "
                      f"{last['checkpoint_bytes'] / first['checkpoint_bytes']:.2f}x and the peak "
                      f"{last['peak_rss_bytes'] / first['peak_rss_bytes']:.2f}x."]
    lines += ["", "The peak is set by one layer's work plus a fixed runtime (Python, torch, transformers), "
              "not by depth. Produced by `benchmarks/memory.py`.", ""]
    return "\n".join(lines)


STEPS = (("ftc.compression.methods", "FTC.qkv", "Q/K/V"),
         ("ftc.compression.pipeline", "context_stats", "context statistics"),
         ("ftc.compression.methods", "calibrated_wo", "W_O solve"),
         ("ftc.compression.methods", "guarded_whitened_svd", "W_O truncation"),
         ("ftc.compression.pipeline", "propagate", "propagation"),
         ("ftc.compression.sensitivity", "SpilledTensors.__init__", "plan: reference"),
         ("ftc.compression.sensitivity", "_Surveying._tensor_curve", "plan: Q/K/V curve"),
         ("ftc.compression.sensitivity", "_Surveying._matrix_curve", "plan: W_O curve"),
         ("ftc.compression.sensitivity", "_through", "plan: layers"),
         ("ftc.compression.sensitivity", "_Reference.divergence", "plan: divergence"),
         ("ftc.compression.sensitivity", "layer_gains", "plan: other"),
         ("ftc.compression.gradients", "_head_gradient", "loss gradients: head"),
         ("ftc.compression.gradients", "_layer_backward", "loss gradients: layer backward"),
         ("ftc.compression.gradients", "loss_gradient_grams", "loss gradients: forward and other"))
"""(module, attribute, label) of the steps whose peak `--steps` reports; everything else is "other".
A compression step the layer list runs (it compresses each layer once) is reported as "plan: " and the
step's label, apart from the same step of the compression proper."""


def step_peaks(shape: str, workdir: Path | None, allocation: str, layers: int = 1, ablate: str = "") -> dict:
    """Peak RSS (anonymous and file-backed) per step of one streamed FTC compression, in process.

    A thread samples /proc/self/status every 2 ms and charges each sample to the step running at
    the time (the functions of `STEPS`, wrapped for the run). One layer by default: every layer does
    the same compression work, but the layer list streams the later layers in for each layer's
    divergences, which only `layers` above one runs. The checkpoint is built in a child process, so
    its buffers are not in this one's heap; the plan cache is an empty folder, so `sensitivity`
    measures its layer list in the run.
    """
    import importlib
    import threading

    from ftc.compression.compress import CompressOptions, compress

    root = Path(tempfile.mkdtemp(dir=workdir))
    try:
        spec = SHAPES[shape]
        subprocess.run([sys.executable, __file__, "--build", str(root / "model"), shape, str(layers)], check=True)
        current, peaks = ["other"], {}

        def sample() -> None:
            while True:
                status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
                rss = [int(status[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")]
                if rss[0] > peaks.get(current[0], (0,))[0]:
                    peaks[current[0]] = tuple(rss)
                time.sleep(0.002)

        def wrapped(function, label):
            def run(*args, **kwargs):
                before = current[0]
                inside = before.startswith("plan") and not label.startswith("plan")
                borrowed = label.startswith("plan") and before != "other" and not before.startswith("plan")
                # a plan helper another step uses (the loss gradients' spilled inputs) is that step's
                current[0] = f"plan: {label}" if inside else before if borrowed else label
                try:
                    return function(*args, **kwargs)
                finally:
                    current[0] = before
            return run

        for module, attribute, label in STEPS:
            owner = importlib.import_module(module)
            holder, _, name = attribute.rpartition(".")
            target = getattr(owner, holder) if holder else owner
            setattr(target, name, wrapped(getattr(target, name), label))
        threading.Thread(target=sample, daemon=True).start()
        options = CompressOptions(model=str(root / "model"), method="ftc", ratio=0.4, calib_samples=8,
                                  seq_len=512, device="cpu", allocation=allocation,
                                  ablate=tuple(a for a in ablate.split(",") if a))
        os.environ[CACHE_ENV] = str(root / "plans")
        compress(options, root / "out", progress=False)
        manifest = json.loads((root / "out" / MANIFEST).read_text())
        return {"shape": shape, "allocation": allocation, "ablate": ablate, "layers": layers,
                "layer_budgets": manifest["allocation"]["layer_budgets"],
                "layout": {k: v for k, v in spec.items() if k != "target_bytes"},
                "steps": {label: dict(zip(("rss", "anon", "file"), peaks[label], strict=True))
                          for label in sorted(peaks, key=lambda label: -peaks[label][0])}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def parse_case(text: str) -> tuple[str, list[int]]:
    """`shape:depth,depth` -> (shape, depths)."""
    shape, _, depths = text.partition(":")
    if shape not in SHAPES or not depths:
        raise argparse.ArgumentTypeError(f"case {text!r}: use SHAPE:DEPTH[,DEPTH...] with SHAPE in {', '.join(SHAPES)}")
    try:
        return shape, [int(d) for d in depths.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"case {text!r}: depths must be integers") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=parse_case, nargs="*", default=[parse_case(c) for c in CASES],
                        help=f"SHAPE:DEPTH[,DEPTH...] (default: {' '.join(CASES)})")
    parser.add_argument("--method", default="ftc")
    parser.add_argument("--calib-samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--allocation", choices=ALLOCATIONS, default=None,
                        help="passed to `ftc compress` (default: the method's default allocation)")
    parser.add_argument("--ablate", default="",
                        help="passed to `ftc compress` (e.g. loss_metric: its streamed backward pass inside the peak)")
    parser.add_argument("--workdir", type=Path, default=None, help="where checkpoints are built (default: /tmp)")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory.json")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows of --out for other (shape, layers, allocation) cases: shapes run one "
                             "at a time")
    parser.add_argument("--steps", choices=SHAPES, default=None,
                        help="instead: peak RSS per step of compressing SHAPE (--layers of it), sampled in process")
    parser.add_argument("--layers", type=int, default=1, help="with --steps: decoder layers of the checkpoint")
    parser.add_argument("--build", nargs=3, metavar=("FOLDER", "SHAPE", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layers != 1 and not args.steps:
        parser.error("--layers applies to --steps only; give the depths of --cases as SHAPE:DEPTH")
    if args.build:  # the child of --steps
        shape = SHAPES[args.build[1]]
        build_checkpoint(Path(args.build[0]), int(args.build[2]), shape["hidden"], shape["intermediate"],
                         shape["heads"], shape["kv_heads"])
        return
    allocation = args.allocation or default_allocation(args.method)
    if args.steps:
        if args.layers < 1:
            parser.error(f"--layers {args.layers}: give at least 1")
        found = step_peaks(args.steps, args.workdir, allocation, args.layers, args.ablate)
        print(json.dumps(found, indent=2))
        out = args.out.with_name("memory_steps.json")
        key = (f"{args.steps}, {allocation}" + (f", --ablate {args.ablate}" if args.ablate else "")
               + (f", {args.layers} layers" if args.layers > 1 else ""))
        # the oldest entry is keyed by the shape alone
        out.write_text(json.dumps({**json.loads(out.read_text()), key: found} if out.is_file()
                                  else {key: found}, indent=2))
        return
    settings = {"method": args.method, "ratio": 0.4, "calibration": f"{args.calib_samples} x {args.seq_len}",
                "shapes": {name: {k: v for k, v in shape.items() if k != "target_bytes"}
                           for name, shape in SHAPES.items()}}
    rows = []
    variant = allocation + (f", --ablate {args.ablate}" if args.ablate else "")  # the table's allocation column
    if args.append and args.out.is_file():
        cases = {(name, d, variant) for name, depths in args.cases for d in depths}
        rows = [r for r in json.loads(args.out.read_text())["rows"]
                if (r["shape"], r["layers"], r.get("allocation", "uniform")) not in cases]
    root = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        for name, layers in ((name, d) for name, depths in args.cases for d in depths):
            shape = SHAPES[name]
            folder = root / f"llama-{layers}"
            checkpoint = build_checkpoint(folder, layers, shape["hidden"], shape["intermediate"], shape["heads"],
                                          shape["kv_heads"])
            command = [sys.executable, "-m", "cli", "compress", "--model", str(folder), "--method", args.method,
                       "--ratio", "0.4", "--calib-samples", str(args.calib_samples), "--seq-len", str(args.seq_len),
                       "--device", "cpu", "--quiet", "--allocation", allocation, "--out", str(root / f"out-{layers}"),
                       *(["--ablate", args.ablate] if args.ablate else [])]
            rss, seconds, _ = peak_rss(command, {**os.environ, CACHE_ENV: str(root / f"plans-{layers}")})
            rows.append({"shape": name, "layers": layers, "allocation": variant, "checkpoint_bytes": checkpoint,
                         "peak_rss_bytes": rss, "seconds": seconds, "ratio": rss / checkpoint})
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(folder)
            shutil.rmtree(root / f"out-{layers}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "targets": {k: v["target_bytes"] for k, v in SHAPES.items()},
                                    "rows": rows}, indent=2))
    args.out.with_suffix(".md").write_text(render(rows, settings))
    print(render(rows, settings))


if __name__ == "__main__":
    main()
