"""Inference speed and size of FTC artifacts against the dense model they came from.

    .venv/bin/python benchmarks/inference.py                       # both models, CPU
    .venv/bin/python benchmarks/inference.py --model smollm2 --device cuda

For each model, the dense model and the FTC artifacts at rho 0.8/0.6/0.4/0.2 (loaded with
`load_artifact`, the classes transformers runs with `trust_remote_code=True`) are measured side by
side: every repeat runs each variant once in turn, and the tables give medians, so load from
other processes on a shared machine falls on all variants alike.

- prefill: tokens/s of one forward over 4 x 512 tokens (no cache);
- attention block: seconds spent inside the decoder layers' attention modules during that
  prefill (timed by hooks around each `self_attn`), summed over layers;
- decode: tokens/s of greedy generation with the KV cache, 128 new tokens after a 16-token
  prompt, at batch 1 and 8;
- bytes: attention and whole-model tensors held at run time (float32).

Models: SmolLM2-135M (`smollm2-135m`; artifacts compressed with 8 x 512 calibration tokens unless
`--artifacts` points at existing ones), and a random-weight model of TinyLlama-1.1B's shape (hidden
2048, 32 heads / 4 KV heads, MLP 5632, vocabulary 32000) whose FTC factors come from compressing
one such random layer (4 x 512 calibration tokens) and are reused in every layer: speed depends on
the shapes only. `--tiny-layers` sets its depth (22 is the real one; fewer keeps CPU runs short,
and the lm_head then weighs more in the whole-model numbers). Writes
benchmarks/results/inference.{json,md,png}; finished models are kept in the JSON and skipped on
re-runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ftc.arch import AttentionLayout, decoder_layers, layout_of
from ftc.artifact import load_artifact
from ftc.compress import CompressOptions, compress
from ftc.loading import load_model
from ftc.models import resolve_model

RESULTS = Path(__file__).parent / "results"
RATIOS = (0.8, 0.6, 0.4, 0.2)
PREFILL = (4, 512)
PROMPT, NEW_TOKENS, DECODE_BATCHES = 16, 128, (1, 8)
TARGET_ATTENTION_RATIO = 0.4
"""Attention-block time must be below dense at rho <= this."""
TARGET_PREFILL = 0.95
"""Whole-model prefill time at rho 0.2 must be at most this fraction of dense."""
TINY_SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632,
                  vocab_size=32000, max_position_embeddings=2048)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class AttentionTimer:
    """Wall time spent inside every decoder layer's attention module (hooks before and after)."""

    def __init__(self, model: nn.Module, layout: AttentionLayout, device: torch.device) -> None:
        self.device, self.seconds, self._start = device, 0.0, 0.0
        attention = layout.q.rpartition(".")[0]
        self.handles = []
        for layer in decoder_layers(model, layout):
            module = layer.get_submodule(attention)
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, *_) -> None:
        self._start = _clock(self.device)

    def _leave(self, *_) -> None:
        self.seconds += _clock(self.device) - self._start

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def held_bytes(module: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer a module holds (shared tensors once)."""
    tensors = {t.data_ptr(): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def attention_bytes(model: nn.Module, layout: AttentionLayout) -> int:
    attention = layout.q.rpartition(".")[0]
    total = 0
    for layer in decoder_layers(model, layout):
        parts = [layer.get_submodule(attention)] + ([layer.ftc] if hasattr(layer, "ftc") else [])
        total += sum(held_bytes(p) for p in parts)
    return total


@torch.no_grad()
def prefill(model: nn.Module, layout: AttentionLayout, ids: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """`(seconds of the forward, seconds inside attention)` of one prefill."""
    timer = AttentionTimer(model, layout, device)
    try:
        t0 = _clock(device)
        model(ids, use_cache=False)
        return _clock(device) - t0, timer.seconds
    finally:
        timer.remove()


@torch.no_grad()
def decode(model: nn.Module, prompt: torch.Tensor, device: torch.device) -> float:
    """Seconds to generate `NEW_TOKENS` greedily with the KV cache."""
    t0 = _clock(device)
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         use_cache=True, pad_token_id=0)
    seconds = _clock(device) - t0
    assert out.shape[1] == prompt.shape[1] + NEW_TOKENS
    return seconds


def measure(variants: dict[str, Callable[[], nn.Module]], vocab: int, device: torch.device, repeats: int) -> dict:
    """Every variant once per repeat, in turn; medians per variant."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, PREFILL, generator=generator).to(device)
    prompts = {b: torch.randint(0, vocab, (b, PROMPT), generator=generator).to(device) for b in DECODE_BATCHES}
    models = {name: make().to(device).eval() for name, make in variants.items()}
    layout = layout_of(models["dense"].config)  # every variant has the dense model's layout
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in models}
    for model in models.values():  # warm-up (allocator, kernels) outside the clock
        prefill(model, layout, ids[:1, :64], device)
        decode(model, prompts[1][:, :4], device)
    for repeat in range(repeats):
        for name, model in models.items():
            seconds, attention = prefill(model, layout, ids, device)
            row = samples[name]
            row.setdefault("prefill_seconds", []).append(seconds)
            row.setdefault("attention_seconds", []).append(attention)
            for b, prompt in prompts.items():
                row.setdefault(f"decode_b{b}_seconds", []).append(decode(model, prompt, device))
        print(f"  repeat {repeat + 1}/{repeats} done", flush=True)
    tokens = PREFILL[0] * PREFILL[1]
    out = {}
    for name, model in models.items():
        med = {k: statistics.median(v) for k, v in samples[name].items()}
        out[name] = {
            **{k: round(v, 4) for k, v in med.items()},
            "prefill_tokens_per_s": round(tokens / med["prefill_seconds"], 1),
            **{f"decode_b{b}_tokens_per_s": round(b * NEW_TOKENS / med[f"decode_b{b}_seconds"], 2)
               for b in DECODE_BATCHES},
            "attention_bytes": attention_bytes(model, layout),
            "model_bytes": held_bytes(model),
            "repeats": repeats,
        }
    return out


