"""Tables that fit their reader: a rich table on a terminal, complete plain text anywhere else.

Every command that prints a table takes `--format table|csv|json|tsv`. Without it, stdout decides: a
terminal gets the rich table, a pipe or a file gets TSV (every row, every value as it is: greppable, and
readable by `cut`, `sort`, PostgreSQL's COPY and DuckDB's read_csv). Data goes to stdout, messages to
stderr.

Rows hold typed values, one value per cell (numbers, booleans, None, text). The text formats (table,
csv, tsv) share the rendering of a value where it is a choice: a column's renderer where the command
gives one (a budget of None shown as "dense", a parameter count as "134.5M"), else yes/no for booleans.
They differ where a reader needs it. The table is for reading: floats to 6 significant digits, None an
empty cell, tabs and newlines in text shown as spaces, and no cell cut short (`print_table`). CSV and TSV
are for machines and lose nothing: floats in their shortest form that reads back to the same number
(repr). CSV quotes text and leaves None an empty cell; TSV is one line per row in PostgreSQL COPY's
text format: None is \\N, and a backslash, tab, newline or carriage return in text is escaped as \\\\,
\\t, \\n, \\r. JSON keeps the types: numbers are numbers, booleans are booleans, None (and NaN) is null.

A stage's summary (rollout, profile, fit-cost, train) is data too: `emit_record` prints one record as a
two-column rich table on a terminal, and as a header and one row (csv, tsv) or one JSON object elsewhere,
with the same keys that scripts find in the artifact's metadata.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import typer
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from .console import UNBOUNDED_WIDTH, console, drop_stream, is_terminal, out, stdout_taken, writing_stdout
from .errors import UsageError

FORMATS = ("table", "csv", "json", "tsv")
FORMAT_HELP = ("table, csv, json or tsv on stdout, case-insensitive (default: table on a terminal, tsv in a "
               "pipe).")
ARTIFACT_FORMAT_HELP = (f"{FORMAT_HELP} With -o -, stdout carries the artifact and this output goes to "
                        "stderr as a table (-f then changes nothing).")
FORMAT_METAVAR = f"[{'|'.join(FORMATS)}]"


def format_option(artifact: bool = True):
    """--format/-f of a command that prints a table; `artifact`: the command writes one with -o, which
    takes stdout with -o - (its help then says where the table goes)."""
    return typer.Option(None, "--format", "-f", metavar=FORMAT_METAVAR,
                        help=ARTIFACT_FORMAT_HELP if artifact else FORMAT_HELP)


def resolve_format(fmt: str | None) -> str:
    if fmt is None:
        return "table" if is_terminal(sys.stdout) else "tsv"
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
    return one_line(str(v))


def one_line(text: str) -> str:
    """Text as a table cell shows it: tabs and line breaks as spaces, so that a row stays one line."""
    return text.translate(_ONE_LINE)


_ONE_LINE = str.maketrans({"\t": " ", "\n": " ", "\r": " "})


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
        print_table(t, to or out)
    elif fmt == "json":
        write_out(json.dumps(json_rows(columns, rows)) + "\n")
    elif fmt == "csv":
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([[_cell(c, v, render, "csv") for c, v in zip(columns, r)] for r in rows])
        write_out(text.getvalue())
    else:
        write_out("".join(["\t".join(map(tsv_field, columns)) + "\n",
                           *(tsv_line(r, columns, render) for r in rows)]))


def write_out(text: str) -> None:
    """`text` on stdout, flushed. A reader that stops early (`| head`) is not a failure (app.main): the rest
    goes to /dev/null and the command carries on. Any other failure (a full disk, a closed stdout) is
    StdoutFailed: one sentence and exit 2."""
    try:
        with writing_stdout():
            sys.stdout.write(text)
            sys.stdout.flush()
    except BrokenPipeError:
        drop_stream(sys.stdout)


# ---------------------------------------------------------------- tables for reading

def print_table(table: Table, to: Console) -> None:
    """A rich table that loses nothing: no cell is ever cut to "..." and no column is dropped. Anywhere but
    a terminal the console has no width (console.MessageConsole), so the table is as wide as its cells. On a
    terminal a table wider than it is fitted (`fit_table`): headers fold first, then the table drops its
    box, and only then do cells fold, the first (key) column last. A table whose columns cannot all fit
    even one character wide (or a terminal of no usable width, COLUMNS=0) is printed as wide as its cells,
    uncropped: the terminal wraps its lines, where rich would leave columns out."""
    for column in table.columns:
        column.overflow = "fold"
    if to.is_terminal and not fit_table(table, to, to.width):
        with _as_wide_as(to, _natural_width(table, to)):
            to.print(table)
        return
    to.print(table)


@contextmanager
def _as_wide_as(console: Console, width: int) -> Iterator[None]:
    """`console` `width` cells wide while in the block, then as it was: rich prints nothing below one cell
    and crops every line to the console's width, so a table wider than the terminal needs a wider console."""
    saved = console._width  # None: the terminal's own width, read at each print
    console.width = width
    try:
        yield
    finally:
        console._width = saved


COMPACT = {"box": box.SIMPLE_HEAD, "show_edge": False, "padding": 0, "pad_edge": False}  # one space apart


def fit_table(table: Table, console: Console, width: int) -> bool:
    """Set `table`'s columns (and, where needed, its style) so it fits `width`, in this order of
    preference: as it is; its headers folded to the width of their cells; the same without a box
    (COMPACT); and last, cells folded too but the first column's kept whole where it leaves room. False
    where not every column fits even one character wide (a width below 1 never fits)."""
    if width < 1:
        return False
    if _natural_width(table, console) <= width or _fold_headers(table, console, width):
        return True
    for name, value in COMPACT.items():
        setattr(table, name, value)
    if _natural_width(table, console) <= width or _fold_headers(table, console, width):
        return True
    overhead = _overhead(table, console)
    if overhead + len(table.columns) > width:
        return False
    key = _widths(table, console)[0][0]
    if key + overhead + len(table.columns) - 1 <= width:
        table.columns[0].width = key
    return True


def _widths(table: Table, console: Console) -> tuple[list[int], list[int]]:
    """Each column's widest cell and its header's width, in cells of the terminal."""
    def measure(renderable) -> int:
        return Measurement.get(console, console.options, renderable).maximum

    cells = [max([1, *(measure(c) for c in column.cells)]) for column in table.columns]
    return cells, [measure(column.header) for column in table.columns]


def _natural_width(table: Table, console: Console) -> int:
    return Measurement.get(console, console.options.update_width(UNBOUNDED_WIDTH), table).maximum


def _overhead(table: Table, console: Console) -> int:
    """What the table's box and padding take beside its columns' text."""
    cells, headers = _widths(table, console)
    return _natural_width(table, console) - sum(map(max, cells, headers))


def _fold_headers(table: Table, console: Console, width: int) -> bool:
    """Each column as wide as its widest cell, the room left over given to the headers that fold into the
    most lines; False (the table unchanged) if the cells alone do not fit."""
    cells, headers = _widths(table, console)
    spare = width - _overhead(table, console) - sum(cells)
    if spare < 0:
        return False
    widths = list(cells)
    for _ in range(spare):
        lines = [-(-h // w) for h, w in zip(headers, widths)]
        if max(lines) == 1:
            break
        widest = max(range(len(widths)), key=lambda i: (lines[i], headers[i]))
        widths[widest] += 1
    for column, w in zip(table.columns, widths):
        column.width = w
    return True


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
        write_out(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
    else:
        emit(list(record), [list(record.values())], fmt, render=render)
