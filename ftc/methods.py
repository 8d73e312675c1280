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

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from .allocation import Curve, candidate_ratios, choose, heterogeneous_ratios, lowrank_curve, tucker_curve
from .arch import AttentionLayout
from .cp import EXTRAPOLATION_POWER, MAX_SWEEPS, PROXIMAL, TOLERANCE, compress_cp
from .lowrank import (
    ASVD_ALPHA,
    anchored_rhs,
    budget_rank,
    calibrated_wo,
    eig_whitened_svd,
    guarded_whitened_svd,
    rank_within,
    scaled_svd,
    truncated_svd,
)
from .metric import (
    DEFAULT_EPS,
    GUARD_TOLERANCE,
    MAX_EPS,
    WORK_DTYPE,
    ActivationError,
    Moments,
    Whitening,
    guarded_fit,
)
from .options import (
    ALLOCATION_METHODS,
    ALLOCATIONS,
    ASVD_RATIO_CANDIDATES,
    ASVD_SENSITIVITY_SEQUENCES,
    ASVD_UNLISTED_RATIO,
    LAYER_RATIO_CANDIDATES,
    METHODS,
)
from .stored import cp_tensors, lowrank_tensors, tucker_tensors
from .tucker import GRID_POINTS, PRUNE_STEPS, REFITS, compress_tensor, head_concat, head_slices

Group = tuple[dict, dict[str, torch.Tensor]]

SINK_WEIGHT = 32
"""How many times the first position of each calibration sequence counts in FTC's Q/K/V Gram (§3).

Most of the attention in a trained model's deeper layers goes to the first position (the
attention sink: 52-63% of it in SmolLM2-135M's layers 20 and 28), so that token's keys and values
move every output, yet it is one row in 512 of an unweighted Gram. At rho 0.4 on
SmolLM2-135M-Instruct it takes perplexity from 45.89 to 43.00; 32 and 256 measured the same: past
a few percent of the Gram the sink is kept as well as the rank allows. 1 under `no_sink`.
"""

KEY_WEIGHT = 1.0
"""The weight of each key slice in FTC's Q/K/V objective (§4) is `(Hq / Hkv) ** KEY_WEIGHT`.

A key head's error moves the scores of every query head of its group; a query or value head's
moves one head's scores or output, and the calibrated `W_O` (§8) can absorb part of a value
error, never a score error (it acts after the softmax). So under GQA/MQA each key slice counts
`Hq / Hkv` times, the objective of compressing the attention of every query head with its own
copy of its key head, at the storage of one. On SmolLM2-135M-Instruct (3 query heads per key
head) at rho 0.4: 41.68 perplexity against 43.00 unweighted; 2 and 6 measured 41.82 and 42.05,
and the value slices weighted 3 as well 43.57, weighted 0.5 42.13. 1 under `no_key_weight`.
"""

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

    def take(self) -> tuple[Moments, Moments | None, torch.Tensor | None]:
        """`(teacher, student, cross)`, handed over: this object drops them, so a consumer that
        holds the only references can free or overwrite each d x d float64 buffer once it is
        spent (134 MB apiece at width 4096; FTC's `o` sets the 7B-shaped memory peak)."""
        taken = self.teacher, self.student, self.cross
        del self.teacher
        self.student = self.cross = None
        return taken


