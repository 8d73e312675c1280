"""The compressed checkpoint on disk (ftc-method.md §9): per-layer checkpoints, atomic assembly,
and a loader that rebuilds a working model.

While compressing, every finished layer goes to a work folder (`LayerStore`) as its own
safetensors file plus a JSON entry, together with the calibration stream needed to continue, so
a killed run resumes at the first unfinished layer. At the end the layer files and the untouched
weights are streamed, one tensor at a time, into `DIR/model.safetensors`; `manifest.json` is
written last and the folder appears atomically.

Tensor names: every unchanged weight keeps its Hugging Face name; compressed groups are stored
as `{layer prefix}.ftc.{group}.{tensor}` (group `qkv`, `o`, or `q`/`k`/`v` for per-matrix methods).

`config.json` is the base model's config under its own architecture (`model_type` `ftc_<base>`,
`auto_map` to the `modeling_ftc.py` copied beside it) plus an `ftc` block with every group's spec
and tensor shapes, so transformers (with `trust_remote_code=True`) and `load_artifact` build the
same modules from the same files.
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

from ftc.models.arch import AttentionLayout, layout_of
from ftc.options import InputError

from .hf import modeling_ftc
from .hf.modeling_ftc import FORMAT_VERSION, RUNTIMES, family, group_name
from .stored import runtime_values, stored_values, tensor_shapes

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CODE = f"{modeling_ftc.CODE_FILE}.py"
COPY_CHUNK = 16 << 20
DTYPE_CODES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
               torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`path` holds `data` whole or keeps what it held: written beside it, then renamed over it. The
    temporary name carries the pid, so processes writing the same file (workers filling one cache)
    never write into each other's temporary."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
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


def layer_tensors(layer: nn.Module, prefix: str, groups: list, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A compressed decoder layer as stored: unchanged weights in `dtype` plus its groups.

    The installed projections reference their groups without registering them, so the layer's
    own state dict holds only the uncompressed weights and the projections' biases.
    """
    out = {}
    for key, value in layer.state_dict().items():
        out[f"{prefix}.{key}"] = value.detach().to("cpu", dtype if value.is_floating_point() else value.dtype)
    for spec, tensors in groups:
        for name, t in tensors.items():
            out[f"{prefix}.ftc.{group_name(spec)}.{name}"] = t.detach().cpu()
    return {k: v.contiguous() for k, v in out.items()}


