"""`sparrow train` says what its initial eval is doing (a line per pass: greedy and sampled, dense and
under the run's sparsity), and a fresh run that a reward error stops leaves no schedule.parquet behind."""

from __future__ import annotations

import pytest
from test_train import tiny_llama, vowel_train_args  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.stages.tasks.base import RewardError
from sparrow.stages.train import Trainer

runner = CliRunner()


@pytest.fixture()
def args(tiny_llama, tmp_path, monkeypatch):  # noqa: F811 - the imported fixture
    prompts = str(tmp_path / "p.parquet")
    return vowel_train_args(tiny_llama, tmp_path, monkeypatch, "--eval-prompts", prompts, "--budget", "48")


def test_the_initial_eval_says_each_pass(args):
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    start = lines.index("initial eval of the --eval-prompts ...")
    assert [line.strip() for line in lines[start + 1:start + 5]] == [
        "initial eval 1/4: greedy, dense ...", "initial eval 2/4: greedy, sparse ...",
        "initial eval 3/4: sampled, dense ...", "initial eval 4/4: sampled, sparse ..."]


def test_a_reward_error_in_a_fresh_run_leaves_no_schedule(args, tmp_path, monkeypatch):
    def failing(self, prompts, groups):
        raise RewardError("--reward-fn r.py:f returned NaN for row 0")

    monkeypatch.setattr(Trainer, "_rewards", failing)
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "returned NaN for row 0" in r.output
    run = tmp_path / "run"
    assert not (run / "schedule.parquet").exists()
    assert not [p.name for p in run.iterdir() if not p.name.startswith(".")]
