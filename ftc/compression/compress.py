"""One compression job from options to artifact: the entry point shared by the CLI, the
benchmarks and the service workers.

The model is never loaded whole: a skeleton on the meta device, one decoder layer materialised
at a time from the weight source, each finished layer checkpointed to the work folder, and the
artifact assembled from those checkpoints at the end.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ftc import __version__
from ftc.evaluation.data import bos_prefix, calibration_ids, calibration_text, ids_sha256, load_text, tokenize
from ftc.models.arch import AttentionLayout, layer_types, layout_of
from ftc.models.registry import load_tokenizer, pick_device, resolve_model
from ftc.models.weights import (
    ModuleSource,
    gguf_parsed_once,
    materialize_embedding_rows,
    open_weights,
    release,
    skeleton,
    text_part,
)
from ftc.numerics.metric import spilled_grams
from ftc.options import (
    ALLOCATIONS,
    BATCH_SIZE,
    DTYPES,
    METHODS,
    SCOPES,
    InputError,
    default_allocation,
    method_ratio_problem,
    parse_ablations,
    scope_problem,
    validate_ratio,
)
from ftc.runtime.artifact import LayerStore, assemble, extra_names, layer_entry, layer_tensors
from ftc.runtime.hf.modeling_ftc import trim_heap

from .gradients import with_loss_metric
from .methods import Method, make_method
from .pipeline import compress_layers, layer_inputs, planned, survey_layers
from .sensitivity import UNITS, PlanStore, cache_folder, search_budgets, streamed_budgets, whole_model


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
    batch_size: int = BATCH_SIZE
    allocation: str | None = None
    """None: the method's default (`ftc.options.default_allocation`), resolved by `validate`."""
    scope: str = "attention"

    def validate(self) -> CompressOptions:
        """Check every field before any work starts; messages name the flag and the fix."""
        validate_ratio(self.ratio)
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.allocation is None:
            self.allocation = default_allocation(self.method)
        if self.allocation not in ALLOCATIONS:
            raise InputError(f"unknown allocation {self.allocation!r}; choose from {', '.join(ALLOCATIONS)}")
        if self.scope not in SCOPES:
            raise InputError(f"unknown scope {self.scope!r}; choose from {', '.join(SCOPES)}")
        if problem := scope_problem(self.method, self.allocation, self.ablate, self.scope):
            raise InputError(problem)
        if problem := method_ratio_problem(self.method, self.ratio, self.allocation):
            raise InputError(problem.replace("ratio", "--ratio", 1).replace("allocation", "--allocation", 1))
        self.ablate = parse_ablations(list(self.ablate))
        if self.ablate and self.method != "ftc":
            raise InputError("--ablate applies to --method ftc only")
        storage_dtype(self.dtype)
        if self.calib_samples < 1 or self.seq_len < 2 or self.batch_size < 1:
            raise InputError("--calib-samples and --batch-size must be >= 1 and --seq-len >= 2")
        return self


def library_versions() -> dict:
    """Library versions, and the thread count and kernels the numbers were computed with: the
    artifact is the same on any thread count (ftc-method.md §16), and this is how one checks."""
    import re

    import safetensors
    import transformers

    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return {"ftc": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "blas": blas.group(1) if blas else "unknown",
            "cpu_kernels": torch.backends.cpu.get_cpu_capability()}


def calibration_batch(tokenizer, options: CompressOptions, hidden: int) -> torch.Tensor:
    ids = calibration_ids(tokenize(tokenizer, load_text(options.calib, "validation")),
                          options.calib_samples, options.seq_len, options.seed, bos_prefix(tokenizer))
    if ids.numel() < hidden:
        raise InputError(
            f"calibration has {ids.numel()} tokens but the model's hidden size is {hidden}: the "
            f"activation Gram would be singular; raise --calib-samples or --seq-len"
        )
    return ids


