"""Decode-step cost model: analytic (hardware presets, spec-sheet numbers) or fitted to the rollout engine's
timed decode steps, in one linear form of four features of a step (per step, per sequence, KV tokens
read, pages scored), so that `plan-schedule` can price a schedule against dense; an analytic model also
prices the prompt's dense prefill, which a plan's speedup adds to both sides (`SpeedupScope`). The model
shape travels with the coefficients, so a cost artifact is never applied to another model. The derivation
of the features and coefficients is docs/cost-model.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pyarrow as pa

from .core.definitions import DEFAULT_DENSE_LAYERS, PAGE_SIZE, RESERVED_PAGES  # torch-free, for planning
from .model.config import SHAPE_KEYS, ModelConfig, shape_of

FEATURES = ("step", "seq", "kv", "page")
# a speculative verification forward (fit-cost --speculate): per forward, per fed token, KV tokens read
VERIFY_FEATURES = ("step", "token", "kv")
VERIFY_TOKENS = (2, 5)  # fed tokens per sample of the timed verification forwards (K = 1 and 4 drafts)
BF16 = 2


class CostError(ValueError):
    """Bad input to the cost model (unknown hardware, a cost artifact for another model, ...)."""


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth: float  # bytes / s (HBM)
    flops: float  # dense bf16 FLOP / s
    overhead: float  # seconds per decode step that do not scale with work
    summary: str


# Spec-sheet numbers. The overhead (0.5 ms) is an a-priori allowance for a CUDA-graph decode step:
# ~40 layers x ~10 kernels of a few microseconds each, plus sampling and the engine's scheduler.
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("h100", 3.35e12, 989e12, 5e-4, "NVIDIA H100 SXM: 3.35 TB/s HBM3, 989 TFLOP/s bf16"),
    Hardware("h200", 4.8e12, 989e12, 5e-4, "NVIDIA H200 SXM: 4.8 TB/s HBM3e, 989 TFLOP/s bf16"),
    Hardware("a100", 2.039e12, 312e12, 5e-4, "NVIDIA A100 80GB SXM: 2.04 TB/s HBM2e, 312 TFLOP/s bf16"),
)}


def get_hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise CostError(f"unknown hardware {name!r}; known hardware presets: {', '.join(HARDWARE)}") from None


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters that a decode step multiplies (the input embedding is a lookup, unless tied)."""
    untied_embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.num_parameters - untied_embedding


