"""The shell blocks of the README and of docs/ run as written, in order, on a fresh clone, and the
documents' relative links resolve.

The documents are README.md, then docs/*.md in alphabetical order: the README's quick start writes
`run/`, and the pages' blocks build on it. Every fenced ```bash (or sh, shell) block is picked up,
whoever wrote it. A block that needs more than a fresh clone (a cluster, a GPU, an optional extra from
PyPI) says so in an HTML comment on the line above it, `<!-- readme-test: skip (why) -->`, and is left
out of the walk; every other block is checked:

- in `make test` (fast, nothing runs): each `sparrow` command parses with the real CLI (every flag exists,
  nothing required is missing; skipped blocks too), and every file or directory a runnable block reads
  was written by an earlier command of the walk (a Training block once read a schedule and eval prompts
  that nothing wrote);
- in `make test-slow`: the runnable blocks run, in order, with bash in one empty directory, `sparrow` on
  the PATH as `source .venv/bin/activate` puts it, at the small sizes of SMALL below (the documents'
  sizes are for reading; these keep the whole walk within minutes on two cores).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from sparrow.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SHELL = ("bash", "sh", "shell")  # fence languages whose blocks are commands
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

# What the walk must keep running, wherever the blocks live: the pipeline and the pages' own stages.
WALKED_COMMANDS = {"prompts", "profile", "plan-schedule", "rollout", "train", "sql", "report", "distill",
                   "reward"}


@dataclass(frozen=True)
class Fence:
    doc: Path
    line: int  # where it opens, 1-based
    language: str
    text: str
    above: str  # the nearest non-blank line above the fence


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    text: str
    skip: str | None  # why it is left out of the walk, or None

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)} block at line {self.line}"


def fences(doc: Path) -> Iterator[Fence]:
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip().startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{doc.relative_to(ROOT)} line {i + 1}: the fence is never closed"
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            yield Fence(doc, i + 1, lines[i].strip()[3:].strip(), "\n".join(lines[i + 1:end]), above)
            i = end
        i += 1


def shell_blocks(doc: Path) -> list[Block]:
    blocks = []
    for f in fences(doc):
        if f.language in SHELL:
            match = SKIP.match(f.above)
            blocks.append(Block(doc, f.line, f.text, match["why"] if match else None))
    return blocks


def all_blocks() -> list[Block]:
    return [b for doc in DOCUMENTS for b in shell_blocks(doc)]


def runnable() -> list[Block]:
    return [b for b in all_blocks() if b.skip is None]


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


def sparrow_commands(blocks: list[Block]) -> Iterator[tuple[Block, list[str]]]:
    for block in blocks:
        for argv in command_lines(block.text):
            if argv[0] == "sparrow":
                yield block, argv


def test_every_block_runs_or_says_why_not():
    readme = [b for b in runnable() if b.doc.name == "README.md"]
    assert readme and any("sparrow train" in b.text for b in readme), "the README's quick start must run"
    for b in all_blocks():
        assert b.skip is None or len(b.skip.split()) >= 3, f"{b.where}: give the reason"


def test_the_walk_keeps_every_stage_it_ran():
    used = {argv[1] for _, argv in sparrow_commands(runnable())}
    assert WALKED_COMMANDS <= used, f"no runnable block runs {sorted(WALKED_COMMANDS - used)}"
    assert any("--kv-compression" in argv for _, argv in sparrow_commands(runnable())), \
        "the KV compression page's block must run"


def test_every_fence_names_its_language():
    """A shell block without a language would be left out of the walk unseen."""
    for doc in DOCUMENTS:
        for f in fences(doc):
            where = f"{doc.relative_to(ROOT)} line {f.line}"
            assert f.language, f"{where}: name the fence's language (```bash, ```text)"


def test_no_shell_commands_hide_in_indented_code():
    for doc in DOCUMENTS:
        outside = _without_fences(doc.read_text()).splitlines()
        for i, line in enumerate(outside):
            after_blank = i == 0 or not outside[i - 1].strip()
            if after_blank and re.match(r" {4,}(sparrow|bash|make|torchrun|pip) ", line):
                pytest.fail(f"{doc.relative_to(ROOT)}: `{line.strip()[:60]}` is indented code; "
                            "put commands in a ```bash block so the walk checks them")


def _parse(command: click.Command, argv: list[str], where: str) -> dict:
    try:
        return command.make_context(argv[1], argv[2:]).params
    except Exception as e:  # click's usage errors: an unknown flag, a missing option
        pytest.fail(f"{where}: {e}")


def _paths(value) -> list[Path]:
    if value is None:
        return []
    return [Path(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def test_blocks_read_only_what_earlier_blocks_wrote_with_real_flags():
    """Each `sparrow` command of the runnable blocks parses with the CLI itself, and reads only what an
    earlier command wrote (a directory counts as written when something was written into it)."""
    group = typer.main.get_command(app)
    written: set[Path] = set()
    for block, argv in sparrow_commands(runnable()):
        where = f"{block.where}: `{' '.join(argv)[:80]}`"
        assert argv[1] in group.commands, f"{where}: no such command {argv[1]!r}"
        params = _parse(group.commands[argv[1]], argv, where)
        for name in INPUTS:
            for path in _paths(params.get(name)):
                known = path in written or any(path in w.parents for w in written)
                assert known, f"{where}: reads {path}, which no earlier command of the walk writes"
        for name in OUTPUTS:
            for path in _paths(params.get(name)):
                written.add(path)
                if argv[1] in ("train", "distill"):  # a run or adapter directory and its artifacts
                    written |= {path / "metrics.parquet", path / "schedule.parquet", path / "adapter"}


def test_skipped_blocks_use_real_flags():
    """A block left out of the walk still names commands and flags that exist."""
    group = typer.main.get_command(app)
    for block, argv in sparrow_commands([b for b in all_blocks() if b.skip is not None]):
        where = f"{block.where}: `{' '.join(argv)[:80]}`"
        assert argv[1] in group.commands, f"{where}: no such command {argv[1]!r}"
        _parse(group.commands[argv[1]], argv, where)


def _small(text: str) -> str:
    for pattern, replacement in SMALL:
        text = re.sub(pattern, replacement, text)
    return text


def test_small_sizes_reach_every_size_flag():
    """The slow walk's table covers the size flags the blocks use (a new flag would run at full size)."""
    text = "\n".join(_small(b.text) for b in runnable())
    assert not re.search(r"--(n|samples|max-new-tokens|steps|prompts-per-step) (?!2\b|8\b)\d+", text), text


