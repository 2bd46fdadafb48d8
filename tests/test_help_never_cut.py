"""--help at any width shows every option name whole and cuts nothing to "...": in a pipe or a log (80
columns), at 60 and 40 columns. The names expected are the click command's own (its options' names and
negative names, and the other names `take_aliases` moved into the help), independent of the rendering."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from sparrow.cli.app import app

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


@pytest.mark.parametrize("width", WIDTHS)
def test_the_top_level_help_cuts_nothing(width):
    r = runner.invoke(app, ["--help"], env={"COLUMNS": width})
    assert r.exit_code == 0 and "…" not in r.stdout
    assert all(_shown_whole(name, r.stdout) for name in GROUP.commands)
    assert all(_shown_whole(n, r.stdout) for n in ("--version", "--help", "-h"))
