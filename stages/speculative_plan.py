"""Planning exact speculative rollouts (`plan-schedule --speculate`): a draft budget per position bin and
one K for the run, those that minimise the predicted seconds per generated token.

A cycle of K drafts at budget b emits (1 - a^(K+1)) / (1 - a) tokens on average, with a the profile's
mean alpha of the bin at b: for speculation the mean sets the speed, not the tail, since a rejected draft
costs time and never correctness. The alpha is a draft's (`profile --draft-alpha`: queries over the dense
KV that verification keeps) where the profile has it, else the lossy sampler's, whose queries read keys
its own sparse layers wrote and which so undercounts the drafts kept (a note says the plan is
conservative). The cycle costs K decode steps at b and one dense forward of K + 1 tokens per sample; on
the engine's static step (a GPU's) K - 1 of the drafts attend to the pages the first one kept and score
none, so a cost model of a GPU prices them without the page term (`drafts_keep_pages`), and a CPU's
measured one with it (its plain step selects at every draft). A cost artifact that `fit-cost --speculate`
wrote prices the forward from its timed verifications; otherwise, since it reads the weights and every
sample's KV once, it is priced as a dense decode step whose per-row term is paid K + 1 times. Only
profiled budgets are candidates, and budgets are made non-decreasing across bins, as every schedule's
are. A thin bin, one with fewer profiled tokens than --min-tokens (counted as the lossy plan counts them,
the most at one budget; a bin without tokens is thin too), has no mean to trust: it is priced at its
nearest trusted neighbour's mean alpha (as the lossy plan's thin bins take a neighbour's budget) and
shown as thin, with no mean or tokens per cycle of its own. The plan that wins may be slower than dense
decoding, which is exact too: it is still the plan, and `SpeculativePlan.warning` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .core.schedule import ScheduleError, bin_span
from .cost import VERIFY_FEATURES, CostModel

MAX_SPECULATE = 8
LOSSY_ALPHA_NOTE = ("drafts priced at the profile's lossy alpha: it undercounts how often drafts are kept "
                    "(they read the dense KV that verification keeps), so the speedups are conservative; "
                    "profile with --draft-alpha for the drafts' own")


def format_speedup(speedup: float) -> str:
    """A predicted speedup as "0.996x": three decimals, more where a slowdown would round up to 1.000x,
    so that a value below 1 never reads as break-even."""
    for digits in range(3, 7):
        text = f"{speedup:.{digits}f}"
        if speedup >= 1 or float(text) < 1:
            return f"{text}x"
    return f"{np.floor(speedup * 1e6) / 1e6:.6f}x"


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a cycle of k drafts emits on average when each draft is kept with probability alpha:
    (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class MeanAlpha:
    """The profile's mean alpha per position bin [n] and profiled budget [m]."""

    budgets: np.ndarray  # [m] increasing
    mean: np.ndarray  # [n, m]; nan where a bin has no token at a budget, or is thin
    bin_width: int
    tokens: np.ndarray | None = None  # [n] profiled tokens per bin (the most at one budget)
    min_tokens: int = 1  # the fewest tokens a bin needs for its mean to be trusted
    drafts: bool = False  # the drafts' own alpha (the profile's alpha_draft), not the lossy sampler's

    @property
    def thin(self) -> np.ndarray:
        """[n] bool: bins without a trusted mean at any budget."""
        return np.isnan(self.mean).all(axis=1)


def mean_alpha(mismatch, bin_width: int, num_bins: int, min_tokens: int = 1) -> MeanAlpha:
    """Mean alpha per bin (position // bin_width) and budget from a `mismatch` table or reader: a draft's
    (alpha_draft, `profile --draft-alpha`) where every row has it, else the lossy sampler's; a bin with
    fewer than `min_tokens` tokens at every budget (--min-tokens, as the lossy plan counts them) is thin:
    nan."""
    import duckdb

    con = duckdb.connect()
    con.register("mismatch", mismatch)
    draft = "alpha_draft" if "alpha_draft" in mismatch.schema.names else "NULL::FLOAT"
    rows = con.execute(f"""SELECT position // ? AS bin, budget, avg(alpha::DOUBLE), avg({draft}::DOUBLE),
                                  count(*), count({draft}) FROM mismatch
                           GROUP BY ALL ORDER BY bin, budget""", [bin_width]).fetchall()
    drafts = bool(rows) and all(r[4] == r[5] for r in rows)
    budgets = np.array(sorted({int(r[1]) for r in rows}), dtype=np.int64)
    mean = np.full((num_bins, len(budgets)), np.nan)
    tokens = np.zeros(num_bins, dtype=np.int64)
    for b, budget, lossy, draft_mean, count, _ in rows:
        if b < num_bins:
            mean[b, np.searchsorted(budgets, budget)] = draft_mean if drafts else lossy
            tokens[b] = max(tokens[b], count)
    mean[tokens < min_tokens] = np.nan
    return MeanAlpha(budgets, mean, bin_width, tokens, min_tokens, drafts)


