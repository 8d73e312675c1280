"""The stored form of a compressed attention layer (ftc-method.md §9) and the modules it runs as.

A layer is a list of *groups*. Each group covers one or more projections and is either
`tucker` (`U1`, `U2`, and a dense `core` or `core_values` + bit-packed `core_mask`) or `lowrank`
(`A`, `B`). The compressing process and the loader both build modules from these stored tensors
through `build_modules`, so a reloaded artifact computes exactly what the compressor measured.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .tucker import TuckerFactors


class FactoredLinear(nn.Module):
    """`y = (x @ A) @ B + bias`: a projection replaced by two factors.

    Q/K/V modules of one Tucker group share the same `A` (`U1_hat`), so `x @ U1_hat` is the
    shared latent code of §9 and `B` holds the per-slice `G_s U2^T` blocks.
    """

    def __init__(self, a: nn.Parameter, b: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.a = a
        self.b = nn.Parameter(b, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = a.shape[0], b.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x @ self.a.to(x.dtype)) @ self.b.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """Dense `(out, in)` equivalent, for code that inspects `Linear.weight`."""
        return (self.a @ self.b).T


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Row-major bits of a boolean tensor, 8 per byte (big-endian within a byte)."""
    return torch.from_numpy(np.packbits(mask.flatten().cpu().numpy()))


def unpack_mask(bits: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    count = int(np.prod(shape))
    flat = np.unpackbits(bits.cpu().numpy(), count=count).astype(bool)
    return torch.from_numpy(flat).reshape(shape)


def tucker_tensors(factors: TuckerFactors, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """§9 tensors of a Tucker group, cast to the storage dtype (values in row-major support order)."""
    out = {"U1": factors.u1.to(dtype).contiguous(), "U2": factors.u2.to(dtype).contiguous()}
    if factors.mask is None:
        out["core"] = factors.core.to(dtype).contiguous()
    else:
        out["core_values"] = factors.core[factors.mask].to(dtype).contiguous()
        out["core_mask"] = pack_mask(factors.mask)
    return out


def lowrank_tensors(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"A": a.to(dtype).contiguous(), "B": b.to(dtype).contiguous()}


def tucker_core(tensors: dict[str, torch.Tensor], shape: tuple[int, int, int]) -> torch.Tensor:
    """The `(S, r1, r2)` core from its dense or sparse stored form."""
    if "core" in tensors:
        return tensors["core"]
    mask = unpack_mask(tensors["core_mask"], shape)
    core = torch.zeros(shape, dtype=tensors["core_values"].dtype)
    core[mask] = tensors["core_values"]
    return core


def stored_values(spec: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Budget units a group occupies: 16-bit values, the mask counted as `ceil(bits / 16)` (§1)."""
    values = sum(t.numel() for name, t in tensors.items() if name != "core_mask")
    if "core_mask" in tensors:
        bits = int(np.prod(spec["shape"]))
        values += -(-bits // 16)
    return values


def build_modules(
    spec: dict,
    tensors: dict[str, torch.Tensor],
    biases: dict[str, torch.Tensor | None],
    head_dim: int,
    compute_dtype: torch.dtype,
) -> dict[str, FactoredLinear]:
    """Projection modules (keyed `q`/`k`/`v`/`o`) of one stored group."""
    cast = {k: v.to(compute_dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    if spec["kind"] == "lowrank":
        (proj,) = spec["proj"]
        a = nn.Parameter(cast["A"], requires_grad=False)
        return {proj: FactoredLinear(a, cast["B"], biases.get(proj))}
    core = tucker_core(cast, tuple(spec["shape"]))
    blocks = core @ cast["U2"].T  # (S, r1, dh): per-slice G_s U2^T
    a = nn.Parameter(cast["U1"], requires_grad=False)
    modules: dict[str, FactoredLinear] = {}
    start = 0
    for proj, heads in zip(spec["proj"], spec["heads"], strict=True):
        copies = spec.get("kv_repeat", 1) if proj in ("k", "v") else 1
        part = blocks[start : start + heads * copies]
        start += heads * copies
        if copies > 1:  # ablation kv_repeat: the repeated copies of a shared head are averaged
            part = part.reshape(heads, copies, *part.shape[1:]).mean(1)
        b = part.permute(1, 0, 2).reshape(part.shape[1], heads * head_dim)
        modules[proj] = FactoredLinear(a, b, biases.get(proj))
    return modules
