"""The compressed checkpoint on disk (ftc-method.md §9): per-layer checkpoints, atomic assembly,
and a loader that rebuilds a working model.

While compressing, every finished layer goes to a work folder (`LayerStore`) as its own
safetensors file plus a JSON entry, together with the calibration stream needed to continue, so
a killed run resumes at the first unfinished layer. At the end the layer files and the untouched
weights are streamed, one tensor at a time, into `DIR/model.safetensors`; `manifest.json` is
written last and the folder appears atomically.

Tensor names: every unchanged weight keeps its Hugging Face name; compressed groups are stored
as `{layer prefix}.ftc.{group}.{tensor}` (group `qkv`, `o`, or `q`/`k`/`v` for per-matrix methods).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .arch import AttentionLayout, decoder_layers, layout_of, set_module
from .options import InputError
from .stored import FactoredLinear, build_modules, stored_values
from .weights import embedding_weight_name, skeleton

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
FORMAT_VERSION = 1
COPY_CHUNK = 16 << 20
DTYPE_CODES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
               torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}


def group_name(spec: dict) -> str:
    return "".join(spec["proj"])


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


@contextmanager
def atomic_dir(target: Path, overwrite: bool = False):
    """Yield a temporary sibling folder that replaces `target` only if the block succeeds."""
    target = Path(target)
    if target.exists() and not overwrite and any(target.iterdir()):
        raise FileExistsError(f"--out {target} exists and is not empty; pass --overwrite or pick a new folder")
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


def _factor_keys(module: nn.Module, params: tuple[str, ...] = ("a", "b")) -> set[str]:
    return {f"{name}.{p}" if name else p for name, m in module.named_modules() if isinstance(m, FactoredLinear)
            for p in params}


def layer_tensors(layer: nn.Module, prefix: str, groups: list, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A compressed decoder layer as stored: unchanged weights in `dtype` plus its groups."""
    skip = _factor_keys(layer)
    out = {}
    for key, value in layer.state_dict().items():
        if key not in skip:
            out[f"{prefix}.{key}"] = value.detach().to("cpu", dtype if value.is_floating_point() else value.dtype)
    for spec, tensors in groups:
        for name, t in tensors.items():
            out[f"{prefix}.ftc.{group_name(spec)}.{name}"] = t.detach().cpu()
    return {k: v.contiguous() for k, v in out.items()}


def group_entries(groups: list) -> list[dict]:
    """Manifest entries of a layer's groups: the spec, the values it occupies and its bytes."""
    return [{**spec, "values": stored_values(spec, tensors),
             "bytes": sum(t.numel() * t.element_size() for t in tensors.values())} for spec, tensors in groups]