def open_model(options: CompressOptions, loaded: tuple | None = None):
    """`(weights, tokenizer, source)` without loading any weight into memory; a multimodal model's
    weights are its text decoder's (`ftc.models.weights.TextPartSource`)."""
    if loaded is not None:
        model, tokenizer, source = loaded
        return text_part(ModuleSource(model)), tokenizer, source
    source = resolve_model(options.model)
    if source.kind == "artifact":
        raise InputError(f"--model {options.model} is already a compressed artifact; give the base model")
    weights = open_weights(source)
    layout_of(weights.config)  # fail fast on an unsupported architecture
    return weights, load_tokenizer(source), source


@gguf_parsed_once()  # a GGUF's config, weights and tokenizer (read twice) from one parse of the file
def compress(
    options: CompressOptions,
    out_dir: Path,
    *,
    loaded: tuple | None = None,
    work_dir: Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    on_layer=None,
    plan_store: PlanStore | None = None,
    budgets: list[dict] | None = None,
) -> dict:
    """Compress `options.model` and write the artifact to `out_dir`; returns the manifest.

    `work_dir` keeps per-layer checkpoints: re-running the same job with the same `work_dir`
    resumes at the first unfinished layer. Without it a temporary folder is used and removed.
    `loaded = (model, tokenizer, source)` takes weights from a model already in memory. `plan_store`
    shares the layer lists of `--allocation sensitivity` beyond this machine (a service's object store).
    `budgets` (per layer, stored values by part) replaces the allocation's own plan: a plan made
    elsewhere, as a benchmark comparing plans makes them.
    """
    options.validate()
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    device = pick_device(options.device)
    weights, tokenizer, source = open_model(options, loaded)
    layout = layout_of(weights.config)
    dtype = storage_dtype(options.dtype)
    method = make_method(options.method, options.ratio, dtype, options.ablate, options.allocation, options.scope)
    calib = calibration_batch(tokenizer, options, layout.hidden) if method.needs_data else None
    if loaded is None:
        tokenizer = None  # tens of MB held through every layer otherwise; the artifact reloads it
    # a model streamed from disk: its Grams spill to files while the factorisations run, so the
    # memory bound holds for one layer's math, not its statistics too (`spilled_grams`)
    with spilled_grams(not weights.resident):
        if budgets is not None:
            method = dataclasses.replace(method, budgets=tuple(budgets))
        elif method.plans:
            method = plan_budgets(method, weights, layout, calib, options, device, progress, plan_store=plan_store,
                                  resident=None if loaded is None else loaded[0])
        if method.loss_metric:  # a streamed backward pass, one layer resident (ftc.compression.gradients)
            method = with_loss_metric(method, weights, layout, calib, device, progress)
            trim_heap()
        temporary = work_dir is None
        # the method's fixed choices (sink and key weights, anchor...) too: layers written by a version
        # that made other choices must not be mixed into this run's artifact
        description = {**work_description(options, source, weights, calib), "choices": method.choices()}
        if method.budgets is not None:  # a changed plan must not resume another plan's layers
            description["plan"] = list(method.budgets)
        store = LayerStore(work_dir or out_dir.parent / f".{out_dir.name}.work-{os.getpid()}", description)
        try:
            run = compress_to_store(store, weights, layout, method, calib, options, device,
                                    progress=progress, on_layer=on_layer)
            manifest = build_manifest(options, method, source, layout, calib, store.entries(), run, device,
                                      text_part_of=weights.text_part_of)
            tokenizer = tokenizer or load_tokenizer(source)
            manifest = assemble(out_dir, store, weights.config, tokenizer, manifest, overwrite)
        finally:
            if temporary:
                shutil.rmtree(store.folder, ignore_errors=True)
    manifest["total_seconds"] = round(time.perf_counter() - t0, 3)
    return manifest