def drafts_keep_pages(cost: CostModel) -> bool:
    """Whether the engine the cost model prices keeps a cycle's first draft's pages for its later drafts:
    the static step does (a GPU's, which the analytic presets describe); a CPU's plain step does not."""
    return cost.source != "measured:cpu"


def cycle_seconds(cost: CostModel, batch: int, context, budget: int, k: int,
                  kept: bool | None = None) -> np.ndarray:
    """Predicted seconds of one cycle at each context: k drafts at `budget`, the later ones on the first
    one's pages when `kept` (None: `drafts_keep_pages`), and the verification of k + 1 tokens per sample."""
    kept = drafts_keep_pages(cost) if kept is None else kept
    later = cost.step_seconds(batch, context, budget, scored=not kept)
    first = cost.step_seconds(batch, context, budget)
    return first + (k - 1) * later + verify_seconds(cost, batch, context, k)


def verify_seconds(cost: CostModel, batch: int, context, k: int) -> np.ndarray:
    """Predicted seconds of one dense forward of k + 1 tokens for each of `batch` samples at `context`:
    the fitted verification coefficients where `fit-cost --speculate` measured them, else from the decode
    step's."""
    if cost.verify is not None:
        coefficients = np.array([cost.verify[f] for f in VERIFY_FEATURES])
        return cost.verify_features(batch, context, k + 1) @ coefficients
    features = cost.features(batch, context, 0).copy()
    features[..., 1] *= k + 1  # the per-row term; weights and the KV are read once
    return features @ cost.vector


@dataclass
class SpeculativePlan:
    k: int
    budgets: list[int]  # draft budget per bin
    mean_alpha: list[float | None]  # per bin, at its draft budget; None: a thin bin (no trusted mean)
    tokens_per_cycle: list[float | None]  # per bin: expected tokens a sample's cycle emits (None as above)
    speedup: float  # predicted over dense, with the prefill on both sides where priced (SpeedupScope)
    speedups_by_k: dict[int, float]  # the best plan's predicted speedup for each K tried, as `speedup`
    notes: list[str] = field(default_factory=list)  # how thin bins were priced, one sentence each
    decode_speedup: float = 0.0  # over dense decoding alone, prefill excluded
    priced_at: str = "alpha"  # the profile's column the drafts were priced at: alpha_draft or (lossy) alpha

    @property
    def pays(self) -> bool:
        """Whether the best K is predicted faster than dense decoding; break-even does not pay, since
        dense sampling is exact too and needs no drafts."""
        return self.speedup > 1.0

    @property
    def warning(self) -> str | None:
        """The sentence that says speculation is not predicted to pay (None where it does)."""
        if self.pays:
            return None
        return (f"speculation is not predicted to pay here ({format_speedup(self.speedup)} at best, K = "
                f"{self.k}): dense sampling is exact too")