@dataclass(frozen=True)
class CostModel:
    """Seconds per decode step = coefficients . features(batch, context, budget)."""

    config: ModelConfig
    coefficients: dict[str, float]  # keyed by FEATURES
    source: str  # "analytic:h200", "measured:cpu", ...
    page_size: int = PAGE_SIZE
    dense_layers: tuple[int, ...] = DEFAULT_DENSE_LAYERS
    extra: dict = field(default_factory=dict)  # fit quality etc., written to metadata
    verify: dict[str, float] | None = None  # fitted to timed verification forwards (VERIFY_FEATURES)

    @property
    def num_sparse_layers(self) -> int:
        return self.config.num_layers - len({i for i in self.dense_layers if i < self.config.num_layers})

    def features(self, batch, context, budget) -> np.ndarray:
        """[..., 4] features; arguments broadcast; budget 0 (or None) = dense."""
        batch = np.asarray(batch, dtype=np.float64)
        context = np.asarray(context, dtype=np.float64)
        budget = np.asarray(0 if budget is None else budget, dtype=np.float64)
        pages = np.ceil(context / self.page_size)
        sparse = (budget > 0) & (pages > budget / self.page_size)
        read = np.where(sparse, np.minimum(context, budget), context)
        n_sparse = self.num_sparse_layers
        n_dense = self.config.num_layers - n_sparse
        kv = batch * (n_dense * context + n_sparse * read)
        page = batch * np.where(sparse, n_sparse * pages, 0.0)
        ones = np.ones(np.broadcast(batch, context, budget).shape)
        return np.stack(np.broadcast_arrays(ones, batch * ones, kv, page), axis=-1)

    def verify_features(self, batch, context, tokens) -> np.ndarray:
        """[..., 3] features of a verification forward of `tokens` fed tokens per sample at `context`."""
        batch, context, tokens = (np.asarray(x, dtype=np.float64) for x in (batch, context, tokens))
        ones = np.ones(np.broadcast(batch, context, tokens).shape)
        return np.stack(np.broadcast_arrays(ones, batch * tokens * ones,
                                            batch * self.config.num_layers * context * ones), axis=-1)

    @property
    def vector(self) -> np.ndarray:
        return np.array([self.coefficients[k] for k in FEATURES])

    def step_seconds(self, batch, context, budget, scored: bool = True) -> np.ndarray:
        """Predicted seconds of a decode step; `scored` False: a sparse step on pages an earlier step
        selected (a speculative cycle's later drafts), which scores no page."""
        features = self.features(batch, context, budget)
        if not scored:
            features[..., FEATURES.index("page")] = 0.0
        return features @ self.vector

    def rollout_seconds(self, budget_at: Callable[[np.ndarray], np.ndarray] | None, gen_len: int,
                        batch: int, prompt_len: int = 0) -> float:
        """Decode seconds of `batch` sequences generating `gen_len` tokens after `prompt_len` prompt
        tokens. The first token comes from the (dense) prefill; the token at position t, for t from
        prompt_len + 1 to prompt_len + gen_len - 1, from a decode step that attends to t cached
        positions with budget `budget_at(t)` (None = dense), as `Schedule.budget_at` defines it."""
        contexts = np.arange(prompt_len + 1, prompt_len + gen_len)
        budgets = 0 if budget_at is None else budget_at(contexts)
        return float(self.step_seconds(batch, contexts, budgets).sum())

    def speedup(self, budget_at: Callable[[np.ndarray], np.ndarray], gen_len: int, batch: int,
                prompt_len: int = 0, prefill_s: float = 0.0) -> float:
        """Predicted speedup over dense: (prefill_s + dense decode seconds) / (prefill_s + sparse decode
        seconds); `prefill_s` 0 gives decode alone (`SpeedupScope` says which a plan prints)."""
        return ((prefill_s + self.rollout_seconds(None, gen_len, batch, prompt_len))
                / (prefill_s + self.rollout_seconds(budget_at, gen_len, batch, prompt_len)))

    @property
    def hardware(self) -> Hardware | None:
        """The hardware preset of an analytic model (its metadata carries it); None for a measured one."""
        spec = self.extra.get("hardware") if self.source.startswith("analytic:") else None
        return Hardware(**json.loads(spec)) if spec else None

    def prefill_seconds(self, batch: int, prompt_len: int) -> float | None:
        """Predicted seconds of the dense prefill of `batch` prompts of `prompt_len` tokens in one forward,
        in the eFLOPs form of the analytic decode step (docs/cost-model.md): the weights read once, every
        prompt token through the active parameters, causal attention in every layer, K and V written. Each
        sequence prefills its own prompt, as each reads its own KV in decode. 0 with no prompt; None for a
        measured model, whose fit timed decode steps only and so cannot price a prefill."""
        if prompt_len == 0:
            return 0.0
        hw = self.hardware
        if hw is None:
            return None
        cfg = self.config
        p = active_parameters(cfg)
        attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (prompt_len + 1)  # per query token
        flops = batch * prompt_len * (2 * p + attention)
        written = batch * prompt_len * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * BF16
        return hw.overhead + flops / hw.flops + (p * BF16 + written) / hw.bandwidth

    def check_model(self, cfg: ModelConfig, subject: str) -> None:
        theirs, ours = shape_of(self.config), shape_of(cfg)
        diff = [k for k in SHAPE_KEYS if theirs[k] != ours[k]]
        if diff:
            shown = ", ".join(f"{k} {theirs[k]} vs {ours[k]}" for k in diff[:3])
            raise CostError(f"{subject} was fitted for another model shape ({shown}); "
                            "run `sparrow fit-cost` for this model or use --hardware")

    def metadata(self) -> dict:
        verify = {} if self.verify is None else {"verify_coefficients": json.dumps(self.verify)}
        return {"source": self.source, "coefficients": json.dumps(self.coefficients),
                "model_config": json.dumps(self.config.to_dict()), "page_size": self.page_size,
                "dense_layers": json.dumps(list(self.dense_layers)),
                **self.extra, **verify}

    @classmethod
    def from_metadata(cls, meta: dict, subject: str) -> CostModel:
        try:
            coefficients = json.loads(meta["coefficients"])
            cfg = ModelConfig.from_dict(json.loads(meta["model_config"]))
            verify = json.loads(meta["verify_coefficients"]) if "verify_coefficients" in meta else None
            source = str(meta["source"])
            hardware = meta.get("hardware") if source.startswith("analytic:") else None
            if hardware:  # the preset that prices a prefill: a malformed one is refused here, with the rest
                Hardware(**json.loads(hardware))
            return cls(cfg, {k: float(coefficients[k]) for k in FEATURES}, source,
                       int(meta.get("page_size", PAGE_SIZE)),
                       tuple(json.loads(meta.get("dense_layers", "[0, 1]"))),
                       {"hardware": str(hardware)} if hardware else {},
                       verify=None if verify is None else {k: float(verify[k]) for k in VERIFY_FEATURES})
        except (KeyError, TypeError, ValueError) as e:
            raise CostError(f"{subject} lacks usable cost-model metadata ({type(e).__name__}: {e}); "
                            "write it with `sparrow fit-cost`") from None