def plan_budgets(method: Method, weights, layout: AttentionLayout, calib: torch.Tensor,
                 options: CompressOptions, device: torch.device, progress: bool,
                 resident: torch.nn.Module | None = None, plan_store: PlanStore | None = None) -> Method:
    """The statistics pass of a model-wide budget (§13) and the layer list of `--allocation
    sensitivity` (§15), one original layer resident at a time (the list kept in `plan_store` or the
    cache folder, `ftc.compression.sensitivity.cache_folder`); `asvd`'s rank search (§11) needs the whole model
    instead (`resident`, when it is in memory already), its list kept in the cache folder.

    Deterministic for the same model and calibration, so a resumed run plans the same budgets.
    """
    if method.layer_sensitivity and method.allocation == "sensitivity":
        return streamed_budgets(method, weights, layout, calib, device=device, batch_size=options.batch_size,
                                progress=progress, cache=cache_folder(), store=plan_store)
    if method.whole_model_plan:
        return search_budgets(method, whole_model(weights, device, resident), layout, calib,
                              batch_size=options.batch_size, progress=progress, cache=cache_folder())
    model = skeleton(weights.config)
    embed = materialize_embedding_rows(model, weights, calib, device)
    stream = layer_inputs(model, layout, calib, options.batch_size, device)
    release(model, embed)
    surveys = survey_layers(model, layout, method, stream, device=device, weights=weights, progress=progress)
    return planned(method, surveys, layout)


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype of a storage dtype name from `ftc.options.DTYPES` (the one list of them)."""
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return getattr(torch, name)


def work_description(options: CompressOptions, source, weights, calib: torch.Tensor | None) -> dict:
    """What identifies a run's checkpoints: a work folder is resumed only for the same description."""
    description = {**asdict(options), "source": source.describe(), "checkpoint_bytes": weights.nbytes,
                   "calibration_sha256": None if calib is None else ids_sha256(calib), "format": 1}
    description.pop("device")  # a run may resume on another device
    return description


@dataclass(frozen=True)
class LayerRun:
    """What `compress_to_store` reports for the manifest."""

    resumed_from_layer: int
    seconds: float
    dense_params: int
    source_bytes: int