def plan_speculation(cost: CostModel, alpha: MeanAlpha, batch: int, prompt_len: int, gen_len: int,
                     max_k: int = MAX_SPECULATE, prefill_s: float = 0.0) -> SpeculativePlan:
    """The K in 1..max_k and the per-bin draft budgets that minimise the predicted decode seconds of
    `gen_len` tokens after `prompt_len`; positions as `CostModel.rollout_seconds` counts them. The
    speedups add `prefill_s` (the prompt's dense prefill, the same for every K) to both sides, which
    changes no choice."""
    if alpha.thin.all():
        raise ScheduleError(f"no bin of the profile has the --min-tokens {alpha.min_tokens} tokens a mean "
                            "alpha needs; profile more samples or lower --min-tokens")
    contexts = np.arange(prompt_len + 1, prompt_len + gen_len)
    bins = np.minimum(contexts // alpha.bin_width, alpha.mean.shape[0] - 1)
    dense = float(cost.step_seconds(batch, contexts, 0).sum())
    thin = np.isnan(alpha.mean)
    priced = MeanAlpha(alpha.budgets, borrowed(alpha.mean), alpha.bin_width)
    best: SpeculativePlan | None = None
    by_k = {}
    for k in range(1, max_k + 1):
        plan = _plan_for_k(cost, priced, thin, batch, contexts, bins, k, dense)
        if best is None or plan.speedup > best.speedup:
            best = plan
        by_k[k] = plan.speedup
    best.decode_speedup = best.speedup
    best.speedup = _with_prefill(best.speedup, dense, prefill_s)
    best.speedups_by_k = {k: _with_prefill(v, dense, prefill_s) for k, v in by_k.items()}
    best.notes = thin_notes(alpha) + ([] if alpha.drafts else [LOSSY_ALPHA_NOTE])
    best.priced_at = "alpha_draft" if alpha.drafts else "alpha"
    return best


def _with_prefill(decode_speedup: float, dense: float, prefill_s: float) -> float:
    """A decode speedup over `dense` decode seconds as the speedup with `prefill_s` on both sides."""
    return (prefill_s + dense) / (prefill_s + dense / decode_speedup)


def thin_notes(alpha: MeanAlpha) -> list[str]:
    """One sentence per run of thin bins before the first trusted one and one for the later ones: which
    mean alpha prices their drafts (the lossy plan's notes, in the drafts' terms)."""
    thin = alpha.thin
    trusted = int(np.argmin(thin))
    notes = []
    leading, later = np.flatnonzero(thin[:trusted]), trusted + np.flatnonzero(thin[trusted:])
    for bins, whose in ((leading, f"bin {trusted}, the first bin with enough"),
                        (later, f"the nearest trusted bin before {'it' if len(later) == 1 else 'each'}")):
        if len(bins):
            starts = np.arange(len(thin)) * alpha.bin_width
            shown = ", ".join(f"{i} ({bin_span(starts, i)})" for i in bins[:8])
            more = f" and {len(bins) - 8} more" if len(bins) > 8 else ""
            one = len(bins) == 1
            empty = alpha.tokens is not None and not alpha.tokens[bins].any()
            few = ("no profiled tokens" if empty else
                   f"fewer profiled tokens than --min-tokens ({alpha.min_tokens})")
            notes.append(f"bin{'' if one else 's'} {shown}{more}: {few}, so {'its' if one else 'their'} "
                         f"drafts are priced at the mean alpha of {whose}")
    return notes


def borrowed(mean: np.ndarray) -> np.ndarray:
    """`mean` [bins, budgets] where a bin without tokens at a budget takes the value of the nearest earlier
    bin with some (the first later one, for leading bins), as the lossy plan's thin bins take a trusted
    neighbour's budget: its positions are priced, never free or impossible. A budget no bin has stays nan."""
    out = mean.copy()
    for j in range(out.shape[1]):
        have = ~np.isnan(out[:, j])
        if have.any():
            last = np.maximum.accumulate(np.where(have, np.arange(len(have)), -1))
            out[:, j] = out[np.where(last < 0, np.argmax(have), last), j]
    return out


def _plan_for_k(cost: CostModel, alpha: MeanAlpha, thin: np.ndarray, batch: int, contexts: np.ndarray,
                bins: np.ndarray, k: int, dense: float) -> SpeculativePlan:
    """The non-decreasing per-bin budgets of the fewest predicted seconds (dynamic programming over bins:
    best[i, j] is the least time of bins 0..i with bin i at budget j). `thin` [bins, budgets]: no trusted
    mean there (its value `borrowed`), shown as None."""
    n, m = alpha.mean.shape
    seconds = np.zeros((n, m))  # [bin, budget] predicted decode seconds of the bin's positions
    for i in range(n):
        at = bins == i
        for j, b in enumerate(alpha.budgets):
            a = alpha.mean[i, j]
            if np.isnan(a):
                seconds[i, j] = np.inf if at.any() else 0.0
                continue
            cycle = cycle_seconds(cost, batch, contexts[at], int(b), k)
            seconds[i, j] = float(cycle.sum()) / expected_tokens(float(a), k)
    best = seconds.copy()
    for i in range(1, n):
        best[i] += np.minimum.accumulate(best[i - 1])
    choice = [int(np.argmin(best[-1]))]
    for i in range(n - 2, -1, -1):
        choice.append(int(np.argmin(best[i, : choice[-1] + 1])))
    choice.reverse()
    total = float(best[-1, choice[-1]])
    # a bin without profiled tokens has no mean of its own to show: None (a thin bin), never a made-up 0
    means = [None if thin[i, j] or np.isnan(alpha.mean[i, j]) else float(alpha.mean[i, j])
             for i, j in enumerate(choice)]
    return SpeculativePlan(k, [int(alpha.budgets[j]) for j in choice], means,
                           [None if a is None else expected_tokens(a, k) for a in means],
                           dense / total if total > 0 else 1.0, {})
