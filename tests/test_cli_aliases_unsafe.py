"""The vLLM, TRL and verl names that rollout's and train's help cite are accepted as aliases of the same
option, and --unsafe-code-execution means on rollout and train what it means on reward.

Aliases are checked by parsing a command line with each name and comparing the option's value with the
value typed. --unsafe-code-execution is checked where no sandbox can run (SPARROW_BWRAP=none): every
command that scores code refuses with the same sentence without it, and with it rollout and train run
their code prompts; their 2-token answers hold no program, so their reward is 0, as reward scores the
same completions.
"""

from __future__ import annotations

import os

import pytest
import typer
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact
from sparrow.stages.tasks import sandbox as sb
from sparrow.stages.train.objective import LossConfig

from cli_checks import error_line

runner = CliRunner()

# command, the alias typed, the canonical name, the parameter, the value typed (None: a switch)
ALIASES = [
    ("rollout", "--enforce-eager", "--eager", "eager", None),
    ("rollout", "--num-speculative-tokens", "--speculate", "speculate", 3),
    ("train", "--num-speculative-tokens", "--speculate", "speculate", 3),
    ("train", "--num-iterations", "--ppo-epochs", "ppo_epochs", 2),
    ("train", "--loss-type", "--loss-agg", "loss_agg", "dr_grpo"),
    ("train", "--clip-ratio-high", "--epsilon-high", "epsilon_high", 0.3),
    ("train", "--clip-ratio-low", "--epsilon", "epsilon", 0.1),
]


def _command(name: str):
    return typer.main.get_command(app).commands[name]


def _parsed(tmp_path, name: str, args: list[str]) -> dict:
    """The values of `sparrow NAME args`, as its command line is read (nothing runs)."""
    prompts = tmp_path / "p.parquet"
    prompts.touch()
    out = tmp_path / ("out.parquet" if name == "rollout" else "run")
    required = ["--prompts", str(prompts), "-o", str(out)]
    return _command(name).make_context(name, [*required, *args]).params


@pytest.mark.parametrize(("name", "alias", "canonical", "param", "value"), ALIASES)
def test_alias_reaches_the_same_option(tmp_path, name, alias, canonical, param, value):
    typed = [] if value is None else [str(value)]
    expected = True if value is None else value
    assert _parsed(tmp_path, name, [alias, *typed])[param] == expected
    assert _parsed(tmp_path, name, [canonical, *typed])[param] == expected
    assert _parsed(tmp_path, name, [])[param] != expected  # the default is another value


@pytest.mark.parametrize(("name", "alias"), sorted({(name, alias) for name, alias, *_ in ALIASES}))
def test_help_names_the_alias(name, alias):
    text = runner.invoke(app, [name, "--help"], env={"COLUMNS": "300"}).output
    assert alias in text


@pytest.mark.parametrize(("trl", "aggregation"), [("dapo", "token-mean"), ("grpo", "seq-mean-token-mean"),
                                                  ("dr_grpo", "seq-mean-token-sum-norm"), ("bnpo", "bnpo")])
def test_loss_type_takes_trls_values_with_trls_meaning(tmp_path, trl, aggregation):
    """TRL's loss_type: dapo normalizes by the batch's tokens, grpo by each sequence's length then over
    sequences, dr_grpo by sequences x max_completion_length, bnpo by each local batch's tokens."""
    loss_agg = _parsed(tmp_path, "train", ["--loss-type", trl.upper()])["loss_agg"]
    assert LossConfig(loss_agg=loss_agg).validate().aggregation == aggregation


def test_loss_type_refuses_what_it_cannot_aggregate(tmp_path):
    (tmp_path / "p.parquet").touch()  # refused before it is read
    line = error_line(runner.invoke(app, ["train", "--prompts", str(tmp_path / "p.parquet"),
                                          "--loss-type", "cispo", "-o", str(tmp_path / "run")]))
    assert "'cispo'" in line and "dr_grpo" in line and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["rollout", "train"])
def test_dense_help_says_what_no_dense_does(name):
    """--no-dense is the default (every switch has its --no- form): it leaves the attention to the other
    sparsity flags, dense without any, and the help says so."""
    dense = next(p for p in _command(name).params if p.name == "dense")
    assert "--no-dense, the default, leaves the choice to them." in dense.help


def test_train_help_gives_units_and_other_defaults():
    params = {p.name: p for p in _command("train").params}
    assert "tokens" in params["bin_width"].help
    said = params["epsilon_high"].help
    assert "0.28" in said and "TRL's (unset: epsilon's, 0.2)" in said and "verl's (0.2)" in said


# ---------------------------------------------------------------- --unsafe-code-execution

@pytest.fixture
def no_sandbox(tmp_path, monkeypatch):
    """Code prompts where no sandbox can run; the unsafe variable unset ("0") and restored afterwards."""
    monkeypatch.setenv("SPARROW_BWRAP", "none")
    monkeypatch.setenv(sb.UNSAFE_ENV, "0")
    prompts = tmp_path / "code.parquet"
    result = runner.invoke(app, ["prompts", "--task", "code", "--n", "2", "-o", str(prompts)])
    assert result.exit_code == 0, result.output
    return prompts


def _refusal(line: str) -> str:
    assert "SPARROW_BWRAP=none turns the sandbox off" in line and "no bwrap binary" not in line
    assert "--unsafe-code-execution" in line
    return line


def test_rollout_runs_code_prompts_as_reward_does(no_sandbox, tmp_path, monkeypatch):
    out, rewards = tmp_path / "r.parquet", tmp_path / "rw.parquet"
    rollout = ["rollout", "--prompts", str(no_sandbox), "--max-tokens", "2", "--threads", "1", "-o", str(out)]
    reward = ["reward", "--prompts", str(no_sandbox), "--completions", str(out), "-o", str(rewards)]
    refused = _refusal(error_line(runner.invoke(app, rollout)))
    assert not out.exists()

    result = runner.invoke(app, [*rollout, "--unsafe-code-execution"])
    assert result.exit_code == 0, result.output
    sampled = read_artifact(out, "rollouts").to_pylist()
    assert len(sampled) == 2 and [r["reward"] for r in sampled] == [0.0, 0.0]  # no program in 2 tokens

    assert os.environ[sb.UNSAFE_ENV] == "0"  # the flag held for its command only
    assert error_line(runner.invoke(app, reward)) == refused
    result = runner.invoke(app, [*reward, "--unsafe-code-execution"])
    assert result.exit_code == 0, result.output
    assert read_artifact(rewards, "rewards").column("reward").to_pylist() == [0.0, 0.0]


def test_train_runs_code_prompts_with_the_flag(no_sandbox, tmp_path):
    run = tmp_path / "run"
    train = ["train", "--prompts", str(no_sandbox), "--max-tokens", "2", "--steps", "1", "--prompts-per-step",
             "1", "--samples", "2", "--threads", "1", "--alpha-sequences", "0", "-o", str(run), "-f", "json"]
    _refusal(error_line(runner.invoke(app, train)))
    assert not (run / "metrics.parquet").exists()
    result = runner.invoke(app, [*train, "--unsafe-code-execution"])
    assert result.exit_code == 0, result.output
    assert read_artifact(run / "metrics.parquet", "metrics").column("reward_mean").to_pylist() == [0.0]
