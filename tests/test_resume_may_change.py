"""`sparrow train --resume` may change when it checkpoints and evaluates (--checkpoint-every, --eval-every):
neither changes the weights or the training metrics, so the resumed run still reaches those of the run that
was never interrupted; the new value is said in a note and recorded by the next checkpoint. A resume with
another CPU thread count than the run's (recorded in its configuration) is said in a note: the last digits
of a CPU's logprobs depend on it, so the bit-for-bit promise holds at the same --threads."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import tiny_llama  # noqa: F401 - a fixture
from test_train_resume import adapter, metrics, setup  # noqa: F401 - setup is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app

runner = CliRunner()


def said(result) -> str:
    return " ".join(result.stderr.split())


def test_checkpoint_and_eval_cadence_may_change_on_resume(setup, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert runner.invoke(app, setup["args"](run, "--steps", "1")).exit_code == 0
    assert json.loads((run / "checkpoint" / "config.json").read_text())["threads"] == torch.get_num_threads()
    r = runner.invoke(app, [*setup["args"](run, "--resume"), "--checkpoint-every", "1", "--eval-every", "1"])
    assert r.exit_code == 0, r.output
    assert "note: --resume: --checkpoint-every changes from 10 to 1 from the resumed step on" in said(r)
    assert "note: --resume: --eval-every changes from 2 to 1" in said(r)
    # the uninterrupted run (eval every 2 steps) is the expectation: the same weights and training metrics
    straight = setup["straight"]
    assert metrics(run, evals=False) == metrics(straight, evals=False)
    for name, tensor in adapter(straight).items():
        assert torch.equal(adapter(run)[name], tensor), name
    saved = json.loads((run / "checkpoint" / "config.json").read_text())
    assert (saved["checkpoint_every"], saved["eval_every"]) == (1, 1)  # recorded
    evaluated = [r["step"] for r in metrics(run) if r["eval_accuracy"] is not None]
    assert evaluated == [1, 2, 3]  # step 1 is the last of the first call; 2 and 3 by --eval-every 1


@pytest.mark.slow  # a second real training: the cadence test above covers resume in the default run
def test_another_thread_count_on_resume_is_said_in_a_note(setup, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert runner.invoke(app, setup["args"](run, "--steps", "1")).exit_code == 0
    config = run / "checkpoint" / "config.json"
    saved = json.loads(config.read_text())
    now = torch.get_num_threads()
    saved["threads"] = now + 1  # as a run on another machine (or with another --threads) recorded it
    config.write_text(json.dumps(saved))
    r = runner.invoke(app, setup["args"](run, "--resume", "--steps", "2"))
    assert r.exit_code == 0, r.output
    assert (f"note: --resume: {run} ran with {now + 1} CPU threads and resumes with {now}; a CPU's logprobs "
            "differ in their last digits with the thread count") in said(r)
    assert f"(--threads {now + 1} keeps them)" in said(r)
    saved = json.loads(config.read_text())
    assert saved["threads"] == now  # the resumed checkpoint records this process's threads
    saved["threads"] = 0  # a run of an older Sparrow, which did not record it: nothing to say
    config.write_text(json.dumps(saved))
    r = runner.invoke(app, setup["args"](run, "--resume", "--steps", "3"))
    assert r.exit_code == 0 and "CPU threads" not in said(r)


def test_two_paths_of_one_model_folder_are_one_model(tmp_path, monkeypatch):
    """A run started with --model m/ckpt resumes with the folder's absolute path (and the other way); a
    path of another folder, or another preset, still differs."""
    from sparrow.stages.train.config import TrainConfig
    from sparrow.stages.train.run_dir import differences

    (tmp_path / "m" / "ckpt").mkdir(parents=True)
    (tmp_path / "m" / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    saved = TrainConfig(model="m/ckpt")
    assert differences(saved, TrainConfig(model=str(tmp_path / "m" / "ckpt"))) == []
    assert differences(saved, TrainConfig(model="m/other")) == ["model"]
    assert differences(TrainConfig(model="smollm2-135m"), TrainConfig(model="tiny-llama")) == ["model"]
