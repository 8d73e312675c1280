"""Peak host memory of a streamed compression against the checkpoint size, at two depths.

    .venv/bin/python benchmarks/memory.py                 # 22 and 44 layers (~2.2 and ~4.2 GB)
    .venv/bin/python benchmarks/memory.py --layers 2 4    # a quick look

Builds synthetic checkpoints with the layer shape of TinyLlama-1.1B (hidden 2048, MLP 5632,
32 query heads sharing 4 K/V heads; float16, random weights, several safetensors shards,
SmolLM2's tokenizer), at its real depth (22 layers) and at twice that, compresses each with
`ftc compress` in a child process run under `/usr/bin/time -v`, and reads the child's peak
resident set size from outside. Calibration is one default batch (8 x 512 tokens): the
activation transients are those of a full run; only the stream itself (tokens x hidden x 4
bytes) grows with more samples.
Writes benchmarks/results/memory.{json,md}. Target: peak RSS <= 40% of the checkpoint, flat in depth.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

RESULTS = Path(__file__).parent / "results"
TARGET = 0.40


def build_checkpoint(folder: Path, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                     shard_bytes: int = 1 << 30) -> int:
    """Write a random float16 Llama checkpoint in shards, one shard in memory at a time."""
    from transformers import AutoTokenizer, LlamaConfig

    from ftc.models import resolve_model

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


def peak_rss(command: list[str]) -> tuple[int, float, str]:
    """Run `command` under /usr/bin/time -v; return (peak RSS bytes, seconds, stderr tail)."""
    t0 = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    kbytes = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    return kbytes * 1024, seconds, done.stderr[-500:]


def render(rows: list[dict], settings: dict) -> str:
    lines = ["# Memory: peak resident memory while compressing, against the checkpoint size", "",
             f"Synthetic Llama-layout checkpoints, float16 safetensors shards, random weights: {settings}.",
             "Peak RSS of the `ftc compress` process, read by `/usr/bin/time -v` from outside.", "",
             "| layers | checkpoint (GB) | peak RSS (GB) | RSS / checkpoint | target | seconds |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["peak_rss_bytes"] / r["checkpoint_bytes"]
        lines.append(f"| {r['layers']} | {r['checkpoint_bytes'] / 1e9:.2f} | {r['peak_rss_bytes'] / 1e9:.2f} | "
                     f"{ratio:.1%} | {'met' if ratio <= TARGET else 'MISSED'} (<= {TARGET:.0%}) | {r['seconds']:.0f} |")
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        lines += ["", f"From {first['layers']} to {last['layers']} layers the checkpoint grows "
                  f"{last['checkpoint_bytes'] / first['checkpoint_bytes']:.2f}x and the peak "
                  f"{last['peak_rss_bytes'] / first['peak_rss_bytes']:.2f}x: the peak is set by one layer's work "
                  "plus a fixed runtime (Python, torch, tokenizer), not by depth."]
    lines += ["", "Produced by `benchmarks/memory.py`.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="*", default=[22, 44])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--method", default="ftc")
    parser.add_argument("--calib-samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--workdir", type=Path, default=None, help="where checkpoints are built (default: /tmp)")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory.json")
    args = parser.parse_args()
    settings = {"hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
                "kv_heads": args.kv_heads, "method": args.method, "ratio": 0.4,
                "calibration": f"{args.calib_samples} x {args.seq_len}"}
    rows = []
    root = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        for layers in args.layers:
            folder = root / f"llama-{layers}"
            checkpoint = build_checkpoint(folder, layers, args.hidden, args.intermediate, args.heads, args.kv_heads)
            command = [sys.executable, "-m", "cli", "compress", "--model", str(folder), "--method", args.method,
                       "--ratio", "0.4", "--calib-samples", str(args.calib_samples), "--seq-len", str(args.seq_len),
                       "--device", "cpu", "--quiet", "--out", str(root / f"out-{layers}")]
            rss, seconds, _ = peak_rss(command)
            rows.append({"layers": layers, "checkpoint_bytes": checkpoint, "peak_rss_bytes": rss, "seconds": seconds,
                         "ratio": rss / checkpoint})
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(folder)
            shutil.rmtree(root / f"out-{layers}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "target": TARGET, "rows": rows}, indent=2))
    args.out.with_suffix(".md").write_text(render(rows, settings))
    print(render(rows, settings))


if __name__ == "__main__":
    main()
