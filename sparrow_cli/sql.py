"""`sparrow sql`: query a run directory with DuckDB; each artifact kind is a view.

Results stream to stdout as a table, TSV, CSV or JSON records (at most --max-rows), or with `-o` to
Parquet; the query is read-only and bounded in memory and time (stages/sql/), so `-o` is the only
thing written. A value text has no form of its own for is written as PostgreSQL writes it, so that its
COPY (TSV, CSV) and JSON readers read it back: bytes as bytea's hex (`\\x0102`), an interval as ISO 8601
(`P1DT2H`); in JSON, NaN and the infinities are the strings PostgreSQL's to_json gives them ("NaN",
"Infinity", "-Infinity") and only NULL is null.
"""

from __future__ import annotations

import csv
import datetime as dt
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Annotated

import pyarrow as pa
import typer
from rich.cells import cell_len
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from sparrow.schemas.io import write_batches
from sparrow.schemas.locations import PLAIN, QUERY_KEY, describe, is_stdio, special_kind
from sparrow.stages.sql import (
    DEFAULT_MEMORY,
    DEFAULT_TIMEOUT,
    MAX_TIMEOUT,
    Limits,
    QueryError,
    QueryLimit,
    parquet_refusal,
    parse_memory,
)
from sparrow.stages.sql import query as run_sql

from .console import console, out, stdout_failed, writing_stdout
from .errors import UsageError, friendly_errors
from .messages import fail, printable, warn
from .options import finite, output_path
from .output import FORMAT_HELP, FORMAT_METAVAR, one_line, print_table, resolve_format, tsv_field
from .paths import FORCE_HELP, check_output
from .progress import live_progress

TABLE_ROWS = 1000
DEFAULT_MAX_ROWS = 1_000_000

VIEWS_HELP = ("Run directory: each *.parquet artifact in it (and in a folder of parts) is read through "
              "views: one per artifact kind, all its files unioned by column name (mismatch, schedule, "
              "...; with source_file and the files' provenance as source_* columns, those some file of "
              "the kind records: source_model, source_temperature, source_seed, a profile's "
              "source_sampler, rollouts' source_sparsity and the others docs/sql.md lists), one per "
              "artifact file named <kind>__<path in the run> (mismatch__mismatch_b64 for "
              "mismatch_b64.parquet), and one per other Parquet file named after its stem. "
              "\"SHOW TABLES\" lists them.")

OUTPUT_HELP = ("Write the result to this Parquet file instead (- = stdout), every row; its footer marks it "
               "as a query result. An existing file is replaced only if it is an earlier query result or "
               "empty, not an artifact or any other Parquet file (or --force); a symlink is written through.")


class TooManyRows(UsageError):
    """More rows than --max-rows: those printed are the first of the result."""


