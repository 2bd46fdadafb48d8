"""--help at any width shows every option name whole and cuts nothing to "...": in a pipe or a log (80
columns), at 60 and 40 columns. The names expected are the click command's own (its options' names and
negative names, and the other names `take_aliases` moved into the help), independent of the rendering.
A typer whose private panel printers are gone or print another table gets its own layout, never a crash."""

from __future__ import annotations

import re

import pytest
import typer
from rich.panel import Panel
from rich.table import Table
from typer import rich_utils
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.cli.help_layout import whole_help_cells

runner = CliRunner()
GROUP = typer.main.get_command(app)
WIDTHS = ["80", "60", "40"]


def _names(command) -> set[str]:
    names = {n for p in command.params if not p.hidden for n in (*p.opts, *getattr(p, "secondary_opts", ()))
             if n.startswith("-")}
    return names | {n for others in getattr(command, "aliases", {}).values() for n in others}


def _shown_whole(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(GROUP.commands))
def test_every_option_name_is_whole_and_nothing_is_cut(name, width):
    r = runner.invoke(app, [name, "--help"], env={"COLUMNS": width})
    assert r.exit_code == 0, r.output
    assert "…" not in r.stdout, "\n".join(line for line in r.stdout.splitlines() if "…" in line)
    missing = sorted(n for n in _names(GROUP.commands[name]) if not _shown_whole(n, r.stdout))
    assert not missing, f"sparrow {name} --help at {width} columns: {missing}"
    assert max(len(line) for line in r.stdout.splitlines()) <= int(width)


@pytest.mark.parametrize("width", ["0", "1", "20"])
@pytest.mark.parametrize("name", ["rollout", "train"])
def test_narrower_than_40_columns_help_is_laid_out_at_40(name, width):
    """At COLUMNS=0 rich prints nothing, and below 40 no name fits beside its help: the help is laid out
    at 40 columns, every name whole, and the terminal wraps its lines."""
    r = runner.invoke(app, [name, "--help"], env={"COLUMNS": width})
    assert r.exit_code == 0 and "…" not in r.stdout
    assert not [n for n in _names(GROUP.commands[name]) if not _shown_whole(n, r.stdout)]
    assert max(len(line) for line in r.stdout.splitlines()) == 40


@pytest.mark.parametrize("width", WIDTHS)
def test_the_top_level_help_cuts_nothing(width):
    r = runner.invoke(app, ["--help"], env={"COLUMNS": width})
    assert r.exit_code == 0 and "…" not in r.stdout
    assert all(_shown_whole(name, r.stdout) for name in GROUP.commands)
    assert all(_shown_whole(n, r.stdout) for n in ("--version", "--help", "-h"))


def test_the_top_level_help_lists_each_command_on_one_line_at_80_columns():
    """A command's line in `sparrow --help` is its summary, one sentence; its own --help says the rest."""
    r = runner.invoke(app, ["--help"], env={"COLUMNS": "80"})
    rows = [line for line in r.stdout.splitlines() if line.startswith("│ ")]
    listed = {line.split()[1]: line for line in rows if line.split()[1] in GROUP.commands}
    assert set(listed) == set(GROUP.commands)
    assert len(rows) == len(GROUP.commands) + 2, r.stdout  # the options panel's --version and --help
    assert all(line.rstrip(" │").endswith(".") for line in listed.values()), r.stdout


PRINTERS = ("_print_options_panel", "_print_commands_panel")


def test_this_typer_has_the_panel_printers_that_help_lays_out():
    """Without them --help still prints (typer's layout, cut to "..."); a typer that renamed them fails
    here, not in front of a user."""
    assert all(callable(getattr(rich_utils, name, None)) for name in PRINTERS)


def test_a_typer_without_the_private_panel_printers_is_left_alone(monkeypatch):
    for name in PRINTERS:
        monkeypatch.delattr(rich_utils, name)
    with whole_help_cells():
        assert not any(hasattr(rich_utils, name) for name in PRINTERS)
    assert not any(hasattr(rich_utils, name) for name in PRINTERS)


def test_an_options_table_of_another_shape_is_printed_as_typer_made_it(monkeypatch):
    """A typer release whose options table has 3 columns: at 40 columns, where Sparrow would stack typer's
    7 columns, --help prints typer's table as it is."""

    def three_columns(*, name, params, ctx, markup_mode, console):
        table = Table(show_header=False, expand=True)
        for _ in range(3):
            table.add_column()
        for param in params:
            table.add_row(param.opts[0], "TEXT", "the option's help")
        console.print(Panel(table, title=name))

    monkeypatch.setattr(rich_utils, "_print_options_panel", three_columns)
    r = runner.invoke(app, ["sql", "--help"], env={"COLUMNS": "40"})
    assert r.exit_code == 0, r.output
    assert _shown_whole("--run", r.stdout)