def fingerprint_of(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()


class LayerStore:
    """The work folder of one compression run: finished layers, the stream, untouched weights.

    A fingerprint of model, options and calibration guards against resuming a different run.
    """

    def __init__(self, folder: Path, description: dict) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        stamp = self.folder / "fingerprint.json"
        fingerprint = fingerprint_of(description)
        if stamp.exists():
            held = json.loads(stamp.read_text())
            if held["fingerprint"] != fingerprint:
                raise InputError(
                    f"work dir {self.folder} holds a different run ({held['description'].get('method')} "
                    f"at ratio {held['description'].get('ratio')}); use a fresh --work-dir or delete it"
                )
        else:
            _atomic_write_bytes(stamp, json.dumps({"fingerprint": fingerprint, "description": description},
                                                  indent=2, default=str).encode())

    def _layer(self, index: int, suffix: str) -> Path:
        return self.folder / f"layer-{index:03d}.{suffix}"

    def finished(self) -> int:
        """Number of leading layers whose tensors and entry are both on disk."""
        count = 0
        while self._layer(count, "json").exists() and self._layer(count, "safetensors").exists():
            count += 1
        return count

    def save_layer(self, index: int, tensors: dict[str, torch.Tensor], entry: dict,
                   hidden: list[torch.Tensor] | None = None) -> None:
        """Commit a finished layer and, if given, the stream entering the next one.

        Order matters for a kill at any point: the new stream and the layer tensors first, the
        layer's JSON entry (the commit) next, the previous stream only after that.
        """
        if hidden is not None:
            _atomic_save({f"batch.{i}": h.cpu().contiguous() for i, h in enumerate(hidden)}, self._stream(index))
        _atomic_save(tensors, self._layer(index, "safetensors"))
        _atomic_write_bytes(self._layer(index, "json"), json.dumps(entry, indent=2).encode())
        for old in self.folder.glob("stream-*.safetensors"):
            if old != self._stream(index):
                old.unlink(missing_ok=True)

    def entries(self) -> list[dict]:
        return [json.loads(self._layer(i, "json").read_text()) for i in range(self.finished())]

    def _stream(self, after_layer: int) -> Path:
        return self.folder / f"stream-{after_layer:03d}.safetensors"

    def load_stream(self, after_layer: int) -> list[torch.Tensor]:
        path = self._stream(after_layer)
        if not path.exists():
            raise InputError(f"work dir {self.folder} lacks the stream after layer {after_layer}; delete it")
        saved = load_file(str(path))
        return [saved[f"batch.{i}"] for i in range(len(saved))]

    def save_extra(self, name: str, tensor: torch.Tensor) -> None:
        """A weight outside the decoder layers (embeddings, final norm, head), one file each."""
        digest = hashlib.sha1(name.encode()).hexdigest()[:12]
        _atomic_save({name: tensor.contiguous()}, self.folder / f"extra-{digest}.safetensors")

    def files(self) -> list[Path]:
        return sorted(self.folder.glob("extra-*.safetensors")) + [
            self._layer(i, "safetensors") for i in range(self.finished())
        ]


def _data_section(path: Path) -> tuple[int, dict]:
    """Where a safetensors file's tensor bytes start, and its header (minus the metadata)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def concat_safetensors(sources: list[Path], target: Path, metadata: dict[str, str]) -> int:
    """Join several safetensors files into one; returns its size in bytes.

    A file's data section is the tensors' bytes back to back with no holes (the format requires
    it), so each section is copied verbatim in chunks and only the offsets in the header move:
    no tensor is ever materialised, whatever its size.
    """
    header: dict = {"__metadata__": metadata}
    sections, base = [], 0
    for path in sources:
        start, entries = _data_section(path)
        for name, info in entries.items():
            begin, end = info["data_offsets"]
            header[name] = {**info, "data_offsets": [base + begin, base + end]}
        size = path.stat().st_size - start
        sections.append((path, start))
        base += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(target, "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for path, start in sections:
            with open(path, "rb") as src:
                src.seek(start)
                shutil.copyfileobj(src, out, COPY_CHUNK)
        out.flush()
        os.fsync(out.fileno())
    return target.stat().st_size


def assemble(out_dir: Path, store: LayerStore, config, tokenizer, manifest: dict, overwrite: bool = False) -> dict:
    """Build the artifact folder from a complete `LayerStore`, atomically; returns the manifest."""
    with atomic_dir(out_dir, overwrite) as tmp:
        written = concat_safetensors(store.files(), tmp / WEIGHTS, {"format": "ftc", "version": str(FORMAT_VERSION)})
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        manifest = {**manifest, "format_version": FORMAT_VERSION, "layers": store.entries(), "bytes_written": written}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))  # last: its presence means complete
    return manifest


def write_artifact(out_dir: Path, model: nn.Module, tokenizer, layout: AttentionLayout, layers: list, manifest: dict,
                   dtype: torch.dtype, overwrite: bool = False) -> dict:
    """Write a model compressed in memory (all layers present) through the same store and assembly."""
    out_dir = Path(out_dir)
    work = out_dir.parent / f".{out_dir.name}.work-{os.getpid()}"
    try:
        store = LayerStore(work, {"in_memory": id(model)})
        decoder = decoder_layers(model, layout)
        for result in layers:
            prefix = f"{layout.layers_path}.{result.index}"
            store.save_layer(result.index, layer_tensors(decoder[result.index], prefix, result.groups, dtype),
                             layer_entry(result))
        for name, value in extra_weights(model, layout):
            store.save_extra(name, value.detach().to(dtype if value.is_floating_point() else value.dtype))
        return assemble(out_dir, store, model.config, tokenizer, manifest, overwrite)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def layer_entry(result) -> dict:
    return {"index": result.index, "groups": group_entries(result.groups), **result.report,
            "seconds": round(result.seconds, 3)}


def extra_names(names: list[str], layout: AttentionLayout, config) -> list[str]:
    """Weights outside the decoder layers; a tied output head is stored once, as the embedding."""
    tied = getattr(config, "tie_word_embeddings", False)
    return [n for n in names if not n.startswith(f"{layout.layers_path}.") and not (tied and n == "lm_head.weight")]


def extra_weights(model: nn.Module, layout: AttentionLayout):
    state = model.state_dict()
    for name in extra_names(list(state), layout, model.config):
        yield name, state[name]


def read_manifest(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def load_artifact(path: Path, compute_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """`(model, tokenizer, manifest)` rebuilt from an artifact folder, with no base model needed."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    manifest = read_manifest(path)
    config = AutoConfig.from_pretrained(path)
    layout = layout_of(config)
    model = skeleton(config)
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
            group = {k[len(head):]: tensors.pop(k) for k in list(tensors) if k.startswith(head)}
            for proj, module in build_modules(spec, group, biases, layout.head_dim, compute_dtype).items():
                set_module(layers[entry["index"]], layout.projections[proj], module)
    state = {k: v.to(compute_dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    tied = getattr(config, "tie_word_embeddings", False)
    if tied and "lm_head.weight" not in state:
        state["lm_head.weight"] = state[embedding_weight_name(model)]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    installed = _factor_keys(model, ("a", "b", "bias"))
    missing = [k for k in missing if k not in installed]
    if unexpected or missing:
        raise ValueError(f"artifact {path} does not match its config: missing {missing}, unexpected {unexpected}")
    if tied:
        model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    return model.to(device).eval(), tokenizer, manifest


