"""Progress on stderr: live bars only on a terminal that redraws; anywhere else (a log, a pipe, FORCE_COLOR
set for colour, TERM=dumb) whole lines, and a training step that runs long still says so in a log.

The expectations are the stream's own nature (a pipe from os.pipe, a pseudo-terminal from os.openpty) and
rich's own reading of the environment (FORCE_COLOR makes rich call a pipe a terminal), not the CLI's
predicate itself; the distill line's floor is the definition of a KL divergence (never negative)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli import progress
from sparrow.cli.app import app
from sparrow.cli.console import console
from sparrow.cli.distill import shown_loss
from sparrow.cli.progress import Heartbeat, live_progress, log_line
from sparrow.schemas import write_artifact

from tiny_models import tiny_chat_llama

runner = CliRunner()
CR, ESC = "\r", "\x1b"


@pytest.fixture
def stderr_pipe(monkeypatch):
    """The console writing into a real pipe, as `> log 2>&1` makes stderr; yields a reader of it."""
    read_fd, write_fd = os.pipe()
    writer = os.fdopen(write_fd, "w")
    monkeypatch.setattr(console, "_file", writer)
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)

    def read() -> str:
        writer.flush()
        os.set_blocking(read_fd, False)
        try:
            return os.read(read_fd, 1 << 20).decode()
        except BlockingIOError:
            return ""

    yield read
    writer.close()
    os.close(read_fd)


@pytest.fixture
def stderr_tty(monkeypatch):
    """The console writing into a real pseudo-terminal."""
    leader, follower = os.openpty()
    writer = os.fdopen(follower, "w")
    monkeypatch.setattr(console, "_file", writer)
    monkeypatch.delenv("TTY_INTERACTIVE", raising=False)
    yield writer
    writer.close()
    os.close(leader)


@pytest.mark.parametrize("env", [{}, {"FORCE_COLOR": "1"}, {"FORCE_COLOR": "0"}, {"TTY_COMPATIBLE": "1"}])
def test_a_pipe_gets_whole_lines_whatever_forces_colour(stderr_pipe, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert console.is_terminal == bool(env)  # rich itself calls the pipe a terminal under these
    assert not live_progress()
    log_line("train step 1/2: reward 0.000 acc 0.00 | " + "x" * 200 + " | 11.3 s")
    shown = stderr_pipe()
    assert shown.endswith(" | 11.3 s\n") and CR not in shown and ESC not in shown
    assert console.size.width > 1000  # a log is as wide as its lines: nothing is cut to 80 columns


@pytest.mark.parametrize("term, live", [("xterm-256color", True), ("dumb", False), ("unknown", False)])
def test_a_terminal_gets_a_bar_unless_it_cannot_redraw(stderr_tty, monkeypatch, term, live):
    monkeypatch.setenv("TERM", term)
    assert live_progress() is live
    assert os.isatty(stderr_tty.fileno())


def test_tty_interactive_0_on_a_terminal_gets_lines(stderr_tty, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("TTY_INTERACTIVE", "0")
    assert not live_progress()


def test_a_heartbeat_says_what_runs_while_a_log_hears_nothing_else(stderr_pipe):
    with Heartbeat(every=0.05) as heartbeat:
        heartbeat.doing("rollout of train step 2/3")
        time.sleep(0.4)
        heartbeat.doing(None)
        said = stderr_pipe()
        time.sleep(0.3)
    lines = said.splitlines()
    assert lines and all(line.startswith("rollout of train step 2/3 ... (") for line in lines), said
    assert stderr_pipe() == ""  # nothing named: nothing said


class SlowStores(Heartbeat):
    """A heartbeat whose every attribute store, once `slow`, is followed by a pause: the thread then runs
    between any two stores that `doing` makes."""

    slow = False

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if self.slow:
            time.sleep(0.3)


def test_a_heartbeat_times_a_phase_from_its_own_start(stderr_pipe):
    with SlowStores(every=0.05) as heartbeat:
        heartbeat.doing("rollout of train step 1/2")
        time.sleep(1.1)
        stderr_pipe()
        object.__setattr__(heartbeat, "slow", True)
        heartbeat.doing("update of train step 1/2")
        object.__setattr__(heartbeat, "slow", False)
        heartbeat.doing(None)
        said = stderr_pipe()
    lines = [line for line in said.splitlines() if line.startswith("update of")]
    assert lines and all(line.endswith("(0 s so far)") for line in lines), said  # started 0.3 s ago at most


def test_a_heartbeat_counts_the_silence_from_its_own_start(stderr_pipe, monkeypatch):
    """The last progress line long before (another command's, or none since import): the first line still
    waits `every` seconds, not the thread's first tick (1 s)."""
    monkeypatch.setitem(progress._logged, "at", time.monotonic() - 100)
    with Heartbeat(every=1.5) as heartbeat:
        heartbeat.doing("eval of train step 1/1")
        time.sleep(1.2)
        said = stderr_pipe()
    assert said == ""


def test_no_heartbeat_where_the_bar_shows_the_time(stderr_tty, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    with Heartbeat(every=0.01) as heartbeat:
        heartbeat.doing("update of train step 1/1")
        time.sleep(0.05)
        assert heartbeat._thread is None


def test_a_negative_rounding_of_a_kl_shows_as_zero():
    assert f"{shown_loss(-1.32e-09):.4g}" == "0"
    assert f"{shown_loss(0.0123):.4g}" == "0.0123"


def _token_prompts(path, n: int = 2, length: int = 20, vocab: int = 500):
    rng = np.random.default_rng(0)
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": rng.integers(3, vocab, length).tolist(), "answer": "5", "metadata": None}
            for i in range(n)]
    return write_artifact(rows, path, "prompts")


def test_train_into_a_log_with_force_color_logs_every_step_and_its_phases(tmp_path, monkeypatch):
    """The Slurm case: stderr a log, FORCE_COLOR=1 in the job's environment. Every step is a whole line,
    no carriage return or escape; a phase that runs longer than the heartbeat says so for any step."""
    model = tiny_chat_llama(tmp_path / "tiny")
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.01)
    run = tmp_path / "run"
    prompts = _token_prompts(tmp_path / "p.parquet")
    r = runner.invoke(app, ["train", "--model", model, "--prompts", str(prompts),
                            "--prompts-per-step", "1", "--samples", "2", "--max-new-tokens", "4",
                            "--lora-rank", "2", "--budget", "48", "--steps", "2",
                            "--format", "json", "-o", str(run)], env={"FORCE_COLOR": "1"})
    assert r.exit_code == 0, r.output
    assert CR not in r.stderr and ESC not in r.stderr
    steps = [line.split(":")[0] for line in r.stderr.splitlines() if line.startswith("train step ")]
    assert steps == ["train step 1/2", "train step 2/2"]
    assert any(line.endswith(" s") and line.startswith("train step 2/2: ") for line in r.stderr.splitlines())
    assert any(" of train step 2/2 ... (" in line for line in r.stderr.splitlines()), r.stderr