@dataclass
class Method:
    """Options common to every method; subclasses implement `qkv` and `o`."""

    keep_ratio: float
    storage_dtype: torch.dtype = torch.float16
    ablations: frozenset[str] = field(default_factory=frozenset)
    allocation: str = "uniform"
    """`uniform`: every layer spends `keep_ratio` (the paper); `global`: a model-wide plan (§13);
    `sensitivity`: layer budgets from the divergence each layer causes compressed alone (§15)."""
    budgets: tuple[dict, ...] | None = None
    """Per-layer stored-value budgets by part ("qkv", "o", or "q"/"k"/"v"), from `plan`."""
    layer_budget: dict | None = None
    """The entry of `budgets` for the layer being compressed (set by `at_layer`)."""
    name: ClassVar[str] = ""  # set by @register
    stream = "student"  # which hidden-state stream feeds the statistics (§3)
    needs_data = True
    needs_student_context = False
    needs_abs_mean = False  # per-channel mean |x| is gathered only for the methods that read it
    first_weight = 1  # times the first position of each sequence counts in the Q/K/V Gram (`SINK_WEIGHT`)
    per_matrix_qkv: ClassVar[bool] = True
    """Whether Q, K and V are compressed one matrix at a time, each with its own budget (§11)."""
    layer_sensitivity: ClassVar[bool] = False
    """Whether `--allocation sensitivity` plans this method from its own layer list (§15)."""

    def qkv_moments(self, dim: int, device: torch.device | str) -> Moments:
        """The empty accumulator of this method's Q/K/V statistics (sink weight, mean |x|): the one
        place compression and a model-wide plan's survey both take it from, so the two measure alike."""
        return Moments(dim, device, self.needs_abs_mean, self.first_weight)

    def qkv(self, weights: dict[str, torch.Tensor], x: Moments | None, layout: AttentionLayout):
        raise NotImplementedError

    def o(self, w_o: torch.Tensor, ctx: ContextStats | None, layout: AttentionLayout):
        raise NotImplementedError

    def choices(self) -> dict:
        """The fixed constants this method ran with, for the manifest (none for the base class)."""
        return {}

    @property
    def plans(self) -> bool:
        """Whether a model-wide plan (`survey` + `plan`, or the search of `whole_model_plan`) comes
        before compression."""
        return False

    @property
    def whole_model_plan(self) -> bool:
        """Whether the plan measures the whole model's loss (ASVD's rank search, `ftc.sensitivity`)
        instead of per-layer `survey`s: it then needs every layer resident at once."""
        return False

    def survey(self, weights: dict[str, torch.Tensor], x: Moments, ctx: ContextStats, residual: float,
               layout: AttentionLayout) -> dict:
        """Error-versus-budget data of one original layer on the original model's stream (§13).

        `residual` is the mean squared norm of the layer's input hidden state per token.
        """
        raise NotImplementedError

    def plan(self, surveys: list[dict], layout: AttentionLayout) -> list[dict]:
        """Per-layer budgets (stored values by part) from every layer's survey (§13)."""
        raise NotImplementedError

    def at_layer(self, index: int) -> Method:
        """This method with the budgets of layer `index`, when a plan gave it some."""
        if self.budgets is None:
            return self
        return dataclasses.replace(self, layer_budget=self.budgets[index])

    def values(self, part: str, full: int) -> int:
        """Stored values this layer may spend on `part`: the plan's, else `keep_ratio * full` (§1)."""
        if self.layer_budget is not None and part in self.layer_budget:
            return int(self.layer_budget[part])
        return int(self.keep_ratio * full)

    def budget_values(self, layout: AttentionLayout) -> dict[str, int]:
        """Stored values this layer may spend on its Q/K/V and on `W_O` (§1), as the plan gave them:
        the manifest's budgets are these, summed over layers. A method that compresses Q, K and V
        one matrix at a time (`per_matrix_qkv`) has one budget per matrix; their sum is shown."""
        if self.per_matrix_qkv:
            sizes = layout.hidden * layout.head_dim
            qkv = sum(self.values(p, sizes * heads) for p, heads in
                      (("q", layout.heads), ("k", layout.kv_heads), ("v", layout.kv_heads)))
        else:
            qkv = self.values("qkv", layout.qkv_params)
        return {"qkv": qkv, "o": self.values("o", layout.o_params)}

    def rank(self, part: str, rows: int, cols: int) -> int:
        """Rank of a two-factor `rows x cols` matrix within this layer's budget for `part`."""
        return rank_within(self.values(part, rows * cols), rows, cols)

    def _lowrank(self, proj: str, a: torch.Tensor, b: torch.Tensor) -> Group:
        return {"kind": "lowrank", "proj": [proj], "rank": a.shape[1]}, lowrank_tensors(
            a, b, self.storage_dtype
        )

    def _per_matrix(self, weights: dict[str, torch.Tensor], factor) -> tuple[list[Group], dict]:
        groups = []
        for proj, w in weights.items():
            a, b = factor(w, self.rank(proj, *w.shape))
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
    return {"eps": DEFAULT_EPS, "max_eps": MAX_EPS, "guard": "outcome", "guard_tolerance": GUARD_TOLERANCE}


@register("svd")
class SVD(Method):
    """Plain truncated SVD of each projection (§11 `svd`)."""

    stream = "teacher"
    needs_data = False

    def qkv(self, weights, x, layout):
        return self._per_matrix(weights, truncated_svd)

    def o(self, w_o, ctx, layout):
        rank = self.rank("o", *w_o.shape)
        return self._lowrank("o", *truncated_svd(w_o, rank)), {"r_o": rank}