def _artifact(folder: Path, options: CompressOptions) -> Path:
    if not (folder / "manifest.json").exists():
        print(f"  compressing {options.model} at rho {options.ratio} -> {folder}", flush=True)
        compress(options, folder, overwrite=True, progress=False)
    return folder


def smollm2_variants(artifacts: Path, device: torch.device) -> tuple[dict, int, str]:
    def dense() -> nn.Module:
        return load_model(resolve_model("smollm2-135m"))[0]

    variants: dict[str, Callable[[], nn.Module]] = {"dense": dense}
    for ratio in RATIOS:
        folder = _artifact(artifacts / f"smollm2-{ratio}", CompressOptions(
            model="smollm2-135m", ratio=ratio, calib_samples=8, seq_len=512, dtype="float16", device=str(device)))
        variants[f"ftc@{ratio}"] = lambda folder=folder: load_artifact(folder)[0]
    setup = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32); FTC artifacts: 8 x 512 calibration tokens"
    return variants, 49152, setup


def tinyllama_variants(artifacts: Path, device: torch.device, layers: int) -> tuple[dict, int, str]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ftc.hf.modeling_ftc import place
    from ftc.models import load_tokenizer
    from ftc.stored import build_modules

    source = artifacts / "tinyllama-shape-1layer"
    if not (source / "config.json").exists():
        torch.manual_seed(0)
        one = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY_SHAPE, "vocab_size": 49152},
                                                           num_hidden_layers=1))
        one.save_pretrained(source)
        load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(source)
    config = LlamaConfig(**TINY_SHAPE, num_hidden_layers=layers)

    def dense() -> nn.Module:
        torch.manual_seed(1)
        return AutoModelForCausalLM.from_config(config).eval()

    def compressed(folder: Path) -> nn.Module:
        """The dense random model with layer 0's stored groups installed in every layer."""
        from safetensors.torch import load_file

        from ftc.artifact import WEIGHTS, read_manifest

        model = dense()
        layout = layout_of(config)
        tensors = load_file(str(folder / WEIGHTS))
        entry = read_manifest(folder)["layers"][0]
        for layer in decoder_layers(model, layout):
            modules, groups = {}, nn.ModuleDict()
            for spec in entry["groups"]:
                name = "".join(spec["proj"])
                prefix = f"model.layers.0.ftc.{name}."
                group = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
                built = build_modules(spec, group, {}, layout.head_dim, torch.float32)
                groups[name] = next(iter(built.values())).group  # registered as load_artifact does
                modules.update(built)
            place(layer, layout.projections, modules)
            layer.ftc = groups
        return model

    variants: dict[str, Callable[[], nn.Module]] = {"dense": dense}
    for ratio in RATIOS:
        folder = _artifact(artifacts / f"tinyllama-shape-{ratio}", CompressOptions(
            model=str(source), ratio=ratio, calib_samples=4, seq_len=512, dtype="float16", device=str(device)))
        variants[f"ftc@{ratio}"] = lambda folder=folder: compressed(folder)
    setup = (f"random weights, TinyLlama-1.1B shape with {layers} of its 22 layers; FTC factors of one random "
             f"layer (4 x 512 calibration tokens) in every layer")
    return variants, TINY_SHAPE["vocab_size"], setup


