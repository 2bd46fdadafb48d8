"""`sparrow train` under interrupts and resumes: SIGTERM to a job the shell started in the background
(SIGINT ignored) waits for the step's update as in the foreground; an interrupt during a step's eval stops
the eval at once (only the weight change and the step's logs wait); a resume whose --steps is the steps
done runs the final eval before the summary; a refused resume names both sides of what differs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from test_train import VOWELS, tiny_llama, vowel_token_prompts  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import TASKS
from sparrow.stages.train import Trainer
from sparrow.stages.train.config import TrainConfig
from sparrow.stages.train.run_dir import check_same_run

runner = CliRunner()
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):  # noqa: F811 - the imported fixture
    patch = pytest.MonkeyPatch()
    patch.setitem(TASKS, "vowels", VOWELS)
    root = tmp_path_factory.mktemp("interrupts")
    tok = load_model(tiny_llama[0]).tokenizer
    prompts = write_artifact(vowel_token_prompts(tok, 4, 4), root / "prompts.parquet", "prompts")

    def args(run, *extra: str) -> list[str]:
        return ["train", "--model", tiny_llama[0], "--prompts", str(prompts), "--eval-prompts", str(prompts),
                "--steps", "2", "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens", "4",
                "--lora-rank", "2", "--budget", "48", "--threads", "1", "-o", str(run), *extra]

    yield {"root": root, "args": args, "model": tiny_llama[0]}
    patch.undo()


def rows(run) -> list[dict]:
    return read_artifact(run / "metrics.parquet", "metrics").to_pylist()


def checkpoint_at(run) -> int:
    return json.loads((run / "checkpoint" / "progress.json").read_text())["step"]


@pytest.fixture()
def python_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever ran us
    yield
    signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------- SIGTERM in a background job

BACKGROUND = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_train import VOWELS
from sparrow.stages.tasks import TASKS
from sparrow.stages.train.update import Learner
TASKS["vowels"] = VOWELS
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # as a shell leaves it for `cmd &`
update = Learner.update

def update_with_sigterm(self, exp):
    if exp.step == 0:
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's SIGTERM while step 1's weights change
    out = update(self, exp)
    print("update of step 1 finished", file=sys.stderr)
    return out

Learner.update = update_with_sigterm
from sparrow.cli.entry import main
sys.argv = ["sparrow", *sys.argv[1:]]
main()
"""


