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

from ftc.models.arch import AttentionLayout
from ftc.numerics.allocation import Curve, candidate_ratios, choose, heterogeneous_ratios, lowrank_curve, tucker_curve
from ftc.numerics.cp import EXTRAPOLATION_POWER, MAX_SWEEPS, PROXIMAL, TOLERANCE, compress_cp
from ftc.numerics.lowrank import (
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
from ftc.numerics.metric import (
    DEFAULT_EPS,
    GUARD_TOLERANCE,
    MAX_EPS,
    WORK_DTYPE,
    ActivationError,
    Moments,
    Whitening,
    damped_factor,
    guarded_fit,
)
from ftc.numerics.tucker import (
    GRID_POINTS,
    PRUNE_STEPS,
    REFITS,
    compress_tensor,
    head_concat,
    head_slices,
    times_right,
)
from ftc.options import (
    ALLOCATION_METHODS,
    ALLOCATIONS,
    ASVD_RATIO_CANDIDATES,
    ASVD_SENSITIVITY_SEQUENCES,
    ASVD_UNLISTED_RATIO,
    LAYER_RATIO_CANDIDATES,
    METHODS,
    PLAN_REFERENCE_RATIO,
    SCOPES,
)
from ftc.runtime.stored import cp_tensors, lowrank_tensors, tucker_tensors

Group = tuple[dict, dict[str, torch.Tensor]]

HEAD_EPS = 1.0
"""Damping of `loss_metric`'s head metric (§5), relative to its mean diagonal **[choice]**: half of the
metric is then the identity. Measured on the tuning split (rho 0.4, 16 windows, against
`wo_loss_metric` alone; docs/results.md): 1e-3 / 0.1 / 1 gave -3.6% / -3.7% / -3.5% on Gemma-3-270M
and +2.5% / +2.1% / +1.0% on SmolLM2-135M-Instruct; `W_O`'s metric keeps `OUTPUT_EPS`."""

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
and the value slices weighted 3 as well 43.57, weighted 0.5 42.13. The value slices stay at 1 on
Gemma-3-270M too (4 query heads per key head, rho 0.4, uniform allocation, 32 windows of
`wikitext2-tune`): weighted 0.5 / 1 / 4 they gave 34.05 / 33.08 / 34.81. 1 under `no_key_weight`.
"""

ANCHOR = 0.5
"""Weight of the original `W_O` in FTC's calibrated `W_O` target (§8); 0 under `no_anchor`."""

MLP_PRUNE_STEPS = 1
"""Steps of §7's pruning schedule for the gate/up tensor (§17) **[choice]**: one (the top-K core of
the allocation, then `REFITS` refits). Its core is 20-30 times Q/K/V's on SmolLM2 (`2 x 445 x 1536`
at keep 0.6), so each step costs a refit of that size; eight steps lower the gate/up error by a
further 10% relative on layers 3 and 27 at keep 0.6, at seven times the time."""


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
    """Per-layer stored-value budgets by part ("qkv", "o", "gateup", "down", or per matrix "q", "k",
    "v", "gate", "up"), from `plan`; `"whole"` lists the units a layer keeps uncompressed (`whole`)."""
    layer_budget: dict | None = None
    """The entry of `budgets` for the layer being compressed (set by `at_layer`)."""
    output_grams: tuple[dict[str, torch.Tensor], ...] | None = field(default=None, compare=False, repr=False)
    """Per layer, the loss gradient's metrics at the outputs of the parts in `loss_parts` (`"o"`:
    `W_O`'s Gram, §8; `"qkv"`: the head dimension's shared metric, §5; `ftc.compression.gradients`),
    else None."""
    output_metric: dict[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)
    """The entry of `output_grams` for the layer being compressed (set by `at_layer`)."""
    scope: str = "attention"
    """`attention`: Q/K/V and `W_O` only; `model`: the MLP projections too, at the same ratio (§17)."""
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

    def factor(self, w: torch.Tensor, stats: Moments | None, rank: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """One matrix's factors `(A, B, report)` at `rank`, from the statistics of its input: the whole
        of a per-matrix method (§11), which applies it to each of the seven projections alike."""
        raise NotImplementedError

    def _matrices(self, weights: dict[str, torch.Tensor], stats: Moments | None) -> tuple[list[Group], dict]:
        """`factor` applied to each matrix within its budget: groups and `{"ranks", "eps"}`."""
        groups, report = [], {"ranks": {}}
        for proj, w in weights.items():
            rank = self.rank(proj, *w.shape)
            a, b, info = self.factor(w, stats, rank)
            groups.append(self._lowrank(proj, a, b))
            report["ranks"][proj] = rank
            if "eps" in info:
                report.setdefault("eps", {})[proj] = info["eps"]
        return groups, report

    def qkv(self, weights: dict[str, torch.Tensor], x: Moments | None, layout: AttentionLayout):
        """Q, K and V (`(in, out)` weights) from the statistics `x` of their input: groups and a report."""
        return self._matrices(weights, x)

    def o(self, w_o: torch.Tensor, ctx: ContextStats | None, layout: AttentionLayout):
        """`W_O` from the statistics of the attention context: one group and a report."""
        (group,), report = self._matrices({"o": w_o}, None if ctx is None else ctx.teacher)
        return group, {"r_o": report["ranks"]["o"], **({"eps_o": report["eps"]["o"]} if "eps" in report else {})}

    def mlp_in(self, weights: dict[str, torch.Tensor], x: Moments | None, layout: AttentionLayout):
        """Gate and up (or up alone) from the statistics `x` of the MLP input (§17)."""
        return self._matrices(weights, x)

    def mlp_out(self, w_down: torch.Tensor, ctx: ContextStats | None, layout: AttentionLayout):
        """`W_down` from the statistics of its input, the MLP's intermediate activations (§17)."""
        (group,), report = self._matrices({"down": w_down}, None if ctx is None else ctx.teacher)
        return group, report

    def choices(self) -> dict:
        """The fixed constants this method ran with, for the manifest (none for the base class)."""
        return {}

    @property
    def dense_core(self) -> bool:
        """Variant `dense_core` (§9): every Tucker core kept dense, no pruning, so the `speed` runtime
        holds exactly the stored values and a keep ratio is also the share of values a decoded token
        reads and of the multiply-adds; the sparse core's savings are given up for that."""
        return "dense_core" in self.ablations

    @property
    def plans(self) -> bool:
        """Whether a model-wide plan (`survey` + `plan`, or the search of `whole_model_plan`) comes
        before compression."""
        return False

    @property
    def whole_model_plan(self) -> bool:
        """Whether the plan measures the whole model's loss (ASVD's rank search, `ftc.compression.sensitivity`)
        instead of per-layer `survey`s: it then needs every layer resident at once."""
        return False

    def survey(self, weights: dict[str, torch.Tensor], x: Moments, ctx: ContextStats, residual: float,
               layout: AttentionLayout, mlp: tuple[Moments, ContextStats] | None = None) -> dict:
        """Error-versus-budget data of one original layer on the original model's stream (§13).

        `residual` is the mean squared norm of the layer's input hidden state per token; with scope
        `model`, `mlp` holds the statistics of the MLP input and of `W_down`'s input, and `weights`
        the MLP's projections too.
        """
        raise NotImplementedError

    def plan(self, surveys: list[dict], layout: AttentionLayout) -> list[dict]:
        """Per-layer budgets (stored values by part) from every layer's survey (§13)."""
        raise NotImplementedError

    @property
    def loss_parts(self) -> frozenset[str]:
        """The parts fitted in the loss gradient's metric too: `W_O` (`"o"`) under `wo_loss_metric`
        (§8), `W_O` and Q/K/V (`"qkv"`) under `loss_metric` (§5); their `output_grams` are measured on
        the whole original model before compression."""
        if "loss_metric" in self.ablations:
            return frozenset({"o", "qkv"})
        return frozenset({"o"}) if "wo_loss_metric" in self.ablations else frozenset()

    @property
    def loss_metric(self) -> bool:
        """Whether any part is fitted in the loss gradient's metric (`loss_parts`)."""
        return bool(self.loss_parts)

    def output_gram(self, part: str) -> torch.Tensor | None:
        """This layer's loss metric at `part`'s output (`loss_parts`), None where it has none."""
        return None if self.output_metric is None else self.output_metric.get(part)

    def at_layer(self, index: int) -> Method:
        """This method with the budgets of layer `index`, when a plan gave it some, and its output
        metric, when it has one."""
        if self.budgets is None and self.output_grams is None:
            return self
        return dataclasses.replace(self, layer_budget=None if self.budgets is None else self.budgets[index],
                                   output_metric=None if self.output_grams is None else self.output_grams[index])

    def values(self, part: str, full: int) -> int:
        """Stored values this layer may spend on `part`: the plan's, else `keep_ratio * full` (§1)."""
        if self.layer_budget is not None and part in self.layer_budget:
            return int(self.layer_budget[part])
        return int(self.keep_ratio * full)

    def matrix_budgets(self, layout: AttentionLayout) -> Method:
        """This method with a plan's joint `gateup` budget (§15 plans the MLP as one unit) spread over
        gate and up by size, for a method that compresses them one matrix at a time (`per_matrix_mlp`):
        each matrix then spends the part's planned ratio, not `keep_ratio`."""
        budget = self.layer_budget
        if budget is None or "gateup" not in budget or any(p in budget for p in layout.mlp_in):
            return self
        share = int(budget["gateup"]) // len(layout.mlp_in)
        return dataclasses.replace(self, layer_budget={**budget, **dict.fromkeys(layout.mlp_in, share)})

    def whole(self, unit: str) -> bool:
        """Whether this layer's plan keeps `unit` ("attention" or "mlp") uncompressed (§15): its
        dense weights stay as they are and its budget is its whole size."""
        return self.layer_budget is not None and unit in self.layer_budget.get("whole", ())

    def budget_values(self, layout: AttentionLayout) -> dict[str, int]:
        """Stored values this layer may spend on each part (§1, §17), as the plan gave them: the
        manifest's budgets are these, summed over layers. A method that compresses Q, K and V (gate
        and up) one matrix at a time (`per_matrix_qkv`, `per_matrix_mlp`) has one budget per matrix;
        their sum is shown."""
        if self.per_matrix_qkv:
            sizes = layout.hidden * layout.head_dim
            qkv = sum(self.values(p, sizes * heads) for p, heads in
                      (("q", layout.heads), ("k", layout.kv_heads), ("v", layout.kv_heads)))
        else:
            qkv = self.values("qkv", layout.qkv_params)
        budgets = {"qkv": qkv, "o": self.values("o", layout.o_params)}
        if self.scope == "model":
            size = layout.hidden * layout.intermediate
            budgets["gateup"] = (sum(self.values(p, size) for p in layout.mlp_in) if self.per_matrix_mlp
                                 else self.values("gateup", layout.mlp_in_params))
            budgets["down"] = self.values("down", layout.down_params)
        return budgets

    @property
    def per_matrix_mlp(self) -> bool:
        """Whether gate and up are compressed one matrix at a time, each with its own budget."""
        return self.per_matrix_qkv

    def rank(self, part: str, rows: int, cols: int) -> int:
        """Rank of a two-factor `rows x cols` matrix within this layer's budget for `part`."""
        return rank_within(self.values(part, rows * cols), rows, cols)

    def _lowrank(self, proj: str, a: torch.Tensor, b: torch.Tensor) -> Group:
        return {"kind": "lowrank", "proj": [proj], "rank": a.shape[1]}, lowrank_tensors(
            a, b, self.storage_dtype
        )



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

    def factor(self, w, stats, rank):
        return *truncated_svd(w, rank), {}


@register("asvd")
class ASVD(Method):
    """Activation-aware SVD (§11): input channels scaled by `mean|x|^alpha` of the original model,
    each matrix's rank from ASVD's sensitivity-based search over the whole model (`ftc.compression.sensitivity`)."""

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

    def factor(self, w, stats, rank):
        return *scaled_svd(w, stats.abs_mean, rank), {}


@register("svd_llm")
class SVDLLM(Method):
    """SVD-LLM: Cholesky whitening of the original model's input Gram, per matrix (§11)."""

    stream = "teacher"

    def choices(self) -> dict:
        return whitening_choices()

    def factor(self, w, stats, rank):
        (a, b), whitening = guarded_whitened_svd(w, stats.gram, rank)
        return a, b, {"eps": whitening.eps}


@register("svd_llm_v2")
class SVDLLMV2(Method):
    """SVD-LLM V2 (§11): heterogeneous per-matrix ratios, loss-optimised (eigen-whitened) truncation.

    The statistics pass computes each matrix's theoretical truncation loss at the uniform ratio on
    the original model's stream; `plan` spreads the ratio over the layers per matrix type
    (`ftc.numerics.allocation.heterogeneous_ratios`); each matrix is then truncated in its exact metric.
    """

    stream = "teacher"

    @property
    def plans(self) -> bool:
        return True

    def survey(self, weights, x, ctx, residual, layout, mlp=None):
        inputs = {"q": x, "k": x, "v": x, "o": ctx.teacher}
        if mlp is not None:
            inputs.update(gate=mlp[0], up=mlp[0], down=mlp[1].teacher)
        losses = {}
        for proj, w in weights.items():
            stats = inputs[proj]
            values, vectors = torch.linalg.eigh(stats.gram)
            white = values.clamp_min(0).sqrt()[:, None] * (vectors.T @ w.to(WORK_DTYPE))
            spectrum = torch.linalg.svdvals(white)
            rank = budget_rank(*w.shape, self.keep_ratio)
            losses[proj] = float(spectrum[rank:].pow(2).sum() * stats.count) ** 0.5  # ||X (W - W')||_F
        return {"loss": losses}

    def plan(self, surveys, layout):
        """Within each matrix type (every layer's `W_Q`, ... and with scope `model` every `W_gate`,
        `W_up`, `W_down`), the ratio spread by the truncation losses (`heterogeneous_ratios`)."""
        budgets: list[dict] = [{} for _ in surveys]
        sizes = {"q": layout.hidden * layout.heads * layout.head_dim,
                 "k": layout.hidden * layout.kv_heads * layout.head_dim,
                 "v": layout.hidden * layout.kv_heads * layout.head_dim, "o": layout.o_params}
        if self.scope == "model":
            sizes.update({p: layout.hidden * layout.intermediate for p in layout.mlp_projections})
        for proj, size in sizes.items():
            losses = torch.tensor([s["loss"][proj] for s in surveys])
            for budget, keep in zip(budgets, heterogeneous_ratios(losses, self.keep_ratio), strict=True):
                budget[proj] = int(keep * size)
        return budgets

    def factor(self, w, stats, rank):
        return *eig_whitened_svd(w, stats.gram, rank), {}


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
        mlp = {"mlp_prune_steps": MLP_PRUNE_STEPS} if self.scope == "model" else {}
        return {**whitening_choices(), "prune_steps": PRUNE_STEPS, **mlp, "refits": REFITS, "anchor": self.anchor,
                "sink_weight": self.first_weight,
                "key_weight": self.key_weight,
                "allocation_grid": "fixed ranks (ablation)" if "fixed_ranks" in self.ablations else grid,
                # only when set: the lists kept for sparse cores keep their names (`plan_key`)
                **({"core": "dense (variant dense_core): no pruning"} if self.dense_core else {}),
                **self.search_choices()}

    def search_choices(self) -> dict:
        """The settings of the layer list `--allocation sensitivity` plans from (§15), when it does."""
        if self.allocation != "sensitivity":
            return {}
        return {"layer_sensitivity": {"ratio_candidates": list(LAYER_RATIO_CANDIDATES),
                                      "sequences": ASVD_SENSITIVITY_SEQUENCES,
                                      "reference_ratio": PLAN_REFERENCE_RATIO,
                                      "loss": "KL divergence from the original model per token, measured at the "
                                              "reference ratio, along each part's predicted error curve"}}

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
                    steps: int | None = None, refits: int | None = None, mode2: bool = True,
                    out_gram: torch.Tensor | None = None):
        """`compress_tensor` under the outcome guard of §3: `((factors, report), whitening, error)`, the
        error being the objective of §3-§4 (slice balancing and weights) in the undamped activation
        metric, the one the guard compares. The reference is the unwhitened allocation (HOSVD +
        top-K core, no pruning schedule).

        `out_gram` `H` (`dh x dh`, one for every slice; `loss_metric`, §5) adds K-FAC's metric on the
        second mode, `sum_s tr(C dW_s H dW_s^T)`: with `H = L L^T` (damped by `HEAD_EPS`) that is the
        plain objective of `V_s = W_s L`, so `V` is fitted as the tensor would be, guard, balancing and
        weights included (the reported error is then `V`'s), and `U2 <- L^-T U2` maps it back. An `H`
        that does not factorise is ignored."""
        right = None if out_gram is None else damped_factor(out_gram, HEAD_EPS)
        if right is not None:  # a few slices at a time: no float64 copy of the whole tensor (201 MB at 7B)
            tensor = times_right(tensor, right)
        gram = None if "no_whiten" in self.ablations else x.gram
        balance = "no_slice_norm" not in self.ablations
        coupled = "fixed_ranks" not in self.ablations or not mode2  # a Q/K/V ablation
        steps, refits = PRUNE_STEPS if steps is None else steps, REFITS if refits is None else refits

        def fit(whitening: Whitening, steps: int = steps, refits: int = refits):
            return compress_tensor(tensor, whitening, budget, balance=balance, coupled=coupled, steps=steps,
                                   refits=refits, weights=weights, mode2=mode2, dense_core=self.dense_core)

        measure = ActivationError(tensor, gram, balance, weights)

        def error(result) -> float:
            return measure(result[0].weights)

        result, whitening = guarded_fit(gram, fit, error, lambda: error(fit(Whitening(None, None), 1, 0)))
        measured = error(result)
        if right is not None:
            factors, report = result
            u2 = torch.linalg.solve_triangular(right.T, factors.u2.to(WORK_DTYPE), upper=True)
            result = dataclasses.replace(factors, u2=u2.to(factors.u2.dtype)), report
        return result, whitening, measured

    def _tucker(self, tensor: torch.Tensor, x: Moments, proj: list[str], heads: list[int], budget: int,
                weights: torch.Tensor | None = None, mode2: bool = True, steps: int | None = None,
                out_gram: torch.Tensor | None = None):
        (factors, report), _, measured = self._tucker_fit(tensor, x, budget, weights, steps=steps, mode2=mode2,
                                                          out_gram=out_gram)
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
                                                         self.slice_weights(layout, repeat),
                                                         out_gram=self.output_gram("qkv"))
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
        group, report = self._calibrated("o", w_o, ctx)
        return group, {"r_o": report["rank"], "eps_o": report["eps"], "eps_o_solve": report["eps_solve"],
                       "anchor": report["anchor"]}

    def mlp_out(self, w_down, ctx, layout):
        """`W_down` as `W_O` (§17): calibrated toward the original MLP output on the compressed model's
        stream, truncated in the metric of the compressed gate/up's intermediate activations."""
        return self._calibrated("down", w_down, ctx)

    def _calibrated(self, part: str, w_o: torch.Tensor, ctx: ContextStats) -> tuple[Group, dict]:
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
        rank = self.rank(part, *w_o.shape)
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
        (a, b), whitening = guarded_whitened_svd(target, None if "no_whiten" in self.ablations else metric, rank,
                                                 self.output_gram(part))  # `wo_loss_metric`: K-FAC's metric
        return self._lowrank(part, a, b), {"rank": rank, "eps": whitening.eps, "eps_solve": eps_solve,
                                           "anchor": anchor}

    @property
    def per_matrix_mlp(self) -> bool:
        return "mlp_per_matrix" in self.ablations

    def factor(self, w, stats, rank):
        """One matrix in FTC's metric (`mlp_per_matrix`, `per_matrix`): the whitened truncated SVD
        under the guard of §3."""
        (a, b), whitening = guarded_whitened_svd(w, None if "no_whiten" in self.ablations else stats.gram, rank)
        return a, b, {"eps": whitening.eps}

    def mlp_in(self, weights, x, layout):
        """Gate and up as one tensor (§17): slices gate and up (`(2, d, I)`; GPT-J's `fc_in` alone,
        one slice), one shared input factor and a budget-coupled sparse core, pruned and refitted as
        Q/K/V's (§5-§7), in the whitened metric of the compressed model's MLP input. The second mode
        (the intermediate neurons) keeps no factor: gate and up share no output subspace
        (`mlp_mode2` adds the shared `U2` of Q/K/V's Tucker; `mlp_per_matrix`: each matrix alone)."""
        if self.per_matrix_mlp:
            return self._matrices(weights, x)
        tensor = torch.stack([weights[p] for p in layout.mlp_in])
        budget = self.values("gateup", layout.mlp_in_params)
        (spec, tensors), report, measured = self._tucker(tensor, x, list(layout.mlp_in), [1] * tensor.shape[0],
                                                         budget, mode2="mlp_mode2" in self.ablations,
                                                         steps=MLP_PRUNE_STEPS)
        return [(spec, tensors)], {"r1": report.r1, "r2": report.r2, "K": report.kept, "eps": report.eps,
                                   "error_allocated": report.error_allocated, "error_refit": report.error_refit,
                                   "error_activation": measured, "budget": budget}

    @property
    def plans(self) -> bool:
        return self.allocation != "uniform"


    def survey(self, weights, x, ctx, residual, layout, mlp=None):
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
                              weights=slice_weights, dense_core=self.dense_core)
        w_o = weights["o"].to(WORK_DTYPE)
        o_gram = None if "no_whiten" in self.ablations else ctx.teacher.gram
        _, o_white = guarded_whitened_svd(w_o, o_gram, budget_rank(*w_o.shape, self.keep_ratio))
        white = o_white.apply(w_o)
        o_white.release()
        spectrum = torch.linalg.svdvals(white)
        branch = float((w_o * (ctx.teacher.gram @ w_o)).sum())
        return {"qkv_costs": costs, "qkv_errors": errors, "o_spectrum": spectrum.tolist(),
                "effect": branch / max(residual, 1e-30)}

    def plan(self, surveys, layout):
        """One budget for the whole attention stack, split by `ftc.numerics.allocation.choose` (§13)."""
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

    @property
    def per_matrix_mlp(self) -> bool:
        return True

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
        heads = [layout.heads, layout.kv_heads, layout.kv_heads]
        group, report = self._cp(tensor, x, budget, self.slice_weights(layout, 1), ["q", "k", "v"], heads)
        return [group], {**report, "qkv_budget": budget}

    def mlp_in(self, weights, x, layout):
        """Gate and up as one CP tensor (FTC's §17 with CP's §14)."""
        if self.per_matrix_mlp:
            return self._matrices(weights, x)
        tensor = torch.stack([weights[p] for p in layout.mlp_in])
        budget = self.values("gateup", layout.mlp_in_params)
        group, report = self._cp(tensor, x, budget, None, list(layout.mlp_in), [1] * tensor.shape[0])
        return [group], {**report, "budget": budget}

    def _cp(self, tensor: torch.Tensor, x: Moments, budget: int, slice_weights: torch.Tensor | None,
            proj: list[str], heads: list[int]) -> tuple[Group, dict]:
        """The guarded CP fit of one slice stack (`proj`, `heads` slices each): its group and report."""
        measure = ActivationError(tensor, x.gram, True, slice_weights)

        def fit(whitening: Whitening, sweeps: int = MAX_SWEEPS):
            return compress_cp(tensor, whitening, budget, weights=slice_weights, max_sweeps=sweeps)

        def error(result) -> float:
            return measure(result[0].weights)

        # the outcome guard of §3, which CP shares (§14); the reference is the unwhitened HOSVD start
        (factors, report), _ = guarded_fit(x.gram, fit, error, lambda: error(fit(Whitening(None, None), 0)))
        spec = {"kind": "cp", "proj": proj, "heads": heads, "rank": report.rank}
        return (spec, cp_tensors(factors, self.storage_dtype)), {
            "R": report.rank, "eps": report.eps, "error_init": report.error_init, "error_fit": report.error,
            "sweeps": report.sweeps, "extrapolated": report.extrapolated}


def make_method(
    name: str, keep_ratio: float, storage_dtype: torch.dtype, ablations: tuple[str, ...] = (),
    allocation: str = "uniform", scope: str = "attention",
) -> Method:
    if ablations and name != "ftc":
        raise ValueError(f"ablations apply to method 'ftc' only; got method {name!r}")
    if allocation not in ALLOCATIONS or name not in ALLOCATION_METHODS.get(allocation, METHODS):
        raise ValueError(f"allocation {allocation!r} does not apply to method {name!r} (ALLOCATION_METHODS)")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}; got {scope!r}")
    return METHOD_CLASSES[name](keep_ratio, storage_dtype, frozenset(ablations), allocation, scope=scope)