def test_reward_with_a_slow_function_says_it_still_scores_in_a_log(tmp_path, monkeypatch):
    """`sparrow reward` counts nothing while a user's function runs over every completion: a log hears
    that it still scores, as it does of a training step's phase."""
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.05)
    prompts = _token_prompts(tmp_path / "p.parquet")
    completions = tmp_path / "c.jsonl"
    completions.write_text('{"prompt_id": "p0", "text": "5"}\n{"prompt_id": "p1", "text": "6"}\n')
    slow = tmp_path / "slow.py"
    slow.write_text("import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    time.sleep(0.3)\n    return 1.0\n")
    r = runner.invoke(app, ["reward", "--prompts", str(prompts), "--completions", str(completions),
                            "--reward-fn", str(slow), "-o", str(tmp_path / "r.parquet")])
    assert r.exit_code == 0, r.output
    assert any(line.startswith("scoring 2 completions ... (") for line in r.stderr.splitlines()), r.stderr
    assert CR not in r.stderr and ESC not in r.stderr


def test_profile_into_a_log_counts_the_tokens_it_samples(tmp_path):
    """A profile's sampling line in a log says how many tokens were generated (its samples may all finish
    at once, at the end): the last one counts every token the profile then scores, a trajectory's
    completion as the mismatch file holds it at one budget."""
    import pyarrow.parquet as pq

    model = tiny_chat_llama(tmp_path / "tiny")
    prompts = _token_prompts(tmp_path / "p.parquet")
    out = tmp_path / "profile.parquet"
    r = runner.invoke(app, ["profile", "--model", model, "--prompts", str(prompts), "--samples", "2",
                            "--max-new-tokens", "6", "--budgets", "48", "-o", str(out)])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("sampling")]
    scored = pq.read_table(out, columns=["budget"]).num_rows  # one budget: a row per completion token
    assert lines and lines[-1].split(": ", 1)[1].startswith(f"4/4, {scored:,} tokens"), r.stderr
