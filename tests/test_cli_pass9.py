"""The CLI's edges a user meets first: every option's help, -h, vLLM's spellings of --top-k and --device,
a stdout that cannot be written, Ctrl-C while the command is still starting, `-` on a terminal's stdin,
`sql -o` onto a device and sql's clock, and a rollout bar whose clock starts with sampling.

Expected values come from outside the code under test: the documented exit codes (2 for an error, 130 for
Ctrl-C), the errno text of the operating system, what a real process prints through /dev/full, a closed
descriptor or a pseudo-terminal, pyproject's console script, and the tokens of a run given the equivalent
spelling.
"""

from __future__ import annotations

import errno
import io
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
import torch
import typer
from rich.progress import Progress
from typer.testing import CliRunner

from sparrow.cli import output, rollout
from sparrow.cli.app import app
from sparrow.cli.console import StdoutFailed
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact

from cli_checks import error_line

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
COMMANDS = typer.main.get_command(app).commands
# the console script as pip writes it for pyproject's [project.scripts] entry
SCRIPT = "import sys; from {module} import {name}; sys.exit({name}())"
INTERRUPTED = "interrupted; nothing half-written was left behind"


def _script() -> list[str]:
    module, name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["sparrow"] \
        .split(":")
    return [sys.executable, "-c", SCRIPT.format(module=module, name=name)]


def _token_prompts(path: Path, n: int = 2, length: int = 12) -> Path:
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": [(7 * i + 3 * j) % 400 + 3 for j in range(length)], "answer": "5",
             "metadata": None} for i in range(n)]
    return write_artifact(rows, path, "prompts")


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------- every option says what it does; -h


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_of_every_command_has_a_help_text(command):
    bare = [p.opts[0] for p in COMMANDS[command].params
            if p.param_type_name == "option" and len((p.help or "").strip()) < 12]
    assert not bare, f"{command}: options without a help text: {bare}"


@pytest.mark.parametrize("args", [(), ("rollout",), ("sql",), ("train",)])
def test_dash_h_is_help_everywhere(args):
    short, long = runner.invoke(app, [*args, "-h"]), runner.invoke(app, [*args, "--help"])
    assert (short.exit_code, long.exit_code) == (0, 0), short.output
    assert short.stdout == long.stdout and "Usage:" in short.stdout


def test_the_help_of_seeds_and_zeros_says_what_they_mean():
    def help_of(command: str, flag: str) -> str:
        return next(p.help for p in COMMANDS[command].params if flag in p.opts)

    assert all(w in help_of("rollout", "--seed") for w in ("prompt", "sample", "--max-num-seqs"))
    for command in ("rollout", "profile"):
        assert "-1" in help_of(command, "--top-k") and "off" in help_of(command, "--top-k")
    for flag in ("--checkpoint-every", "--eval-every", "--ppo-epochs", "--steps"):
        assert "at least 1" in help_of("train", flag)
    assert "0" in help_of("train", "--temperature") and "refused" in help_of("train", "--temperature")


# ---------------------------------------------------------------- --top-k -1 and --device cuda:N


