"""`plan-schedule --sweep` followed by another option (`--sweep -f json`: its list forgotten) is refused in
one sentence naming what it got, not read as the list with the option's value left over."""

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app

from cli_checks import error_line

runner = CliRunner()


@pytest.mark.parametrize("args, got", [(["--sweep", "-f", "json"], "-f"), (["--sweep=-0.5"], "-0.5"),
                                       (["--sweep", "--threshold", "0.5"], "--threshold")])
def test_a_sweep_value_that_is_an_option_is_refused(args, got):
    line = error_line(runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", *args]))
    assert line == f"error: --sweep needs a comma-separated list of thresholds, got '{got}'"


def test_a_sweep_list_still_plans():
    r = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--sweep", "0.8,0.9", "-f", "json"])
    assert r.exit_code == 0, r.output
    assert '"frontier"' in r.stdout
