"""A command line that does not parse is one "error: ..." line and exit 2, as every other refusal; an
unknown option that is another tool's name for one of ours names ours, and a look-alike is suggested only
for a typo; SIGTERM while the CLI is still starting is one line and exit 143.

Expected lines are written out by hand from click's messages, the option names of each command's --help
and the shell's convention for a signal's end (128 + the signal)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from sparrow.cli.app import app

from cli_checks import error_line

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
COMMANDS = typer.main.get_command(app).commands


def _id(value) -> str | None:
    return " ".join(value) if isinstance(value, list) else None


def _refused(args: list[str]) -> str:
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    return error_line(r)


@pytest.mark.parametrize(("args", "line"), [
    (["rollout"], "error: missing option '--prompts' (try 'sparrow rollout -h')"),
    (["sql"], "error: missing argument '[RUN] QUERY' (try 'sparrow sql -h')"),
    (["rolout"], "error: no such command 'rolout'. Did you mean 'rollout'? (try 'sparrow -h')"),
    (["--foo"], "error: no such option: --foo (try 'sparrow -h')"),
    (["rollout", "--prompts"], "error: option '--prompts' requires an argument (try 'sparrow rollout -h')"),
    (["models", "-f", "table", "extra"],
     "error: got unexpected extra argument(s) (extra) (try 'sparrow models -h')"),
], ids=_id)
def test_a_command_line_that_does_not_parse_is_one_error_line(args, line):
    assert _refused(args) == line


@pytest.mark.parametrize(("args", "flag", "command"), [
    (["sql", "--max-rows", "abc", ".", "SELECT 1"], "--max-rows", "sql"),
    (["prompts", "--task", "count", "--n", "two", "-o", "p.parquet"], "--n", "prompts"),
], ids=_id)
def test_a_value_of_the_wrong_type_is_one_error_line(args, flag, command):
    line = _refused(args)
    assert line.startswith(f"error: invalid value for '{flag}': ")
    assert line.endswith(f" (try 'sparrow {command} -h')")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unknown_option_is_one_error_line_on_every_command(command):
    assert _refused([command, "--no-such-flag"]) == \
        f"error: no such option: --no-such-flag (try 'sparrow {command} -h')"


def test_a_bare_sparrow_still_prints_its_help():
    r = runner.invoke(app, [])
    assert r.exit_code == 2 and "Usage" in r.stdout and "error" not in r.stderr


# ---------------------------------------------------------------- what an unknown option's line suggests


@pytest.mark.parametrize(("command", "typed", "ours", "theirs"), [
    ("rollout", "--n", "--samples", "vLLM's n"),
    ("profile", "--n", "--samples", "vLLM's n"),
    ("distill", "--max-steps", "--steps", "TRL's max_steps"),
    ("distill", "--max_steps", "--steps", "TRL's max_steps"),
])
def test_another_tools_name_names_ours(command, typed, ours, theirs):
    assert _refused([command, typed, "2"]) == \
        f"error: no such option: {typed}. Sparrow's name for {theirs} is {ours} (try 'sparrow {command} -h')"


# TRL counts optimizer updates, train counts steps of rollouts with --ppo-epochs updates each
UPDATES = ", which counts steps of rollouts, each of --ppo-epochs optimizer updates"
TRAIN_NAMES = [("--num-iterations", "Sparrow's name for TRL's num_iterations is --ppo-epochs"),
               ("--loss-type", "Sparrow's name for TRL's loss_type is --loss-agg"),
               ("--clip-ratio-high", "Sparrow's name for verl's clip_ratio_high is --epsilon-high"),
               ("--total-training-steps", "Sparrow's name for verl's total_training_steps is --steps"),
               ("--test-freq", "Sparrow's name for verl's test_freq is --eval-every"),
               ("--max-steps", "Sparrow's nearest to TRL's max_steps is --steps" + UPDATES),
               ("--save-steps", "Sparrow's nearest to TRL's save_steps is --checkpoint-every" + UPDATES),
               ("--eval-steps", "Sparrow's nearest to TRL's eval_steps is --eval-every" + UPDATES),
               ("--clip-ratio-low", "Sparrow's name for verl's clip_ratio_low is --epsilon"),
               ("--per-device-train-batch-size", "Sparrow's nearest to TRL's per_device_train_batch_size is "
                "--micro-batch, sequences per forward/backward; a step's batch is --prompts-per-step x "
                "--samples"),
               ("--gradient-accumulation-steps", "Sparrow's nearest to TRL's gradient_accumulation_steps is "
                "--micro-batch, the sequences per forward/backward: a step accumulates the gradient of all "
                "its --prompts-per-step x --samples sequences")]


@pytest.mark.parametrize(("typed", "hint"), TRAIN_NAMES)
def test_trains_foreign_names_are_accepted_or_name_ours(typed, hint):
    """train may accept the name as an alias; where it does not, the line names train's option."""
    train = COMMANDS["train"]
    names = {n for p in train.params for n in p.opts} | {n for ns in train.aliases.values() for n in ns}
    line = _refused(["train", typed, "2"])
    if typed in names:
        assert line == "error: missing option '--prompts' (try 'sparrow train -h')"
    else:
        assert line == f"error: no such option: {typed}. {hint} (try 'sparrow train -h')"