@friendly_errors
def sql(
    words: Annotated[list[str], typer.Argument(metavar="[RUN] QUERY", show_default=False, help="The run "
                                               "directory (as --run gives it; default: the current "
                                               "directory), then one SQL statement over its views, e.g. "
                                               "\"SELECT bin, budget, quantile_cont(alpha, 0.05) FROM "
                                               "mismatch GROUP BY ALL\".")],
    run_option: Annotated[Path | None, typer.Option("--run", show_default=False, help=VIEWS_HELP)] = None,
    format: Annotated[str | None, typer.Option("--format", "-f", metavar=FORMAT_METAVAR,
                                               help=FORMAT_HELP)] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help=OUTPUT_HELP,
                                                parser=output_path())] = None,
    force: Annotated[bool, typer.Option("--force/--no-force", help=FORCE_HELP)] = False,
    memory_limit: Annotated[str, typer.Option("--memory-limit", help="The memory the query may take in "
                                              "all, as 4GB, 512MiB or a share of this machine's memory "
                                              "such as 25%, at most all of it: DuckDB works in half of it "
                                              "(and spills to a temporary folder beyond that, of at most "
                                              "twice this limit and a quarter of the free disk), the "
                                              "result on its way out in the rest.")] = DEFAULT_MEMORY,
    timeout: Annotated[float, typer.Option("--timeout", callback=finite, help="Stop the query after this "
                                           "many seconds (0: no limit).")] = DEFAULT_TIMEOUT,
    max_rows: Annotated[int, typer.Option("--max-rows", help="At most this many rows on stdout (table, "
                                          "csv, json, tsv); a larger result prints its first rows and "
                                          "fails (0: no limit; -o writes every row).")] = DEFAULT_MAX_ROWS,
) -> None:
    """Run one SQL query (DuckDB) over the artifacts of a run directory, bounded in memory and time."""
    run, query = _run_and_query(words, run_option)
    if output is not None and format is not None:
        fail("-f/--format chooses how rows print on stdout, and -o writes them as Parquet instead; give one "
             "of the two")
    try:
        format = resolve_format(format)
    except UsageError as e:
        fail(str(e))
    if output is not None and _is_dir(output):
        fail(f"{output} is a directory; give a file path such as {output / 'out.parquet'}")
    if output is not None and not is_stdio(output) and special_kind(output) is None \
            and output.suffix != ".parquet":  # a device or FIFO: check_output names it
        fail(f"-o writes Parquet, so give a path ending in .parquet (not {output.name}); "
             f"use --format csv or json with a shell redirect for text")
    limits = _limits(memory_limit, timeout, max_rows)
    check_output(output, None, force, inputs={"--run": _tables_of_the_run(output, run)})
    # rows on a terminal's stdout stop the clock at the first batch; a file or a pipe's run to the end
    until_first = output is None and format != "table" and out.on_terminal
    try:
        with _QueryClock() as clock, run_sql(run, query, limits, warn=warn) as result:
            batches = clock.batches(result.batches, until_first)
            if output is not None:
                if refused := parquet_refusal(result.schema):
                    fail(refused)
                rows = write_batches(_marked(result.schema, query), batches, output)
                where = "stdout" if str(output) == "-" else printable(str(output))
                width = len(result.schema)
                console.print(f"wrote {rows} row{'s' * (rows != 1)} x {width} column{'s' * (width != 1)} to "
                              f"{where}", highlight=False, markup=False)
            else:
                PRINTERS[format](result.schema, _capped(batches, max_rows))
    except QueryLimit as e:
        fail(str(e))
    except QueryError as e:
        fail(f"query failed: {e}")
    except TooManyRows as e:
        fail(str(e))
    except BrokenPipeError:  # the reader stopped early (| head): not an error
        _drop_stdout()


def _tables_of_the_run(output: Path | None, run: Path) -> list[Path]:
    """An existing -o that is one of the tables the query reads (an artifact of the run, or another Parquet
    file there, which has a view too), which even --force may not replace; an earlier query result may
    be."""
    if output is None or is_stdio(output) or not os.path.isfile(output):  # False for a name too long
        return []
    inside = output.resolve().is_relative_to(run.resolve())
    kind, words = describe(output)
    return [output] if inside and (kind is not None or words == PLAIN) else []


def _run_and_query(words: list[str], run: Path | None) -> tuple[Path, str]:
    """The run directory and the query from `sparrow sql [RUN] QUERY` (or `QUERY --run RUN`): one argument
    is the query, two are the run directory then the query."""
    if len(words) == 1:
        return run or Path("."), words[0]
    if len(words) > 2:
        raise UsageError(f"sparrow sql takes the run directory and one query, got {len(words)} arguments; "
                         "quote the query as one argument: sparrow sql RUN \"SELECT ...\"")
    first, query = words
    if run is not None:
        raise UsageError(f"the run directory was given twice, as {first} and as --run {run}; give it once")
    if not Path(first).is_dir() and Path(query).is_dir():
        raise UsageError(f"sparrow sql takes the run directory before the query: sparrow sql {query} QUERY")
    if not Path(first).is_dir() and Path(query).is_file():
        raise UsageError(f"sparrow sql takes a run directory, then the query, and {query} is a file: give "
                         f"its directory first, sparrow sql {Path(query).parent} QUERY (each of its "
                         "artifacts is a view)")
    return Path(first), query