@pytest.mark.slow
def test_blocks_run_in_order_on_a_fresh_clone(tmp_path):
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    for block in runnable():
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", _small(block.text)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, (f"{block.where} failed ({r.returncode}):\n"
                                   f"{_small(block.text)}\n--- stderr:\n{r.stderr[-4000:]}")


def test_the_cli_runner_sees_the_documents_commands():
    """`sparrow --help` lists every command the blocks use (a renamed command fails here)."""
    shown = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).stdout
    used = {argv[1] for _, argv in sparrow_commands(all_blocks())}
    assert used and all(f" {name} " in shown for name in used), used


# Links between the documents.

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _without_fences(text: str) -> str:
    """The text with every fenced block blanked (line numbers kept)."""
    out, inside = [], False
    for line in text.splitlines():
        fence = line.strip().startswith("```") if not inside else line.strip() == "```"
        inside ^= fence
        out.append("" if inside or fence else line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """The anchor a heading gets on GitHub: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in _without_fences(doc.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:  # a repeated heading gets -1, -2, ... as on GitHub
            base = slug(match[1])
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(f"{base}-{n}" if n else base)
    return found


def relative_links(doc: Path) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(_without_fences(doc.read_text()).splitlines(), 1):
        for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = match["target"]
            if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, mailto: and the like
                yield number, target


def test_relative_links_resolve():
    """Every relative link (and image) of README.md and docs/*.md names a file that exists, and an
    anchor into a Markdown file names one of its headings."""
    broken = []
    for doc in DOCUMENTS:
        for number, target in relative_links(doc):
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)} line {number}: {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no such heading in {resolved.name})")
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_links():
    """The documents link to each other, so a parser that found no link would pass vacuously."""
    readme = [target for _, target in relative_links(ROOT / "README.md")]
    assert len(readme) >= 15 and any("#" in t for t in readme), readme
    assert slug("Measuring the mismatch (`sparrow profile`)") == "measuring-the-mismatch-sparrow-profile"
