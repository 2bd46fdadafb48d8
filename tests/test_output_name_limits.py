"""Output names as long as the file system takes: every legal name is written (its hidden temporaries
too), a longer one is refused in one sentence before any work, and a failed write never ends in a
traceback of its own cleanup. The limit compared against is the kernel's, by creating the file itself."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import ArtifactError, artifact_kind, read_artifact, write_artifact
from sparrow.schemas.io import leftovers, replace_dir, write_table

from cli_checks import error_line

runner = CliRunner()
PLAN = ["plan-schedule", "--model", "qwen3-4b"]  # the reference profile: no input file, no model load


def kernel_takes(folder: Path, name: str) -> bool:
    """Whether this file system creates a file of `name` in `folder` (the independent check)."""
    try:
        (folder / name).touch()
    except OSError as e:
        assert e.errno == errno.ENAMETOOLONG
        return False
    (folder / name).unlink()
    return True


@pytest.fixture()
def no_planning(monkeypatch):
    """Fails the test if plan-schedule gets as far as planning: refusals must come first."""
    import sparrow.stages.plan as plan

    def refuse(*a, **k):
        raise AssertionError("the plan was made before the refusal")

    monkeypatch.setattr(plan, "plan_schedule", refuse)


def test_a_248_byte_name_is_written_with_nothing_left_beside_it(tmp_path):
    name = "s" * 240 + ".parquet"
    assert kernel_takes(tmp_path, name)  # legal, but too long to take `.NAME.<hex>-<pid>.tmp` marks
    r = runner.invoke(app, [*PLAN, "-o", str(tmp_path / name)])
    assert r.exit_code == 0, r.output
    assert artifact_kind(tmp_path / name) == "schedule"
    assert os.listdir(tmp_path) == [name]
    again = runner.invoke(app, [*PLAN, "--threshold", "0.9", "-o", str(tmp_path / name)])  # replaced in place
    assert again.exit_code == 0, again.output
    assert os.listdir(tmp_path) == [name]


@pytest.mark.parametrize("where", ["name", "folder"])
def test_a_300_byte_name_is_one_sentence_before_any_work(tmp_path, where, no_planning):
    long = "s" * 300 + ".parquet"
    assert not kernel_takes(tmp_path, long)
    out = tmp_path / long if where == "name" else tmp_path / long / "s.parquet"
    line = error_line(runner.invoke(app, [*PLAN, "-o", str(out)]))
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    assert line.startswith("error: -o ") and "308 bytes" in line and f"at most {limit} bytes" in line, line
    assert "choose a shorter name" in line
    assert os.listdir(tmp_path) == []


def test_a_300_byte_export_name_is_one_sentence(tmp_path, no_planning):
    line = error_line(runner.invoke(app, [*PLAN, "--export", "json", "--export-to",
                                          str(tmp_path / ("s" * 300 + ".json"))]))
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    assert line.startswith("error: --export-to ") and f"at most {limit} bytes" in line, line


def test_the_write_helpers_take_every_legal_name(tmp_path):
    for length in (229, 240, 255):
        name = "r" * (length - len(".parquet")) + ".parquet"
        assert kernel_takes(tmp_path, name)
        write_artifact({"prompt_id": ["a"], "task": ["t"], "prompt": ["x"], "prompt_token_ids": [[1, 2]],
                        "answer": ["1"], "metadata": [None]}, tmp_path / name, "prompts")
        assert read_artifact(tmp_path / name, "prompts").column("prompt_id").to_pylist() == ["a"]
        folder = tmp_path / ("d" * length)
        replace_dir(folder, lambda d: (d / "one.txt").write_text("1"))
        replace_dir(folder, lambda d: (d / "two.txt").write_text("2"))  # an old version moved aside
        assert sorted(os.listdir(folder)) == ["two.txt"]
        assert sorted(os.listdir(tmp_path)) == sorted([name, folder.name])
        assert leftovers(folder) == ([], [])
        (tmp_path / name).unlink()
        (folder / "two.txt").unlink()
        folder.rmdir()


def test_a_killed_writers_temporary_of_a_long_name_is_found_and_removed(tmp_path):
    """A temporary of a long name (named by a digest of it) left by a dead process is removed by the next
    write of that name, as a short name's is."""
    import pyarrow as pa

    target = tmp_path / ("q" * 240 + ".parquet")
    write_table(pa.table({"a": [1]}), target)
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    from sparrow.schemas.io import temporary

    left = temporary(target, "tmp")
    left = left.with_name(left.name.replace(f"-{os.getpid()}.", f"-{dead}."))
    left.write_bytes(b"half")
    assert leftovers(target)[0] == [left]
    write_table(pa.table({"a": [2]}), target)
    assert sorted(os.listdir(tmp_path)) == [target.name]


def test_a_failed_write_is_one_error_even_when_its_cleanup_fails(tmp_path, monkeypatch):
    """The write fails (ENOSPC), and removing its temporary fails too: the error is the write's."""
    import pyarrow as pa

    import sparrow.schemas.io as io

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    def stuck(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(io.os, "fsync", full)
    monkeypatch.setattr(io, "_remove", stuck)
    with pytest.raises(ArtifactError, match=r"cannot write .*\(No space left on device\)"):
        write_table(pa.table({"a": [1]}), tmp_path / "t.parquet")
    with pytest.raises(ArtifactError, match=r"cannot write .*\(No space left on device\)"):
        replace_dir(tmp_path / "d", lambda d: full())
    assert not (tmp_path / "t.parquet").exists() and not (tmp_path / "d").exists()
