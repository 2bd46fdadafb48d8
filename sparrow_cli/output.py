"""Tables that fit their reader: a rich table on a terminal, complete plain text anywhere else.

Every command that prints a table takes `--format table|csv|json|tsv`. Without it, stdout decides: a
terminal gets the rich table, a pipe or a file gets TSV (every row, every character: greppable, and
readable by `cut`, `sort` and DuckDB's read_csv). Data goes to stdout, messages to stderr.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Sequence

import typer
from rich.table import Table

from .common import UsageError, out

FORMATS = ("table", "csv", "json", "tsv")
FORMAT_HELP = "table, csv, json or tsv on stdout (default: table on a terminal, tsv in a pipe)."


def format_option():
    return typer.Option(None, "--format", "-f", help=FORMAT_HELP)


def resolve_format(fmt: str | None) -> str:
    if fmt is None:
        return "table" if sys.stdout.isatty() else "tsv"
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def _plain(v: object) -> object:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _text(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v).replace("\t", " ").replace("\n", " ")


def emit(columns: Sequence[str], rows: Sequence[Sequence[object]], fmt: str, title: str | None = None,
         left: Sequence[str] = ()) -> None:
    """Print `rows` under `columns` in `fmt` (already resolved); numbers are right-aligned in tables
    unless named in `left`."""
    if fmt == "table":
        t = Table(title=title)
        for c in columns:
            t.add_column(c, justify="left" if c in left else "right")
        for r in rows:
            t.add_row(*(_text(v) for v in r))
        out.print(t)
    elif fmt == "json":
        sys.stdout.write(json.dumps([{c: _plain(v) for c, v in zip(columns, r)} for r in rows]) + "\n")
    elif fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([["" if v is None else v for v in r] for r in rows])
    else:
        sys.stdout.write("\t".join(columns) + "\n")
        for r in rows:
            sys.stdout.write("\t".join(_text(v) for v in r) + "\n")
    sys.stdout.flush()
