"""What every CLI refusal must look like: a non-zero exit and exactly one stderr line, "error: ..."."""

from __future__ import annotations


def error_line(result) -> str:
    """The single stderr line of a refused command (typer's CliRunner result)."""
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def passed_the_checks(result) -> bool:
    """Under conftest's `no_work`: the command got past every refusal to the model's loading."""
    return isinstance(result.exception, AssertionError) and "a model was loaded" in str(result.exception)
