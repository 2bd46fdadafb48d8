"""Artifact schemas, version 1: one declarative `ArtifactSpec` per artifact kind, and its validation.

Design decisions:
- A column is declared once (`Col`): Arrow type, nullability, an allowed range in interval notation
  ("[0, 1]", "(0, inf)") that applies to every element of list columns, and optional allowed values.
  Cross-column rules are small functions that return the rows failing them (a `Failure`) or None.
- Types are checked by family, not width: integer columns take any integer width, float columns any
  float width (and integers, which widen), string columns string/large_string, list columns any list
  kind of the right value family; values are then cast to the declared type, safely (an int64 that
  does not fit int32 is an error, never a wraparound). All-null columns of Arrow type null are fine.
- An integer column also takes floats whose every non-null value is a whole number in the declared
  type's range: pandas reads an integer column that holds a null as float64 (NaN the null) and saves it
  so, and such a round trip changes no value. A float with a fraction, NaN or out of range keeps the
  type's sentence.
- Closed bounds of float columns allow a 1e-6 tolerance (float32 rounding); NaN is out of any range.
- Unknown columns are an error (catches typos; a new column means a new schema version).
- Validation uses pyarrow.compute on whole columns, so it stays fast on millions of per-token rows. A
  large file is checked a batch of rows at a time (`check_batches`): each check reports its `Failure`, and
  the earliest check any batch fails is reported with its counts summed, as the whole table would be.
- Every problem is one sentence that starts with the subject (the file, or the data meant for it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

VERSION = "1"
KEY_KIND = "sparrow.artifact"
KEY_VERSION = "sparrow.version"
KEY_META = "sparrow.meta"
FLOAT_TOL = 1e-6


class ArtifactError(ValueError):
    """An artifact file or table that does not match its schema; the message is one sentence."""


@dataclass(frozen=True)
class Interval:
    lo: float
    hi: float
    lo_closed: bool
    hi_closed: bool
    text: str

    @classmethod
    def parse(cls, text: str) -> Interval:
        m = re.fullmatch(r"([\[(])\s*([^,]+?)\s*,\s*([^,]+?)\s*([\])])", text)
        if not m:
            raise ValueError(f"bad interval {text!r}")
        return cls(float(m[2]), float(m[3]), m[1] == "[", m[4] == "]", text)

    def outside(self, values: pa.Array | pa.ChunkedArray, tol: float) -> pa.ChunkedArray:
        lo = pc.less(values, self.lo - tol) if self.lo_closed else pc.less_equal(values, self.lo)
        hi = pc.greater(values, self.hi + tol) if self.hi_closed else pc.greater_equal(values, self.hi)
        bad = pc.or_(lo, hi)
        if pa.types.is_floating(values.type):
            bad = pc.or_(bad, pc.is_nan(values))
        return pc.fill_null(bad, False)


@dataclass(frozen=True)
class Col:
    name: str
    type: pa.DataType
    nullable: bool = False
    range: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable)


@dataclass(frozen=True)
class Failure:
    """A check some rows fail: `order` ranks the check where `conform` runs it (earlier checks win), `n`
    counts what fails it, `row` is the first failing row and `say(n, row)` the phrase that follows the
    subject."""

    order: tuple[int, int]
    n: int
    row: int
    say: Callable[[int, int], str]

    @property
    def phrase(self) -> str:
        return self.say(self.n, self.row)

    def after(self, rows: int) -> Failure:
        return replace(self, row=self.row + rows)


Rule = Callable[[pa.Table], "Failure | None"]  # its order is given by `ArtifactSpec.checked`
SCHEMA_LEVEL = (-1, 0)  # duplicated, unknown or missing columns: every batch of a table says the same


def whole_table(rule: Rule) -> Rule:
    """Mark a rule that relates rows to each other, so that a table is not checked batch by batch."""
    rule.whole_table = True  # type: ignore[attr-defined]
    return rule


def _failed(n: int, row: int, say: Callable[[int, int], str]) -> Failure:
    return Failure(SCHEMA_LEVEL, n, row, say)


def _said(phrase: str) -> Failure:
    return _failed(0, 0, lambda n, row: phrase)


def merged(found: Failure | None, new: Failure | None) -> Failure | None:
    """The failure a whole table reports, from those of two of its batches (`found` of the earlier rows):
    the earlier check, its counts summed."""
    if new is None:
        return found
    if found is None or new.order < found.order:
        return new
    if new.order == found.order:
        return replace(found, n=found.n + new.n)
    return found


@dataclass(frozen=True)
class ArtifactSpec:
    kind: str
    doc: str
    columns: tuple[Col, ...]
    rules: tuple[Rule, ...] = field(default=())

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def schema(self) -> pa.Schema:
        meta = {KEY_KIND: self.kind, KEY_VERSION: VERSION}
        return pa.schema([c.field for c in self.columns], metadata=meta)

    @property
    def by_batches(self) -> bool:
        """Whether a table of this kind can be checked a batch of rows at a time."""
        return not any(getattr(rule, "whole_table", False) for rule in self.rules)

    def conform(self, table: pa.Table, subject: str, fill_missing: bool = False) -> pa.Table:
        """Cast `table` to this schema and check every rule; raise ArtifactError("<subject> ...")."""
        out, failure = self.checked(table, fill_missing)
        if failure:
            raise ArtifactError(f"{subject} {failure.phrase}")
        return out

    def check_batches(self, schema: pa.Schema, batches: Iterable[pa.Table], subject: str) -> int:
        """Check a table of `schema` given a batch of rows at a time exactly as `conform` checks it whole
        (the same sentence, rows counted from the table's start), holding one batch at a time; missing
        nullable columns are allowed. Returns the number of rows."""
        if not self.by_batches:
            batches = [pa.concat_tables([schema.empty_table(), *batches], promote_options="default")]
        found = self.checked(schema.empty_table(), fill_missing=True)[1]
        rows = 0
        if not (found and found.order == SCHEMA_LEVEL):  # else every batch would say the same
            for batch in batches:
                found = merged(found, self.checked(batch, fill_missing=True, first_row=rows)[1])
                rows += batch.num_rows
        if found:
            raise ArtifactError(f"{subject} {found.phrase}")
        return rows

    def checked(self, table: pa.Table, fill_missing: bool = False,
                first_row: int = 0) -> tuple[pa.Table | None, Failure | None]:
        """`table` cast to this schema, or the first check it fails (its rows numbered from `first_row`)."""
        names = table.column_names
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            return None, _said(f"has column {_quoted(dupes)} more than once")
        unknown = [n for n in names if n not in self.names]
        if unknown:
            return None, _said(f"has column {_quoted(unknown)}, which the '{self.kind}' schema does not have "
                               f"(its columns: {', '.join(self.names)})")
        missing = [c.name for c in self.columns if c.name not in names and not (fill_missing and c.nullable)]
        if missing:
            return None, _said(f"lacks column {_quoted(missing)} required by the '{self.kind}' schema")

        arrays = []
        for i, col in enumerate(self.columns):
            if col.name not in names:
                arrays.append(pa.nulls(table.num_rows, col.type))
                continue
            values, failure = _check_column(table.column(col.name), col)
            if failure:
                return None, replace(failure, order=(i, failure.order[1])).after(first_row)
            arrays.append(values)
        out = pa.Table.from_arrays(arrays, schema=self.schema)
        for j, rule in enumerate(self.rules):
            failure = rule(out)
            if failure:
                return None, replace(failure, order=(len(self.columns) + j, 0)).after(first_row)
        return out, None


def _step(step: int, n: int, row: int, say: Callable[[int, int], str]) -> Failure:
    return Failure((0, step), n, row, say)


def _check_column(values: pa.ChunkedArray, col: Col) -> tuple[pa.ChunkedArray, Failure | None]:
    """The column cast to `col`'s type, or the first of its checks it fails (order (0, step))."""
    if not _accepts(col.type, values.type) or not _whole_if_float(values, col.type):
        return values, _step(0, 0, 0, lambda n, row: (
            f"has column '{col.name}' of type {_type_name(values.type)}, expected "
            f"{_type_name(col.type)} ({_family(col.type)})"))
    if values.type != col.type:
        try:
            values = values.cast(col.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            error = first_line(e)
            return values, _step(1, 0, 0, lambda n, row: (
                f"has values in column '{col.name}' that do not fit {_type_name(col.type)} ({error})"))
    if not col.nullable and values.null_count:
        return values, _step(2, values.null_count, 0, lambda n, row: (
            f"has nulls in {_count(n, 'row')} of column '{col.name}', which allows no nulls"))
    is_list = pa.types.is_list(col.type)
    elements = pc.list_flatten(values) if is_list else values
    if is_list and not col.nullable and elements.null_count:
        return values, _step(3, elements.null_count, 0, lambda n, row: (
            f"has {_count(n, 'null element')} inside the lists of column '{col.name}'"))
    if col.range:
        interval = Interval.parse(col.range)
        tol = FLOAT_TOL if pa.types.is_floating(elements.type) else 0.0
        n, first = _count_first(interval.outside(elements, tol))
        if n:
            row = pc.list_parent_indices(values)[first].as_py() if is_list else first
            shown = _fmt(elements[first].as_py())
            return values, _step(4, n, row, lambda n, row: (
                f"has {_count(n, 'value')} of column '{col.name}' outside the allowed range "
                f"{interval.text} (first: {shown} in row {row})"))
    if col.choices:
        bad = pc.and_(pc.is_valid(values), pc.invert(pc.is_in(values, value_set=pa.array(col.choices))))
        n, first = _count_first(bad)
        if n:
            shown = repr(values[first].as_py())
            return values, _step(5, n, first, lambda n, row: (
                f"has {_count(n, 'value')} of column '{col.name}' other than "
                f"{_quoted(col.choices, ' or ')} (first: {shown} in row {row})"))
    return values, None


def _whole_if_float(values: pa.ChunkedArray, target: pa.DataType) -> bool:
    """Whether a float column (or list of floats) meant for an integer type holds only whole numbers in
    its range (nulls aside); True for any other pairing, which `_accepts` judges."""
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    while pa.types.is_list(target) and _is_list_kind(values.type):
        values, target = pc.list_flatten(values), target.value_type
    if not (pa.types.is_integer(target) and pa.types.is_floating(values.type)):
        return True
    if values.null_count == len(values):
        return True
    if pa.types.is_float16(values.type):  # Arrow has no floor for half floats; float32 holds them exactly
        values = values.cast(pa.float32())
    if not pc.all(pc.equal(values, pc.floor(values))).as_py():  # NaN equals nothing: refused too
        return False
    bounds = np.iinfo(target.to_pandas_dtype())
    exact = 2 ** (np.finfo(values.type.to_pandas_dtype()).nmant + 1)  # past it, the float was rounded
    low, high = (v.as_py() for v in pc.min_max(values).values())
    return max(bounds.min, -exact) <= low and high <= min(bounds.max, exact)


def _is_list_kind(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
            or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))


def _family(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "any integer type"
    if pa.types.is_floating(t):
        return "any float or integer type"
    if pa.types.is_string(t):
        return "string or large_string"
    if pa.types.is_list(t):
        return f"any list of {'integers' if pa.types.is_integer(t.value_type) else 'floats'}"
    return str(t)


def _type_name(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        return f"dictionary<{_type_name(t.value_type)}>"
    if hasattr(t, "value_type"):
        return f"{str(t).split('<', 1)[0]}<{_type_name(t.value_type)}>"
    return str(t)


def _accepts(target: pa.DataType, found: pa.DataType) -> bool:
    if pa.types.is_dictionary(found):
        found = found.value_type
    if pa.types.is_null(found):
        return True
    if pa.types.is_integer(target):  # floats: if whole (`_whole_if_float`)
        return pa.types.is_integer(found) or pa.types.is_floating(found)
    if pa.types.is_floating(target):
        return pa.types.is_floating(found) or pa.types.is_integer(found)
    if pa.types.is_string(target):
        return pa.types.is_string(found) or pa.types.is_large_string(found) or pa.types.is_string_view(found)
    if pa.types.is_list(target):
        return _is_list_kind(found) and _accepts(target.value_type, found.value_type)
    return found == target


def _count_first(mask: pa.Array | pa.ChunkedArray) -> tuple[int, int]:
    n = pc.sum(mask).as_py() or 0
    return (n, pc.indices_nonzero(mask)[0].as_py()) if n else (0, -1)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _fmt(v: object) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.7g}"
    return str(v)


def _quoted(names, sep: str = ", ") -> str:
    return sep.join(f"'{n}'" for n in names)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# Cross-column rules: each returns the Failure of the rows that break it, or None.

def _prompt_or_token_ids(t: pa.Table) -> Failure | None:
    n, first = _count_first(pc.and_(pc.is_null(t["prompt"]), pc.is_null(t["prompt_token_ids"])))
    if n:
        return _failed(n, first, lambda n, row: (
            f"has {_count(n, 'row')} with neither 'prompt' nor 'prompt_token_ids' (first: row {row})"))
    return None


def _tests_passed_within_total(t: pa.Table) -> Failure | None:
    over = pc.fill_null(pc.greater(t["tests_passed"], t["tests_total"]), False)
    n, first = _count_first(over)
    if n:
        return _failed(n, first, lambda n, row: (
            f"has more tests passed than tests in {_count(n, 'row')} (columns 'tests_passed' and "
            f"'tests_total'; first: row {row})"))
    return None


@whole_table
def _budget_non_decreasing(t: pa.Table) -> Failure | None:
    bins = t["bin"].to_numpy()
    order = np.argsort(bins, kind="stable")
    bins = bins[order]
    budgets = t["budget"].fill_null(np.iinfo(np.int32).max).to_numpy()[order]
    dup = np.flatnonzero(np.diff(bins) == 0)
    if dup.size:
        return _said(f"has bin {bins[dup[0]]} more than once")
    dec = np.flatnonzero(np.diff(budgets) < 0)
    if dec.size:
        i = dec[0]
        shown = ["dense" if b == np.iinfo(np.int32).max else str(b) for b in budgets[i:i + 2]]
        return _said(f"has budget {shown[0]} in bin {bins[i]} but {shown[1]} in bin {bins[i + 1]}, and a "
                     f"schedule's budget must not decrease with position (null = dense counts as largest)")
    return None


@whole_table
def _bins_tile_positions(t: pa.Table) -> Failure | None:
    """A schedule's bins, in bin order, start at position 0, each where the one before ends, the last open
    (null bin_end): every position has exactly one budget."""
    if t.num_rows == 0:
        return None
    order = np.argsort(t["bin"].to_numpy(), kind="stable")
    starts = t["bin_start"].to_numpy()[order]
    ends = [t["bin_end"][int(i)].as_py() for i in order]
    if starts[0] != 0:
        return _said(f"starts its first bin at position {starts[0]}, and a schedule's bins start at 0, so "
                     "that every position has a budget")
    for i in range(len(starts) - 1):
        if starts[i + 1] <= starts[i]:
            return _said(f"starts a bin at position {starts[i + 1]}, not after the one before it "
                         f"({starts[i]}); bin_start increases with bin")
        if ends[i] is not None and ends[i] != starts[i + 1]:
            return _said(f"ends the bin that starts at position {starts[i]} at {ends[i]}, but starts the "
                         f"next at {starts[i + 1]}; each bin ends where the next starts")
    if ends[-1] is not None:
        return _said(f"ends its last bin at {ends[-1]}; a schedule's last bin is open (null bin_end), its "
                     "budget holding at every later position")
    return None


def _equal_lengths(*names: str) -> Rule:
    def rule(t: pa.Table) -> Failure | None:
        lengths = [pc.list_value_length(t[n]) for n in names]
        bad = pc.or_(pc.not_equal(lengths[0], lengths[1]), pc.not_equal(lengths[0], lengths[2]))
        n, first = _count_first(pc.fill_null(bad, False))
        if n:
            found = ", ".join(str(ln[first].as_py()) for ln in lengths)
            return _failed(n, first, lambda n, row: (
                f"has {_count(n, 'row')} whose {_quoted(names)} lengths differ "
                f"(first: row {row} with lengths {found})"))
        return None

    return rule


def _same_length_if_given(name: str) -> Rule:
    """A nullable per-token column: where present, as long as token_ids."""

    def rule(t: pa.Table) -> Failure | None:
        bad = pc.not_equal(pc.list_value_length(t[name]), pc.list_value_length(t["token_ids"]))
        n, first = _count_first(pc.fill_null(bad, False))
        if n:
            return _failed(n, first, lambda n, row: (
                f"has {_count(n, 'row')} whose '{name}' and 'token_ids' lengths differ (first: row {row})"))
        return None

    return rule


def no_null_elements(name: str) -> Rule:
    """A nullable list column whose lists, where given, hold no null (a null list stays allowed)."""

    def rule(t: pa.Table) -> Failure | None:
        values = t[name]
        elements = pc.list_flatten(values)  # the elements of the lists that are not null
        n, first = _count_first(pc.is_null(elements))
        if n:
            row = pc.list_parent_indices(values)[first].as_py()
            return _failed(n, row, lambda n, row: (
                f"has {_count(n, 'null element')} inside the lists of column '{name}' (first: in row {row})"))
        return None

    return rule


I32, I64, F32, F64, STR = pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.string()
LIST_I32, LIST_F32 = pa.list_(pa.int32()), pa.list_(pa.float32())
LIST_BOOL = pa.list_(pa.bool_())
UNIT, NONNEG, POS, NONPOS, OPEN_UNIT = "[0, 1]", "[0, inf)", "(0, inf)", "(-inf, 0]", "(0, 1)"
# why a completion got its reward: code tasks' statuses, then the answer tasks' (stages/tasks/base.py)
REWARD_STATUSES = ("passed", "failed", "timeout", "output_limit", "error", "no_code", "correct", "incorrect",
                   "unparsed")
# `sparrow train`'s rollout-correction metrics under verl's names (stages/train/corrections.py)
_RS_RULES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
             "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3", "veto", "opsm", "rejection")
TRAIN_CORRECTION_METRICS = tuple("rollout_corr/" + n for n in (
    "rollout_is_mean", "rollout_is_std", "rollout_is_min", "rollout_is_max", "rollout_is_eff_sample_size",
    "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low", "rollout_is_masked_fraction",
    "rollout_is_seq_masked_fraction", "is_bounded_mean", "is_bounded_std", "is_bounded_min", "is_bounded_max",
    "is_bounded_eff_sample_size", "rollout_rs_masked_fraction",
    "rollout_rs_seq_masked_fraction", *(f"rollout_rs_{r}_masked_fraction" for r in _RS_RULES),
    "training_ppl", "rollout_ppl", "ppl_ratio", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max",
    "log_ppl_diff_min", "kl", "k3_kl", "chi2_token", "chi2_seq"))


def _spec(kind: str, doc: str, *columns: Col, rules: tuple[Rule, ...] = ()) -> ArtifactSpec:
    return ArtifactSpec(kind, doc, columns, rules)


SCHEMAS: dict[str, ArtifactSpec] = {s.kind: s for s in (
    _spec("prompts", "one row per prompt",
          Col("prompt_id", STR), Col("task", STR),
          Col("prompt", STR, nullable=True),
          Col("prompt_token_ids", LIST_I32, nullable=True, range=NONNEG),
          Col("answer", STR, nullable=True),
          Col("metadata", STR, nullable=True),
          rules=(_prompt_or_token_ids,)),
    _spec("mismatch", "one row per generated token per budget",
          Col("prompt_id", STR), Col("sample", I32, range=NONNEG),
          Col("position", I32, range=NONNEG), Col("bin", I32, range=NONNEG),
          Col("budget", I32, range=POS), Col("token_id", I32, range=NONNEG),
          Col("alpha", F32, range=UNIT),
          Col("logp_dense", F32, range=NONPOS), Col("logp_sparse", F32, range=NONPOS),
          Col("log_ratio", F32), Col("k1", F32),
          Col("k2", F32, range=NONNEG), Col("k3", F32, range=NONNEG),
          Col("entropy_dense", F32, range=NONNEG),
          Col("alpha_draft", F32, nullable=True, range=UNIT)),
    _spec("threshold", "one row: the critical tail threshold",
          Col("threshold", F64, range=OPEN_UNIT),
          Col("lower", F64, nullable=True, range=UNIT), Col("upper", F64, nullable=True, range=UNIT),
          Col("quantile", F64, range=OPEN_UNIT),
          Col("source", STR, choices=("prior", "calibrated")),
          Col("n_runs", I32, range=NONNEG), Col("n_collapsed", I32, range=NONNEG),
          Col("note", STR, nullable=True)),
    _spec("cost", "one row per measured or analytic decode-step point; coefficients in the metadata",
          Col("model", STR), Col("device", STR),
          Col("batch", I32, range=POS), Col("context", I32, range=NONNEG),
          Col("budget", I32, nullable=True, range=POS),
          Col("seconds", F64, nullable=True, range=NONNEG),
          Col("predicted_seconds", F64, range=NONNEG)),
    _spec("schedule", "one row per position bin; null budget = dense",
          Col("bin", I32, range=NONNEG), Col("bin_start", I64, range=NONNEG),
          Col("bin_end", I64, nullable=True, range=NONNEG),
          Col("budget", I32, nullable=True, range=POS),
          Col("tail", F64, nullable=True, range=UNIT),
          Col("predicted_step_seconds", F64, nullable=True, range=NONNEG),
          rules=(_budget_non_decreasing, _bins_tile_positions)),
    _spec("rollouts", "one row per sample; budgets per token, 0 = dense; the sample's KV policy and the "
          "KV tokens its cache held at each token (kv_lens: the retained cache under eviction, else the "
          "whole cache, of which block top-k reads only its budget); "
          "reward_extra: the fields beside 'score' a user's reward function returned (a JSON object); "
          "speculative decoding (--speculate): accepted, per token whether it was a draft the dense model "
          "kept (else drawn from the dense model), and drafted, the drafts the sample proposed",
          Col("prompt_id", STR), Col("sample", I32, range=NONNEG),
          Col("prompt_token_ids", LIST_I32, range=NONNEG), Col("token_ids", LIST_I32, range=NONNEG),
          Col("text", STR, nullable=True),
          Col("logprobs", LIST_F32, range=NONPOS), Col("budgets", LIST_I32, range=NONNEG),
          Col("finish_reason", STR, choices=("stop", "length")),
          Col("reward", F64, nullable=True),
          Col("kv_policy", STR, nullable=True), Col("kv_lens", LIST_I32, nullable=True, range=POS),
          Col("reward_extra", STR, nullable=True),
          Col("accepted", LIST_BOOL, nullable=True), Col("drafted", I32, nullable=True, range=NONNEG),
          rules=(_equal_lengths("token_ids", "logprobs", "budgets"), _same_length_if_given("kv_lens"),
                 _same_length_if_given("accepted"))),
    _spec("metrics", "one row per training step",
          Col("run_id", STR), Col("step", I32, range=NONNEG), Col("reward_mean", F64),
          *(Col(n, F64, nullable=True)
            for n in ("reward_std", "loss", "grad_norm", "entropy", "mismatch_kl")),
          Col("truncation_rate", F64, nullable=True, range=UNIT),
          Col("repetition_rate", F64, nullable=True, range=UNIT),
          *(Col(n, F64, nullable=True) for n in ("response_length", "lr", "seconds")),
          *(Col(n, F64, nullable=True, range=UNIT)
            for n in ("accuracy", "eval_accuracy", "clip_fraction", "clip_fraction_low", "clip_fraction_high",
                      "dual_clip_fraction", "masked_fraction", "vetoed_fraction", "alpha_lb_mean",
                      "alpha_lb_p5")),
          *(Col(n, F64, nullable=True)
            for n in ("policy_loss", "kl", "mean_budget", "rollout_seconds", "scoring_seconds",
                      "update_seconds", "tokens_per_second", "weight_sync_seconds", "reward_seconds")),
          Col("collapse", STR, nullable=True),
          *(Col(n, F64, nullable=True) for n in TRAIN_CORRECTION_METRICS),
          Col("eval_accuracy_sparse", F64, nullable=True, range=UNIT),
          Col("update_skipped", STR, nullable=True),
          Col("alpha_lb_p5_by_bin", LIST_F32, nullable=True),
          Col("oversample_acceptance_kept", F64, nullable=True, range=UNIT),
          Col("oversample_acceptance_dropped", F64, nullable=True, range=UNIT),
          Col("frac_reward_zero_std", F64, nullable=True, range=UNIT),
          Col("alpha_mean", F64, nullable=True, range=UNIT), Col("alpha_p5", F64, nullable=True, range=UNIT),
          Col("alpha_p5_by_bin", LIST_F32, nullable=True),
          Col("sampler_gap", F64, nullable=True),
          Col("draft_acceptance", F64, nullable=True, range=UNIT),
          Col("reward_extra", STR, nullable=True)),
    _spec("rewards", "one row per scored completion (sparrow reward): reward (in [0, 1] for our tasks, as "
          "returned by a user's function), status, a code task's tests, a user's function's extra fields",
          Col("prompt_id", STR), Col("sample", I32, range=NONNEG), Col("task", STR),
          Col("reward", F64, range="(-inf, inf)"), Col("status", STR, nullable=True, choices=REWARD_STATUSES),
          Col("tests_passed", I32, nullable=True, range=NONNEG),
          Col("tests_total", I32, nullable=True, range=NONNEG),
          Col("reward_extra", STR, nullable=True),
          rules=(_tests_passed_within_total,)),
    _spec("train_completions", "one row per sampled completion per training step: its text, reward and "
          "advantage (TRL's log_completions, verl's rollout_data_dir)",
          Col("step", I32, range=NONNEG), Col("prompt_id", STR), Col("sample", I32, range=NONNEG),
          Col("text", STR), Col("tokens", I32, range=NONNEG), Col("finish_reason", STR),
          Col("reward", F64, range="(-inf, inf)"), Col("advantage", F64, range="(-inf, inf)"),
          Col("mean_budget", F64, nullable=True, range=NONNEG)),
    _spec("train_mismatch", "one row per generated token per training step (the sparse actor vs the "
          "dense learner)",
          Col("step", I32, range=NONNEG), Col("prompt_id", STR), Col("sample", I32, range=NONNEG),
          Col("position", I32, range=NONNEG), Col("bin", I32, range=NONNEG),
          Col("budget", I32, range=NONNEG), Col("token_id", I32, range=NONNEG),
          Col("logp_rollout", F32, range=NONPOS), Col("logp_dense", F32, range=NONPOS),
          Col("log_ratio", F32), Col("k3", F32, range=NONNEG),
          Col("alpha_top20_lb", F32, nullable=True, range=UNIT),
          Col("alpha", F32, nullable=True, range=UNIT),
          Col("weight", F32, range=NONNEG), Col("masked", pa.bool_()), Col("vetoed", pa.bool_())),
)}