@dataclass(frozen=True)
class SpeedupScope:
    """What a plan's predicted speedups over dense cover. The dense prefill of the prompt is the same in a
    sparse and a dense rollout, but it does not cancel from a ratio: (P + D_dense) / (P + D_sparse) is
    below D_dense / D_sparse. So where the cost model prices a prefill (`prefill_s`, 0 with no prompt) it
    is on both sides and the speedup is the whole rollout's; where it cannot (a measured model: None) the
    speedup is of decode alone and says so."""

    prefill_s: float | None
    prompt_len: int

    @classmethod
    def of(cls, cost: CostModel, batch: int, prompt_len: int) -> SpeedupScope:
        return cls(cost.prefill_seconds(batch, prompt_len), prompt_len)

    @property
    def name(self) -> str:
        """The artifacts' `speedup_scope`: "rollout" (prefill included, or no prompt) or "decode" (prefill
        excluded)."""
        return "decode" if self.prefill_s is None else "rollout"

    @property
    def prefill(self) -> float:
        """Seconds added to both sides of the ratio (0 where the prefill is not priced)."""
        return self.prefill_s or 0.0

    def label(self) -> str:
        """The headline's words: "rollout speedup", with what it includes where there is a prompt."""
        if self.prefill_s is None:
            return "decode speedup over dense (prefill excluded)"
        if self.prompt_len:
            return "rollout speedup over dense (the prompt's dense prefill included)"
        return "rollout speedup over dense"


def analytic(cfg: ModelConfig, hardware: str | Hardware, page_size: int = PAGE_SIZE,
             dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS) -> CostModel:
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    p = active_parameters(cfg)
    kv_token_layer = 2 * cfg.num_kv_heads * cfg.head_dim * BF16
    coefficients = {
        "step": hw.overhead + p * BF16 / hw.bandwidth,
        "seq": 2 * p / hw.flops,
        "kv": kv_token_layer / hw.bandwidth + 4 * cfg.num_heads * cfg.head_dim / hw.flops,
        "page": kv_token_layer / 2 / hw.bandwidth + 2 * cfg.num_kv_heads * cfg.head_dim / hw.flops,
    }
    return CostModel(cfg, coefficients, f"analytic:{hw.name}", page_size, tuple(dense_layers),
                     {"hardware": json.dumps(asdict(hw))})