@register("asvd")
class ASVD(Method):
    """Activation-aware SVD (§11): input channels scaled by `mean|x|^alpha` of the original model,
    each matrix's rank from ASVD's sensitivity-based search over the whole model (`ftc.sensitivity`)."""

    stream = "teacher"
    needs_abs_mean = True

    @property
    def plans(self) -> bool:
        return True

    @property
    def whole_model_plan(self) -> bool:
        return True

    def choices(self) -> dict:
        return {"alpha": ASVD_ALPHA, "rank_search": {
            "ratio_candidates": list(ASVD_RATIO_CANDIDATES), "unlisted_ratio": ASVD_UNLISTED_RATIO,
            "sensitivity_sequences": ASVD_SENSITIVITY_SEQUENCES, "sensitivity": "calibration perplexity"}}

    def qkv(self, weights, x, layout):
        return self._per_matrix(weights, lambda w, r: scaled_svd(w, x.abs_mean, r))

    def o(self, w_o, ctx, layout):
        rank = self.rank("o", *w_o.shape)
        return self._lowrank("o", *scaled_svd(w_o, ctx.teacher.abs_mean, rank)), {"r_o": rank}


@register("svd_llm")
class SVDLLM(Method):
    """SVD-LLM: Cholesky whitening of the original model's input Gram, per matrix (§11)."""

    stream = "teacher"

    def choices(self) -> dict:
        return whitening_choices()

    def qkv(self, weights, x, layout):
        groups, eps = [], {}
        for proj, w in weights.items():
            (a, b), whitening = guarded_whitened_svd(w, x.gram, self.rank(proj, *w.shape))
            groups.append(self._lowrank(proj, a, b))
            eps[proj] = whitening.eps
        return groups, {"ranks": {g[0]["proj"][0]: g[0]["rank"] for g in groups}, "eps": eps}

    def o(self, w_o, ctx, layout):
        rank = self.rank("o", *w_o.shape)
        factors, whitening = guarded_whitened_svd(w_o, ctx.teacher.gram, rank)
        return self._lowrank("o", *factors), {"r_o": rank, "eps_o": whitening.eps}


@register("svd_llm_v2")
class SVDLLMV2(Method):
    """SVD-LLM V2 (§11): heterogeneous per-matrix ratios, loss-optimised (eigen-whitened) truncation.

    The statistics pass computes each matrix's theoretical truncation loss at the uniform ratio on
    the original model's stream; `plan` spreads the ratio over the layers per matrix type
    (`ftc.allocation.heterogeneous_ratios`); each matrix is then truncated in its exact metric.
    """

    stream = "teacher"

    @property
    def plans(self) -> bool:
        return True

    def survey(self, weights, x, ctx, residual, layout):
        losses = {}
        for proj, w in weights.items():
            stats = ctx.teacher if proj == "o" else x
            values, vectors = torch.linalg.eigh(stats.gram)
            white = values.clamp_min(0).sqrt()[:, None] * (vectors.T @ w.to(WORK_DTYPE))
            spectrum = torch.linalg.svdvals(white)
            rank = budget_rank(*w.shape, self.keep_ratio)
            losses[proj] = float(spectrum[rank:].pow(2).sum() * stats.count) ** 0.5  # ||X (W - W')||_F
        return {"loss": losses}

    def plan(self, surveys, layout):
        budgets: list[dict] = [{} for _ in surveys]
        shapes = {"q": layout.hidden * layout.heads, "k": layout.hidden * layout.kv_heads,
                  "v": layout.hidden * layout.kv_heads, "o": layout.heads * layout.hidden}
        for proj, size in shapes.items():
            losses = torch.tensor([s["loss"][proj] for s in surveys])
            for budget, keep in zip(budgets, heterogeneous_ratios(losses, self.keep_ratio), strict=True):
                budget[proj] = int(keep * size * layout.head_dim)
        return budgets

    def qkv(self, weights, x, layout):
        return self._per_matrix(weights, lambda w, r: eig_whitened_svd(w, x.gram, r))

    def o(self, w_o, ctx, layout):
        rank = self.rank("o", *w_o.shape)
        return self._lowrank("o", *eig_whitened_svd(w_o, ctx.teacher.gram, rank)), {"r_o": rank}