def group_entries(groups: list) -> list[dict]:
    """Manifest entries of a layer's groups: the spec, its tensor shapes, the values it occupies on
    disk and at run time, and its bytes."""
    return [{**spec, "shapes": tensor_shapes(tensors), "values": stored_values(spec, tensors),
             "runtime_values": runtime_values(spec, tensors),
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
            atomic_write_bytes(stamp, json.dumps({"fingerprint": fingerprint, "description": description},
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
        atomic_write_bytes(self._layer(index, "json"), json.dumps(entry, indent=2).encode())
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


GROUP_SPEC_KEYS = ("kind", "proj", "heads", "shape", "kept", "kv_repeat", "shapes")


def compressed_config(config, entries: list[dict]) -> dict:
    """The artifact's `config.json`: the base config under the compressed architecture."""
    layout = layout_of(config)
    config_name, model_name = modeling_ftc.family_names(layout.model_type)
    base = config.to_dict()
    block = {
        "format_version": FORMAT_VERSION,
        "base_model_type": layout.model_type,
        "base_architectures": base.get("architectures") or [model_name[len("Ftc"):]],
        "layers_path": layout.layers_path,
        # the MLP's names too where its projections were compressed (scope `model`, §17)
        "projections": layout.all_projections if any(set(g["proj"]) & {"gate", "up", "down"} for e in entries
                                                     for g in e["groups"]) else layout.projections,
        "head_dim": layout.head_dim,
        "layers": [{"index": e["index"], "groups": [{k: g[k] for k in GROUP_SPEC_KEYS if k in g}
                                                    for g in e["groups"]]} for e in entries],
    }
    return {**base, "model_type": f"ftc_{layout.model_type}", "architectures": [model_name],
            "auto_map": {"AutoConfig": f"{modeling_ftc.CODE_FILE}.{config_name}",
                         "AutoModelForCausalLM": f"{modeling_ftc.CODE_FILE}.{model_name}"},
            "ftc": block}


def assemble(out_dir: Path, store: LayerStore, config, tokenizer, manifest: dict, overwrite: bool = False) -> dict:
    """Build the artifact folder from a complete `LayerStore`, atomically; returns the manifest."""
    with atomic_dir(out_dir, overwrite) as tmp:
        written = concat_safetensors(store.files(), tmp / WEIGHTS, {"format": "pt"})
        entries = store.entries()
        if any("shapes" not in g for e in entries for g in e["groups"]):
            raise InputError(f"work dir {store.folder} holds layers from an older ftc (artifact format < "
                             f"{FORMAT_VERSION}); delete it and run again")
        (tmp / CONFIG).write_text(json.dumps(compressed_config(config, entries), indent=2, sort_keys=True))
        shutil.copyfile(modeling_ftc.__file__, tmp / CODE)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        manifest = {**manifest, "format_version": FORMAT_VERSION, "layers": entries, "bytes_written": written,
                    "stored_values": sum(e["stored_values"] for e in entries),
                    "runtime_values": sum(e["runtime_values"] for e in entries)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))  # last: its presence means complete
    return manifest


def layer_entry(result) -> dict:
    groups = group_entries(result.groups)
    return {"index": result.index, "groups": groups, **result.report,
            "stored_values": sum(g["values"] for g in groups),
            "runtime_values": sum(g["runtime_values"] for g in groups),
            "seconds": round(result.seconds, 3)}


def extra_names(names: list[str], layout: AttentionLayout, config) -> list[str]:
    """Weights outside the decoder layers; a tied output head is stored once, as the embedding."""
    tied = getattr(config, "tie_word_embeddings", False)
    return [n for n in names if not n.startswith(f"{layout.layers_path}.") and not (tied and n == "lm_head.weight")]


def read_manifest(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def ftc_block(path: Path) -> dict:
    """The `ftc` block of an artifact's config, or a clear error for anything else."""
    path = Path(path)
    if not (path / MANIFEST).is_file() or not (path / CONFIG).is_file():
        raise InputError(f"{path} is not an ftc artifact (no {MANIFEST} or {CONFIG}); give a folder written by "
                         f"'ftc compress'")
    try:
        block = json.loads((path / CONFIG).read_text()).get("ftc")
    except ValueError as exc:
        raise InputError(f"{path}/{CONFIG} is not valid JSON ({exc}); the artifact is damaged") from None
    if block is None:
        raise InputError(f"{path} is not an ftc artifact (no {MANIFEST} or no 'ftc' block in {CONFIG}); "
                         f"give a folder written by 'ftc compress' (format {FORMAT_VERSION})")
    if block.get("format_version") != FORMAT_VERSION:
        raise InputError(f"{path} is in artifact format {block.get('format_version')}; this ftc reads format "
                         f"{FORMAT_VERSION}: compress the model again")
    return block


def base_config(path: Path):
    """The stock config of the base architecture an artifact was compressed from."""
    from transformers import CONFIG_MAPPING

    block = ftc_block(path)
    data = json.loads((Path(path) / CONFIG).read_text())
    for key in ("ftc", "auto_map", "model_type"):
        data.pop(key, None)
    data["architectures"] = block["base_architectures"]
    return CONFIG_MAPPING[block["base_model_type"]].from_dict(data)


def load_compressed(path: Path, compute_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    runtime: str = "speed"):
    """The model of an artifact folder alone, in eval mode: `load_artifact` without the tokenizer
    and manifest, for a process that serves tokens it is given (and is sized by its memory).

    The model is the checkpoint's own compressed class (the one `trust_remote_code` loads),
    taken from this package rather than from the copy in the folder; its weights are read
    without mapping the file (`modeling_ftc.unmapped_weights`).
    """
    if runtime not in RUNTIMES:
        raise InputError(f"runtime must be one of {', '.join(RUNTIMES)}; got {runtime!r}")
    path = Path(path)
    _, model_cls = family(ftc_block(path)["base_model_type"])
    return model_cls.from_pretrained(path, dtype=compute_dtype, ftc_runtime=runtime).to(device).eval()


def load_artifact(path: Path, compute_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  runtime: str = "speed"):
    """`(model, tokenizer, manifest)` rebuilt from an artifact folder, with no base model needed.

    `runtime` picks the form every group runs in (ftc-method.md §9): `speed` (the default) the
    cheapest per token for its shapes, `memory` the stored tensors as they are (the smallest
    resident size, and the only form a loaded model can be saved from). `model.ftc_forms()` lists
    what each group runs as.
    """
    from transformers import AutoTokenizer

    model = load_compressed(path, compute_dtype, device, runtime)
    path = Path(path)
    # the base config tells AutoTokenizer the tokenizer's family, so it never reads the folder's
    # `auto_map` (which would ask, on stdout, whether to run the folder's code)
    tokenizer = (AutoTokenizer.from_pretrained(path, config=base_config(path))
                 if (path / "tokenizer_config.json").exists() else None)
    return model, tokenizer, read_manifest(path)