# ---------------------------------------------------------------- fitting measured points


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of columns: the best unconstrained fit over
    every subset of columns whose solution is non-negative (2^k small solves; k = 4 here)."""
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    best, best_res = np.zeros(a.shape[1]), float(np.sum(b**2))
    for r in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), r):
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (x < 0).any():
                continue
            res = float(np.sum((a[:, cols] @ x - b) ** 2))
            if res < best_res - 1e-15:
                best, best_res = np.zeros(a.shape[1]), res
                best[list(cols)] = x
    return best / scale


def fit(cfg: ModelConfig, points: Sequence[tuple[int, int, int, float]], source: str,
        page_size: int = PAGE_SIZE, dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS) -> CostModel:
    """Fit coefficients to (batch, context, budget (0 = dense), seconds) points."""
    if len(points) < 2:
        raise CostError("fitting the cost model needs at least two measured points")
    probe = CostModel(cfg, dict.fromkeys(FEATURES, 0.0), source, page_size, tuple(dense_layers))
    b, c, bud, sec = (np.array(x, dtype=np.float64) for x in zip(*points))
    x = probe.features(b, c, bud)
    coef = nnls(x / sec[:, None], np.ones_like(sec))
    rel = np.abs(x @ coef - sec) / sec
    extra = {"median_relative_error": float(np.median(rel)), "max_relative_error": float(rel.max()),
             "points": len(points), "spare_points": spare_points(x)}
    return CostModel(cfg, dict(zip(FEATURES, map(float, coef))), source, page_size,
                     tuple(dense_layers), extra)


def fit_verify(model: CostModel, points: Sequence[tuple[int, int, int, float]]) -> CostModel:
    """`model` with verification coefficients fitted to (batch, context, fed tokens per sample, seconds)
    points, as `fit` fits the decode step's; every point, with its prediction, goes to the metadata's
    `verify_points` (`verify_rows`), since the artifact's rows are decode steps."""
    b, c, t, sec = (np.array(x, dtype=np.float64) for x in zip(*points))
    x = model.verify_features(b, c, t)
    coef = nnls(x / sec[:, None], np.ones_like(sec))
    pred = x @ coef
    rel = np.abs(pred - sec) / sec
    rows = [{"batch": int(p[0]), "context": int(p[1]), "tokens": int(p[2]), "seconds": float(p[3]),
             "predicted_seconds": float(y)} for p, y in zip(points, pred)]
    extra = {**model.extra, "verify_median_relative_error": float(np.median(rel)),
             "verify_max_relative_error": float(rel.max()), "verify_spare_points": spare_points(x),
             "verify_points": json.dumps(rows)}
    return replace(model, verify=dict(zip(VERIFY_FEATURES, map(float, coef))), extra=extra)


def verify_rows(model: CostModel) -> list[dict]:
    """The timed verification forwards a fit wrote (batch, context, tokens, seconds, predicted_seconds);
    none for a model without fitted verification coefficients."""
    return json.loads(model.extra.get("verify_points", "[]"))


# ---------------------------------------------------------------- the grid, and how far a fit to it reaches


@dataclass
class Grid:
    batches: list[int]
    contexts: list[int]
    budgets: list[int]  # 0 = dense
    warmup: int = 2
    repeats: int = 5

    def points(self) -> list[tuple[int, int, int]]:
        return [(b, c, k) for b in self.batches for c in self.contexts for k in self.budgets]


COEFFICIENT_NAMES = {"step": "per-step", "seq": "batch", "kv": "KV token-layer", "page": "scored page-layer"}
VERIFY_NAMES = {"step": "per-forward", "token": "fed-token", "kv": "KV token-layer"}


def generated_tokens(warmup: int, repeats: int, verify: Sequence[int] = ()) -> int:
    """The most tokens a timed point generates after its context: the prefill's first token and the
    warmup and timed decode steps (`time_decode_steps`), or, verifying (`time_verifications`), as many
    cycles of up to max(verify) fed tokens per sample and a last token."""
    steps = warmup + repeats + 1
    return max([steps, *(steps * t + 1 for t in verify)])