@pytest.mark.parametrize(("command", "typed"), [
    ("rollout", "--silent"),  # click: --seed
    ("rollout", "--verbose"),  # click: --dense
    ("rollout", "--version"),  # click: --kv-compression
    ("rollout", "--num-iterations"),  # train's --ppo-epochs; click: --num-generations
    ("fit-cost", "--num-speculative-tokens"),  # fit-cost's --speculate is a switch, not K
    ("fit-cost", "--n"),  # fit-cost samples nothing
])
def test_no_hint_where_nothing_fits(command, typed):
    assert _refused([command, typed, "2"]) == f"error: no such option: {typed} (try 'sparrow {command} -h')"


@pytest.mark.parametrize(("command", "typed", "meant"), [
    ("rollout", "--sampels", "--samples"),
    ("rollout", "--temprature", "--temperature"),
    ("rollout", "--top_p", "--top-p"),
    ("train", "--max-new-token", "--max-new-tokens"),
])
def test_a_typo_still_gets_its_option(command, typed, meant):
    assert _refused([command, typed, "2"]) == \
        f"error: no such option: {typed}. Did you mean {meant}? (try 'sparrow {command} -h')"


# ---------------------------------------------------------------- SIGTERM while the CLI starts

TERMINATED = "terminated; nothing half-written was left behind"


def _started_and_terminated(when: str) -> subprocess.CompletedProcess:
    """The console script's entry with SIGTERM sent to itself at `when`: while `sparrow.cli.app` is
    imported, or while `models`' command line is read."""
    script = textwrap.dedent(f"""
        import importlib.abc, os, signal, sys
        from sparrow.cli import command, entry

        def terminate():
            os.kill(os.getpid(), signal.SIGTERM)

        class AtImport(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "sparrow.cli.app":
                    terminate()
                return None

        if {when!r} == "import":
            sys.meta_path.insert(0, AtImport())
        else:
            parse = command.Command.parse_args
            def parse_args(self, ctx, args):
                terminate()
                return parse(self, ctx, args)
            command.Command.parse_args = parse_args
        sys.argv = ["sparrow", "models"]
        entry.main()
    """)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("when", ["import", "parse"])
def test_sigterm_while_starting_is_one_line_and_exit_143(when):
    r = _started_and_terminated(when)
    assert r.returncode == 128 + signal.SIGTERM, (r.returncode, r.stderr)
    assert [line for line in r.stderr.splitlines() if line.strip()] == [TERMINATED]
    assert r.stdout == ""


def test_a_query_that_opens_with_an_sql_comment_is_told_to_follow_a_double_dash():
    """`sparrow sql "$(cat q.sql)"` where q.sql starts with `-- count`: the parser takes it for an option;
    the line says how to give it, on one line however many the query has."""
    assert _refused(["sql", "-- count\nselect 1", "--run", "."]) == (
        "error: '-- count\\nselect 1' starts with a dash, so it was read as an option; put -- before it, "
        "after the options, to give it as an argument (sparrow sql [OPTIONS] -- ARGUMENT) "
        "(try 'sparrow sql -h')")
