"""`sparrow train` says what its initial eval is doing (a line per pass: greedy and sampled, dense and
under the run's sparsity), and a fresh run that a reward error stops leaves no schedule.parquet behind."""

from __future__ import annotations

import pytest
from test_train import tiny_llama, vowel_train_args  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact
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
    assert not run.exists()  # the run made it and left it empty: removed


def test_a_reward_error_after_complete_steps_keeps_them_resumable(args, tmp_path, monkeypatch):
    """The reward raising in step 3 leaves a checkpoint of steps 1-2, as an interrupt does; the reward
    fixed, --resume trains step 3."""
    rewards = Trainer._rewards

    def failing_in_step_3(self, prompts, groups):
        if self.step == 2:
            raise RewardError("--reward-fn r.py:f returned NaN for row 0")
        return rewards(self, prompts, groups)

    three = [*args, "--steps", "3", "--checkpoint-every", "10"]
    with monkeypatch.context() as m:
        m.setattr(Trainer, "_rewards", failing_in_step_3)
        r = runner.invoke(app, three)
    run = tmp_path / "run"
    assert r.exit_code == 2
    assert " ".join(r.stderr.split()).endswith(
        f"returned NaN for row 0; {run}/checkpoint holds the 2 complete steps of 3, so once the reward is "
        "fixed, add --resume to the same command to continue")
    r = runner.invoke(app, [*three, "--resume"])
    assert r.exit_code == 0, r.output
    assert [row["step"] for row in read_artifact(run / "metrics.parquet", "metrics").to_pylist()] == [1, 2, 3]
