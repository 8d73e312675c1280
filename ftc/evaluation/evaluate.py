"""Perplexity by the common protocol: non-overlapping windows of `seq_len` tokens."""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(
    model: nn.Module,
    ids: torch.Tensor,
    seq_len: int,
    max_windows: int | None = None,
    *,
    device: torch.device | str = "cpu",
    batch_size: int = 4,
    progress: bool = True,
    prefix: tuple[int, ...] = (),
) -> dict:
    """exp(mean next-token NLL) over the first `max_windows` windows of `ids` (1-D).

    Each window is scored on its own, predicting tokens 2..seq_len from their prefix. `prefix` (the
    tokenizer's `bos_prefix`) is put before every window as context and not scored, so the scored
    tokens are the same with or without it.
    """
    windows = ids.numel() // seq_len
    if max_windows is not None:
        windows = min(windows, max_windows)
    if windows == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    data = ids[: windows * seq_len].view(windows, seq_len)
    data = torch.cat([torch.tensor(prefix, dtype=data.dtype).expand(windows, len(prefix)), data], dim=1)
    skip = len(prefix)
    total_nll, count = 0.0, 0
    starts = range(0, windows, batch_size)
    for start in tqdm(starts, desc="eval", unit="batch", disable=not progress):
        batch = data[start : start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, skip:-1].float()
        nll = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, skip + 1 :].reshape(-1), reduction="sum"
        )
        total_nll += float(nll)
        count += batch[:, skip + 1 :].numel()
    mean_nll = total_nll / count
    return {
        "seq_len": seq_len,
        "windows": windows,
        "tokens": windows * seq_len,
        "nll": mean_nll,
        "ppl": math.exp(mean_nll),
    }
