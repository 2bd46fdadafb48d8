"""The CLI as a pipeline component: tables that never cut a cell, a reader that stops early, option names
the docs list, `-f` help true to each command, paths fixed as the command line is read, and sampler specs
in any case.

Expected values come from outside the code under test: the presets' names (PRESETS), the option-name
table of docs/commands.md, the files a command is asked to write, and the exit status and stderr of a
real `sparrow` process whose stdout reader is gone.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from rich.cells import cell_len
from rich.table import Table
from rich.text import Text
from typer.testing import CliRunner

from sparrow.cli import output
from sparrow.cli.app import app
from sparrow.cli.console import MessageConsole
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.model.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
SPARROW = ROOT / ".venv" / "bin" / "sparrow"
runner = CliRunner()
COMMANDS = typer.main.get_command(app).commands


def _terminal(width: int) -> MessageConsole:
    """A terminal console of `width` columns that writes into a string."""
    return MessageConsole(file=io.StringIO(), force_terminal=True, width=width, color_system=None)


# ---------------------------------------------------------------- tables: no cell is cut


@pytest.mark.parametrize("width", [80, 120])
def test_models_on_a_terminal_shows_every_preset_name_whole(monkeypatch, width):
    terminal = _terminal(width)
    monkeypatch.setattr(output, "out", terminal)
    result = runner.invoke(app, ["models", "-f", "table"])
    assert result.exit_code == 0, result.output
    shown = terminal.file.getvalue()
    lines = shown.splitlines()
    assert "…" not in shown
    assert max(cell_len(line) for line in lines) <= width
    for name in PRESETS:  # each on a row of its own, whole, as the first cell
        assert any(re.match(rf"^\W*{re.escape(name)}\s", line) for line in lines), (name, shown)


def test_a_table_into_a_pipe_is_as_wide_as_its_cells():
    result = runner.invoke(app, ["models", "-f", "table"])  # stdout is not a terminal here
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    assert "kv_kib_per_token_bf16" in result.stdout  # the widest header, unfolded
    for name in PRESETS:
        assert f" {name} " in result.stdout


def test_a_sql_table_into_a_pipe_is_not_cut_at_80_columns(tmp_path):
    values = [f"value_{i}_" + "x" * 20 for i in range(6)]
    query = "SELECT " + ", ".join(f"'{v}' AS column_{i}" for i, v in enumerate(values))
    result = runner.invoke(app, ["sql", query, "--run", str(tmp_path), "-f", "table"])
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    assert all(v in result.stdout for v in values)


def test_a_table_too_wide_for_the_terminal_folds_but_keeps_its_first_column_whole():
    key = "a-long-first-column-key"
    table = Table(title="wide")
    for i in range(8):
        table.add_column(Text(f"column_number_{i}"))
    table.add_row(Text(key), *(Text(f"cell-{i}-" + "y" * 12) for i in range(1, 8)))
    terminal = _terminal(60)
    output.print_table(table, terminal)
    shown = terminal.file.getvalue()
    assert "…" not in shown
    assert max(cell_len(line) for line in shown.splitlines()) <= 60
    assert key in shown
    drawn = Counter(c for c in shown if not c.isspace() and not "\u2500" <= c <= "\u257f")  # no box
    written = Counter("wide" + "".join(f"column_number_{i}" for i in range(8)) + key
                      + "".join(f"cell-{i}-" + "y" * 12 for i in range(1, 8)))
    assert drawn == written  # every character of every header and cell, folded but none lost


# ---------------------------------------------------------------- a reader that stops early


def _reader_gone(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`sparrow ARGS` whose stdout is a pipe closed before it writes: the exit status and stderr."""
    proc = subprocess.Popen([str(SPARROW), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    return subprocess.CompletedProcess(args, proc.wait(), "", stderr)


@pytest.mark.parametrize("args", [*(("models", "-f", fmt) for fmt in ("tsv", "table", "json", "csv")),
                                  ("--version",)])
def test_printing_into_a_closed_pipe_exits_0_silently(tmp_path, args):
    r = _reader_gone(*args, cwd=tmp_path)
    assert (r.returncode, r.stderr) == (0, "")


def test_a_command_whose_reader_stops_early_writes_its_artifact_and_says_so(tmp_path):
    r = _reader_gone("plan-schedule", "--model", "qwen3-4b", "-o", "s.parquet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "error" not in r.stderr and "wrote" in r.stderr  # the messages after the table still come
    assert read_artifact(tmp_path / "s.parquet", "schedule").num_rows > 0


# ---------------------------------------------------------------- option names


def _docs_aliases() -> list[tuple[str, list[str]]]:
    """(option, its other names) of each row of docs/commands.md's "Option names" table with any."""
    text = (ROOT / "docs" / "commands.md").read_text()
    section = text.split("## Option names", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("idea", "---"):
            names = re.findall(r"`(--[a-z-]+)`", cells[1])
            others = re.findall(r"`(--[a-z-]+)`", cells[2])
            if others:
                rows.append((names[-1], others))
    return rows


PROMPTS = ["--prompts", "p.parquet", "-o", "x"]
REQUIRED = {"prompts": ["--task", "basic_arithmetic", "-o", "x"], "rollout": PROMPTS, "profile": PROMPTS,
            "train": PROMPTS, "distill": PROMPTS, "fit-cost": ["-o", "x"],
            "reward": ["--prompts", "p.parquet", "--completions", "c.parquet", "-o", "x"],
            "calibrate-threshold": ["--profile", "m.parquet", "-o", "x"], "sql": ["SELECT 1"],
            "report": ["run"]}
VALUES = {"--output": "out.parquet"}


def _parsed(command: str, *args: str) -> dict:
    cmd = COMMANDS[command]
    return cmd.make_context(command, [*REQUIRED.get(command, []), *args]).params


def _param_of(command: str, flag: str):
    return next((p for p in COMMANDS[command].params if flag in p.opts), None)


def test_every_alias_the_docs_list_names_the_same_option_on_every_command_with_it():
    rows = _docs_aliases()
    assert ("--max-num-seqs", ["--max-batch", "--batch-size", "--batch"]) in rows
    assert ("--output", ["--output-dir"]) in rows
    checked = 0
    for primary, others in rows:
        for command in COMMANDS:
            param = _param_of(command, primary)
            if param is None:
                continue
            value = [] if param.is_flag else [VALUES.get(primary, "3")]  # a switch takes none
            expected = _parsed(command, primary, *value)[param.name]
            declared = {n for p in COMMANDS[command].params if p is not param for n in p.opts}
            for other in others:
                if param.is_flag and other not in COMMANDS[command].aliases.get(param, ()):
                    continue  # a switch answers only to its own aliases (fit-cost's --speculate is no K)
                if other in declared:
                    continue  # a name the command gives another option (train refuses --batch-size)
                assert _parsed(command, other, *value)[param.name] == expected, (command, other)
                checked += 1
    assert checked >= 30


def test_distill_keeps_its_batch_size_and_each_help_says_what_the_name_means():
    assert _parsed("distill", "--batch-size", "3")["batch_size"] == 3
    assert _param_of("distill", "--max-num-seqs") is None  # distill decodes nothing together
    assert "--batch-size is its older name here" in _param_of("distill", "--trajectories-per-step").help
    for command in ("rollout", "profile", "plan-schedule"):
        assert "Also --max-batch, --batch-size, --batch." in _param_of(command, "--max-num-seqs").help
    assert "not Ray workers" in _param_of("reward", "--workers").help


def test_aliases_reach_the_artifact(tmp_path):
    prompts = write_artifact([{"prompt_id": "p0", "task": "test", "prompt": None, "answer": None,
                               "metadata": None, "prompt_token_ids": [5, 6, 7, 8]}],
                             tmp_path / "p.parquet", "prompts")
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(prompts),
                                 "--num-generations", "2", "--max-completion-length", "3", "--batch-size",
                                 "2", "--output-dir", str(out), "-f", "json"])
    assert result.exit_code == 0, result.output
    table = read_artifact(out, "rollouts")
    assert table.num_rows == 2 and all(len(t) == 3 for t in table.column("token_ids").to_pylist())


# ---------------------------------------------------------------- -f help, true to each command

WITH_ARTIFACT_ON_STDOUT = {"calibrate-threshold", "fit-cost", "plan-schedule", "profile", "rollout", "reward"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_format_help_speaks_of_o_dash_only_where_the_artifact_can_take_stdout(command):
    param = _param_of(command, "--format")
    if param is None:
        return
    assert ("-o -" in param.help) == (command in WITH_ARTIFACT_ON_STDOUT), param.help


# ---------------------------------------------------------------- paths fixed as the command line is read

WANDERER = """
import os
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    os.chdir({elsewhere!r})
    return 1.0
"""


def test_a_reward_function_that_changes_directory_moves_no_output(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "fns.py").write_text(WANDERER.format(elsewhere=str(elsewhere)))
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
         "extra_info": {"split": "train", "index": 0}}]), tmp_path / "verl.parquet")
    completions = [{"prompt_id": "verl-0", "sample": s, "text": t} for s, t in enumerate(["5", "4"])]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in completions))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["reward", "--prompts", "verl.parquet", "--completions", "c.jsonl",
                                 "--reward-fn", "fns.py:compute_score", "-o", "out.parquet", "-f", "json"])
    assert result.exit_code == 0, result.output
    assert Path.cwd() == tmp_path  # the function's move is undone when it returns
    assert read_artifact(tmp_path / "out.parquet", "rewards").num_rows == 2
    assert list(elsewhere.iterdir()) == []
    assert "wrote 2 rewards to out.parquet" in result.stderr


# ---------------------------------------------------------------- specs and names in any case


def test_a_sampler_spec_kind_takes_any_case_and_its_path_keeps_its_own():
    assert _parsed("profile", "--sampler", "SNAPKV:32")["sampler"] == "snapkv:32"
    assert _parsed("profile", "--sampler", "Schedule:Run/S.parquet")["sampler"] == "schedule:Run/S.parquet"


def test_task_takes_any_case(tmp_path):
    out = tmp_path / "p.parquet"
    result = runner.invoke(app, ["prompts", "--task", "Basic_Arithmetic", "--n", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert read_artifact(out, "prompts").column("task").to_pylist() == ["basic_arithmetic"]
