"""Issue 26, items 3 and 4: `sparrow train --resume` continues only the same run (options and the content
of its prompts and schedule; only --steps may change), and an interrupted run is resumable: a checkpoint
at the last complete step, after which `--resume` reaches bit for bit the metrics and weights of a run
that was never interrupted (CPU, fp32). Everything through the CLI, as a user runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from test_train import TIMING, VOWELS, tiny_llama, vowel_token_prompts  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import TASKS
from sparrow.stages.train import Trainer
from sparrow.stages.train.update import Learner

from cli_checks import error_line

runner = CliRunner()


def metrics(run, evals: bool = True) -> list[dict]:
    """The metrics rows without timings (and without eval accuracies: a shorter run evaluates after its own
    last step, which a longer run does not)."""
    drop = TIMING | (set() if evals else {"eval_accuracy", "eval_accuracy_sparse", "sampler_gap"})
    return [{k: v for k, v in r.items() if k not in drop}
            for r in read_artifact(run / "metrics.parquet", "metrics").to_pylist()]


def adapter(run) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):  # noqa: F811 - the imported fixture
    """Vowel prompts for the tiny model, the CLI arguments of a 3-step run, and that run done straight."""
    patch = pytest.MonkeyPatch()
    patch.setitem(TASKS, "vowels", VOWELS)
    root = tmp_path_factory.mktemp("resume")
    tok = load_model(tiny_llama[0]).tokenizer
    rows = vowel_token_prompts(tok, 6, 6)
    prompts = write_artifact(rows, root / "prompts.parquet", "prompts")

    def args(run, *extra: str, prompts_path=prompts) -> list[str]:
        return ["train", "--model", tiny_llama[0], "--prompts", str(prompts_path), "--eval-prompts",
                str(prompts), "--steps", "3", "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens",
                "6", "--lora-rank", "2", "--lr", "0.05", "--budget", "48", "--eval-every", "2",
                "-o", str(run), *extra]

    straight = root / "straight"
    r = runner.invoke(app, args(straight))
    assert r.exit_code == 0, r.output
    yield {"root": root, "prompts": prompts, "rows": rows, "args": args, "straight": straight}
    patch.undo()


def interrupt_at(monkeypatch, step: int) -> None:
    """KeyboardInterrupt while step `step` rolls out (nothing of it applied yet)."""
    experience = Trainer.experience

    def interrupted(self, s):
        if s == step:
            raise KeyboardInterrupt
        return experience(self, s)

    monkeypatch.setattr(Trainer, "experience", interrupted)


# ---------------------------------------------------------------- 3. resume checks what the run read

def test_resume_with_other_prompts_is_refused_naming_them(setup, tmp_path):
    run = tmp_path / "run"
    assert runner.invoke(app, setup["args"](run, "--steps", "1")).exit_code == 0
    before = digest(run / "metrics.parquet")
    other = write_artifact(setup["rows"][:4], tmp_path / "other.parquet", "prompts")
    line = error_line(runner.invoke(app, setup["args"](run, "--resume", prompts_path=other)))
    assert f"--resume: {run} was trained on other prompts than --prompts holds" in line
    assert "only --steps, --checkpoint-every and --eval-every may change on resume" in line
    line = error_line(runner.invoke(app, [*setup["args"](run, "--resume"), "--lr", "0.1"]))
    assert "was trained with --lr 0.05, not 0.1" in line
    line = error_line(runner.invoke(app, [*setup["args"](run, "--resume"), "--budget", "64"]))
    assert "--budget/--schedule/--dense 'budget:48', not 'budget:64'" in line
    assert digest(run / "metrics.parquet") == before and len(metrics(run)) == 1
    same = tmp_path / "same.parquet"  # the same prompts at another path: the same run
    same.write_bytes(setup["prompts"].read_bytes())
    r = runner.invoke(app, setup["args"](run, "--resume", "--steps", "2", prompts_path=same))
    assert r.exit_code == 0, r.output
    assert len(metrics(run)) == 2


def test_resume_with_other_eval_prompts_or_schedule_content_is_refused(setup, tmp_path):
    schedule = tmp_path / "schedule.parquet"

    def plan(budget: int) -> None:
        write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [budget], "tail": [None],
                        "predicted_step_seconds": [None]}, schedule, "schedule", {"page_size": 16})

    plan(48)
    run = tmp_path / "run"
    base = [a for a in setup["args"](run, "--steps", "1") if a not in ("--budget", "48")]
    assert runner.invoke(app, [*base, "--schedule", str(schedule)]).exit_code == 0, "first run"
    plan(64)  # the same path, other budgets
    line = error_line(runner.invoke(app, [*base, "--schedule", str(schedule), "--resume"]))
    assert "was trained with another schedule than --schedule holds (its budgets differ)" in line
    plan(48)
    held = write_artifact(setup["rows"][:2], tmp_path / "held.parquet", "prompts")
    i = base.index("--eval-prompts")
    line = error_line(runner.invoke(app, [*base[:i + 1], str(held), *base[i + 2:], "--schedule",
                                          str(schedule), "--resume"]))
    assert "was trained on other held-out prompts than --eval-prompts holds" in line


def test_resume_from_a_model_rewritten_in_place_is_refused(setup, tmp_path):
    """A checkpoint folder written again since the run began (a re-export at the same path) is not the
    model the run's steps were taken from; a run that did not record its model's files is not checked."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_path(setup), model)
    run = tmp_path / "run"

    def args(*extra: str) -> list[str]:
        given = setup["args"](run, *extra)
        return [str(model) if a == tiny_llama_path(setup) else a for a in given]

    assert runner.invoke(app, args("--steps", "1")).exit_code == 0
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes, written again
    before = digest(run / "metrics.parquet")
    line = error_line(runner.invoke(app, args("--resume", "--steps", "2")))
    assert f"--resume: {run} was trained from {model} as its files were then; they have been written " \
           "since" in line
    assert digest(run / "metrics.parquet") == before
    config = run / "checkpoint" / "config.json"
    saved = json.loads(config.read_text())
    del saved["model_files_sha256"]  # a checkpoint that did not record it
    config.write_text(json.dumps(saved))
    r = runner.invoke(app, args("--resume", "--steps", "2"))
    assert r.exit_code == 0, r.output
    assert len(metrics(run)) == 2