@register("ftc")
class FTC(Method):
    """The full method: joint head-concat Tucker for Q/K/V (§2-§7), calibrated W_O (§8)."""

    needs_student_context = True  # W_O's target and, even under `no_wo_target`, its own metric use A_s
    per_matrix_qkv = False
    layer_sensitivity = True

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

    @property
    def first_weight(self) -> int:  # type: ignore[override]
        return 1 if "no_sink" in self.ablations else SINK_WEIGHT

    @property
    def key_weight(self) -> float:
        """The exponent of the key slices' weight `(Hq / Hkv) ** p` (§4): `KEY_WEIGHT`, or 0 under
        `no_key_weight`; what the manifest records and what `slice_weights` applies."""
        return 0.0 if "no_key_weight" in self.ablations else KEY_WEIGHT

    def choices(self) -> dict:
        grid = f"{GRID_POINTS} x {GRID_POINTS // 2} coarse, step-halving refinement"
        return {**whitening_choices(), "prune_steps": PRUNE_STEPS, "refits": REFITS, "anchor": self.anchor,
                "sink_weight": self.first_weight,
                "key_weight": self.key_weight,
                "allocation_grid": "fixed ranks (ablation)" if "fixed_ranks" in self.ablations else grid,
                **self.search_choices()}

    def search_choices(self) -> dict:
        """The settings of the layer list `--allocation sensitivity` plans from (§15), when it does."""
        if self.allocation != "sensitivity":
            return {}
        return {"layer_sensitivity": {"ratio_candidates": list(LAYER_RATIO_CANDIDATES),
                                      "sequences": ASVD_SENSITIVITY_SEQUENCES,
                                      "loss": "KL divergence from the original model per token"}}

    def slice_weights(self, layout: AttentionLayout, repeat: int) -> torch.Tensor | None:
        """The weight of every slice of the head-concat tensor (`KEY_WEIGHT`): `(Hq / Hkv) ** p` for a
        key slice, 1 for the others; None where all are 1 (MHA, `kv_repeat`'s repeated copies, which
        weigh both keys and values by repetition, and `no_key_weight`)."""
        group = layout.heads // layout.kv_heads
        if group == 1 or repeat > 1 or self.key_weight == 0:
            return None
        weights = torch.ones(layout.heads + 2 * layout.kv_heads, dtype=WORK_DTYPE)
        weights[layout.heads : layout.heads + layout.kv_heads] = group**self.key_weight
        return weights

    def _tucker_fit(self, tensor: torch.Tensor, x: Moments, budget: int, weights: torch.Tensor | None = None,
                    steps: int | None = None, refits: int | None = None):
        """`compress_tensor` under the outcome guard of §3: `((factors, report), whitening, error)`, the
        error being the objective of §3-§4 (slice balancing and weights) in the undamped activation
        metric, the one the guard compares. The reference is the unwhitened allocation (HOSVD +
        top-K core, no pruning schedule)."""
        gram = None if "no_whiten" in self.ablations else x.gram
        balance, coupled = "no_slice_norm" not in self.ablations, "fixed_ranks" not in self.ablations
        steps, refits = PRUNE_STEPS if steps is None else steps, REFITS if refits is None else refits

        def fit(whitening: Whitening, steps: int = steps, refits: int = refits):
            return compress_tensor(tensor, whitening, budget, balance=balance, coupled=coupled, steps=steps,
                                   refits=refits, weights=weights)

        measure = ActivationError(tensor, gram, balance, weights)

        def error(result) -> float:
            return measure(result[0].weights)

        result, whitening = guarded_fit(gram, fit, error, lambda: error(fit(Whitening(None, None), 1, 0)))
        return result, whitening, error(result)

    def _tucker(self, tensor: torch.Tensor, x: Moments, proj: list[str], heads: list[int], budget: int,
                weights: torch.Tensor | None = None):
        (factors, report), _, measured = self._tucker_fit(tensor, x, budget, weights)
        spec = {"kind": "tucker", "proj": proj, "heads": heads, "shape": list(factors.core.shape)}
        if factors.mask is not None:
            spec["kept"] = int(factors.mask.sum())
        return (spec, tucker_tensors(factors, self.storage_dtype)), report, measured

    def qkv_tensor(self, weights: dict[str, torch.Tensor], layout: AttentionLayout) -> tuple[torch.Tensor, int]:
        """The head-concat tensor of §2 and how often each key/value head appears in it (`kv_repeat`)."""
        repeat = layout.heads // layout.kv_heads if "kv_repeat" in self.ablations else 1
        return head_concat(weights["q"], weights["k"], weights["v"], layout.head_dim, repeat), repeat

    def qkv(self, weights, x, layout):
        tensor, repeat = self.qkv_tensor(weights, layout)
        budget = self.values("qkv", layout.qkv_params)
        heads = [layout.heads, layout.kv_heads, layout.kv_heads]
        (spec, tensors), report, measured = self._tucker(tensor, x, ["q", "k", "v"], heads, budget,
                                                         self.slice_weights(layout, repeat))
        spec["kv_repeat"] = repeat
        return [(spec, tensors)], {
            "r1": report.r1,
            "r2": report.r2,
            "K": report.kept,
            "eps": report.eps,
            "error_allocated": report.error_allocated,
            "error_refit": report.error_refit,
            "error_activation": measured,
            "qkv_budget": budget,
        }

    def o(self, w_o, ctx, layout):
        """Calibrated target `W*` (§8), truncated in the anchored objective's own metric.

        `||A_s W - A_t W_O||^2 + a ||A_t W - A_t W_O||^2` equals `n ||R^T (W - W*)||^2` plus a
        constant, with `R R^T = C_s + a C_t`, so whitening by that sum (the left side of the
        solve) makes the truncated SVD the best rank-`r_o` `W_O` for the whole objective. The
        paper whitens by `C_s` alone (`wo_student_metric`), exact only without the anchor; without
        the calibrated target (`no_wo_target`) the objective is `||A_s W - A_s W_O||^2` and `C_s`
        is its metric either way.

        `ctx` is taken over (`ContextStats.take`): each Gram is freed as soon as it is spent and
        `C_s + a C_t` is formed in `C_s`'s buffer, so the solve holds four d x d float64 buffers
        and the truncation three, not the eight and seven of building every term beside the
        Grams (the 7B-shaped peak, benchmarks/results/memory.md).
        """
        rank = self.rank("o", *w_o.shape)
        anchor = self.anchor
        teacher, student, cross = ctx.take()
        target, eps_solve = w_o, None
        if "no_wo_target" in self.ablations:
            metric = student.gram
        else:
            rhs = anchored_rhs(cross, student.count, teacher.gram, w_o, anchor)
            del cross
            if "wo_student_metric" in self.ablations:  # the paper's metric, C_s alone: both kept
                metric, lhs = student.gram, torch.add(student.gram, teacher.gram, alpha=anchor)
            else:
                metric = lhs = student.gram.add_(teacher.gram, alpha=anchor)  # C_s is spent here
            del teacher, student
            target, eps_solve = calibrated_wo(lhs, rhs, w_o)
            del lhs, rhs, w_o  # the pipeline hands W_O over: its float32 copy (64 MB at 4096) goes here
        (a, b), whitening = guarded_whitened_svd(target, None if "no_whiten" in self.ablations else metric, rank)
        return self._lowrank("o", a, b), {"r_o": rank, "eps_o": whitening.eps, "eps_o_solve": eps_solve,
                                          "anchor": anchor}

    @property
    def plans(self) -> bool:
        return self.allocation != "uniform"

    @property
    def whole_model_plan(self) -> bool:
        return self.allocation == "sensitivity"

    def survey(self, weights, x, ctx, residual, layout):
        """Q/K/V curve from the allocator's prediction, W_O curve from its whitened spectrum (§13).

        Both errors are relative to their own part; `effect` (attention branch energy over residual
        energy) turns them into a share of the layer's output, comparable across layers.
        """
        tensor, repeat = self.qkv_tensor(weights, layout)
        slice_weights = self.slice_weights(layout, repeat)
        costs = sorted({int(r * layout.qkv_params) for r in candidate_ratios(self.keep_ratio)})
        # each curve in the metric the guard of §3 accepts at the uniform budget, as compression would
        _, qkv_white, _ = self._tucker_fit(tensor, x, int(self.keep_ratio * layout.qkv_params), slice_weights, 1, 0)
        errors = tucker_curve(tensor, qkv_white, costs, balance="no_slice_norm" not in self.ablations,
                              weights=slice_weights)
        w_o = weights["o"].to(WORK_DTYPE)
        o_gram = None if "no_whiten" in self.ablations else ctx.teacher.gram
        _, o_white = guarded_whitened_svd(w_o, o_gram, budget_rank(*w_o.shape, self.keep_ratio))
        spectrum = torch.linalg.svdvals(o_white.apply(w_o))
        branch = float((w_o * (ctx.teacher.gram @ w_o)).sum())
        return {"qkv_costs": costs, "qkv_errors": errors, "o_spectrum": spectrum.tolist(),
                "effect": branch / max(residual, 1e-30)}

    def plan(self, surveys, layout):
        """One budget for the whole attention stack, split by `ftc.allocation.choose` (§13)."""
        rows, cols = layout.heads * layout.head_dim, layout.hidden
        curves = []
        for i, s in enumerate(surveys):
            curves.append(Curve(f"{i}.qkv", tuple(s["qkv_costs"]), tuple(s["qkv_errors"]), s["effect"]))
            curves.append(lowrank_curve(f"{i}.o", torch.tensor(s["o_spectrum"]), rows, cols, self.keep_ratio,
                                        s["effect"]))
        total = int(self.keep_ratio * len(surveys) * (layout.qkv_params + layout.o_params))
        chosen = choose(curves, total)
        costs = [c.costs[i] for c, i in zip(curves, chosen, strict=True)]
        return [{"qkv": costs[2 * i], "o": costs[2 * i + 1]} for i in range(len(surveys))]


