"""DuckDB over a run directory: every artifact kind is a view, so questions about a run are SQL.

Views are named after the artifact kind in each Parquet footer, unioned by column name, with a
`source_file` column and the files' provenance as `source_*` columns; each file is also a view of its
own. Unreadable files, and files that name a kind Sparrow does not know, are skipped with a warning.
Read only, twice over: only one read statement runs (as DuckDB's parser reads it), and DuckDB is
sandboxed to the run's files, which it reads through a file system that cannot write them, before any
view exists. Bounded: memory, spill disk, time, and a Ctrl-C or SIGTERM stops the query; the spill
folder goes whatever happens. docs/sql.md gives the rules.

views.py names the views, files.py is the read-only file system they read through, connection.py opens
DuckDB over them and checks a statement, limits.py bounds a query while it runs; here, the query itself,
streamed. A query that fails on a damaged file (a data page DuckDB cannot decode, which the footer check
cannot see) says which file: DuckDB's own message names none, so the files of the views it read are read
again, one by one, to find it.

A result written as Parquet (`-o`) may hold only what Parquet holds: a column of a type pyarrow's Parquet
writer has no form for (DuckDB's INTERVAL, a UNION, or a list, struct or map of one) is refused in one
sentence naming it (`parquet_refusal`), before anything is written. None is cast on the user's behalf:
neither text nor seconds is faithful to DuckDB's months, days and nanoseconds for every reader (DuckDB
cannot read the ISO 8601 text back, and a month has no fixed length), so the query says which it wants.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from .connection import check_query, check_read_only, close_run, first_line, open_run, open_views
from .files import file_url
from .limits import (
    DEFAULT_MEMORY,
    DEFAULT_TIMEOUT,
    MAX_TIMEOUT,
    Guard,
    Limits,
    QueryError,
    QueryLimit,
    Stopped,
    guarded,
    machine_memory,
    memory_text,
    parse_memory,
)
from .views import (
    RunChanged,
    Source,
    View,
    Warn,
    mixed_warning,
    python_warning,
    run_changed,
    run_views,
    sql_literal,
    vanished,
)

__all__ = ["DEFAULT_MEMORY", "DEFAULT_TIMEOUT", "MAX_TIMEOUT", "Limits", "QueryError", "QueryLimit", "Result",
           "RunChanged", "Stopped", "View", "check_query", "check_read_only", "machine_memory", "memory_text",
           "open_run", "parquet_refusal", "parse_memory", "query", "run_query", "run_views"]

BATCH_ROWS = 8192


@dataclass
class Result:
    """A query's result as it streams: its schema (unique column names) and its record batches, read
    while the `query` block is open."""

    schema: pa.Schema
    batches: Iterator[pa.RecordBatch]


def parquet_refusal(schema: pa.Schema) -> str | None:
    """One sentence naming the first column of `schema` that Parquet cannot hold, with what to do; None
    when every column can be written."""
    for field in schema:
        try:
            pq.ParquetWriter(io.BytesIO(), pa.schema([field])).close()
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
            return (f"column '{field.name}' {_held(field.type)}, which Parquet cannot hold; cast it in the "
                    f"query ({_cast_advice(field)}) or print the result with -f tsv, csv or json")
    return None


def _held(t: pa.DataType) -> str:
    """What a column of type `t` is or holds, in DuckDB's words where they differ from Arrow's."""
    inner = _unwritable_part(t)
    if inner is None:
        return f"is of type {t}"
    what = {"interval": "an INTERVAL", "union": "a UNION"}[inner]
    return f"is {what}" if _unwritable_part(t, nested=False) else f"holds {what}"


def _unwritable_part(t: pa.DataType, nested: bool = True) -> str | None:
    """'interval' or 'union' for the part of `t` Parquet cannot hold (looked for inside lists, structs and
    maps unless not `nested`), else None."""
    if pa.types.is_interval(t):
        return "interval"
    if pa.types.is_union(t):
        return "union"
    if not nested:
        return None
    children = [t.field(i).type for i in range(t.num_fields)]
    return next((found for child in children if (found := _unwritable_part(child))), None)


def _cast_advice(field: pa.Field) -> str:
    name = field.name if re.fullmatch(r"[a-z_][a-z0-9_]*", field.name) else _identifier(field.name)
    if pa.types.is_interval(field.type):
        return f"epoch({name}) for its seconds, or {name}::VARCHAR for its text"
    return f"{name}::VARCHAR for its text"


def _identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@contextmanager
def query(run_dir: str | Path, sql: str, limits: Limits | None = None, warn: Warn | None = None
          ) -> Iterator[Result]:
    """Run one read statement against a run directory's views within `limits`; the result streams
    while the block is open. Refusals, errors and limits are QueryError (one sentence); SIGINT and
    SIGTERM are `Stopped`; the connection and its spill folder are gone when the block ends. A file of
    the run that goes before the first rows come (a finished rollout moves its journal away, once OUT
    holds its rows) lists the run again, once, within what is left of the time limit; what is said of the
    run is said of the listing answered. One gone after that, or again, is RunChanged (one sentence: run the
    query again)."""
    limits = limits or Limits()
    limits = dataclasses.replace(limits, spill=limits.spill_bytes())  # one value for DuckDB and messages
    warn = warn or python_warning
    check_query(sql)
    used = _used_views(sql)
    deadline: float | None = None
    for last in (False, True):
        said: list[str] = []
        try:
            views = run_views(run_dir, said.append)
            said += [w for v in views if v.name.lower() in (used or ()) and (w := mixed_warning(v, sql))]
            con, spill = open_views(run_dir, views, said.append, limits.memory // 2, limits.spill)
        except RunChanged:
            if last:
                raise
            continue
        try:
            if deadline is None and limits.seconds:
                deadline = time.monotonic() + limits.seconds
            with _guarded_until(con, limits, deadline) as guard:
                read = views if used is None else [v for v in views if v.name.lower() in used]
                translate = functools.partial(_translated, guard=guard, con=con, run_dir=run_dir,
                                              read=_sources(read))
                try:
                    result = _started(con, sql, guard, translate)
                except RunChanged:
                    if last:
                        raise
                    continue
                for message in said:
                    warn(message)
                try:
                    yield result
                except MemoryError:
                    raise QueryLimit(guard.memory_message()) from None
                except KeyboardInterrupt as e:
                    stopped = guard.signum is not None and not isinstance(e, Stopped)
                    raise (Stopped(guard.signum) if stopped else e) from None
                return
        finally:
            close_run(con, spill)


@contextmanager
def _guarded_until(con: duckdb.DuckDBPyConnection, limits: Limits, deadline: float | None
                   ) -> Iterator[Guard]:
    """`guarded` with the wall time left until `deadline`, so that a query listed again runs within the
    --timeout of the first pass, never a second one; its messages name the limit asked for."""
    left = None if deadline is None else deadline - time.monotonic()
    seconds = None if left is None else max(left, 1e-3)  # guarded sets no timer for 0
    with guarded(con, limits, seconds) as guard:
        if left is not None and left <= 0:
            guard.expire()
        yield guard


def _started(con: duckdb.DuckDBPyConnection, sql: str, guard: Guard,
             translate: Callable[[BaseException], BaseException]) -> Result:
    """The statement run, its first batch read already: a file gone before then (RunChanged) may still be
    answered from a new listing, since nothing has streamed."""
    try:
        rel = con.sql(sql)
        reader = rel.to_arrow_reader(BATCH_ROWS) if rel is not None else None
    except (Exception, KeyboardInterrupt) as e:
        raise translate(e) from None
    if reader is None:
        return Result(pa.schema([]), iter(()))
    schema = _unique_names(reader.schema)
    batches = _batches(reader, schema, guard, translate)
    first = next(batches, None)
    return Result(schema, batches if first is None else itertools.chain([first], batches))


def run_query(run_dir: str | Path, sql: str, warn: Warn | None = None, limits: Limits | None = None
              ) -> pa.Table:
    """Run one read-only SQL statement against a run directory's views; the whole result as an Arrow
    table."""
    with query(run_dir, sql, limits, warn) as result:
        return pa.Table.from_batches(list(result.batches), schema=result.schema)


def _batches(reader: pa.RecordBatchReader, schema: pa.Schema, guard: Guard,
             translate: Callable[[BaseException], BaseException]) -> Iterator[pa.RecordBatch]:
    """The reader's batches under `schema`; what stops the stream (an error, a limit, a signal) as the
    caller should see it."""
    batches = iter(reader)
    while True:
        try:
            guard.check()
            batch = next(batches)
        except StopIteration:
            return
        except (Exception, KeyboardInterrupt) as e:
            raise translate(e) from None
        yield pa.RecordBatch.from_arrays(batch.columns, schema=schema)


def _translated(e: BaseException, guard: Guard, con: duckdb.DuckDBPyConnection, run_dir: str | Path,
                read: tuple[Source, ...] = ()) -> BaseException:
    """What the caller sees of an exception DuckDB (or the stream from it) raised while a query ran; `read`:
    the files of the views the query names. A signal or a limit is said as such whatever else happened;
    otherwise one of `read` gone since the listing is RunChanged (a file the query does not read going
    says nothing of its error), and one that DuckDB cannot decode is searched for when the error names
    no file."""
    if guard.signum is not None:
        return e if isinstance(e, Stopped) else Stopped(guard.signum)
    if isinstance(e, QueryError | KeyboardInterrupt):
        return e
    engine = isinstance(e, duckdb.Error | OSError | pa.ArrowException | RuntimeError)
    if guard.timed_out.is_set() and engine:
        return QueryLimit(guard.timeout_message())
    if engine and "max_temp_directory_size" in str(e):
        return QueryLimit(guard.spill_message())
    if isinstance(e, MemoryError) or (engine and re.search(r"out of memory|bad_alloc", str(e), re.I)):
        return QueryLimit(guard.memory_message())
    if not engine:
        return e
    if (gone := vanished(read)) is not None:
        return run_changed(gone.path)
    message = first_line(e)
    if isinstance(e, duckdb.CatalogException) and (path := _missing_path(message)):
        message = (f'Permission Error: Cannot access file "{path}" - file system operations are disabled by '
                   'configuration')
        e = duckdb.PermissionException(message)
    if isinstance(e, duckdb.CatalogException):
        views = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() "
                                           "WHERE NOT internal ORDER BY view_name").fetchall()]
        message += f" (views in {run_dir}: {_listing(views)})"
    elif isinstance(e, duckdb.PermissionException):
        message += " (sparrow sql reads only the run's artifacts, through their views)"
    elif _unnamed_read_error(e, message, read) and (bad := _damaged(con, read, guard)) is not None:
        message = (f"{Path(run_dir) / bad.name} cannot be read, its data is damaged ({message}); the other "
                   f"files' views still read (SHOW TABLES lists them)")
    return QueryError(message)  # as DuckDB says it: the CLI's printer escapes the bytes it quotes


def _sources(views: list[View]) -> tuple[Source, ...]:
    """The files of `views`, each once, in view order."""
    return tuple({s.path: s for view in views for s in view.sources}.values())


def _unnamed_read_error(e: BaseException, message: str, read: tuple[Source, ...]) -> bool:
    """An error of DuckDB's Parquet reader that names no file: a damaged page raises DuckDB's bare `Error`
    ("TProtocolException: ...", "don't know what type"), the same through the Arrow stream once rows have
    come (an OSError, "Invalid Error: ..."), or fails in its Python binding."""
    bare = type(e) is duckdb.Error or isinstance(e, RuntimeError | OSError | pa.ArrowException)
    return bare and not any(str(s.path) in message for s in read)


def _damaged(con: duckdb.DuckDBPyConnection, read: tuple[Source, ...], guard: Guard) -> Source | None:
    """The first of `read` that DuckDB cannot read whole (every column of every row, streamed); None when
    each reads, or when the query's time ran out or a signal came while looking."""
    for source in read:
        if guard.signum is not None or guard.timed_out.is_set():
            return None
        try:
            rel = con.sql(f"SELECT * FROM read_parquet([{sql_literal(file_url(source.path))}])")
            for _ in rel.to_arrow_reader(BATCH_ROWS):
                pass
        except Exception:  # noqa: BLE001 - any failure to read it is the answer
            return source
    return None


