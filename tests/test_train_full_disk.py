"""`sparrow train` on a disk that fills up (a quota, a file size limit): a checkpoint or a model folder that
cannot be written stops the run in one sentence naming it and the OS's reason, the previous checkpoint
kept, and --resume continues from it to what an uninterrupted run reaches; a tracker file (metrics.jsonl,
tensorboard) that cannot be written is a warning and the run goes on; a run directory that holds logged
steps but no checkpoint offers only what works.

A full disk is a real one for the write that meets it: RLIMIT_FSIZE lowered around that write alone (Python
ignores SIGXFSZ, so the write gets EFBIG "File too large" at the limit, as a full disk gets ENOSPC).
"""

from __future__ import annotations

import errno
import json
import resource
import sys
import types
import warnings
from contextlib import contextmanager

import pytest
import torch
from test_train import TIMING, tiny_llama, vowel_train_args  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact
from sparrow.stages.model import export
from sparrow.stages.train.tracking import JsonlTracker, Trackers

from cli_checks import error_line

runner = CliRunner()


@pytest.fixture()
def args(tiny_llama, tmp_path, monkeypatch):  # noqa: F811 - the imported fixture
    return lambda *extra: vowel_train_args(tiny_llama, tmp_path, monkeypatch, *extra)


@contextmanager
def file_size_limit(nbytes: int):
    """Files of this process cannot grow past `nbytes` inside the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def full_on_call(monkeypatch, owner, name: str, call: int, room=lambda *a: 512) -> None:
    """The `call`-th call of `owner.name` meets a full disk: its files may grow to `room(*its args)` bytes."""
    real, calls = getattr(owner, name), []

    def limited(*a, **kw):
        calls.append(a)
        if len(calls) != call:
            return real(*a, **kw)
        with file_size_limit(room(*a)):
            return real(*a, **kw)

    monkeypatch.setattr(owner, name, limited)


def failed(result) -> str:
    """The one error line of a run stopped after it started (its progress lines before it), exit 2."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert lines[-1].startswith("error:") and sum(line.startswith("error:") for line in lines) == 1
    return lines[-1]


def steps(run) -> list[int]:
    return read_artifact(run / "metrics.parquet", "metrics").column("step").to_pylist()


def rows(run) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING}
            for r in read_artifact(run / "metrics.parquet", "metrics").to_pylist()]


def checkpoint_at(run) -> int:
    return json.loads((run / "checkpoint" / "progress.json").read_text())["step"]


# ---------------------------------------------------------------- the checkpoint