def compress_to_store(store: LayerStore, weights, layout: AttentionLayout, method: Method,
                      calib: torch.Tensor | None, options: CompressOptions, device: torch.device, *,
                      progress: bool = True, on_layer=None) -> LayerRun:
    """Compress every unfinished layer into `store` (resuming after the last finished one), then
    save the weights outside the attention layers, in the storage dtype where floating point."""
    config = weights.config
    dtype = method.storage_dtype
    model = skeleton(config)
    dense_params = _parameter_count(model, config)
    start = store.finished()
    stream = None
    if method.needs_data:
        embed = materialize_embedding_rows(model, weights, calib, device)
        stream = layer_inputs(model, layout, calib, options.batch_size, device)
        release(model, embed)
        if start:
            stream.hidden = [stream.keep(h) for h in store.load_stream(start - 1)]

    def checkpoint(result, layer) -> None:
        prefix = f"{layout.layers_path}.{result.index}"
        store.save_layer(result.index, layer_tensors(layer, prefix, result.groups, dtype), layer_entry(result),
                         None if stream is None else stream.hidden)
        if on_layer is not None:
            on_layer(result)

    result = compress_layers(model, layout, method, stream, device=device, weights=weights, start=start,
                             progress=progress, on_layer=checkpoint)
    for name in extra_names(weights.names(), layout, config):
        tensor = weights.get(name)
        store.save_extra(name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
    return LayerRun(start, result.seconds, dense_params, weights.nbytes)


def build_manifest(options: CompressOptions, method: Method, source, layout: AttentionLayout,
                   calib: torch.Tensor | None, entries: list[dict], run: LayerRun, device: torch.device,
                   text_part_of: str | None = None) -> dict:
    """The artifact's manifest (docs/artifact.md): what was asked, what the method fixed, what was stored.

    `text_part_of` names the multimodal model whose text decoder alone was compressed; only then is it
    recorded, so the manifests of text-only models stay as they were.
    """
    base_model = {**source.describe(), "model_type": layout.model_type}
    if text_part_of is not None:
        base_model["text_part_of"] = text_part_of
    return {
        "base_model": base_model,
        "method": options.method,
        "ratio": options.ratio,
        "options": {**asdict(options), "ablate": list(options.ablate)},
        "ablations": list(options.ablate),
        "choices": method.choices(),
        "allocation": {"kind": options.allocation,
                       "layer_budgets": None if method.budgets is None else list(method.budgets)},
        "calibration": None if calib is None else {
            "source": options.calib, "split": "validation", "text": calibration_text(options.calib),
            "samples": options.calib_samples,
            "seq_len": options.seq_len, "tokens": calib.numel(), "seed": options.seed,
            "sha256": ids_sha256(calib)},
        "storage": storage_summary(layout, entries, method, run.dense_params, run.source_bytes),
        "resumed_from_layer": run.resumed_from_layer,
        "compress_seconds": round(run.seconds, 3),
        "device": str(device),
        "versions": library_versions(),
    }


PARTS = {"qkv": ("q", "k", "v"), "o": ("o",), "gateup": ("gate", "up"), "down": ("down",)}
"""The budgeted parts of a decoder layer (§1, §17) and the projections each holds."""


def part_of(projections: list[str]) -> str:
    """The part a stored group belongs to, by the projections it holds."""
    return next(part for part, members in PARTS.items() if set(projections) <= set(members))


def storage_summary(layout: AttentionLayout, entries: list[dict], method: Method, dense_params: int,
                    source_bytes: int) -> dict:
    """Budget and usage in stored values (§1), per part, and the reductions they imply, each named for
    what it counts: the decoder's linear projections (the ratio the papers quote: q, k, v, o, gate, up,
    down of every layer), the whole checkpoint (embeddings and norms too, a tied head once), and the
    bytes of the artifact's weights against those of the source checkpoint."""
    layers = len(entries)
    used = dict.fromkeys(PARTS, 0)
    sizes = layout.part_params("model")
    for entry in entries:
        for group in entry["groups"]:
            used[part_of(group["proj"])] += group["values"]
        for part in (p for unit in entry.get("whole", ()) for p in UNITS[unit]):  # kept dense by the plan (§15)
            used[part] += sizes[part]
    budget = {part: sum(entry["budget_values"].get(part, 0) for entry in entries) for part in PARTS}
    original = {part: layers * size for part, size in sizes.items()}
    compressed = set(layout.part_params(method.scope))
    linear_dense = sum(original.values())
    linear_kept = sum(used[p] if p in compressed else original[p] for p in PARTS)
    removed = sum(original[p] - used[p] for p in compressed)
    return {
        "scope": method.scope,
        "value_bytes": torch.finfo(method.storage_dtype).bits // 8,
        "parts": {part: {"original_params": original[part], "budget_values": budget[part] if part in compressed
                         else None, "values_used": used[part] if part in compressed else None}
                  for part in PARTS},
        "qkv_budget_values": budget["qkv"],
        "qkv_values_used": used["qkv"],
        "o_budget_values": budget["o"],
        "o_values_used": used["o"],
        "attention_budget_values": budget["qkv"] + budget["o"],
        "attention_bytes_written": sum(g["bytes"] for e in entries for g in e["groups"]
                                       if part_of(g["proj"]) in ("qkv", "o")),
        "original_attention_params": original["qkv"] + original["o"],
        "attention_share": (original["qkv"] + original["o"]) / dense_params,
        "linear_params_dense": linear_dense,
        "linear_params_kept": linear_kept,
        "linear_reduction": 1 - linear_kept / linear_dense,
        "model_params_dense": dense_params,
        "model_params_kept": dense_params - removed,
        "model_reduction": removed / dense_params,
        "source_bytes": source_bytes,
    }


def _parameter_count(model, config) -> int:
    """Parameters of the uncompressed model, a tied output head counted once (works on meta tensors,
    where the skeleton's head is not tied to the embedding yet)."""
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(config, "tie_word_embeddings", False) and head is not None and head.weight is not embedding.weight:
        count -= head.weight.numel()
    return count


def plan(options: CompressOptions) -> dict:
    """What a run will do and need, read from the config alone (`--dry-run`)."""
    options.validate()
    source = resolve_model(options.model)
    weights = open_weights(source)
    config = weights.config
    layout = layout_of(config)
    model = skeleton(config)
    layer_params = sum(p.numel() for p in model.get_submodule(f"{layout.layers_path}.0").parameters())
    tokens = options.calib_samples * options.seq_len
    n_layers = len(model.get_submodule(layout.layers_path))
    stream_bytes = tokens * layout.hidden * 4
    workspace = 8 * layout.hidden**2 * 3 + 4 * layout.qkv_params * 4  # Grams (float64) + tensor copies
    # asvd's rank search holds the whole model, in float32; the loss metric's streamed backward pass
    # holds the gradients at one depth beside the stream (its float64 Grams of the hidden size, one a
    # layer, are file-backed when streaming, `gram_buffer`) and under `loss_metric` one Gram of the head
    # size per head slice of the layer running backward
    method = make_method(options.method, options.ratio, storage_dtype(options.dtype), options.ablate,
                         options.allocation, options.scope)
    whole = 4 * _parameter_count(model, config) if method.whole_model_plan else 0
    workspace += stream_bytes if method.loss_metric else 0
    workspace += 8 * layout.slices * layout.head_dim**2 if "qkv" in method.loss_parts else 0
    if options.scope == "model":  # the MLP's Grams: W_down's input is `intermediate` wide
        workspace += 8 * layout.intermediate**2 * 3 + 4 * layout.mlp_in_params * 4
    parts = layout.part_params("model")
    compressed = layout.part_params(options.scope)
    budgets = method.budget_values(layout)
    linear_kept = sum(budgets[p] if p in compressed else parts[p] for p in parts)
    return {
        "model": source.describe(), "model_type": layout.model_type, "text_part_of": weights.text_part_of,
        "layers": n_layers,
        "layer_types": dict(Counter(layer_types(config, n_layers))), "projections": layout.projections,
        "mlp_projections": layout.mlp_projections, "fused_qkv": layout.fused_qkv,
        "fused_gate_up": layout.fused_gate_up, "intermediate": layout.intermediate,
        "scope": options.scope,
        "parts_per_layer": {part: {"params": size, "budget_values": budgets[part] if part in compressed else None}
                            for part, size in parts.items()},
        "linear_params_dense": n_layers * sum(parts.values()),
        "linear_reduction": 1 - linear_kept / sum(parts.values()),
        "model_params_dense": _parameter_count(model, config),
        "hidden": layout.hidden, "heads": layout.heads, "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
        "slices": layout.slices,
        "qkv_shape": [layout.hidden, layout.head_dim, layout.slices],
        "o_shape": [layout.heads * layout.head_dim, layout.hidden],
        "qkv_budget_values_per_layer": int(options.ratio * layout.qkv_params),
        "allocation": options.allocation,
        "attention_budget_values": int(options.ratio * n_layers * (layout.qkv_params + layout.o_params)),
        "o_rank": max(1, int(options.ratio * layout.o_params / (layout.heads * layout.head_dim + layout.hidden))),
        "calibration_tokens": tokens,
        "checkpoint_bytes": weights.nbytes,
        "estimated_peak_bytes": {"one_layer_float32": layer_params * 4, "calibration_stream": stream_bytes,
                                 "workspace": workspace, "whole_model_for_the_plan": whole,
                                 "total": layer_params * 4 + stream_bytes + workspace + whole},
    }

