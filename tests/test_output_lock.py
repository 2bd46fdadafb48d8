"""A file output is held by the command writing it (a lock beside it, `schemas.locations.hold_output`), so
a second command writing the same file on this machine is refused at once, before any work, instead of
replacing the first one's result when it ends; the lock goes with the command, however it ends."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact

from cli_checks import error_line

runner = CliRunner()

HOLD = """
import sys, time
from sparrow.schemas.locations import hold_output
hold_output(sys.argv[1], "sparrow command", "another -o")
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def reward_args(tmp_path):
    data = tmp_path / "gsm8k.parquet"
    prompt = [{"role": "user", "content": "What is 1 + 1?"}]
    truth = {"style": "rule", "ground_truth": "2"}
    pd.DataFrame([{"data_source": "openai/gsm8k", "prompt": prompt, "ability": "math",
                   "reward_model": truth}]).to_parquet(data)
    done = tmp_path / "done.jsonl"
    done.write_text(json.dumps({"prompt_id": "gsm8k-0", "sample": 0, "text": "it is 2"}) + "\n")
    return lambda out: ["reward", "--prompts", str(data), "--completions", str(done), "--reward", "math",
                        "-o", str(out)]


def _hidden(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_second_writer_of_an_output_is_refused_and_the_first_ones_file_kept(reward_args, tmp_path):
    out = tmp_path / "rewards.parquet"
    assert runner.invoke(app, reward_args(out)).exit_code == 0
    before = out.read_bytes()
    assert _hidden(tmp_path) == []  # the command let go of its lock when it ended
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        r = runner.invoke(app, reward_args(out))
        assert r.exit_code == 2
        assert error_line(r) == (f"error: -o {out} is being written by another sparrow command (pid "
                                 f"{proc.pid}), and a second one would replace that one's result when it "
                                 "ends; wait for it to end, or choose another -o")
        assert out.read_bytes() == before
    finally:
        proc.kill()
        proc.wait()
    r = runner.invoke(app, reward_args(out))  # the killed holder's lock blocks nothing
    assert r.exit_code == 0, r.output
    assert read_artifact(out, "rewards").num_rows == 1 and _hidden(tmp_path) == []


def test_stdout_is_not_locked(reward_args, tmp_path):
    r = runner.invoke(app, reward_args("-"))
    assert r.exit_code == 0, r.output
    assert _hidden(tmp_path) == []
