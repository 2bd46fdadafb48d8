"""A torchrun rank whose peers never come: it says where it waits, the wait is bounded and ends in one
sentence, and SIGINT/SIGTERM end it (stages/train/distributed.py: init_world)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from sparrow.schemas import write_artifact
from sparrow.stages.train.distributed import Rendezvous, rendezvous_timeout, wait_for_ranks

NEVER = threading.Event()  # never set: a join whose peers never come


def test_a_join_that_never_ends_is_cut_at_the_bound_in_one_sentence():
    said: list[str] = []
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        wait_for_ranks(NEVER.wait, Rendezvous(0, 2, "10.0.0.7:29613"), timeout=0.6, say_after=0.1,
                       say=said.append)
    assert 0.6 <= time.monotonic() - start < 2.0
    assert said == ["rank 0: waiting for 2 ranks at 10.0.0.7:29613 (up to 0.6 s; SPARROW_RENDEZVOUS_TIMEOUT "
                    "sets it)"]
    assert "\n" not in str(e.value) and "10.0.0.7:29613" in str(e.value) and "2 ranks" in str(e.value)


def test_a_quick_join_says_nothing_and_a_failed_one_is_one_sentence():
    said: list[str] = []
    wait_for_ranks(lambda: None, Rendezvous(1, 2, "h:1"), timeout=5, say=said.append)
    assert said == []

    def refused():
        raise RuntimeError("The server socket has failed to listen on any local network address.\n"
                           "port: 29613, useIpv6: false, code: -98, name: EADDRINUSE")

    with pytest.raises(ValueError, match=r"^rank 1 could not join the torchrun job at h:1: The server socket "
                                         r"has failed to listen on any local network address\.$"):
        wait_for_ranks(refused, Rendezvous(1, 2, "h:1"), timeout=5, say=said.append)


def test_the_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPARROW_RENDEZVOUS_TIMEOUT", raising=False)
    assert rendezvous_timeout() == 600.0  # torchrun's rendezvous join timeout
    monkeypatch.setenv("SPARROW_RENDEZVOUS_TIMEOUT", "45")
    assert rendezvous_timeout() == 45.0
    for bad in ("soon", "0", "-3", "inf", "nan"):
        monkeypatch.setenv("SPARROW_RENDEZVOUS_TIMEOUT", bad)
        with pytest.raises(ValueError, match="SPARROW_RENDEZVOUS_TIMEOUT"):
            rendezvous_timeout()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _half_job(tmp_path, timeout: str, rank: int = 0) -> subprocess.Popen:
    """`sparrow train` as rank `rank` of 2 where no other rank ever starts."""
    row = {"prompt_id": "p0", "task": "none", "prompt": "", "answer": None, "metadata": None,
           "prompt_token_ids": [5, 6, 7]}
    prompts = write_artifact([row], tmp_path / "p.parquet", "prompts")
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "SPARROW_RENDEZVOUS_TIMEOUT": timeout,
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-c", "from sparrow.cli.entry import main; main()", "train", "--prompts",
           str(prompts), "--steps", "1", "--prompts-per-step", "1", "--samples", "2",
           "-o", str(tmp_path / "run")]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_a_rank_alone_gives_up_at_the_bound(tmp_path):
    proc = _half_job(tmp_path, "1.5", rank=1)
    out, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and out == ""
    assert lines[-1].startswith("error: rank 1 waited 1.5 s at 127.0.0.1:") and "nothing listens" in lines[-1]
    assert not (tmp_path / "run").exists()


def test_sigterm_ends_the_wait(tmp_path):
    proc = _half_job(tmp_path, "600")
    line = proc.stderr.readline()  # after the few seconds a job whose ranks start together never waits
    assert line.startswith("rank 0: waiting for 2 ranks at 127.0.0.1:"), line
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - start < 5
    assert proc.returncode == 128 + signal.SIGTERM and err.strip().startswith("terminated;"), err
