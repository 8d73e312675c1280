"""FTC and the baselines as methods plugged into the one layer pipeline (ftc-method.md §8, §11).

A method sees one layer at a time: the original projection weights (`(in, out)` layout), the
statistics the pipeline gathered on its stream, and the keep ratio. It returns stored groups
(spec + tensors, see `stored.py`) plus a report for the manifest. No model objects, no I/O.

Adding a method: list its name and description in `ftc.options.METHOD_DESCRIPTIONS`, then write
a `Method` subclass here decorated with `@register("<name>")` that implements `qkv`, `o` and, if
it has tunable constants, `choices()` (read from the module constants that define them, so the
manifest cannot drift from the code). Nothing else needs to change: `make_method`, the CLI and the
service find it through the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from .arch import AttentionLayout
from .lowrank import ASVD_ALPHA, budget_rank, calibrated_wo, scaled_svd, truncated_svd, whitened_svd
from .metric import DEFAULT_EPS, MAX_COND, MAX_EPS, Moments, Whitening
from .options import METHODS
from .stored import lowrank_tensors, tucker_tensors
from .tucker import GRID_POINTS, PRUNE_STEPS, REFITS, compress_tensor, head_concat, head_slices

Group = tuple[dict, dict[str, torch.Tensor]]

ANCHOR = 0.5
"""Weight of the original `W_O` in FTC's calibrated `W_O` target (§8); 0 under `no_anchor`."""


@dataclass
class ContextStats:
    """Statistics of the attention context (the input of `o_proj`) on the current stream (§8).

    `teacher` is `A_t` (original Q/K/V); `student` and `cross` (`sum A_s^T A_t`) exist only for
    methods that calibrate `W_O` against the compressed Q/K/V.
    """

    teacher: Moments
    student: Moments | None = None
    cross: torch.Tensor | None = None


@dataclass
class Method:
    """Options common to every method; subclasses implement `qkv` and `o`."""

    keep_ratio: float
    storage_dtype: torch.dtype = torch.float16
    ablations: frozenset[str] = field(default_factory=frozenset)
    name: ClassVar[str] = ""  # set by @register
    stream = "student"  # which hidden-state stream feeds the statistics (§3)
    needs_data = True
    needs_student_context = False
    needs_abs_mean = False  # per-channel mean |x| is gathered only for the methods that read it

    def qkv(self, weights: dict[str, torch.Tensor], x: Moments | None, layout: AttentionLayout):
        raise NotImplementedError

    def o(self, w_o: torch.Tensor, ctx: ContextStats | None, layout: AttentionLayout):
        raise NotImplementedError

    def choices(self) -> dict:
        """The fixed constants this method ran with, for the manifest (none for the base class)."""
        return {}

    def _lowrank(self, proj: str, a: torch.Tensor, b: torch.Tensor) -> Group:
        return {"kind": "lowrank", "proj": [proj], "rank": a.shape[1]}, lowrank_tensors(
            a, b, self.storage_dtype
        )

    def _per_matrix(self, weights: dict[str, torch.Tensor], factor) -> tuple[list[Group], dict]:
        groups = []
        for proj, w in weights.items():
            a, b = factor(w, budget_rank(*w.shape, self.keep_ratio))
            groups.append(self._lowrank(proj, a, b))
        return groups, {"ranks": {g[0]["proj"][0]: g[0]["rank"] for g in groups}}


M = TypeVar("M", bound=type[Method])

METHOD_CLASSES: dict[str, type[Method]] = {}
"""Method classes by name, filled by `@register`; the names themselves live in `ftc.options`."""


def register(name: str) -> Callable[[M], M]:
    """Bind a `Method` subclass to `name`, which must be listed in `ftc.options.METHODS`.

    Refusing unlisted names keeps the torch-free list (read by the API and the CLI) and the
    classes in step: a class cannot exist without its name being accepted in requests.
    """

    def bind(cls: M) -> M:
        if name not in METHODS:
            raise ValueError(f"method {name!r} is not in ftc.options.METHOD_DESCRIPTIONS; add it there first")
        if name in METHOD_CLASSES:
            raise ValueError(f"method {name!r} is already bound to {METHOD_CLASSES[name].__name__}")
        cls.name = name
        METHOD_CLASSES[name] = cls
        return cls

    return bind


def whitening_choices() -> dict:
    """The guard constants of the Cholesky whitening (§3), shared by every whitened method."""
    return {"eps": DEFAULT_EPS, "max_cond": MAX_COND, "max_eps": MAX_EPS}


@register("svd")
class SVD(Method):
    """Plain truncated SVD of each projection (§11 `svd`)."""

    stream = "teacher"
    needs_data = False

    def qkv(self, weights, x, layout):
        return self._per_matrix(weights, truncated_svd)

    def o(self, w_o, ctx, layout):
        rank = budget_rank(*w_o.shape, self.keep_ratio)
        return self._lowrank("o", *truncated_svd(w_o, rank)), {"r_o": rank}


@register("asvd")
class ASVD(Method):
    """Activation-aware SVD: input channels scaled by `mean|x|^alpha` of the original model (§11)."""

    stream = "teacher"
    needs_abs_mean = True

    def choices(self) -> dict:
        return {"alpha": ASVD_ALPHA}

    def qkv(self, weights, x, layout):
        return self._per_matrix(weights, lambda w, r: scaled_svd(w, x.abs_mean, r))

    def o(self, w_o, ctx, layout):
        rank = budget_rank(*w_o.shape, self.keep_ratio)
        return self._lowrank("o", *scaled_svd(w_o, ctx.teacher.abs_mean, rank)), {"r_o": rank}


