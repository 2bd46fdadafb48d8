"""The README's shell blocks run as written, in order, on a fresh clone (issue 26, item 13).

Every ```bash block of README.md is picked up, whoever wrote it. A block that needs more than a fresh
clone (a cluster, an optional extra from PyPI) says so in an HTML comment on the line above it,
`<!-- readme-test: skip (why) -->`, and is left out; every other block is checked:

- in `make test` (fast, nothing runs): each `sparrow` command parses with the real CLI (every flag exists,
  nothing required is missing), and every file or directory it reads was written by an earlier command
  of the README (the Training block once read a schedule and eval prompts that nothing wrote);
- in `make test-slow`: the blocks run, in order, with bash in an empty directory, `sparrow` on the PATH
  as `source .venv/bin/activate` puts it, at the small sizes of SMALL below (the README's sizes are for
  reading; these keep the whole walk within minutes on two cores).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from sparrow.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
SKIP = re.compile(r"^<!-- readme-test: skip \((?P<why>.+)\) -->$")

# What the slow walk substitutes in every command line, in order: (pattern, replacement).
SMALL = (
    (r"--n \d+", "--n 2"),  # prompts per prompt set
    (r"--context-tokens \d+", "--context-tokens 600"),  # long-context prompts of 600 tokens, not 3000
    (r"--samples \d+", "--samples 2"),  # samples per prompt (a GRPO group needs two)
    (r"--max-new-tokens \d+", "--max-new-tokens 8"),
    (r"--steps \d+", "--steps 2"),  # training and distillation steps
    (r"--prompts-per-step \d+", "--prompts-per-step 2"),
    (r"sparrow plan-schedule", "sparrow plan-schedule --min-tokens 1"),  # few tokens per bin at these sizes
)

INPUTS = ("prompts", "eval_prompts", "schedule", "rollouts", "profile", "threshold_file", "cost", "lora",
          "adapter", "init_adapter", "runs", "run")  # parameters that name something to read
OUTPUTS = ("output", "output_dir", "export_to")


@dataclass
class Block:
    line: int  # where its fence opens in README.md
    text: str
    skip: str | None  # why it is left out, or None


def readme_blocks(path: Path = ROOT / "README.md") -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            match = SKIP.match(above)
            blocks.append(Block(i + 1, "\n".join(lines[i + 1:end]), match["why"] if match else None))
            i = end
        i += 1
    return blocks


def command_lines(text: str) -> list[list[str]]:
    """The block's commands as argument lists: backslash-newline joins lines, a newline outside quotes
    ends a command, `#` at a word's start begins a comment."""
    commands, current, quote, i = [], [], None, 0
    while i < len(text):
        c = text[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "\\" and text[i + 1:i + 2] == "\n":
            current.append(" ")
            i += 2
            continue
        elif c == "#" and (not current or current[-1].isspace()):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif c == "\n":
            commands.append("".join(current))
            current = []
            i += 1
            continue
        current.append(c)
        i += 1
    commands.append("".join(current))
    return [shlex.split(c) for c in commands if c.strip()]


def runnable() -> list[Block]:
    return [b for b in readme_blocks() if b.skip is None]


def test_every_block_runs_or_says_why_not():
    blocks = readme_blocks()
    assert len(runnable()) >= 3, "the README's tour, Training and DistillSparse blocks must run"
    for b in blocks:
        assert b.skip is None or len(b.skip.split()) >= 3, f"README.md line {b.line}: give the reason"


def _paths(value) -> list[Path]:
    if value is None:
        return []
    return [Path(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def test_blocks_read_only_what_earlier_blocks_wrote_with_real_flags():
    """Each `sparrow` command of the runnable blocks parses with the CLI itself, and reads only what an
    earlier command wrote (a directory counts as written when something was written into it)."""
    group = typer.main.get_command(app)
    written: set[Path] = set()
    for block in runnable():
        for argv in command_lines(block.text):
            if argv[0] != "sparrow":
                continue
            where = f"README.md block at line {block.line}: `{' '.join(argv)[:80]}`"
            assert argv[1] in group.commands, f"{where}: no such command {argv[1]!r}"
            command = group.commands[argv[1]]
            try:
                params = command.make_context(argv[1], argv[2:]).params
            except Exception as e:  # click's usage errors: an unknown flag, a missing option
                pytest.fail(f"{where}: {e}")
            for name in INPUTS:
                for path in _paths(params.get(name)):
                    known = path in written or any(path in w.parents for w in written)
                    assert known, f"{where}: reads {path}, which no earlier command of the README writes"
            for name in OUTPUTS:
                for path in _paths(params.get(name)):
                    written.add(path)
                    if argv[1] in ("train", "distill"):  # a run or adapter directory and its artifacts
                        written |= {path / "metrics.parquet", path / "schedule.parquet", path / "adapter"}


def _small(text: str) -> str:
    for pattern, replacement in SMALL:
        text = re.sub(pattern, replacement, text)
    return text


def test_small_sizes_reach_every_size_flag():
    """The slow walk's table covers the size flags the README uses (a new flag would run at full size)."""
    text = "\n".join(_small(b.text) for b in runnable())
    assert not re.search(r"--(n|samples|max-new-tokens|steps|prompts-per-step) (?!2\b|8\b)\d+", text), text


@pytest.mark.slow
def test_readme_blocks_run_in_order_on_a_fresh_clone(tmp_path):
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    for block in runnable():
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", _small(block.text)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, (f"README.md block at line {block.line} failed ({r.returncode}):\n"
                                   f"{_small(block.text)}\n--- stderr:\n{r.stderr[-4000:]}")


def test_the_cli_runner_sees_the_readme_commands():
    """`sparrow --help` lists every command the README's blocks use (a renamed command fails here)."""
    shown = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).stdout
    used = {argv[1] for b in readme_blocks() for argv in command_lines(b.text) if argv[0] == "sparrow"}
    assert used and all(f" {name} " in shown for name in used), used
