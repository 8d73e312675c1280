"""One compression job from options to artifact: the entry point shared by the CLI, the
benchmarks and the service workers."""

from __future__ import annotations

import copy
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import __version__
from .arch import layout_of
from .artifact import write_artifact
from .data import calibration_ids, ids_sha256, load_text, tokenize
from .methods import make_method
from .models import ModelSource, load_model, pick_device, resolve_model
from .options import METHODS, InputError, parse_ablations, validate_ratio
from .pipeline import LayerResult, compress_model

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class CompressOptions:
    model: str = "smollm2-135m"
    method: str = "ftc"
    ratio: float = 0.4
    calib: str = "wikitext2"
    calib_samples: int = 32
    seq_len: int = 512
    seed: int = 0
    dtype: str = "float16"
    device: str = "auto"
    ablate: tuple[str, ...] = field(default_factory=tuple)
    batch_size: int = 8

    def validate(self) -> CompressOptions:
        """Check every field before any work starts; messages name the flag and the fix."""
        validate_ratio(self.ratio)
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        self.ablate = parse_ablations(list(self.ablate))
        if self.ablate and self.method != "ftc":
            raise InputError("--ablate applies to --method ftc only")
        if self.dtype not in DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if self.calib_samples < 1 or self.seq_len < 2:
            raise InputError("--calib-samples must be >= 1 and --seq-len >= 2")
        return self


def library_versions() -> dict:
    import safetensors
    import transformers

    return {
        "ftc": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


def calibration_batch(tokenizer, options: CompressOptions, hidden: int) -> torch.Tensor:
    ids = calibration_ids(
        tokenize(tokenizer, load_text(options.calib, "validation")),
        options.calib_samples,
        options.seq_len,
        options.seed,
    )
    if ids.numel() < hidden:
        raise InputError(
            f"calibration has {ids.numel()} tokens but the model's hidden size is {hidden}: the "
            f"activation Gram would be singular; raise --calib-samples or --seq-len"
        )
    return ids


def compress(
    options: CompressOptions,
    out_dir: Path,
    *,
    loaded: tuple | None = None,
    overwrite: bool = False,
    progress: bool = True,
    on_layer=None,
) -> dict:
    """Compress `options.model` and write the artifact to `out_dir`; returns the manifest.

    `loaded = (model, tokenizer, source)` reuses a model already in memory (it is deep-copied,
    so the caller's copy stays dense).
    """
    options.validate()
    t0 = time.perf_counter()
    device = pick_device(options.device)
    if loaded is None:
        source: ModelSource = resolve_model(options.model)
        model, tokenizer = load_model(source, torch.float32, device)
    else:
        dense, tokenizer, source = loaded
        model = copy.deepcopy(dense).to(device)
    layout = layout_of(model.config)
    method = make_method(options.method, options.ratio, DTYPES[options.dtype], options.ablate)
    calib = calibration_batch(tokenizer, options, layout.hidden) if method.needs_data else None
    result = compress_model(
        model,
        layout,
        method,
        calib,
        device=device,
        batch_size=options.batch_size,
        progress=progress,
        on_layer=on_layer,
    )
    manifest = {
        "base_model": {**source.describe(), "model_type": layout.model_type},
        "method": options.method,
        "ratio": options.ratio,
        "options": {**asdict(options), "ablate": list(options.ablate)},
        "ablations": list(options.ablate),
        "choices": {
            "eps": 1e-4,
            "max_cond": 1e12,
            "prune_steps": 8,
            "refits": 2,
            "anchor": 0.5,
            "allocation_grid": "16x8 coarse, refined within one step",
        },
        "calibration": None
        if calib is None
        else {
            "source": options.calib,
            "split": "validation",
            "samples": options.calib_samples,
            "seq_len": options.seq_len,
            "tokens": calib.numel(),
            "seed": options.seed,
            "sha256": ids_sha256(calib),
        },
        "storage": storage_summary(model, layout, result.layers, options.ratio, DTYPES[options.dtype]),
        "compress_seconds": round(result.seconds, 3),
        "device": str(device),
        "versions": library_versions(),
    }
    manifest = write_artifact(
        Path(out_dir), model, tokenizer, layout, result.layers, manifest, DTYPES[options.dtype], overwrite
    )
    manifest["total_seconds"] = round(time.perf_counter() - t0, 3)
    return manifest


def storage_summary(model, layout, layers: list[LayerResult], ratio: float, dtype: torch.dtype) -> dict:
    """Budget and usage in stored values (§1), and the whole-model reduction it implies."""
    from .stored import stored_values

    qkv_used = o_used = 0
    for layer in layers:
        for spec, tensors in layer.groups:
            used = stored_values(spec, tensors)
            if spec["proj"] == ["o"]:
                o_used += used
            else:
                qkv_used += used
    n_layers = len(layers)
    original_attention = n_layers * (layout.qkv_params + layout.o_params)
    dense_total = _dense_parameter_count(model, layout, n_layers)
    saved = original_attention - qkv_used - o_used
    return {
        "value_bytes": torch.finfo(dtype).bits // 8,
        "qkv_budget_values": n_layers * int(ratio * layout.qkv_params),
        "qkv_values_used": qkv_used,
        "o_budget_values": n_layers * int(ratio * layout.o_params),
        "o_values_used": o_used,
        "original_attention_params": original_attention,
        "attention_share": original_attention / dense_total,
        "model_params_dense": dense_total,
        "model_reduction": saved / dense_total,
    }


def _dense_parameter_count(model, layout, n_layers: int) -> int:
    """Parameters of the uncompressed model (tied embeddings counted once)."""
    from .stored import FactoredLinear

    seen, total = set(), 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or (isinstance(module, FactoredLinear) and name in ("a", "b")):
                continue
            seen.add(id(p))
            total += p.numel()
    return total + n_layers * (layout.qkv_params + layout.o_params)
