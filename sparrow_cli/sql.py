"""`sparrow sql`: query a run directory with DuckDB; each artifact kind is a view.

Results go to stdout as a table, TSV, CSV or JSON records, or with `-o` to Parquet; the query is
read-only (stages/sql.py), so `-o` is the only thing written.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import sys
from decimal import Decimal
from pathlib import Path
from typing import Annotated

import pyarrow as pa
import typer
from rich.markup import escape
from rich.table import Table

from sparrow.schemas.io import write_table
from sparrow.stages.sql import QueryError, run_query

from .common import FORCE_HELP, UsageError, check_output, console, fail, friendly_errors, out
from .output import FORMAT_HELP, emit, resolve_format

TABLE_ROWS = 1000


@friendly_errors
def sql(
    query: Annotated[str, typer.Argument(help="SQL over the run's views, e.g. \"SELECT bin, budget, "
                                              "quantile_cont(alpha, 0.05) FROM mismatch GROUP BY ALL\".")],
    run: Annotated[Path, typer.Option("--run", help="Run directory: each *.parquet artifact in it is a "
                                                    "view named by its kind (mismatch, schedule, ...).")]
    = Path("."),
    format: Annotated[str | None, typer.Option("--format", "-f", help=FORMAT_HELP)] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the result to this "
                                                "Parquet file instead (- = stdout). An existing file is "
                                                "replaced only if it is a query result, not an artifact "
                                                "(or --force); a symlink is written through.")] = None,
    force: Annotated[bool, typer.Option("--force", help=FORCE_HELP)] = False,
) -> None:
    """Run a SQL query (DuckDB) over the artifacts of a run directory."""
    try:
        format = resolve_format(format)
    except UsageError as e:
        fail(str(e))
    if output is not None and output.suffix != ".parquet" and str(output) != "-":
        fail(f"-o writes Parquet, so give a path ending in .parquet (not {output.name}); "
             f"use --format csv or json with a shell redirect for text")
    check_output(output, None, force)
    try:
        result = run_query(run, query, warn=lambda m: console.print(f"[yellow]warning:[/] {escape(m)}",
                                                                    highlight=False))
    except QueryError as e:
        fail(f"query failed: {e}")
    if output is not None:
        write_table(result, output)
        console.print(f"wrote {result.num_rows} rows x {result.num_columns} columns to "
                      f"{'stdout' if str(output) == '-' else output}", highlight=False)
    elif format == "table":
        _print_table(result)
    elif format == "csv":
        _print_csv(result)
    elif format == "tsv":
        emit(result.column_names, [[_tsv_cell(v) for v in r.values()] for r in result.to_pylist()], "tsv")
    else:
        sys.stdout.write(json.dumps([_jsonable(r) for r in result.to_pylist()]) + "\n")


def _print_table(table: pa.Table) -> None:
    shown = table.slice(0, TABLE_ROWS)
    caption = f"{table.num_rows} row{'s' * (table.num_rows != 1)}"
    if table.num_rows > TABLE_ROWS:
        caption += f", first {TABLE_ROWS} shown (use --format csv or -o for all)"
    t = Table(caption=caption)
    for field in table.schema:
        numeric = pa.types.is_integer(field.type) or pa.types.is_floating(field.type) \
            or pa.types.is_decimal(field.type)
        t.add_column(field.name, justify="right" if numeric else "left")
    for row in shown.to_pylist():
        t.add_row(*(_cell(v) for v in row.values()))
    out.print(t)


def _cell(v: object) -> str:
    if v is None:
        return "[dim]null[/]"
    if isinstance(v, float):
        return f"{v:.6g}"
    text = json.dumps(_jsonable(v)) if isinstance(v, list | dict) else str(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _tsv_cell(v: object) -> object:
    return json.dumps(_jsonable(v)) if isinstance(v, list | dict) else v


def _print_csv(table: pa.Table) -> None:
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(table.column_names)
    for batch in table.to_batches(max_chunksize=65536):
        for row in batch.to_pylist():
            writer.writerow(["" if v is None else json.dumps(_jsonable(v)) if isinstance(v, list | dict)
                             else v for v in row.values()])


def _jsonable(v: object) -> object:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, dt.date | dt.time | dt.datetime):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, bytes):
        return v.hex()
    return v