def _missing_path(message: str) -> str | None:
    """The table name of DuckDB's "does not exist" when it is a file's path (`FROM '/etc/passwd'`: DuckDB
    reads a quoted name as a file only by its suffix), so that it is refused as every outside file is."""
    m = re.match(r"Catalog Error: Table with name (.+) does not exist!", message)
    if m is None:
        return None
    name = m.group(1)
    return name if "/" in name or os.sep in name or os.path.exists(name) else None


def _listing(views: list[str], most: int = 12) -> str:
    """The view names of an error message: every one, or the kinds' and a count of the per-file ones."""
    if len(views) <= most:
        return ", ".join(views) or "none"
    per_file = [v for v in views if "__" in v]
    return (", ".join(v for v in views if "__" not in v) + f", and {len(per_file)} per-file views "
            "(<kind>__<file>; SHOW TABLES lists them all)")


def _used_views(sql: str) -> set[str] | None:
    """The table names `sql` reads, in lower case (SQL names are case-insensitive); None when DuckDB's
    parser cannot name them (a PIVOT is several statements to it): then every view may be read."""
    try:
        return {name.lower() for name in duckdb.get_table_names(sql)}
    except duckdb.Error:
        return None


def _unique_names(schema: pa.Schema) -> pa.Schema:
    """The schema with repeated column names made unique: alpha, alpha_1, alpha_2, ..."""
    seen: set[str] = set(schema.names)
    names, first = [], set()
    for name in schema.names:
        if name not in first:
            first.add(name)
            names.append(name)
            continue
        i = 1
        while f"{name}_{i}" in seen:
            i += 1
        seen.add(f"{name}_{i}")
        names.append(f"{name}_{i}")
    return pa.schema([f.with_name(n) for f, n in zip(schema, names)], metadata=schema.metadata)