def verdicts(rows: dict) -> dict:
    dense = rows["dense"]
    low = [r for r in RATIOS if r <= TARGET_ATTENTION_RATIO]
    return {
        "attention_below_dense_at_rho<=0.4": all(
            rows[f"ftc@{r}"]["attention_seconds"] < dense["attention_seconds"] for r in low),
        "prefill_at_rho_0.2_vs_dense": round(rows["ftc@0.2"]["prefill_seconds"] / dense["prefill_seconds"], 3),
        "prefill_target_met": rows["ftc@0.2"]["prefill_seconds"] <= TARGET_PREFILL * dense["prefill_seconds"],
    }


def render(results: dict) -> str:
    lines = ["# Inference: FTC artifacts against dense", "",
             f"Device: {results['device']} ({results['host']}, {results['threads']} torch threads). Prefill "
             f"{PREFILL[0]} x {PREFILL[1]} tokens; decode {NEW_TOKENS} new tokens after a {PROMPT}-token prompt "
             f"with the KV cache. Medians of repeats run side by side (each repeat runs every variant once). "
             "Bytes are the float32 tensors held at run time.", ""]
    for name, entry in results["models"].items():
        rows = entry["rows"]
        dense = rows["dense"]
        lines += [f"## {name}", "", entry["setup"], "",
                  "| variant | prefill tok/s | x dense time | attention s | x dense | decode b1 tok/s | "
                  "decode b8 tok/s | attention MiB | model MiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for variant, r in rows.items():
            lines.append(
                f"| {variant} | {r['prefill_tokens_per_s']:.0f} | "
                f"{r['prefill_seconds'] / dense['prefill_seconds']:.3f} | {r['attention_seconds']:.3f} | "
                f"{r['attention_seconds'] / dense['attention_seconds']:.3f} | {r['decode_b1_tokens_per_s']:.1f} | "
                f"{r['decode_b8_tokens_per_s']:.1f} | {r['attention_bytes'] / 2**20:.1f} | "
                f"{r['model_bytes'] / 2**20:.1f} |")
        v = entry["verdicts"]
        lines += ["", f"- attention-block time below dense at every rho <= {TARGET_ATTENTION_RATIO}: "
                      f"{'met' if v['attention_below_dense_at_rho<=0.4'] else 'MISSED'}",
                  f"- whole-model prefill at rho 0.2: {v['prefill_at_rho_0.2_vs_dense']:.3f}x dense time "
                  f"(target <= {TARGET_PREFILL}): {'met' if v['prefill_target_met'] else 'MISSED'}", ""]
    return "\n".join(lines)


def plot(results: dict) -> bytes:
    """Prefill and decode throughput against rho, relative to dense, one panel per model."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    models = results["models"]
    figure = Figure(figsize=(4.8 * len(models), 3.6))
    FigureCanvasAgg(figure)
    for i, (name, entry) in enumerate(models.items()):
        ax = figure.add_subplot(1, len(models), i + 1)
        rows = entry["rows"]
        for key, label in (("prefill_tokens_per_s", "prefill"), ("decode_b1_tokens_per_s", "decode b1"),
                           ("decode_b8_tokens_per_s", "decode b8")):
            ax.plot(RATIOS, [rows[f"ftc@{r}"][key] / rows["dense"][key] for r in RATIOS], marker="o", label=label)
        ax.plot(RATIOS, [rows["dense"]["attention_seconds"] / rows[f"ftc@{r}"]["attention_seconds"] for r in RATIOS],
                marker="s", linestyle="--", label="attention block")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("keep ratio rho")
        ax.set_ylabel("speed vs dense (x)")
        ax.invert_xaxis()
        ax.legend(fontsize=7)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "tinyllama-shape", "all"), default="all")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny-layers", type=int, default=22, help="decoder layers of the 1.1B-shaped model")
    parser.add_argument("--artifacts", type=Path, default=Path(tempfile.gettempdir()) / "ftc-inference-bench",
                        help="where artifacts are kept between runs (compressed when missing)")
    parser.add_argument("--out", type=Path, default=RESULTS / "inference.json")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    results = json.loads(args.out.read_text()) if args.out.exists() else {"models": {}}
    if not args.render_only:
        results.update(device=str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
                       host=platform.machine(), threads=torch.get_num_threads())
        names = ("smollm2", "tinyllama-shape") if args.model == "all" else (args.model,)
        for name in names:
            print(f"{name}:", flush=True)
            if name == "smollm2":
                variants, vocab, setup = smollm2_variants(args.artifacts, device)
                title = "SmolLM2-135M"
            else:
                variants, vocab, setup = tinyllama_variants(args.artifacts, device, args.tiny_layers)
                title = f"TinyLlama-1.1B shape ({args.tiny_layers} layers, random)"
            rows = measure(variants, vocab, device, args.repeats)
            results["models"][title] = {"setup": setup, "rows": rows, "verdicts": verdicts(rows)}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2))
    args.out.with_suffix(".md").write_text(render(results))
    args.out.with_suffix(".png").write_bytes(plot(results))
    print(render(results))


if __name__ == "__main__":
    main()