def context_problem(cfg: ModelConfig, grid: Grid, verify: Sequence[int] = ()) -> str | None:
    """One sentence when the grid's largest context leaves no room in the model's context for the tokens
    its points generate (verifying `verify` fed tokens too): which flags make those tokens, and the
    largest context that fits; None when all fit."""
    generated = generated_tokens(grid.warmup, grid.repeats, verify)
    room = cfg.max_position_embeddings - generated
    if max(grid.contexts) <= room:
        return None
    how = (f"--warmup {grid.warmup} and --repeats {grid.repeats} decode steps after the prefill's token"
           + (f", verifying up to {max(verify)} tokens per step with --speculate" if verify else ""))
    return (f"--contexts {max(grid.contexts)} plus the {generated} tokens each timed point generates ({how}) "
            f"is beyond the model's context of {cfg.max_position_embeddings}; give contexts of at most "
            f"{room}, or fewer --warmup or --repeats")


def verify_grid(grid: Grid, tokens: Sequence[int] = VERIFY_TOKENS) -> list[tuple[int, int, int]]:
    """The (batch, context, fed tokens per sample) points that `time_verifications` times for `grid`."""
    return [(b, c, t) for t in tokens for b in grid.batches for c in grid.contexts]


def _scaled(x: np.ndarray) -> np.ndarray:
    """Columns scaled to a largest magnitude of 1: ranks that do not depend on the features' units."""
    top = np.abs(x).max(axis=0)
    return x / np.where(top > 0, top, 1.0)


def spare_points(x: np.ndarray) -> int:
    """Points of a design matrix (one row per point) beyond its rank. With none, a fit can pass through
    every point whatever was measured, so its error is 0 by construction and says nothing of accuracy."""
    return len(x) - int(np.linalg.matrix_rank(_scaled(x)))


def _undetermined(x: np.ndarray, names: Sequence[str]) -> list[str]:
    """The columns of `x` whose coefficient a fit cannot pin down: those whose unit vector is outside the
    row space of `x`, so that other values of it (traded against the others) fit every row as well; none
    exactly when `x` has full column rank."""
    x = _scaled(x)
    rank = np.linalg.matrix_rank(x)
    unit = np.eye(x.shape[1])
    return [name for j, name in enumerate(names) if np.linalg.matrix_rank(np.vstack([x, unit[j]])) > rank]


def fitted_features(probe: CostModel) -> tuple[str, ...]:
    """The FEATURES a fit for `probe`'s model must determine: all four, less the page term for a model
    with no sparse layer, whose steps score no page, so that no prediction reads that coefficient."""
    return FEATURES if probe.num_sparse_layers else FEATURES[:-1]


def undetermined(probe: CostModel, points: Sequence[tuple[int, int, int]]) -> list[str]:
    """The `fitted_features` whose coefficient the (batch, context, budget) points cannot pin down
    (`_undetermined` of their feature matrix). `probe`: any model of the shape (its coefficients are not
    read)."""
    b, c, k = (np.array(x, dtype=np.float64) for x in zip(*points))
    names = fitted_features(probe)
    return _undetermined(probe.features(b, c, k)[:, :len(names)], names)


def verify_undetermined(probe: CostModel, points: Sequence[tuple[int, int, int]]) -> list[str]:
    """The VERIFY_FEATURES whose coefficient the (batch, context, fed tokens) points cannot pin down."""
    b, c, t = (np.array(x, dtype=np.float64) for x in zip(*points))
    return _undetermined(probe.verify_features(b, c, t), VERIFY_FEATURES)


