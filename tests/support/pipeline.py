"""Tiny models through the library's two entry points: `ftc.compression.compress.compress` (what users run)
and the layer pipeline on a model held whole in memory (the reference an artifact must match).

The library has one path from options to an artifact, `compress()`; tests that need the
compressed model itself (to compare logits, or to read a layer's report) call the pipeline here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from ftc.compression.compress import CompressOptions, calibration_batch, compress
from ftc.compression.gradients import with_loss_metric
from ftc.compression.methods import Method, make_method
from ftc.compression.pipeline import PipelineResult, compress_layers, layer_inputs, planned, survey_layers
from ftc.compression.sensitivity import search_budgets
from ftc.models.arch import AttentionLayout, layout_of
from ftc.models.registry import ModelSource
from ftc.models.weights import ModuleSource
from ftc.runtime.artifact import load_artifact


def compress_model(
    model: nn.Module,
    layout: AttentionLayout,
    method: Method,
    calibration: torch.Tensor | None,
    *,
    device: torch.device,
    batch_size: int = 8,
    compute_dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> PipelineResult:
    """Compress `model` in place with `method`, every layer resident (small models only)."""
    if method.loss_metric and method.output_grams is None:  # as compress() does
        method = with_loss_metric(method, ModuleSource(model), layout, calibration, device, progress)
    stream = layer_inputs(model, layout, calibration, batch_size, device) if method.needs_data else None
    if method.budgets is None:  # a manifest's method (`method_of`) is planned already
        if method.whole_model_plan:  # ASVD's rank search, on the resident model, as compress() does
            method = search_budgets(method, model, layout, calibration, batch_size=batch_size, progress=progress)
        elif method.plans:  # a model-wide budget: survey first, as compress() does
            copy = dataclasses.replace(stream, hidden=list(stream.hidden))  # the survey advances its own list
            method = planned(method, survey_layers(model, layout, method, copy, device=device, progress=progress),
                             layout)
    return compress_layers(model, layout, method, stream, device=device, compute_dtype=compute_dtype,
                           progress=progress)


def method_of(manifest: dict, storage_dtype: torch.dtype = torch.float32) -> Method:
    """The method a manifest ran, with the layer budgets its plan chose: the in-memory reference of an
    artifact compressed with any allocation (the default's plan, `sensitivity`, is measured by
    `compress()` alone; its budgets are in the manifest)."""
    method = make_method(manifest["method"], manifest["ratio"], storage_dtype, tuple(manifest["ablations"]),
                         manifest["allocation"]["kind"], manifest["options"]["scope"])
    budgets = manifest["allocation"]["layer_budgets"]
    return method if budgets is None else dataclasses.replace(method, budgets=tuple(budgets))


def compress_loaded(model: nn.Module, tokenizer, out: Path, **options) -> tuple[nn.Module, dict, torch.Tensor]:
    """`compress()` on a model already in memory, as the benchmarks call it.

    Returns the artifact reloaded from `out`, its manifest and the calibration ids it used (so a
    reference run can use the very same ones). `options` are `CompressOptions` fields.
    """
    opts = CompressOptions(model="in-memory", device="cpu", **options)
    source = ModelSource(spec="in-memory", kind="hf", path=Path(out))
    manifest = compress(opts, out, loaded=(model, tokenizer, source), progress=False)
    calib = calibration_batch(tokenizer, opts, layout_of(model.config).hidden)
    reloaded, _, _ = load_artifact(out)
    return reloaded, manifest, calib