def test_top_k_minus_one_is_off_as_zero_is(tmp_path):
    prompts = _token_prompts(tmp_path / "p.parquet")
    common = ["rollout", "--model", "tiny-llama", "--prompts", str(prompts), "--samples", "2",
              "--max-new-tokens", "6", "--seed", "3", "-f", "json"]
    tokens = []
    for k in ("0", "-1"):
        out = tmp_path / f"k{k}.parquet"
        result = runner.invoke(app, [*common, "--top-k", k, "-o", str(out)])
        assert result.exit_code == 0, result.output
        tokens.append(read_artifact(out, "rollouts").column("token_ids").to_pylist())
        assert artifact_metadata(out)["top_k"] == 0
    assert tokens[0] == tokens[1]
    line = error_line(runner.invoke(app, [*common, "--top-k", "-2", "-o", str(tmp_path / "x.parquet")]))
    assert line == "error: --top-k must be a number of tokens >= 1, or 0 or -1 for off, got -2"
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize("command", ["rollout", "profile", "train", "distill", "fit-cost"])
def test_device_cuda_0_is_cuda_and_another_index_says_how_to_pick_it(tmp_path, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    prompts = _token_prompts(tmp_path / "p.parquet")
    args = {"fit-cost": [], "distill": ["--prompts", str(prompts), "--budget", "64"]}.get(
        command, ["--prompts", str(prompts)])
    run = [command, "--model", "tiny-llama", *args, "-o", str(tmp_path / "out")]
    same = error_line(runner.invoke(app, [*run, "--device", "CUDA:0"]))
    assert same == "error: --device cuda was given but no CUDA device is available"
    other = error_line(runner.invoke(app, [*run, "--device", "cuda:1"]))
    assert "CUDA_VISIBLE_DEVICES=1" in other and "--device cuda" in other
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- a stdout that cannot be written


def _run(args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    """The CLI as its console script runs it; stdout and stderr captured unless given."""
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.run([*_script(), *args], cwd=cwd, text=True, timeout=120, **kwargs)


WRITERS = [["models"], ["models", "-f", "table"], ["models", "-f", "json"], ["--version"],
           ["rollout", "--help"], ["prompts", "--task", "count", "--n", "2", "-o", "-"],
           ["sql", "SELECT 1 AS a"], ["sql", "SELECT 1 AS a", "-f", "csv"],
           ["sql", "SELECT 1 AS a", "-f", "json"], ["sql", "SELECT 1 AS a", "-o", "-"]]


@pytest.mark.parametrize("args", WRITERS, ids=" ".join)
def test_a_full_stdout_is_one_error_line_and_exit_2(tmp_path, args):
    with open("/dev/full", "w") as full:
        r = _run(args, tmp_path, stdout=full, stderr=subprocess.PIPE)
    assert r.returncode == 2, r.stderr
    assert _lines(r.stderr) == [f"error: cannot write stdout ({os.strerror(errno.ENOSPC)})"]


@pytest.mark.parametrize("args", [["models"], ["sql", "SELECT 1 AS a"], ["--help"],
                                  ["prompts", "--task", "count", "--n", "2", "-o", "-"]], ids=" ".join)
def test_a_closed_stdout_is_one_error_line_and_exit_2(tmp_path, args):
    r = _run(args, tmp_path, stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
    assert r.returncode == 2, r.stderr
    assert len(_lines(r.stderr)) == 1 and "stdout" in r.stderr and "closed" in r.stderr, r.stderr


def test_an_artifact_written_before_stdout_failed_is_whole(tmp_path):
    """plan-schedule writes its schedule, then prints it: the file is whole when the table cannot go out."""
    out = tmp_path / "s.parquet"
    with open("/dev/full", "w") as full:
        r = _run(["plan-schedule", "--model", "qwen3-4b", "-f", "tsv", "-o", str(out)], tmp_path,
                 stdout=full)
    assert r.returncode == 2 and _lines(r.stderr)[-1].startswith("error: cannot write stdout")
    assert read_artifact(out, "schedule").num_rows > 0
    assert [p.name for p in tmp_path.iterdir()] == ["s.parquet"]


class _FailingStdout(io.StringIO):
    def __init__(self, code: int):
        super().__init__()
        self.code = code

    def write(self, text: str) -> int:
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_write_out_turns_an_io_error_into_one_sentence(monkeypatch, code):
    monkeypatch.setattr(sys, "stdout", _FailingStdout(code))
    with pytest.raises(StdoutFailed, match=rf"^cannot write stdout \({os.strerror(code)}\)$"):
        output.write_out("x\n")


def test_a_reader_that_stops_early_is_still_not_a_failure(tmp_path):
    proc = subprocess.Popen([*_script(), "models"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tmp_path)
    proc.stdout.close()
    assert (proc.wait(timeout=120), proc.stderr.read()) == (0, b"")


# ---------------------------------------------------------------- Ctrl-C while the CLI starts


@pytest.mark.parametrize("after", [0.15, 0.4, 0.9, 1.6])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(tmp_path, after):
    """stdin is a pipe that never ends, so the command is still running whenever the signal comes: in
    Python's imports of the CLI, in reading the command line, or spooling stdin."""
    out = tmp_path / "r.parquet"
    proc = subprocess.Popen([*_script(), "rollout", "--prompts", "-", "-o", str(out)], cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 130, stderr
    assert _lines(stderr) == [INTERRUPTED]
    assert not out.exists()


def test_the_console_script_is_the_small_entry_module():
    """pyproject names the entry module, which imports nothing of the CLI before its handler is set."""
    script = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["sparrow"]
    assert script == "sparrow.cli.entry:main"
    source = (ROOT / "sparrow_cli" / "entry.py").read_text()
    top = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert top == ["from __future__ import annotations", "import os", "import sys"]


def test_a_thread_left_running_by_the_command_does_not_keep_the_process_alive():
    """A non-daemon thread that never ends (started by a user's reward function, say) would hang Python's
    exit after the command's work; the watchdog exits with the command's status once it has lingered."""
    code = ("import threading, time; from sparrow.cli.entry import _watch_lingering_threads; "
            "threading.Thread(target=time.sleep, args=(600,), name='stuck').start(); "
            "_watch_lingering_threads(3, linger=1)")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and time.monotonic() - start < 30
    assert done.stderr.strip() == ("warning: a thread started during the command (stuck) was still running "
                                   "1 s after it ended; exiting without it")
    finished = ("import threading, time; from sparrow.cli.entry import _watch_lingering_threads; "
                "threading.Thread(target=time.sleep, args=(1,)).start(); "
                "_watch_lingering_threads(0, linger=5)")
    done = subprocess.run([sys.executable, "-c", finished], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == ""  # a thread that ends in time: Python's own exit


def test_sigterm_after_the_command_ended_exits_with_the_commands_status():
    """A scheduler that stops a finished job while a thread lingers gets the command's status, not 143."""
    code = ("import os, signal, threading, time; from sparrow.cli.entry import _watch_lingering_threads; "
            "threading.Thread(target=time.sleep, args=(600,), name='stuck').start(); "
            "_watch_lingering_threads(0, linger=60); "
            "threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and time.monotonic() - start < 30 and done.stderr == ""


def test_ctrl_c_while_torch_imports_is_delivered_once_the_import_is_done():
    """torch's import runs C++ that calls back into Python; a KeyboardInterrupt raised there ends the
    process in std::terminate (exit 134, a core dump). Held back, it arrives once torch has imported, as
    the interrupt the CLI turns into its one line."""
    code = ("import os, signal, sys, threading\n"
            "from sparrow.cli.entry import _hold_signals_while_torch_imports\n"
            "import sparrow.schemas.signals  # as the CLI has by then\n"
            "_hold_signals_while_torch_imports()\n"
            "threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
            "try:\n"
            "    import torch\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted', 'torch._logging' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["interrupted", "True"], done.stderr


def test_held_signals_deliver_the_first_after_the_block():
    code = ("import os, signal\n"
            "from sparrow.schemas.signals import held_signals\n"
            "steps = []\n"
            "try:\n"
            "    with held_signals():\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        steps.append('after the signal')\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        steps.append('after the second')\n"
            "except KeyboardInterrupt:\n"
            "    print(steps, 'then interrupted')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "['after the signal', 'after the second'] then interrupted", done.stderr


# ---------------------------------------------------------------- `-` on a terminal's stdin


def _on_terminal_stdin(args: list[str], cwd: Path) -> tuple[int, str]:
    """Run the CLI with stdin on a pseudo-terminal; its exit status and stderr (None: it waited)."""
    main, follower = pty.openpty()
    proc = subprocess.Popen([*_script(), *args], cwd=cwd, stdin=follower, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    os.close(follower)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = None
    finally:
        while select.select([main], [], [], 0)[0]:
            try:
                os.read(main, 4096)
            except OSError:
                break
        os.close(main)
    return rc, proc.stderr.read().decode()


@pytest.mark.parametrize("args", [["rollout", "--prompts", "-", "-o", "r.parquet"],
                                  ["profile", "--rollouts", "-", "-o", "m.parquet"],
                                  ["reward", "--prompts", "p.parquet", "--completions", "-", "-o",
                                   "w.parquet"],
                                  ["rollout", "--prompts", "/dev/stdin", "-o", "r.parquet"]], ids=" ".join)
def test_dash_on_a_terminal_stdin_is_refused_at_once(tmp_path, args):
    _token_prompts(tmp_path / "p.parquet")
    rc, stderr = _on_terminal_stdin(args, tmp_path)
    assert rc == 2, stderr
    [line] = _lines(stderr)
    flag = args[args.index("-") - 1] if "-" in args else "--prompts"
    assert line.startswith(f"error: {flag} ") and "terminal" in line and "pipe or redirect" in line
    assert not [p for p in tmp_path.iterdir() if p.name != "p.parquet"]


def test_dash_with_stdin_closed_is_refused(tmp_path):
    r = _run(["rollout", "--prompts", "-", "-o", "r.parquet"], tmp_path, stderr=subprocess.PIPE,
             stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(0))
    assert r.returncode == 2
    assert _lines(r.stderr) == ["error: --prompts - reads stdin, which is closed here; pipe or redirect a "
                                "Parquet or JSONL file into it, or give a file path"]


# ---------------------------------------------------------------- sql: -o onto a device, and its clock


def test_sql_o_onto_a_device_names_the_device(tmp_path):
    line = error_line(runner.invoke(app, ["sql", "SELECT 1 AS a", "--run", str(tmp_path), "-o", "/dev/full"]))
    assert "/dev/full is a character device" in line and ".parquet" not in line


def test_sql_on_a_terminal_shows_its_clock_on_stderr_and_leaves_stdout_as_in_a_pipe(tmp_path):
    query = ["sql", "SELECT range AS n FROM range(3)", "--run", str(tmp_path), "-f", "tsv"]
    plain = _run(query, tmp_path)
    main, follower = pty.openpty()
    proc = subprocess.Popen([*_script(), *query], cwd=tmp_path, stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    stdout, _ = proc.communicate(timeout=120)
    drawn = b""
    while select.select([main], [], [], 0.2)[0]:
        try:
            chunk = os.read(main, 4096)
        except OSError:
            break
        if not chunk:
            break
        drawn += chunk
    os.close(main)
    assert proc.returncode == 0 and plain.returncode == 0, plain.stderr
    assert stdout.decode() == plain.stdout == "n\n0\n1\n2\n"
    assert b"running the query" in drawn and "running the query" not in plain.stderr


# ---------------------------------------------------------------- the rollout bar's clock


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rollout_bar_starts_with_sampling_and_its_rate_counts_sampling_alone(monkeypatch, capsys):
    """Reading, tokenizing and loading (10 s here) before the first engine step are not sampling time: the
    bar does not exist before that step, and its rate is the tokens after it over the time since."""
    clock = _Clock()
    monkeypatch.setattr(rollout.time, "perf_counter", clock)
    with Progress(disable=True) as bar:
        bars = rollout._Bars(bar, "rollouts (samples)", 8, rate=True)
        clock.now += 10.0  # the prompts read and the model loaded: nothing drawn yet
        assert bar.tasks == []
        bars.advance(0, 8)  # the first step: prefill, and each sample's first token
        assert len(bar.tasks) == 1 and bar.tasks[0].fields["rate"] == "8 tokens"
        clock.now += 2.0
        bars.advance(8, 40)  # 40 tokens in the 2 s since: 20 tok/s (not 48 in 12 s)
        assert bar.tasks[0].fields["rate"] == "48 tokens, 20.0 tok/s"
    logged = _lines(capsys.readouterr().err)
    assert logged[0] == "rollouts (samples): 0/8, 8 tokens (0 s)"
    assert logged[-1].startswith("rollouts (samples): 8/8, 48 tokens, 20.0 tok/s (")
