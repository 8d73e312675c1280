"""Dense export: a compressed artifact as a plain checkpoint of its base architecture.

Every projection is rebuilt as the dense weight the factors compute (`W^T = group(I)`, through
the same runtime modules), everything else is copied, and the result is the base model's own
config, tensor names and safetensors layout: stock `from_pretrained`, vLLM or TGI load it with no
custom code. It saves no memory or compute at inference; it is how a compressed model reaches
tools that only run stock architectures.

The export streams: one layer's groups are rebuilt at a time and each tensor is written to its
shard as soon as it exists, so peak memory is one decoder layer whatever the model size. Shards
follow `save_pretrained` (`model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`
above the shard size, one `model.safetensors` below it), and the folder appears atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ftc.options import InputError

from .artifact import CODE, CONFIG, DTYPE_CODES, MANIFEST, WEIGHTS, atomic_dir, base_config, ftc_block
from .hf.modeling_ftc import FactorGroup, group_name, modules_of
from .stored import build_group

DEFAULT_SHARD_BYTES = 5 * 10**9
"""`save_pretrained`'s default `max_shard_size` ("5GB")."""
INDEX = "model.safetensors.index.json"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_NOT_COPIED = {CONFIG, WEIGHTS, MANIFEST, CODE}


@dataclass(frozen=True)
class _Tensor:
    """One tensor of the export: a copy of a stored one, or a projection rebuilt from its group."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str | None = None  # stored name to copy
    layer: int | None = None  # else: layer index and the projections whose rows it stacks
    projs: tuple[str, ...] = ()  # one, or Q, K and V of a fused projection (Phi-3's `qkv_proj`)

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * torch.empty((), dtype=self.dtype).element_size()


def _stored_dtype(f) -> torch.dtype:
    """The floating dtype the artifact was stored in (its first floating tensor's)."""
    for name in f.keys():
        t = f.get_slice(name)
        code = t.get_dtype()
        for dtype, c in DTYPE_CODES.items():
            if c == code and dtype.is_floating_point:
                return dtype
    return torch.float32


def _plan(block: dict, f, dtype: torch.dtype) -> list[_Tensor]:
    """Every tensor of the dense checkpoint in name order, with where its values come from."""
    layers_path, names = block["layers_path"], block["projections"]
    plan: dict[str, _Tensor] = {}
    for name in f.keys():
        if ".ftc." in name:
            continue
        code = f.get_slice(name).get_dtype()
        stored = next(d for d, c in DTYPE_CODES.items() if c == code)
        plan[name] = _Tensor(name, tuple(f.get_slice(name).get_shape()),
                             dtype if stored.is_floating_point else stored, source=name)
    for entry in block["layers"]:
        shapes: dict[str, tuple[int, int]] = {}  # (out, in) of each projection
        for spec in entry["groups"]:
            inputs = spec["shapes"]["U1" if spec["kind"] == "tucker" else "A"][0]
            heads = spec.get("heads", [])
            width = slice_width(spec)
            for i, proj in enumerate(spec["proj"]):
                shapes[proj] = (heads[i] * width if heads else spec["shapes"]["B"][1], inputs)
        for module, projs in modules_of(names, shapes).items():
            name = f"{layers_path}.{entry['index']}.{module}.weight"
            shape = (sum(shapes[p][0] for p in projs), shapes[projs[0]][1])
            plan[name] = _Tensor(name, shape, dtype, layer=entry["index"], projs=tuple(projs))
    return [plan[name] for name in sorted(plan)]


def slice_width(spec: dict) -> int | None:
    """The output width of one slice of a sliced group, read from its own shapes (a head for Q/K/V,
    the intermediate size for gate/up): `U2`'s rows, the core's last mode where `U2` is the identity
    (§17), CP's `B` rows; None for a low-rank group."""
    shapes = spec["shapes"]
    if spec["kind"] == "tucker":
        return shapes["U2"][0] if "U2" in shapes else spec["shape"][2]
    return shapes["B"][0] if spec["kind"] == "cp" else None


def _shards(plan: list[_Tensor], max_bytes: int) -> list[list[_Tensor]]:
    """`save_pretrained`'s rule: fill a shard until the next tensor would overflow it."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in plan:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


class _DenseLayers:
    """Dense projection weights of one layer at a time, rebuilt from its stored groups."""

    def __init__(self, block: dict, f) -> None:
        self.block, self.f = block, f
        self.entries = {e["index"]: e for e in block["layers"]}
        self.index: int | None = None
        self.weights: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def get(self, layer: int, projs: tuple[str, ...]) -> torch.Tensor:
        """The weight of one module: a projection's, or the stacked rows of a fused one's members."""
        if layer != self.index:
            self.index, self.weights = layer, {}
            for spec in self.entries[layer]["groups"]:
                prefix = f"{self.block['layers_path']}.{layer}.ftc.{group_name(spec)}."
                tensors = {k[len(prefix):]: self.f.get_tensor(k) for k in self.f.keys() if k.startswith(prefix)}
                self.weights.update(dense_weights(build_group(spec, tensors, torch.float32), self.block["head_dim"]))
        return torch.cat([self.weights[p] for p in projs]) if len(projs) > 1 else self.weights[projs[0]]


def dense_weights(group: FactorGroup, head_dim: int) -> dict[str, torch.Tensor]:
    """`(out, in)` weights of a group's projections: the group applied to the identity."""
    y = group(torch.eye(group.in_features, dtype=torch.float32))  # (in, all outputs) = W^T
    return {proj: y[:, start:stop].T.contiguous() for proj, (start, stop) in group.column_ranges(head_dim).items()}


def _write_shard(path: Path, tensors: list[_Tensor], values: Iterator[torch.Tensor]) -> None:
    """A safetensors file written one tensor at a time (header first: every size is known)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for t, value in zip(tensors, values, strict=True):
            value = value.to(t.dtype).contiguous()
            if tuple(value.shape) != t.shape:
                raise ValueError(f"{t.name}: planned shape {t.shape}, computed {tuple(value.shape)}")
            out.write(value.reshape(-1).view(torch.uint8).numpy().tobytes())
        out.flush()
        os.fsync(out.fileno())


def export_dense(artifact: Path, out: Path, dtype: str | None = None, overwrite: bool = False,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Write the dense checkpoint of `artifact` to `out`; returns a summary (files, bytes, dtype).

    `dtype` defaults to the artifact's storage dtype.
    """
    artifact, out = Path(artifact), Path(out)
    block = ftc_block(artifact)
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if out.resolve() == artifact.resolve():
        raise InputError("--out must differ from the artifact folder")
    config = base_config(artifact)
    with safe_open(str(artifact / WEIGHTS), "pt") as f, atomic_dir(out, overwrite) as tmp:
        target = DTYPES[dtype] if dtype else _stored_dtype(f)
        shards = _shards(_plan(block, f, target), max_shard_bytes)
        dense = _DenseLayers(block, f)
        files = [WEIGHTS] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for file, shard in zip(files, shards, strict=True):
            values = (f.get_tensor(t.source) if t.source else dense.get(t.layer, t.projs) for t in shard)
            _write_shard(tmp / file, shard, values)
        total = sum(t.nbytes for shard in shards for t in shard)
        if len(shards) > 1:
            weight_map = {t.name: file for file, shard in zip(files, shards, strict=True) for t in shard}
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2, sort_keys=True))
        config.dtype = target
        config.save_pretrained(tmp)
        for item in artifact.iterdir():
            if item.is_file() and item.name not in _NOT_COPIED:
                shutil.copyfile(item, tmp / item.name)
    return {"out": str(out), "files": files, "bytes": total, "dtype": str(target).removeprefix("torch.")}
