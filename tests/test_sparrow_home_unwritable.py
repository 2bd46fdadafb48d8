"""A $SPARROW_HOME that cannot be written (read-only, full) is one sentence naming it when something must be
built there, never a traceback."""

from __future__ import annotations

import os
import stat

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app

from cli_checks import error_line

runner = CliRunner()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_an_unwritable_home_without_the_cache_is_one_sentence(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv("SPARROW_HOME", str(home))
    line = error_line(runner.invoke(app, ["prompts", "--task", "chain_sum", "--n", "2",
                                          "-o", str(tmp_path / "p.parquet")]))
    assert "SPARROW_HOME" in line and str(home) in line
    assert not (tmp_path / "p.parquet").exists()


def test_a_failed_build_names_the_folder_and_the_variable(tmp_path, monkeypatch):
    """As root (where permissions do not stop a write), the build itself is made to fail as a read-only
    file system fails it."""
    import sparrow.stages.model.loading as loading

    def read_only(folder):
        raise OSError(30, "Read-only file system", str(folder))

    monkeypatch.setenv("SPARROW_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loading, "_build_embedded", read_only)
    line = error_line(runner.invoke(app, ["prompts", "--task", "chain_sum", "--n", "2",
                                          "-o", str(tmp_path / "p.parquet")]))
    assert "Read-only file system" in line and "SPARROW_HOME" in line
    assert not (tmp_path / "p.parquet").exists()