@register("per_matrix")
class PerMatrix(FTC):
    """Matched per-matrix control: FTC's metric and W_O, but Q, K and V each compressed alone."""

    per_matrix_qkv = True

    def qkv(self, weights, x, layout):
        groups, reports = [], {}
        for proj, heads in (("q", layout.heads), ("k", layout.kv_heads), ("v", layout.kv_heads)):
            tensor = head_slices(weights[proj], layout.head_dim)
            budget = self.values(proj, layout.hidden * layout.head_dim * heads)
            group, report, _ = self._tucker(tensor, x, [proj], [heads], budget)
            groups.append(group)
            reports[proj] = {
                "r1": report.r1,
                "r2": report.r2,
                "K": report.kept,
                "eps": report.eps,
                "error_refit": report.error_refit,
            }
        return groups, reports


@register("cp")
class CP(FTC):
    """The CP variant: FTC's tensor, metric, balancing and W_O, but Q/K/V as a rank-R CP.

    `W_s ~= A diag(c_s) B^T` with R from the same budget, `R (d + dh + S) <= rho d dh S`
    (ftc-method.md §14); everything but the Q/K/V factorisation is FTC's.
    """

    def choices(self) -> dict:
        return {**whitening_choices(), "anchor": self.anchor, "sink_weight": self.first_weight,
                "key_weight": self.key_weight, "als_max_sweeps": MAX_SWEEPS,
                "als_tolerance": TOLERANCE, "als_proximal": PROXIMAL,
                "als_extrapolation_power": EXTRAPOLATION_POWER, "init": "hosvd heaviest core fibres",
                **self.search_choices()}

    def qkv(self, weights, x, layout):
        tensor, _ = self.qkv_tensor(weights, layout)
        budget = self.values("qkv", layout.qkv_params)
        slice_weights = self.slice_weights(layout, 1)
        measure = ActivationError(tensor, x.gram, True, slice_weights)

        def fit(whitening: Whitening, sweeps: int = MAX_SWEEPS):
            return compress_cp(tensor, whitening, budget, weights=slice_weights, max_sweeps=sweeps)

        def error(result) -> float:
            return measure(result[0].weights)

        # the outcome guard of §3, which CP shares (§14); the reference is the unwhitened HOSVD start
        (factors, report), _ = guarded_fit(x.gram, fit, error, lambda: error(fit(Whitening(None, None), 0)))
        spec = {"kind": "cp", "proj": ["q", "k", "v"], "heads": [layout.heads, layout.kv_heads, layout.kv_heads],
                "rank": report.rank}
        return [(spec, cp_tensors(factors, self.storage_dtype))], {
            "R": report.rank,
            "eps": report.eps,
            "error_init": report.error_init,
            "error_fit": report.error,
            "sweeps": report.sweeps,
            "extrapolated": report.extrapolated,
            "qkv_budget": budget,
        }


def make_method(
    name: str, keep_ratio: float, storage_dtype: torch.dtype, ablations: tuple[str, ...] = (),
    allocation: str = "uniform",
) -> Method:
    if ablations and name != "ftc":
        raise ValueError(f"ablations apply to method 'ftc' only; got method {name!r}")
    if allocation not in ALLOCATIONS or name not in ALLOCATION_METHODS.get(allocation, METHODS):
        raise ValueError(f"allocation {allocation!r} does not apply to method {name!r} (ALLOCATION_METHODS)")
    return METHOD_CLASSES[name](keep_ratio, storage_dtype, frozenset(ablations), allocation)
