"""TRL's everyday GRPO knobs on `sparrow train`: --epsilon / --epsilon-high (the PPO clip's two sides) and
--max-grad-norm reach the loss and the update, are recorded in the run's configuration, and a resume
must keep them."""

from __future__ import annotations

import json

import pytest
from test_train import tiny_llama, vowel_train_args  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app

from cli_checks import error_line

runner = CliRunner()


@pytest.fixture()
def args(tiny_llama, tmp_path, monkeypatch):  # noqa: F811 - the imported fixture
    return lambda *extra: vowel_train_args(tiny_llama, tmp_path, monkeypatch, *extra)


@pytest.mark.parametrize("flag,value,said", [
    ("--epsilon", "1.5", "--epsilon must be between 0 and 1"),
    ("--epsilon", "0", "--epsilon must be between"),
    ("--epsilon-high", "-0.1", "--epsilon-high must be positive"),
    ("--max-grad-norm", "0", "--max-grad-norm must be positive")])
def test_bad_clip_values_are_refused_before_work(args, tmp_path, flag, value, said):
    line = error_line(runner.invoke(app, args(flag, value)))
    assert said in line and not (tmp_path / "run").exists()


def test_the_clip_options_are_recorded_and_kept_on_resume(args, tmp_path):
    r = runner.invoke(app, args("--epsilon", "0.1", "--epsilon-high", "0.5", "--max-grad-norm", "0.5"))
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())
    assert config["loss"] == {"clip_low": 0.1, "clip_high": 0.5} and config["max_grad_norm"] == 0.5
    line = error_line(runner.invoke(app, [*args("--epsilon", "0.2", "--epsilon-high", "0.5",
                                                "--max-grad-norm", "0.5", "--resume"), "--steps", "2"]))
    assert "--epsilon" in line and "{'clip_low': 0.1, 'clip_high': 0.5}" in line
    line = error_line(runner.invoke(app, [*args("--epsilon", "0.1", "--epsilon-high", "0.5", "--resume"),
                                          "--steps", "2"]))
    assert "--max-grad-norm 0.5, not 1.0" in line


def test_the_cli_defaults_are_the_loss_config_s():
    """--epsilon / --epsilon-high default to LossConfig's bounds (0.2 and 0.28, TRL's and DAPO's), and a run
    at those defaults records no loss option."""
    import inspect

    from sparrow.cli.train import train
    from sparrow.stages.train.objective import LossConfig

    options = inspect.signature(train).parameters
    assert options["epsilon"].default.default == LossConfig().clip_low == 0.2
    assert options["epsilon_high"].default.default == LossConfig().clip_high == 0.28


def test_a_run_at_the_default_clip_records_no_loss_option(args, tmp_path):
    r = runner.invoke(app, args("--epsilon", "0.2", "--epsilon-high", "0.28"))
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())["loss"] == {}
