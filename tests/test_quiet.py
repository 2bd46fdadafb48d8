"""-q/--quiet on every command: stderr keeps its warnings and errors and drops progress, notes and the
summary; the files written and stdout's data are those of the same command without it."""

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import COMMANDS, app
from sparrow.schemas import write_artifact

runner = CliRunner()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_quiet(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0 and "--quiet" in result.output and "-q" in result.output


def test_quiet_prompts_write_the_same_file_and_say_nothing(tmp_path):
    quiet, loud = tmp_path / "q.parquet", tmp_path / "l.parquet"
    args = ["prompts", "--task", "chain_sum", "--n", "3", "--seed", "4"]
    said = runner.invoke(app, [*args, "-q", "-o", str(quiet)])
    assert said.exit_code == 0 and said.stderr == "" and said.stdout == ""
    told = runner.invoke(app, [*args, "-o", str(loud)])  # the next command in the process is not quiet
    assert told.exit_code == 0 and "wrote 3 chain_sum prompts" in told.stderr
    assert pq.read_table(quiet).equals(pq.read_table(loud))


def test_quiet_keeps_errors(tmp_path):
    result = runner.invoke(app, ["prompts", "-q", "--task", "nope", "--n", "2", "-o",
                                 str(tmp_path / "p.parquet")])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: unknown task 'nope'") and len(result.stderr.splitlines()) == 1


def test_quiet_keeps_warnings(tmp_path):
    rng = np.random.default_rng(0)
    prompts = write_artifact([{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
                               "prompt_token_ids": rng.integers(3, 500, 12).tolist(), "answer": "5",
                               "metadata": None} for i in range(2)], tmp_path / "p.parquet", "prompts")
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(prompts),
                                 "--max-new-tokens", "4", "--samples", "1", "-q", "-o", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("warning:") for line in lines), lines
    assert any("has no tokenizer" in line for line in lines) and out.exists()


def test_a_refused_command_line_does_not_leave_the_next_command_quiet(tmp_path):
    refused = runner.invoke(app, ["prompts", "-q", "--task", "chain_sum", "--bogus", "-o",
                                  str(tmp_path / "x.parquet")])
    assert refused.exit_code == 2 and refused.stderr.startswith("error: no such option: --bogus")
    told = runner.invoke(app, ["prompts", "--task", "chain_sum", "--n", "1", "-o",
                               str(tmp_path / "p.parquet")])
    assert told.exit_code == 0 and "wrote 1 chain_sum prompts" in told.stderr


def test_a_stage_note_reaches_stderr_where_no_logger_takes_it(capsys, monkeypatch):
    """A script that uses the stages without the CLI (no handler on the `sparrow` logger) still hears a
    prompt set's note."""
    import logging

    from sparrow.stages.core import notes

    logger = logging.getLogger("sparrow")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(notes, "_SAID", set())
    notes.note("the prompts go in as plain text")
    assert capsys.readouterr().err == "note: the prompts go in as plain text\n"


def test_quiet_keeps_the_line_of_a_stopped_command(capsys, monkeypatch):
    """Ctrl-C or SIGTERM under -q still says what was kept and how to go on (exit 128 + the signal)."""
    import signal

    from sparrow.cli.console import console
    from sparrow.cli.errors import stopped

    monkeypatch.setattr(console, "quiet", True)
    with pytest.raises(SystemExit) as stop:
        stopped(signal.SIGTERM, "12 prompts were journaled; --resume continues")
    assert stop.value.code == 143
    assert capsys.readouterr().err == "terminated; 12 prompts were journaled; --resume continues\n"
    assert console.quiet  # what the command asked for stands until the command ends


def test_a_note_a_quiet_command_dropped_is_said_by_the_next_command(capsys):
    """Stage notes go once per command, not once per process: -q on one command does not silence them for
    the commands after it in the same process."""
    from sparrow.cli.app import _this_command_only
    from sparrow.cli.console import console
    from sparrow.stages.core.notes import note

    message = "the prompts of q.parquet go in as plain text"
    with _this_command_only():
        console.quiet = True
        note(message)
    assert capsys.readouterr().err == ""
    with _this_command_only():
        note(message)
        note(message)  # train reads its prompts more than once: said once
    assert capsys.readouterr().err == f"note: {message}\n"
