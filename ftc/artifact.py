"""The compressed checkpoint on disk (ftc-method.md §9): write atomically, reload into a model.

`DIR/model.safetensors` holds every unchanged weight plus the stored groups of each compressed
layer under `{layer prefix}.ftc.{group}.{tensor}`; `DIR/manifest.json` says how each layer was
made and is written last; config and tokenizer files make the folder loadable on its own.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .arch import AttentionLayout, decoder_layers, layout_of, set_module
from .stored import FactoredLinear, build_modules

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
FORMAT_VERSION = 1


def group_name(spec: dict) -> str:
    return "".join(spec["proj"])


def group_key(layout: AttentionLayout, layer: int, spec: dict, tensor: str) -> str:
    return f"{layout.layers_path}.{layer}.ftc.{group_name(spec)}.{tensor}"


@contextmanager
def atomic_dir(target: Path, overwrite: bool = False):
    """Yield a temporary sibling folder that replaces `target` only if the block succeeds."""
    target = Path(target)
    if target.exists() and not overwrite and any(target.iterdir()):
        raise FileExistsError(
            f"--out {target} exists and is not empty; pass --overwrite or pick a new folder"
        )
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _factor_keys(model: nn.Module, params: tuple[str, ...] = ("a", "b")) -> set[str]:
    return {
        f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, FactoredLinear) for p in params
    }


def _plain_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight that is not a factor of a compressed projection, cast to the storage dtype."""
    factor_keys = _factor_keys(model)
    state = {}
    for key, value in model.state_dict().items():
        if key in factor_keys:
            continue
        state[key] = (
            value.detach().to("cpu", dtype if value.is_floating_point() else value.dtype).contiguous()
        )
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def write_artifact(
    out_dir: Path,
    model: nn.Module,
    tokenizer,
    layout: AttentionLayout,
    layers: list,  # PipelineResult.layers
    manifest: dict,
    dtype: torch.dtype,
    overwrite: bool = False,
) -> dict:
    """Write the checkpoint; returns the manifest with layer specs and byte counts filled in."""
    tensors = _plain_state(model, dtype)
    layer_entries = []
    for result in layers:
        specs = []
        for spec, group in result.groups:
            for name, t in group.items():
                tensors[group_key(layout, result.index, spec, name)] = t.cpu().contiguous()
            specs.append({**spec, "bytes": sum(t.numel() * t.element_size() for t in group.values())})
        layer_entries.append(
            {"index": result.index, "groups": specs, **result.report, "seconds": round(result.seconds, 3)}
        )
    with atomic_dir(out_dir, overwrite) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "ftc", "version": str(FORMAT_VERSION)})
        model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        manifest = {
            **manifest,
            "format_version": FORMAT_VERSION,
            "layers": layer_entries,
            "bytes_written": (tmp / WEIGHTS).stat().st_size,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))  # last: its presence means complete
    return manifest


def read_manifest(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def load_artifact(path: Path, compute_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """`(model, tokenizer, manifest)` rebuilt from an artifact folder, with no base model needed."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    manifest = read_manifest(path)
    config = AutoConfig.from_pretrained(path)
    layout = layout_of(config)
    model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
    tensors = load_file(str(path / WEIGHTS))
    layers = decoder_layers(model, layout)
    for entry in manifest["layers"]:
        prefix = f"{layout.layers_path}.{entry['index']}."
        biases = {}
        for proj, name in layout.projections.items():
            bias = tensors.pop(f"{prefix}{name}.bias", None)
            biases[proj] = None if bias is None else bias.to(compute_dtype)
        for spec in entry["groups"]:
            head = f"{prefix}ftc.{group_name(spec)}."
            group = {k[len(head) :]: tensors.pop(k) for k in list(tensors) if k.startswith(head)}
            for proj, module in build_modules(spec, group, biases, layout.head_dim, compute_dtype).items():
                set_module(layers[entry["index"]], layout.projections[proj], module)
    state = {k: v.to(compute_dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    installed = _factor_keys(model, ("a", "b", "bias"))
    missing = [k for k in missing if k not in installed]
    tied = getattr(config, "tie_word_embeddings", False)
    if unexpected or [k for k in missing if not (tied and k == "lm_head.weight")]:
        raise ValueError(
            f"artifact {path} does not match its config: missing {missing}, unexpected {unexpected}"
        )
    if tied:
        model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    return model.to(device).eval(), tokenizer, manifest
