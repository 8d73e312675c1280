"""The stored form of a compressed layer (ftc-method.md §9) and the modules it runs as.

A layer is a list of *groups*. Each group covers one or more projections and is either
`tucker` (`U1`, `U2`, and a dense `core` or `core_values` + bit-packed `core_mask`), `cp` (`A`,
`B`, `C`: the rank-R CP variant) or `lowrank` (`A`, `B`). The compressing process builds its
modules from these stored tensors through `build_modules`, with the same classes
(`ftc/runtime/hf/modeling_ftc.py`) that the loader and the checkpoint's own remote code use, in the
stored form, so an artifact loaded with `runtime="memory"` computes exactly what the compressor
measured (the default `speed` form, the same within float rounding).
"""

from __future__ import annotations

import numpy as np
import torch

from ftc.numerics.cp import CPFactors
from ftc.numerics.tucker import TuckerFactors

from .hf.modeling_ftc import FactorGroup, GroupProjection, held_values, make_group, projections


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Row-major bits of a boolean tensor, 8 per byte (big-endian within a byte), on the mask's
    device: the group built from them runs there while the next layers are compressed."""
    return torch.from_numpy(np.packbits(mask.flatten().cpu().numpy())).to(mask.device)


def tucker_tensors(factors: TuckerFactors, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """§9 tensors of a Tucker group, cast to the storage dtype (values in row-major support order)."""
    out = {"U1": factors.u1.to(dtype).contiguous()}
    if factors.u2 is not None:  # None: the identity, not stored (§17)
        out["U2"] = factors.u2.to(dtype).contiguous()
    if factors.mask is None:
        out["core"] = factors.core.to(dtype).contiguous()
    else:
        out["core_values"] = factors.core[factors.mask].to(dtype).contiguous()
        out["core_mask"] = pack_mask(factors.mask)
    return out


def cp_tensors(factors: CPFactors, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of a CP group, cast to the storage dtype: `A (d x R)`, `B (dh x R)`, `C (S x R)`."""
    return {"A": factors.a.to(dtype).contiguous(), "B": factors.b.to(dtype).contiguous(),
            "C": factors.c.to(dtype).contiguous()}


def lowrank_tensors(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"A": a.to(dtype).contiguous(), "B": b.to(dtype).contiguous()}


def stored_values(spec: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Budget units a group occupies: 16-bit values, the mask counted as `ceil(bits / 16)` (§1)."""
    values = sum(t.numel() for name, t in tensors.items() if name != "core_mask")
    if "core_mask" in tensors:
        bits = int(np.prod(spec["shape"]))
        values += -(-bits // 16)
    return values


def tensor_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {name: list(t.shape) for name, t in tensors.items()}


def runtime_values(spec: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Elements the runtime modules hold for a group (the packed mask counted per byte)."""
    return held_values({**spec, "shapes": tensor_shapes(tensors)})


def build_group(spec: dict, tensors: dict[str, torch.Tensor], compute_dtype: torch.dtype,
                runtime: str = "memory") -> FactorGroup:
    """The runtime module of one stored group, in the form `runtime` chooses (§9).

    `memory` (the default here) holds exactly the stored tensors and computes what the stored
    form computes, so the compressor measures what a `memory` load of the artifact runs.
    """
    group = make_group({**spec, "shapes": tensor_shapes(tensors)})
    group.load_state_dict({k: v.to(compute_dtype) if v.is_floating_point() else v for k, v in tensors.items()},
                          assign=True)
    group.prepare(runtime)
    return group


def build_modules(
    spec: dict,
    tensors: dict[str, torch.Tensor],
    biases: dict[str, torch.Tensor | None],
    head_dim: int | None,
    compute_dtype: torch.dtype,
    runtime: str = "memory",
) -> dict[str, GroupProjection]:
    """Projection modules (keyed by `PROJECTIONS`) of one stored group, sharing its work.

    `head_dim` is not used (each group's slice width is its own); it is accepted for callers
    written when every group was attention.
    """
    return projections(build_group(spec, tensors, compute_dtype, runtime), biases)
