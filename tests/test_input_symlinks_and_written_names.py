"""A prompts file that is a broken symlink is said as one (where it leads, or that it loops), not as a file
that is missing; and `sparrow sql -o`'s "wrote" line escapes a newline in the output's name, as every
message does."""

from __future__ import annotations

import os

from typer.testing import CliRunner

from sparrow.cli.app import app

from cli_checks import error_line

runner = CliRunner()


def test_a_broken_prompts_symlink_says_where_it_leads(tmp_path):
    os.symlink(tmp_path / "gone.parquet", tmp_path / "dangling.parquet")
    os.symlink(tmp_path / "loop.parquet", tmp_path / "loop.parquet")
    line = error_line(runner.invoke(app, ["rollout", "--prompts", str(tmp_path / "dangling.parquet"),
                                          "-o", str(tmp_path / "r.parquet")]))
    assert line == (f"error: the prompts file {tmp_path / 'dangling.parquet'} is a symlink to "
                    f"{tmp_path / 'gone.parquet'}, which does not exist")
    line = error_line(runner.invoke(app, ["rollout", "--prompts", str(tmp_path / "loop.parquet"),
                                          "-o", str(tmp_path / "r.parquet")]))
    assert line.endswith("loop.parquet is a symlink that loops back on itself")
    assert not (tmp_path / "r.parquet").exists()


def test_the_sql_wrote_line_escapes_a_newline_in_the_name(tmp_path):
    (tmp_path / "run").mkdir()
    out = tmp_path / "a\nb.parquet"
    r = runner.invoke(app, ["sql", "SELECT 1 AS x", "--run", str(tmp_path / "run"), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.exists()
    assert f"wrote 1 row x 1 column to {tmp_path}/a\\nb.parquet" in r.output
