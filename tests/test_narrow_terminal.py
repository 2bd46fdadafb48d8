"""A terminal too narrow for a table: every column is still printed, whole where the table cannot fit.

The tables go through the CLI's own path (`sparrow sql`, `sparrow models` with the table format on a
terminal console of a given width). Expected values are the ones put in: the column names and values
written into the query, and the preset names and shapes of `stages.model.presets`.
"""

from __future__ import annotations

import io
import re

import pytest
from rich.cells import cell_len
from typer.testing import CliRunner

from sparrow.cli import output, sql
from sparrow.cli.app import app
from sparrow.cli.console import MessageConsole
from sparrow.stages.model.presets import PRESETS

runner = CliRunner()
WIDTHS = [80, 20, 1, 0]
WORD = re.compile(r"[^\s\u2500-\u257f]+")  # text between spaces and box-drawing characters


def _terminal(width: int) -> MessageConsole:
    """A terminal of `width` columns (as COLUMNS=width sets it) that writes into a string."""
    return MessageConsole(file=io.StringIO(), force_terminal=True, width=width, color_system=None)


def _words(text: str) -> set[str]:
    return set(WORD.findall(text))


def _headers(text: str) -> set[str]:
    """The headers of a table printed under a one-line title, each put back together where it folds: the
    header is the lines of text down to the first rule, a column a run of positions that are not blank
    (space or box) on some line of the header or the rows."""
    lines = [line for line in text.splitlines()[1:] if line.strip()]
    first = next(i for i, line in enumerate(lines) if WORD.search(line))
    rule = next(i for i in range(first, len(lines)) if not WORD.search(lines[i]))
    header = lines[first:rule]
    grid = [line for line in lines if WORD.search(line)]
    size = max(map(len, grid))
    used = "".join("1" if any(WORD.match(line.ljust(size)[i]) for line in grid) else "0" for i in range(size))
    return {"".join(line.ljust(size)[m.start():m.end()].strip() for line in header)
            for m in re.finditer("1+", used)}


@pytest.mark.parametrize("width", WIDTHS)
def test_a_43_column_query_shows_every_column_whole(monkeypatch, tmp_path, width):
    names = [f"c{i}" for i in range(1, 43)] + ["z"]
    values = [str(1000 + i) for i in range(43)]
    query = "SELECT " + ", ".join(f"{v} AS {n}" for n, v in zip(names, values))
    terminal = _terminal(width)
    monkeypatch.setattr(sql, "out", terminal)
    result = runner.invoke(app, ["sql", query, "--run", str(tmp_path), "-f", "table"])
    assert result.exit_code == 0, result.output
    words = _words(terminal.file.getvalue())
    assert set(names) <= words
    assert set(values) <= words


@pytest.mark.parametrize("width", WIDTHS)
def test_the_models_table_shows_every_column_whole(monkeypatch, width):
    terminal = _terminal(width)
    monkeypatch.setattr(output, "out", terminal)
    result = runner.invoke(app, ["models", "-f", "table"])
    assert result.exit_code == 0, result.output
    words = _words(terminal.file.getvalue())
    headers = {"preset", "arch", "layers", "hidden", "q_heads", "kv_heads", "head_dim", "ffn", "vocab",
               "tied", "params", "kv_kib_per_token_bf16", "weights"}
    assert _headers(terminal.file.getvalue()) == headers
    for p in PRESETS.values():
        c = p.config
        shapes = [c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                  c.vocab_size]
        assert {p.name, c.arch, *WORD.findall(p.weights), *map(str, shapes)} <= words


def test_a_table_that_fits_folds_to_the_terminal():
    terminal = _terminal(24)
    output.emit(["first_header", "second_header"], [["alpha", "beta"]], "table", to=terminal)
    shown = terminal.file.getvalue()
    assert max(cell_len(line) for line in shown.splitlines()) <= 24
    assert {"alpha", "beta"} <= _words(shown)