def tiny_llama_path(setup) -> str:
    args = setup["args"](setup["root"])
    return args[args.index("--model") + 1]


def test_a_checkpoint_without_recorded_prompts_is_refused_then_forced(setup, tmp_path):
    run = tmp_path / "run"
    assert runner.invoke(app, setup["args"](run, "--steps", "1")).exit_code == 0
    config = run / "checkpoint" / "config.json"
    saved = json.loads(config.read_text())
    for key in ("prompts_sha256", "eval_prompts_sha256", "schedule_sha256"):
        del saved[key]  # a configuration that does not name them
    config.write_text(json.dumps(saved))
    line = error_line(runner.invoke(app, setup["args"](run, "--resume")))
    assert "was written by a Sparrow that did not record its prompts" in line and "--force" in line
    r = runner.invoke(app, setup["args"](run, "--force", "--steps", "1"))
    assert r.exit_code == 0, r.output
    assert metrics(run, evals=False) == metrics(setup["straight"], evals=False)[:1]


# ---------------------------------------------------------------- 4. an interrupt is not a dead end

def test_an_interrupted_run_resumes_to_the_uninterrupted_one(setup, tmp_path, monkeypatch):
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        interrupt_at(m, 2)
        r = runner.invoke(app, setup["args"](run))
    assert r.exit_code == 130
    said = " ".join(r.stderr.split())
    assert f"interrupted; {run}/checkpoint holds the 2 complete steps of 3; add --resume" in said
    assert json.loads((run / "checkpoint" / "progress.json").read_text())["step"] == 2
    assert len(metrics(run)) == 2 and metrics(run) == metrics(setup["straight"])[:2]
    steps = sorted(p.name for p in (run / "mismatch").iterdir())
    assert steps == ["step=00001.parquet", "step=00002.parquet"]
    line = error_line(runner.invoke(app, setup["args"](run)))  # a fresh run over it says what to do
    assert "already holds a run (2 logged steps, a checkpoint at step 2); pass --resume to continue it, " \
           "--force to start it over" in line
    r = runner.invoke(app, setup["args"](run, "--resume"))
    assert r.exit_code == 0, r.output
    assert metrics(run) == metrics(setup["straight"])
    logged = [read_artifact(r / "completions", "train_completions") for r in (run, setup["straight"])]
    assert logged[0].to_pylist() == logged[1].to_pylist()  # each step's completions once, as uninterrupted
    a, b = adapter(run), adapter(setup["straight"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigint_during_an_update_waits_for_the_step_to_end(setup, tmp_path, monkeypatch):
    """A real SIGINT while step 2's weights change: the step finishes (its eval skipped), its checkpoint is
    written, and the resumed run is the uninterrupted one but for that eval."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever ran us
    update = Learner.update

    def update_with_sigint(self, exp):
        if exp.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return update(self, exp)

    run = tmp_path / "run"
    try:
        with monkeypatch.context() as m:
            m.setattr(Learner, "update", update_with_sigint)
            r = runner.invoke(app, setup["args"](run))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert r.exit_code == 130, r.output
    assert json.loads((run / "checkpoint" / "progress.json").read_text())["step"] == 2
    # the interrupt waited for the update and the logs, not for step 2's eval, which it skipped
    assert metrics(run, evals=False) == metrics(setup["straight"], evals=False)[:2]
    assert metrics(run)[1]["eval_accuracy"] is None
    assert metrics(setup["straight"])[1]["eval_accuracy"] is not None
    r = runner.invoke(app, setup["args"](run, "--resume"))
    assert r.exit_code == 0, r.output
    assert metrics(run, evals=False) == metrics(setup["straight"], evals=False)
    assert metrics(run)[2] == metrics(setup["straight"])[2]  # the last step's eval included
    a, b = adapter(run), adapter(setup["straight"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_force_starts_an_interrupted_run_over(setup, tmp_path, monkeypatch):
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        interrupt_at(m, 2)
        assert runner.invoke(app, setup["args"](run)).exit_code == 130
    (run / "notes.txt").write_text("mine")
    r = runner.invoke(app, setup["args"](run, "--force", "--steps", "1"))
    assert r.exit_code == 0, r.output
    assert metrics(run, evals=False) == metrics(setup["straight"], evals=False)[:1]
    assert (run / "notes.txt").read_text() == "mine"
    assert [p.name for p in (run / "mismatch").iterdir()] == ["step=00001.parquet"]  # the old step 2 went
    assert json.loads((run / "checkpoint" / "progress.json").read_text())["step"] == 1
    line = error_line(runner.invoke(app, setup["args"](run, "--force", "--resume")))
    assert "pass --resume (continue the run) or --force (start it over), not both" in line


# ---------------------------------------------------------------- a resume that cannot go on says so first

def tree_digest(run) -> dict[str, str]:
    return {str(p.relative_to(run)): digest(p) for p in sorted(run.rglob("*")) if p.is_file()}


def no_model_load(monkeypatch) -> None:
    """Fails the test if the command loads the model: these refusals come before the weights."""
    import sparrow.stages.model.loading as loading

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(loading, "load_model", refuse)


@pytest.mark.parametrize("damage", ["truncated", "random bytes"])
def test_a_damaged_checkpoint_is_one_sentence_and_changes_nothing(setup, tmp_path, monkeypatch, damage):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(setup["straight"], run)
    state = run / "checkpoint" / "state.pt"
    if damage == "truncated":
        os.truncate(state, state.stat().st_size // 2)
    else:
        state.write_bytes(os.urandom(100))
    before = tree_digest(run)
    no_model_load(monkeypatch)
    r = runner.invoke(app, setup["args"](run, "--resume", "--steps", "4"))
    assert r.exit_code == 2
    assert error_line(r) == (f"error: --resume: {state} cannot be read (damaged?); pass --force instead of "
                             "--resume to start the run over")
    assert tree_digest(run) == before


def test_a_checkpoint_without_its_state_is_named_and_can_be_forced(setup, tmp_path, monkeypatch):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(setup["straight"], run)
    (run / "checkpoint" / "state.pt").unlink()
    with monkeypatch.context() as m:
        no_model_load(m)
        line = error_line(runner.invoke(app, setup["args"](run, "--resume", "--steps", "4")))
    assert line.startswith(f"error: --resume: {run / 'checkpoint' / 'state.pt'} is missing")
    assert "pass --force instead of --resume" in line
    r = runner.invoke(app, setup["args"](run, "--force", "--steps", "1"))
    assert r.exit_code == 0, r.output
    assert (run / "checkpoint" / "state.pt").is_file()


@pytest.mark.parametrize("steps", ["2", "3"])
def test_a_resume_with_no_step_left_is_refused_before_the_model_loads(setup, tmp_path, monkeypatch, steps):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(setup["straight"], run)
    before = tree_digest(run)
    no_model_load(monkeypatch)
    r = runner.invoke(app, setup["args"](run, "--resume", "--steps", steps))
    assert r.exit_code == 2
    assert error_line(r) == (f"error: --resume: {run} already holds 3 steps, so --steps {steps} leaves none "
                             "to train; give --steps above 3 to continue it")
    assert tree_digest(run) == before


def test_an_interrupted_forced_run_says_to_replace_force_with_resume(setup, tmp_path, monkeypatch):
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        interrupt_at(m, 1)
        r = runner.invoke(app, setup["args"](run, "--force"))
    assert r.exit_code == 130
    said = " ".join(r.stderr.split())
    assert (f"{run}/checkpoint holds the 1 complete step of 3; replace --force with --resume in the same "
            "command to continue") in said
    r = runner.invoke(app, setup["args"](run, "--resume"))  # the command the hint describes
    assert r.exit_code == 0, r.output
    assert metrics(run) == metrics(setup["straight"])