@register("svd_llm")
class SVDLLM(Method):
    """SVD-LLM: Cholesky whitening of the original model's input Gram, per matrix (§11)."""

    stream = "teacher"

    def choices(self) -> dict:
        return whitening_choices()

    def qkv(self, weights, x, layout):
        whitening = Whitening.from_gram(x.gram)
        groups, report = self._per_matrix(weights, lambda w, r: whitened_svd(w, whitening, r))
        return groups, {**report, "eps": whitening.eps}

    def o(self, w_o, ctx, layout):
        rank = budget_rank(*w_o.shape, self.keep_ratio)
        whitening = Whitening.from_gram(ctx.teacher.gram)
        return self._lowrank("o", *whitened_svd(w_o, whitening, rank)), {"r_o": rank, "eps_o": whitening.eps}


@register("ftc")
class FTC(Method):
    """The full method: joint head-concat Tucker for Q/K/V (§2-§7), calibrated W_O (§8)."""

    needs_student_context = True  # W_O's target and, even under `no_wo_target`, its own metric use A_s

    @property
    def stream(self) -> str:  # type: ignore[override]
        """`no_sequential` gathers the metric on the original model's stream (§3).

        A property, not a field set after construction: the dataclass `__init__` that
        subclasses inherit never calls a subclass's `__post_init__`, which once left this
        ablation silently doing nothing.
        """
        return "teacher" if "no_sequential" in self.ablations else "student"

    @property
    def anchor(self) -> float:
        return 0.0 if "no_anchor" in self.ablations else ANCHOR

    def choices(self) -> dict:
        grid = f"{GRID_POINTS} x {GRID_POINTS // 2} coarse, step-halving refinement"
        return {**whitening_choices(), "prune_steps": PRUNE_STEPS, "refits": REFITS, "anchor": self.anchor,
                "allocation_grid": "fixed ranks (ablation)" if "fixed_ranks" in self.ablations else grid}

    def _tucker(self, tensor: torch.Tensor, x: Moments, proj: list[str], heads: list[int], budget: int):
        whitening = Whitening.from_gram(None if "no_whiten" in self.ablations else x.gram)
        factors, report = compress_tensor(
            tensor,
            whitening,
            budget,
            balance="no_slice_norm" not in self.ablations,
            coupled="fixed_ranks" not in self.ablations,
        )
        spec = {"kind": "tucker", "proj": proj, "heads": heads, "shape": list(factors.core.shape)}
        if factors.mask is not None:
            spec["kept"] = int(factors.mask.sum())
        return (spec, tucker_tensors(factors, self.storage_dtype)), report

    def qkv(self, weights, x, layout):
        repeat = layout.heads // layout.kv_heads if "kv_repeat" in self.ablations else 1
        tensor = head_concat(weights["q"], weights["k"], weights["v"], layout.head_dim, repeat)
        budget = int(self.keep_ratio * layout.qkv_params)
        heads = [layout.heads, layout.kv_heads, layout.kv_heads]
        (spec, tensors), report = self._tucker(tensor, x, ["q", "k", "v"], heads, budget)
        spec["kv_repeat"] = repeat
        return [(spec, tensors)], {
            "r1": report.r1,
            "r2": report.r2,
            "K": report.kept,
            "eps": report.eps,
            "error_allocated": report.error_allocated,
            "error_refit": report.error_refit,
            "qkv_budget": budget,
        }

    def o(self, w_o, ctx, layout):
        rank = budget_rank(*w_o.shape, self.keep_ratio)
        anchor = self.anchor
        target = w_o
        if "no_wo_target" not in self.ablations:
            n = ctx.student.count
            target = calibrated_wo(ctx.student.gram, ctx.teacher.gram, ctx.cross / n, w_o, anchor)
        gram = None if "no_whiten" in self.ablations else ctx.student.gram
        whitening = Whitening.from_gram(gram)
        a, b = whitened_svd(target, whitening, rank)
        return self._lowrank("o", a, b), {"r_o": rank, "eps_o": whitening.eps, "anchor": anchor}


@register("per_matrix")
class PerMatrix(FTC):
    """Matched per-matrix control: FTC's metric and W_O, but Q, K and V each compressed alone."""

    def qkv(self, weights, x, layout):
        groups, reports = [], {}
        for proj, heads in (("q", layout.heads), ("k", layout.kv_heads), ("v", layout.kv_heads)):
            tensor = head_slices(weights[proj], layout.head_dim)
            budget = int(self.keep_ratio * layout.hidden * layout.head_dim * heads)
            group, report = self._tucker(tensor, x, [proj], [heads], budget)
            groups.append(group)
            reports[proj] = {
                "r1": report.r1,
                "r2": report.r2,
                "K": report.kept,
                "eps": report.eps,
                "error_refit": report.error_refit,
            }
        return groups, reports


def make_method(
    name: str, keep_ratio: float, storage_dtype: torch.dtype, ablations: tuple[str, ...] = ()
) -> Method:
    if ablations and name != "ftc":
        raise ValueError(f"ablations apply to method 'ftc' only; got method {name!r}")
    return METHOD_CLASSES[name](keep_ratio, storage_dtype, frozenset(ablations))