class _QueryClock:
    """While a query runs, a spinner with its elapsed time (and the rows it has given) on stderr, when
    stderr is a terminal; nothing anywhere else. Stdout is never touched: for rows printed on a terminal
    (`until_first`) the clock stops once the first batch is in, before anything is printed; else it runs
    until the last batch."""

    def __init__(self) -> None:
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                            console=console, transient=True, disable=not live_progress(),
                            redirect_stdout=False, redirect_stderr=False)  # rows go to stdout as they are

    def __enter__(self) -> _QueryClock:
        self.bar.start()
        self.task = self.bar.add_task("running the query", total=None)
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def batches(self, batches: Iterator[pa.RecordBatch], until_first: bool) -> Iterator[pa.RecordBatch]:
        """`batches` as they come, the clock following them; with `until_first`, the first one is read
        (most of a query's time, for an aggregate) and the clock stopped before this returns."""
        if not until_first:
            return self._counted(batches)
        batches = iter(batches)
        first = next(batches, None)
        self.bar.stop()
        return batches if first is None else itertools.chain([first], batches)

    def _counted(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        rows = 0
        for batch in batches:
            rows += batch.num_rows
            self.bar.update(self.task, description=f"running the query: {rows:,} row{'s' * (rows != 1)}")
            yield batch
        self.bar.stop()


class _Stdout:
    """Stdout for the row printers: a failed write other than a reader stopping early (a full disk, an
    I/O error, a closed stdout) is StdoutFailed, one sentence and exit 2; a BrokenPipeError passes to the
    command's own rule."""

    def __init__(self) -> None:
        if sys.stdout is None:
            raise stdout_failed()
        self.stream = sys.stdout

    def write(self, text: str) -> int:
        with writing_stdout():
            return self.stream.write(text)

    def flush(self) -> None:
        with writing_stdout():
            self.stream.flush()


def _marked(schema: pa.Schema, query: str) -> pa.Schema:
    """The result's schema with QUERY_KEY (the query) in its footer: what lets a later `-o` replace it."""
    mark = {QUERY_KEY.encode(): query.encode(errors="replace")}
    return schema.with_metadata({**(schema.metadata or {}), **mark})


def _limits(memory: str, timeout: float, max_rows: int) -> Limits:
    try:
        size = parse_memory(memory)
    except ValueError as e:
        raise UsageError(f"--memory-limit {e}") from None
    if not 0 <= timeout <= MAX_TIMEOUT:  # nan too; the timer takes no later moment than the C library's
        raise UsageError(f"--timeout must be a number of seconds from 0 (no limit) to {MAX_TIMEOUT:,} "
                         f"(a year), got {timeout:g}")
    if max_rows < 0:
        raise UsageError(f"--max-rows must be >= 0 (0: no limit), got {max_rows}")
    return Limits(memory=size, seconds=timeout or None)


def _capped(batches: Iterator[pa.RecordBatch], max_rows: int) -> Iterator[pa.RecordBatch]:
    """The batches up to `max_rows` rows (0: all), then TooManyRows if the result holds more."""
    n = 0
    for batch in batches:
        if max_rows and n + batch.num_rows > max_rows:
            yield batch.slice(0, max_rows - n)
            raise TooManyRows(f"the result has more than {max_rows} rows, so only its first {max_rows} "
                              f"were printed; raise --max-rows (0: no limit), or write every row with -o "
                              f"FILE.parquet")
        n += batch.num_rows
        yield batch


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not raise again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # not a real file (under a test runner)
        pass


def _print_table(schema: pa.Schema, batches: Iterator[pa.RecordBatch]) -> None:
    shown: list[dict] = []
    n = 0
    try:
        for batch in batches:
            if len(shown) < TABLE_ROWS:
                shown += batch.slice(0, TABLE_ROWS - len(shown)).to_pylist()
            n += batch.num_rows
    except TooManyRows:
        _table(schema, shown, f"more than {n} rows, first {len(shown)} shown")
        raise
    caption = f"{n} row{'s' * (n != 1)}"
    if n > TABLE_ROWS:
        caption += f", first {TABLE_ROWS} shown (use --format csv or -o for all)"
    _table(schema, shown, caption)


def _table(schema: pa.Schema, rows: list[dict], caption: str) -> None:
    """Headers and cells are Text, never markup: a value such as '[/INST]' or ':x:' prints as stored. The
    table is at least as wide as its caption, which rich would otherwise wrap under a narrow table."""
    t = Table(caption=caption, min_width=cell_len(caption))
    for field in schema:
        numeric = pa.types.is_integer(field.type) or pa.types.is_floating(field.type) \
            or pa.types.is_decimal(field.type)
        t.add_column(Text(field.name), justify="right" if numeric else "left")
    for row in rows:
        t.add_row(*(_cell(v) for v in row.values()))
    print_table(t, out)


def _print_tsv(schema: pa.Schema, batches: Iterator[pa.RecordBatch]) -> None:
    """One line per row, every value exact (output.tsv_field): NULL is \\N, text escaped."""
    stdout = _Stdout()
    stdout.write("\t".join(tsv_field(name) for name in schema.names) + "\n")
    for batch in batches:
        for row in _rows(batch):
            stdout.write("\t".join(tsv_field(_tsv_cell(v)) for v in row) + "\n")
    stdout.flush()


def _print_csv(schema: pa.Schema, batches: Iterator[pa.RecordBatch]) -> None:
    stdout = _Stdout()
    writer = csv.writer(stdout, lineterminator="\n")
    writer.writerow(schema.names)
    for batch in batches:
        for row in _rows(batch):
            writer.writerow(["" if v is None else json.dumps(_jsonable(v)) if isinstance(v, list | dict)
                             else _text_value(v) for v in row])
    stdout.flush()


def _print_json(schema: pa.Schema, batches: Iterator[pa.RecordBatch]) -> None:
    """One JSON list of records, written as the rows come (closed also when --max-rows cuts it)."""
    stdout, sep = _Stdout(), ""
    stdout.write("[")
    try:
        for batch in batches:
            for record in batch.to_pylist():
                stdout.write(sep + json.dumps(_jsonable(record)))
                sep = ", "
    except TooManyRows:
        stdout.write("]\n")
        raise
    stdout.write("]\n")
    stdout.flush()


def _rows(batch: pa.RecordBatch) -> Iterator[list]:
    columns = [c.to_pylist() for c in batch.columns]
    return (list(row) for row in zip(*columns))


PRINTERS: dict[str, Callable[[pa.Schema, Iterator[pa.RecordBatch]], None]] = {
    "table": _print_table, "tsv": _print_tsv, "csv": _print_csv, "json": _print_json}


def _cell(v: object) -> Text:
    if v is None:
        return Text("null", style="dim")
    if isinstance(v, float):
        return Text(f"{v:.6g}")
    text = json.dumps(_jsonable(v)) if isinstance(v, list | dict) else one_line(str(_text_value(v)))
    return Text(text if len(text) <= 80 else text[:77] + "...")


def _tsv_cell(v: object) -> object:
    """A list or struct as JSON text, a boolean as CSV and the table show it (True, False)."""
    if isinstance(v, bool):
        return str(v)
    return json.dumps(_jsonable(v)) if isinstance(v, list | dict) else _text_value(v)


NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}  # and NaN: "NaN"