def test_sigterm_to_a_background_job_waits_for_the_step_and_leaves_its_checkpoint(setup, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", BACKGROUND.format(tests=str(TESTS)), *setup["args"](run)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    said = " ".join(done.stderr.split())
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "update of step 1 finished" in said
    assert f"terminated; {run}/checkpoint holds the 1 complete step of 2" in said
    assert checkpoint_at(run) == 1 and [r["step"] for r in rows(run)] == [1]


# ---------------------------------------------------------------- an interrupt during a step's eval

def test_an_interrupt_during_a_step_eval_stops_it_at_once(setup, tmp_path, monkeypatch, python_sigint):
    """A real SIGINT as step 1's eval starts: the eval does not run on (before, the interrupt waited for
    every eval pass), step 1 is logged and checkpointed without its eval numbers, and --resume runs that
    eval first (step 1's weights are the checkpoint's: the numbers of a run never stopped) and goes on."""
    evaluate = Trainer.evaluate
    finished: list[int] = []

    def evaluate_with_sigint(self, *a, **k):
        if self.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        out = evaluate(self, *a, **k)
        finished.append(self.step)
        return out

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(Trainer, "evaluate", evaluate_with_sigint)
        r = runner.invoke(app, setup["args"](run, "--eval-every", "1"))
    assert r.exit_code == 130, r.output
    assert 1 not in finished and finished.count(0) == 4  # the initial eval's four passes ran whole
    assert "holds the 1 complete step of 2" in " ".join(r.stderr.split())
    assert checkpoint_at(run) == 1
    (row,) = rows(run)
    assert row["step"] == 1 and row["eval_accuracy"] is None and row["eval_accuracy_sparse"] is None
    r = runner.invoke(app, setup["args"](run, "--eval-every", "1", "--resume"))
    assert r.exit_code == 0, r.output
    straight = tmp_path / "straight"
    assert runner.invoke(app, setup["args"](straight, "--eval-every", "1")).exit_code == 0
    names = ("step", "eval_accuracy", "eval_accuracy_sparse", "sampler_gap")
    expected = [{k: row[k] for k in names} for row in rows(straight)]
    assert [{k: row[k] for k in names} for row in rows(run)] == expected
    assert all(row["eval_accuracy"] is not None for row in expected)


# ---------------------------------------------------------------- a resume that ends at the steps done

def test_a_resume_with_steps_equal_to_the_steps_done_runs_the_final_eval(setup, tmp_path, monkeypatch):
    """A 2-step run stopped during step 2's rollout holds step 1 without an eval (--eval-every 5); resumed
    with --steps 1 it ends there, so step 1 is the last: its eval (dense and sparse) is the one a run of
    --steps 1 never interrupted logs, in the metrics and the trackers (one jsonl line for the step, with
    the eval), and the summary names it."""
    straight = tmp_path / "straight"
    r = runner.invoke(app, [*setup["args"](straight), "--steps", "1"])
    assert r.exit_code == 0, r.output
    expected = rows(straight)[0]
    assert expected["eval_accuracy"] is not None and expected["eval_accuracy_sparse"] is not None

    experience = Trainer.experience

    def interrupted(self, s):
        if s == 1:
            raise KeyboardInterrupt
        return experience(self, s)

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(Trainer, "experience", interrupted)
        assert runner.invoke(app, setup["args"](run)).exit_code == 130
    assert rows(run)[0]["eval_accuracy"] is None
    r = runner.invoke(app, [*setup["args"](run, "--resume"), "--steps", "1", "--report-to", "jsonl"])
    assert r.exit_code == 0, r.output
    (row,) = rows(run)
    zero, line = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]  # the tracker's
    assert zero["step"] == 0  # the initial eval
    for name in ("eval_accuracy", "eval_accuracy_sparse", "sampler_gap"):
        assert row[name] == expected[name], name
        assert line[name] == expected[name], name
    assert line["step"] == 1
    summary = json.loads(artifact_metadata(run / "metrics.parquet")["summary"])
    assert summary["final_eval_accuracy"] == expected["eval_accuracy"]
    assert summary["final_eval_accuracy_sparse"] == expected["eval_accuracy_sparse"]
    # the eval is in the checkpoint too: a later resume keeps it
    r = runner.invoke(app, [*setup["args"](run, "--resume"), "--steps", "2"])
    assert r.exit_code == 0, r.output
    assert rows(run)[0]["eval_accuracy"] == expected["eval_accuracy"]


# ---------------------------------------------------------------- a refused resume names both sides

@pytest.mark.parametrize("saved_eval,now_eval,said", [
    ("e" * 64, "", "was trained with --eval-prompts, but this command gives none"),
    ("", "e" * 64, "was trained without --eval-prompts, but this command gives them"),
    ("e" * 64, "f" * 64, "was trained on other held-out prompts than --eval-prompts holds"),
])
def test_a_refused_resume_names_each_side_of_the_eval_prompts(tmp_path, saved_eval, now_eval, said):
    saved = TrainConfig(model="m", prompts_sha256="p" * 64, eval_prompts_sha256=saved_eval)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text(json.dumps(asdict(saved)))
    now = TrainConfig(model="m", prompts_sha256="p" * 64, eval_prompts_sha256=now_eval)
    with pytest.raises(ValueError) as e:
        check_same_run(tmp_path, now)
    assert f"--resume: {tmp_path} {said}" in str(e.value)
