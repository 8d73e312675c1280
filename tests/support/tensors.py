"""Small head-sliced tensors with a known shared structure, for the Tucker numerics tests."""

from __future__ import annotations

import torch


def structured_tensor(slices: int = 7, d: int = 40, dh: int = 8, seed: int = 0) -> torch.Tensor:
    """`(S, d, dh)` float64 slices sharing a rank-12 mode-1 subspace, plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(d, 12, dtype=torch.float64, generator=g)
    structured = torch.stack(
        [shared @ torch.randn(12, dh, dtype=torch.float64, generator=g) for _ in range(slices)]
    )
    return structured + 0.05 * torch.randn(slices, d, dh, dtype=torch.float64, generator=g)