def _jsonable(v: object) -> object:
    """A value as strict JSON: NaN and the infinities as PostgreSQL's to_json writes them ("NaN",
    "Infinity", "-Infinity"), so that null is NULL alone; bytes and intervals as the text formats write
    them."""
    if isinstance(v, float):
        return v if math.isfinite(v) else NON_FINITE.get(v, "NaN")
    if isinstance(v, bytes | pa.MonthDayNano | dt.timedelta):
        return _text_value(v)
    if isinstance(v, Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, dt.date | dt.time | dt.datetime):
        return v.isoformat()
    return v


def _text_value(v: object) -> object:
    """A value as PostgreSQL writes it where Python's text of it is a repr no reader parses: bytes as
    bytea's hex (`\\x0102`), an interval (DuckDB's months, days and nanoseconds) or a duration as an ISO 8601
    duration; any other value as it is."""
    if isinstance(v, bytes):
        return "\\x" + v.hex()
    if isinstance(v, pa.MonthDayNano):
        return iso_duration(v.months, v.days, v.nanoseconds)
    if isinstance(v, dt.timedelta):
        return iso_duration(0, 0, ((v.days * 86400 + v.seconds) * 10**6 + v.microseconds) * 1000)
    return v


def iso_duration(months: int, days: int, nanoseconds: int) -> str:
    """An interval as ISO 8601's format with designators, each part with its own sign, as PostgreSQL writes
    one (IntervalStyle iso_8601) and reads it back: `P1Y2M3DT4H5M6.5S`, `P-1Y-2M3DT-4H`, `PT0S` for
    none. Months split into years and months, nanoseconds into hours, minutes and seconds, each toward
    zero, so every part keeps its own sign (an interval's parts may differ in sign)."""
    years, months = _toward_zero(months, 12)
    hours, rest = _toward_zero(nanoseconds, 3600 * 10**9)
    minutes, rest = _toward_zero(rest, 60 * 10**9)
    date = "".join(f"{n}{unit}" for n, unit in ((years, "Y"), (months, "M"), (days, "D")) if n)
    time = "".join(f"{n}{unit}" for n, unit in ((hours, "H"), (minutes, "M")) if n)
    if rest:
        whole, fraction = divmod(abs(rest), 10**9)
        digits = f".{fraction:09d}".rstrip("0") if fraction else ""
        time += f"{'-' if rest < 0 else ''}{whole}{digits}S"
    if not date and not time:
        return "PT0S"
    return "P" + date + (f"T{time}" if time else "")


def _toward_zero(n: int, unit: int) -> tuple[int, int]:
    """n // unit rounded toward zero, and what is left (with n's sign)."""
    whole = abs(n) // unit * (1 if n >= 0 else -1)
    return whole, n - whole * unit


def _is_dir(path: Path) -> bool:
    """Whether `path` is a folder; False for a name the system cannot look up (too long: check_output
    names it)."""
    try:
        return path.is_dir()
    except OSError:
        return False