def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one_and_resume_continues(args, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert runner.invoke(app, args("--steps", "2", "-o", str(straight))).exit_code == 0
    full_on_call(monkeypatch, torch, "save", call=2)  # step 1's checkpoint is written, step 2's is not
    run = tmp_path / "run"
    line = failed(runner.invoke(app, args("--steps", "2", "--checkpoint-every", "1")))
    assert f"cannot write {run}/checkpoint (File too large)" in line
    assert "keeps its checkpoint at step 1" in line and "--resume" in line and "--force" not in line
    assert checkpoint_at(run) == 1 and steps(run) == [1, 2]  # step 2 was logged, its checkpoint not
    assert not [f for f in run.iterdir() if f.name.startswith(".")]  # no half-written checkpoint left

    monkeypatch.undo()
    r = runner.invoke(app, args("--steps", "2", "--checkpoint-every", "1", "--resume"))
    assert r.exit_code == 0, r.output
    assert checkpoint_at(run) == 2 and rows(run) == rows(straight)
    assert sorted(f.name for f in (run / "mismatch").iterdir()) == [f"step=0000{s}.parquet" for s in (1, 2)]


def test_a_full_disk_at_the_first_checkpoint_says_force_and_force_works(args, tmp_path, monkeypatch):
    full_on_call(monkeypatch, torch, "save", call=1)
    run = tmp_path / "run"
    line = failed(runner.invoke(app, args()))
    assert f"cannot write {run}/checkpoint (File too large)" in line
    assert "no checkpoint yet" in line and "--force" in line and "--resume" not in line
    monkeypatch.undo()
    # the run directory holds a logged step and no checkpoint: only --force (or another -o) is offered
    line = error_line(runner.invoke(app, args()))
    assert "1 logged step, no checkpoint" in line and "--force" in line and "--resume" not in line
    assert "--force instead of --resume" in error_line(runner.invoke(app, args("--resume")))
    r = runner.invoke(app, args("--force"))
    assert r.exit_code == 0, r.output
    assert checkpoint_at(run) == 1 and steps(run) == [1]


def test_a_checkpoint_a_killed_write_moved_aside_is_offered_to_resume(args, tmp_path):
    assert runner.invoke(app, args()).exit_code == 0
    run = tmp_path / "run"
    (run / "checkpoint").rename(run / ".checkpoint.0123456789ab.old")  # killed between the two renames
    line = error_line(runner.invoke(app, args("--steps", "2")))
    assert "pass --resume to continue it" in line
    r = runner.invoke(app, args("--steps", "2", "--resume"))
    assert r.exit_code == 0, r.output
    assert checkpoint_at(run) == 2 and steps(run) == [1, 2]


def test_a_full_disk_at_the_full_model_export_is_one_sentence_and_resume_writes_it(args, tmp_path,
                                                                                  monkeypatch):
    """`train --full`'s RUN/model: safetensors reports a failed write as its own error type; the sentence
    names the folder and the OS's reason, and the checkpoint of the last step lets --resume write it."""
    full_on_call(monkeypatch, export, "save_weights", call=1, room=lambda *a: 4096)
    run = tmp_path / "run"
    line = failed(runner.invoke(app, full(args)))
    assert f"cannot write {run}/model (File too large)" in line
    assert "checkpoint holds the last step (1), so once it can be written, --resume with the same" in line
    assert not (run / "model").exists() and checkpoint_at(run) == 1
    monkeypatch.undo()
    r = runner.invoke(app, full(args, "--resume"))
    assert r.exit_code == 0, r.output
    assert (run / "model" / "model.safetensors").is_file()


# ---------------------------------------------------------------- the trackers

def full(args, *extra: str) -> list[str]:
    """The run's arguments with --full instead of its LoRA."""
    a = args("--full", *extra)
    at = a.index("--lora-rank")
    return a[:at] + a[at + 2:]


def jsonl_steps(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_full_disk_at_a_jsonl_line_is_a_warning_and_the_run_goes_on(args, tmp_path, monkeypatch):
    run = tmp_path / "run"
    # step 2's line meets a disk with room for 10 more bytes: the file keeps step 1's line whole, no half line
    full_on_call(monkeypatch, JsonlTracker, "log", call=2,
                 room=lambda tracker, row: tracker.path.stat().st_size + 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = runner.invoke(app, args("--steps", "3", "--report-to", "jsonl"))
    assert r.exit_code == 0, r.output
    said = r.stderr + " ".join(str(w.message) for w in caught)
    assert f"cannot write {run}/metrics.jsonl (File too large)" in said and "from step 2 on" in said
    assert checkpoint_at(run) == 3 and steps(run) == [1, 2, 3]
    assert jsonl_steps(run) == [1]
    monkeypatch.undo()
    r = runner.invoke(app, args("--steps", "4", "--report-to", "jsonl", "--resume"))
    assert r.exit_code == 0, r.output
    assert jsonl_steps(run) == [1, 2, 3, 4]  # a resume gives the tracker the steps it lacks


def test_a_jsonl_line_cut_off_by_a_full_disk_is_taken_back(tmp_path):
    tracker = JsonlTracker(tmp_path, 0)
    tracker.log({"step": 1, "loss": 0.5})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with file_size_limit(len(before) + 5), pytest.raises(OSError) as e:
        tracker.log({"step": 2, "loss": 0.25})
    assert e.value.errno == errno.EFBIG
    assert (tmp_path / "metrics.jsonl").read_bytes() == before == b'{"step": 1, "loss": 0.5}\n'


def test_a_tensorboard_tracker_that_cannot_write_is_dropped_with_one_warning(tmp_path, monkeypatch):
    logged, said = [], []

    class Writer:  # tensorboard's SummaryWriter raises its writer thread's OSError at the next flush
        def __init__(self, log_dir, purge_step=None):
            pass

        def add_text(self, *a):
            pass

        def add_scalar(self, key, value, global_step):
            logged.append(global_step)

        def flush(self):
            if logged[-1] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.flush()

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    trackers = Trackers(("tensorboard", "jsonl"), tmp_path, warn=said.append)
    for step in (1, 2, 3):
        trackers.log({"step": step, "loss": 1.0})
    trackers.close()
    assert said == [f"cannot write {tmp_path}/tensorboard (No space left on device), so --report-to "
                    "tensorboard logs no further step of this run (from step 2 on); metrics.parquet holds "
                    "every step"]
    assert logged == [1, 2] and [json.loads(s)["step"] for s in
                                 (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_tracker_warnings_without_a_warn_are_python_warnings(tmp_path):
    trackers = Trackers(("jsonl",), tmp_path)
    with pytest.warns(RuntimeWarning, match="metrics.jsonl"):
        with file_size_limit(0):
            trackers.log({"step": 1})


def test_an_interrupt_while_the_checkpoint_is_written_stays_an_interrupt(tmp_path, monkeypatch):
    """torch.save turns an exception of the file's write into a RuntimeError ("unexpected pos"); Ctrl-C
    there must reach the run as the interrupt it is (a checkpoint at the last step, exit 130), not as a
    traceback."""
    import builtins

    from sparrow.stages.train import checkpoint

    real_open, writes = builtins.open, []

    class Interrupted:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            writes.append(len(data))
            if len(writes) == 3:
                raise KeyboardInterrupt
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(checkpoint, "open", lambda *a, **k: Interrupted(real_open(*a, **k)), raising=False)
    with pytest.raises(KeyboardInterrupt):
        checkpoint._torch_save({"w": torch.zeros(1000)}, tmp_path / "state.pt")
    assert len(writes) == 3