def _listed(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _coefficients(whose: str, missing: Sequence[str], names: dict[str, str]) -> str:
    return f"{whose} {_listed([names[m] for m in missing])} coefficient{'s' * (len(missing) > 1)}"


def grid_problem(cfg: ModelConfig, grid: Grid, speculate: bool = False) -> str | None:
    """One sentence when the grid's feature matrix (with `speculate`, also its verification forwards')
    lacks full column rank, so that a fit would leave some coefficient to chance: which, and what to add
    to the grid (`_decode_lacks`); None when the points determine every coefficient."""
    probe = CostModel(cfg, dict.fromkeys(FEATURES, 0.0), "grid")
    decode = undetermined(probe, grid.points())
    verify = verify_undetermined(probe, verify_grid(grid)) if speculate else []
    if not decode and not verify:
        return None
    what = [_coefficients("the decode step's", decode, COEFFICIENT_NAMES) if decode else "",
            _coefficients("the verification's", verify, VERIFY_NAMES) if verify else ""]
    if decode:
        lacks = _listed(_decode_lacks(probe, grid) or ["values that vary the step's features independently"])
        enough = ("two batch sizes, two contexts, and 'dense' with a budget below a context in --budgets "
                  "always suffice" if probe.num_sparse_layers else
                  "two batch sizes and two contexts always suffice (this model has no sparse layer)")
    else:  # at two fed-token counts: a second batch size or a second context separates the three terms
        lacks, enough = "a second batch size to --batches or a second context to --contexts", ""
    return (f"the grid cannot determine {' or '.join(w for w in what if w)} (other values fit its points as "
            f"well): add {lacks}{'; ' + enough if enough else ''}")


def _decode_lacks(probe: CostModel, grid: Grid) -> list[str]:
    """What a grid lacks of a recipe for a full-rank decode fit: two batch sizes, two contexts and, for a
    model with sparse layers, 'dense' and a budget below a context. The recipe always suffices: across two
    batch sizes the per-step and per-sequence terms separate, and what is left needs three (context,
    budget) points whose KV read and pages scored per sequence are not on one line, which dense points at
    two contexts and a sparse one never are (docs/cost-model.md); and adding values to a grid never undoes
    an item, so adding all that is named suffices."""
    lacks = ["a second batch size to --batches" if len(set(grid.batches)) < 2 else "",
             "a second context to --contexts" if len(set(grid.contexts)) < 2 else ""]
    if probe.num_sparse_layers:
        scored = probe.features(1, np.array(grid.contexts)[:, None], np.array(grid.budgets)[None, :])
        lowest = RESERVED_PAGES * probe.page_size  # the smallest budget
        below = (f"a budget below {max(grid.contexts)} to --budgets" if max(grid.contexts) > lowest else
                 f"a context above {lowest} to --contexts with a budget below it in --budgets")
        lacks += ["" if 0 in grid.budgets else "'dense' to --budgets",
                  "" if (scored[..., FEATURES.index("page")] > 0).any() else below]
    return [x for x in lacks if x]


def fitted_range(table: pa.Table) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """((lowest, highest) batch, (lowest, highest) context) of a cost artifact's measured points; None for
    an analytic model, which is not fitted to any."""
    import pyarrow.compute as pc

    measured = table.filter(pc.is_valid(table.column("seconds")))
    if measured.num_rows == 0:
        return None
    return tuple((int(pc.min(measured.column(k)).as_py()), int(pc.max(measured.column(k)).as_py()))
                 for k in ("batch", "context"))


def underdetermined_warning(subject: str, table: pa.Table, model: CostModel) -> str | None:
    """One sentence when a measured cost artifact's own points cannot determine some coefficient of its
    decode step (or of its verification): fit-cost refuses such grids, a cost file from elsewhere may hold
    one; None for an analytic model or a well-determined fit."""
    rows = [r for r in table.to_pylist() if r["seconds"] is not None]
    if not rows:
        return None
    decode = undetermined(model, [(r["batch"], r["context"], r["budget"] or 0) for r in rows])
    forwards = [(r["batch"], r["context"], r["tokens"]) for r in verify_rows(model)]
    verify = verify_undetermined(model, forwards) if forwards and model.verify is not None else []
    if not decode and not verify:
        return None
    what = [_coefficients("the decode step's", decode, COEFFICIENT_NAMES) if decode else "",
            _coefficients("the verification's", verify, VERIFY_NAMES) if verify else ""]
    return (f"{subject} was fitted from points that cannot determine {' or '.join(w for w in what if w)}, so "
            "its predictions away from those points are guesses; refit it with sparrow fit-cost over two "
            "batch sizes and two contexts")


def _span(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}-{high}"


def extrapolation_warning(subject: str, fitted: tuple[tuple[int, int], tuple[int, int]] | None, batch: int,
                          contexts: np.ndarray) -> str | None:
    """One sentence when a plan prices decode steps far outside the grid a measured model was fitted on:
    a batch beyond a factor 2 of the fitted batches, or contexts beyond twice the largest fitted one. A
    step's cost is linear in its features, so nearby points extrapolate well, and short contexts below the
    grid are priced mostly by the per-step and batch terms that every point measures; None otherwise."""
    if fitted is None or not len(contexts):
        return None
    (b_lo, b_hi), (c_lo, c_hi) = fitted
    far = [f"batch {batch}" if not b_lo / 2 <= batch <= 2 * b_hi else "",
           f"contexts up to {int(contexts.max())}" if contexts.max() > 2 * c_hi else ""]
    if not any(far):
        return None
    return (f"{subject} was fitted at batch {_span(b_lo, b_hi)} and contexts {_span(c_lo, c_hi)}; this plan "
            f"predicts at {' and '.join(f for f in far if f)}, far outside that grid, so its step times and "
            "speedup extrapolate the fit")


# ---------------------------------------------------------------- timing the rollout engine


def time_decode_steps(loaded, grid: Grid, device: str = "cpu", seed: int = 0,
                      progress: Callable[[int, int], None] | None = None,
                      gpu_memory_utilization: float = 0.9) -> list[tuple[int, int, int, float]]:
    """Seconds of one rollout-engine decode step per (batch, context, budget) point: the step `sparrow
    rollout` runs, one engine for the whole grid, the fastest of `repeats` timed steps after `warmup`
    (docs/cost-model.md says why).
    """
    import torch

    from .core.sparsity import as_policy
    from .engine import Engine, EngineConfig, SamplingParams

    model, cfg = loaded.model.eval(), loaded.config
    steps = generated_tokens(grid.warmup, grid.repeats)  # the first token comes from the prefill
    if (problem := context_problem(cfg, grid)) is not None:
        raise CostError(problem)
    gen = torch.Generator().manual_seed(seed)
    prompts = {c: torch.randint(0, cfg.vocab_size, (c - 1,), generator=gen).tolist() for c in grid.contexts}
    params = lambda batch: SamplingParams(max_new_tokens=steps, n=batch,
                                          temperature=1.0, seed=seed, ignore_eos=True)
    points, out = grid.points(), []
    with Engine(model, None, EngineConfig(max_batch=max(grid.batches), dense_layers=DEFAULT_DENSE_LAYERS,
                                          gpu_memory_utilization=gpu_memory_utilization)) as engine:
        engine.reserve([prompts[max(grid.contexts)]], params(max(grid.batches)))
        for i, (batch, context, budget) in enumerate(points):
            engine.generate([prompts[context]], params(batch), policy=as_policy(budget or None))
            timed = engine.stats.step_times[grid.warmup:]
            out.append((batch, context, budget, min(timed)))
            if progress:
                progress(i + 1, len(points))
    return out


class _CyclesTimed(Exception):
    """Raised from a timed generation's step callback once the cycles to time have run."""


def time_verifications(loaded, grid: Grid, tokens: Sequence[int] = VERIFY_TOKENS, seed: int = 0,
                       gpu_memory_utilization: float = 0.9) -> list[tuple[int, int, int, float]]:
    """Seconds of one speculative verification forward per (batch, context, fed tokens per sample): the
    engine speculating with K = tokens - 1 drafts at the grid's smallest budget (dense when it has none),
    the fastest of `repeats` cycles after `warmup`, every timed cycle verifying K + 1 tokens per sample.
    A generation stops once its cycles are timed (rejected drafts would otherwise add cycles up to its
    length)."""
    import torch

    from .core.sparsity import as_policy
    from .engine import Engine, EngineConfig, SamplingParams

    model, cfg = loaded.model.eval(), loaded.config
    cycles = grid.warmup + grid.repeats
    draft = min((b for b in grid.budgets if b), default=0) or None
    if (problem := context_problem(cfg, grid, tokens)) is not None:
        raise CostError(problem)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in tokens:
        new = (cycles + 1) * t + 1  # the timed cycles all draft K: max_new_tokens never cuts them short
        config = EngineConfig(max_batch=max(grid.batches), dense_layers=DEFAULT_DENSE_LAYERS,
                              gpu_memory_utilization=gpu_memory_utilization, speculate=t - 1)
        with Engine(model, as_policy(draft), config) as engine:
            def stop_once_timed(_tokens: int, _finished: int) -> None:
                if len(engine.stats.verify_times) >= cycles:
                    raise _CyclesTimed

            for batch in grid.batches:
                for context in grid.contexts:
                    prompt = torch.randint(0, cfg.vocab_size, (context - 1,), generator=gen).tolist()
                    with contextlib.suppress(_CyclesTimed):  # the engine drops the rest and is idle again
                        engine.generate([prompt], SamplingParams(max_new_tokens=new, n=batch, temperature=1.0,
                                                                 seed=seed, ignore_eos=True),
                                        on_step=stop_once_timed)
                    timed = engine.stats.verify_times[grid.warmup: cycles]
                    out.append((batch, context, t, min(timed)))
    return out


# ---------------------------------------------------------------- the cost artifact


def cost_table(model: CostModel, name: str, device: str,
               points: Sequence[tuple[int, int, int, float | None]]) -> pa.Table:
    b, c, k, s = zip(*points)
    pred = model.step_seconds(np.array(b), np.array(c), np.array(k))
    return pa.table({
        "model": [name] * len(points), "device": [device] * len(points),
        "batch": pa.array(b, pa.int32()), "context": pa.array(c, pa.int32()),
        "budget": pa.array([None if x == 0 else x for x in k], pa.int32()),
        "seconds": pa.array(s, pa.float64()), "predicted_seconds": pa.array(pred, pa.float64()),
    })


def analytic_points(batches: Sequence[int], contexts: Sequence[int],
                    budgets: Sequence[int]) -> list[tuple[int, int, int, None]]:
    return [(b, c, k, None) for b in batches for c in contexts for k in budgets]


def write_analytic(cfg: ModelConfig, name: str, hardware: str, grid: Grid, output
                   ) -> tuple[CostModel, pa.Table]:
    """The analytic model of a hardware preset, with its predictions over the grid, as a cost artifact;
    (model, the table written), as `write_fitted` returns."""
    from sparrow.schemas import write_artifact

    cost = analytic(cfg, get_hardware(hardware))
    points = analytic_points(grid.batches, grid.contexts, grid.budgets)
    table = cost_table(cost, name, hardware.lower(), points)
    write_artifact(table, output, "cost", metadata=cost.metadata() | {"model": name})
    return cost, table


def write_fitted(cfg: ModelConfig, name: str, points: Sequence[tuple[int, int, int, float]], device: str,
                 threads: int, output, verify_points: Sequence[tuple[int, int, int, float]] = (),
                 dtype: str | None = None) -> tuple[CostModel, pa.Table]:
    """The model fitted to timed points on `device` (with `threads` CPU threads, weights and KV cache in
    `dtype`, recorded as the metadata's dtype), and to timed verification forwards when given, as a cost
    artifact."""
    from sparrow.schemas import write_artifact

    cost = fit(cfg, points, f"measured:{device}")
    if verify_points:
        cost = fit_verify(cost, verify_points)
    table = cost_table(cost, name, device, points)
    timed = {"model": name, "threads": threads} | ({"dtype": dtype} if dtype else {})
    write_artifact(table, output, "cost", metadata=cost.metadata() | timed)
    return cost, table


def timed_dtype(path) -> str | None:
    """The dtype a measured cost artifact's decode steps were timed in (its metadata's dtype); None for an
    analytic one, or one that records none."""
    from sparrow.schemas import artifact_metadata

    dtype = artifact_metadata(path).get("dtype")
    return str(dtype) if dtype else None


def load_cost(path, cfg: ModelConfig) -> CostModel:
    """A cost artifact's model, checked against `cfg`'s shape."""
    from sparrow.schemas import artifact_metadata, read_artifact

    table = read_artifact(path, "cost")
    model = CostModel.from_metadata(artifact_metadata(table), str(path))
    model.check_model(cfg, str(path))
    return model
