"""What the figures read of an artifact, from files that are untrusted input.

An artifact was checked against its schema before any figure (`build_report`, a bounded batch of rows at a
time); a figure then reads only the columns it draws, batch by batch, and keeps per sample only the
numbers it plots (a rollout's length, not its tokens, and no Python object per token), and a signal stops
it between two batches.
Aggregates over tokens (a profile's tail per bin) are DuckDB's, over the artifact's files alone: a
connection that reads those files through the read-only file system of `sparrow sql` (..sql.files) and no
other file, with every path an SQL string literal, so that no file name, however made, runs as SQL or
reaches another file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparrow.schemas.footer import artifact_parts, parquet_batches, read_schema

from ..core.schedule import ScheduleError
from ..plan import BinSpan, profile_bin_width
from ..sql.files import file_url, reading_only
from ..sql.views import absent_columns, sql_literal


def files_of(path: Path) -> list[Path]:
    """An artifact's Parquet files: itself, or its parts."""
    return artifact_parts(path) if path.is_dir() else [path]


def sql_rows(files: list[Path], query: Callable[[str], str], kind: str | None = None) -> list[tuple]:
    """The rows of `query(scan)`, where `scan` is DuckDB's read_parquet over `files` (by column name), with
    the nullable columns of `kind`'s schema that no file has read as NULL, as `sparrow sql`'s views read
    them, in a connection that reads those files and nothing else, and writes no file."""
    import duckdb

    paths = [str(Path(f).absolute()) for f in files]
    urls = [sql_literal(file_url(p)) for p in paths]
    absent = absent_columns(kind, {c for f in files for c in read_schema(Path(f)).names}) if kind else []
    scan = f"read_parquet([{', '.join(urls)}], union_by_name = true)"
    if absent:
        scan = f"(SELECT *, {', '.join(absent)} FROM {scan})"
    con = duckdb.connect(":memory:", config={"autoinstall_known_extensions": False,
                                             "autoload_known_extensions": False})
    try:
        reading_only(con, paths)
        con.execute("SET lock_configuration = true")
        return con.sql(query(scan)).fetchall()
    finally:
        con.close()


def column_batches(path: Path, columns: tuple[str, ...]) -> Iterator[dict[str, pa.Array | None]]:
    """`columns` of an artifact (a file or its parts), a bounded batch of rows at a time (`parquet_batches`:
    a few rows of 32K-token rollouts, many of short ones); a column a file lacks (a nullable one added to the
    schema after it was written) is None."""
    for part in files_of(path):
        have = [c for c in columns if c in read_schema(part).names]
        for batch in parquet_batches(part, have):
            yield {c: batch.column(c).combine_chunks() if c in have else None for c in columns}


def _numpy(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False)


@dataclass
class RolloutStats:
    """What the rollouts figure draws: per sample its generated tokens and whether it stopped at EOS; the
    rewards of the samples that have one (NaN or infinite ones kept); the sparse tokens' budgets, summed
    and counted."""

    lengths: np.ndarray
    stops: np.ndarray
    rewards: np.ndarray
    sparse_budget_sum: int
    sparse_tokens: int
    policies: set[str] = field(default_factory=set)  # the samples' KV policies (kv_policy), where recorded
    drafted: int = 0  # speculative decoding: the drafts the samples proposed, and those the dense model kept
    accepted: int = 0


def rollout_stats(path: Path) -> RolloutStats:
    lengths, stops, rewards = [], [], []
    budget_sum = sparse = drafted = accepted = 0
    policies: set[str] = set()
    for batch in column_batches(path, ("token_ids", "finish_reason", "reward", "budgets", "kv_policy",
                                       "drafted", "accepted")):
        lengths.append(_numpy(pc.list_value_length(batch["token_ids"])).astype(np.int64))
        stops.append(_numpy(pc.fill_null(pc.equal(batch["finish_reason"], "stop"), False)))
        if batch["reward"] is not None:
            rewards.append(_numpy(batch["reward"].drop_null().cast(pa.float64())))
        flat = pc.list_flatten(batch["budgets"])
        kept = pc.filter(flat, pc.greater(flat, 0))
        budget_sum += pc.sum(kept.cast(pa.int64())).as_py() or 0
        sparse += len(kept)
        if batch["kv_policy"] is not None:
            policies.update(p for p in pc.unique(batch["kv_policy"].drop_null()).to_pylist())
        if batch["drafted"] is not None:
            drafted += pc.sum(batch["drafted"].cast(pa.int64())).as_py() or 0
        if batch["accepted"] is not None:
            accepted += pc.sum(pc.list_flatten(batch["accepted"]).cast(pa.int64())).as_py() or 0
    return RolloutStats(_joined(lengths, np.int64), _joined(stops, bool), _joined(rewards, float), budget_sum,
                        sparse, policies, drafted, accepted)


def _joined(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


@dataclass
class RewardStats:
    """What the rewards figure draws: per scored completion its reward and its status (None: none)."""

    rewards: np.ndarray
    statuses: list[tuple[str | None, int]]  # each status and its count, most frequent first


def reward_stats(path: Path) -> RewardStats:
    rewards, counts = [], {}
    for batch in column_batches(path, ("reward", "status")):
        rewards.append(_numpy(batch["reward"].cast(pa.float64())))
        status = batch["status"]
        found = ([(None, len(batch["reward"]))] if status is None else
                 [(row["values"], row["counts"]) for row in pc.value_counts(status).to_pylist()])  # a few
        for value, n in found:
            counts[value] = counts.get(value, 0) + n
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0] is None, kv[0] or ""))
    return RewardStats(_joined(rewards, float), ordered)


@dataclass(frozen=True)
class CaptionBins:
    """A mismatch artifact's bin width in tokens (None: its `bin` column fits no one width), as a caption
    says it, with where it came from when no file records it."""

    tokens: int | None
    words: str


def caption_bins(first: Path, spans: Iterable[BinSpan], files: int = 1) -> CaptionBins:
    """The bin width `first` records, else the one `spans` (bin, first and last position) imply:
    plan-schedule's rule for a profile that records none (`profile_bin_width`); `files`: how many files
    the caption speaks of."""
    its, records = ("its", "it records") if files == 1 else ("the", "the files record")
    try:
        width = profile_bin_width(first, spans=spans)
    except ScheduleError:
        return CaptionBins(None, f"the bins of {its} 'bin' column, which fit no one width ({records} none)")
    inferred = (f" (inferred from {its} 'bin' column: {records} no bin width)" if width.origin == "inferred"
                else "")
    return CaptionBins(width.width, f"bins of {width.width} tokens{inferred}")
