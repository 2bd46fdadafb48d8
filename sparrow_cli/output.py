"""Tables that fit their reader: a rich table on a terminal, complete plain text anywhere else.

Every command that prints a table takes `--format table|csv|json|tsv`. Without it, stdout decides: a
terminal gets the rich table, a pipe or a file gets TSV (every row, every value as it is: greppable, and
readable by `cut`, `sort`, PostgreSQL's COPY and DuckDB's read_csv). Data goes to stdout, messages to
stderr.

Rows hold typed values, one value per cell (numbers, booleans, None, text). The text formats (table,
csv, tsv) share the rendering of a value where it is a choice: a column's renderer where the command
gives one (a budget of None shown as "dense", a parameter count as "134.5M"), else yes/no for booleans.
They differ where a reader needs it. The table is for reading: floats to 6 significant digits, None an
empty cell, tabs and newlines in text shown as spaces. CSV and TSV are for machines and lose nothing:
floats in their shortest form that reads back to the same number (repr). CSV quotes text and leaves None
an empty cell; TSV is one line per row in PostgreSQL COPY's text format: None is \\N, and a backslash, tab,
newline or carriage return in text is escaped as \\\\, \\t, \\n, \\r. JSON keeps the types: numbers are
numbers, booleans are booleans, None (and NaN) is null.

A stage's summary (rollout, profile, fit-cost, train) is data too: `emit_record` prints one record as a
two-column rich table on a terminal, and as a header and one row (csv, tsv) or one JSON object elsewhere,
with the same keys that scripts find in the artifact's metadata.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .common import UsageError, console, out, stdout_taken

FORMATS = ("table", "csv", "json", "tsv")
FORMAT_HELP = ("table, csv, json or tsv on stdout, in any case (default: table on a terminal, tsv in a "
               "pipe). With -o - stdout carries the artifact, and the summary is a table on stderr.")
FORMAT_METAVAR = f"[{'|'.join(FORMATS)}]"


def format_option():
    return typer.Option(None, "--format", "-f", metavar=FORMAT_METAVAR, help=FORMAT_HELP)


def resolve_format(fmt: str | None) -> str:
    if fmt is None:
        return "table" if sys.stdout.isatty() else "tsv"
    if fmt.lower() not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt.lower()


Render = Mapping[str, Callable[[object], str]]


def _plain(v: object) -> object:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def json_rows(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> list[dict]:
    """Rows of typed values as JSON-ready objects, one per row, keyed by the column names."""
    return [{c: _plain(v) for c, v in zip(columns, r)} for r in rows]


TSV_NULL = "\\N"
_TSV_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _text(v: object) -> str:
    """A value as the table shows it, for reading."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v).replace("\t", " ").replace("\n", " ")


def tsv_field(v: object) -> str:
    """A value as a TSV field that reads back as it was (PostgreSQL COPY's text format): None is \\N, a
    float its repr, any other value its text with backslash, tab, newline and carriage return escaped."""
    if v is None:
        return TSV_NULL
    if isinstance(v, float):
        return repr(float(v))
    return str(v).translate(_TSV_ESCAPES)


def _csv_field(v: object) -> object:
    """A value as the csv module should write it: None an empty cell, a float its repr."""
    if v is None:
        return ""
    return repr(float(v)) if isinstance(v, float) else v


FIELDS: dict[str, Callable[[object], object]] = {"table": _text, "csv": _csv_field, "tsv": tsv_field}


def _cell(column: str, v: object, render: Render | None, fmt: str = "table") -> object:
    """A value in `column` as `fmt` (table, csv or tsv) writes it: the column's renderer or yes/no for a
    boolean, in every text format, then the format's own form of the value."""
    if render and column in render:
        v = render[column](v)
    elif isinstance(v, bool):
        v = "yes" if v else "no"
    return FIELDS[fmt](v)


def tsv_line(values: Sequence[object], columns: Sequence[str] = (), render: Render | None = None) -> str:
    """One TSV row of typed values, newline included."""
    cells = (str(_cell(c, v, render, "tsv")) for c, v in zip(columns or [""] * len(values), values))
    return "\t".join(cells) + "\n"


def emit(columns: Sequence[str], rows: Sequence[Sequence[object]], fmt: str, title: str | None = None,
         left: Sequence[str] = (), to: Console | None = None, render: Render | None = None) -> None:
    """Print `rows` (typed values) under `columns` in `fmt` (already resolved); numbers are right-aligned
    in tables unless named in `left`; `render` gives a column its text form. A rich table goes to `to`
    (default stdout; stderr when stdout is taken), its headers and cells as Text: data is never markup."""
    if stdout_taken():  # `-o -`: stdout carries the artifact, so this goes to stderr as a table
        fmt, to = "table", console
    if fmt == "table":
        t = Table(title=title)
        for c in columns:
            t.add_column(Text(c), justify="left" if c in left else "right")
        for r in rows:
            t.add_row(*(Text(str(_cell(c, v, render))) for c, v in zip(columns, r)))
        (to or out).print(t)
    elif fmt == "json":
        sys.stdout.write(json.dumps(json_rows(columns, rows)) + "\n")
    elif fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([[_cell(c, v, render, "csv") for c, v in zip(columns, r)] for r in rows])
    else:
        sys.stdout.write("\t".join(map(tsv_field, columns)) + "\n")
        for r in rows:
            sys.stdout.write(tsv_line(r, columns, render))
    sys.stdout.flush()


def emit_record(record: Mapping[str, object], fmt: str, title: str | None = None,
                labels: Mapping[str, str] | None = None, render: Render | None = None) -> None:
    """Print one record: a field/value rich table (fields shown by `labels` where given), else the
    record's keys as the header of one row, or one JSON object."""
    if stdout_taken():
        fmt = "table"
    if fmt == "table":
        labels = labels or {}
        emit(("field", "value"), [[labels.get(k, k), _cell(k, v, render)] for k, v in record.items()], fmt,
             title=title, left=("field",))
    elif fmt == "json":
        sys.stdout.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
        sys.stdout.flush()
    else:
        emit(list(record), [list(record.values())], fmt, render=render)
