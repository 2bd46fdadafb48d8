"""bench/gpu_window.sh's plan (no torch, no GPU): both phases listed, each inside its budget, the two
together inside the lent window's 11 minutes; an unknown phase refused; both GPU scripts parse."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {"a": 420, "b": 300}


def bash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", ["bench/gpu_window.sh", "bench/gpu_checks.sh", "bench/gpu_common.sh"])
def test_scripts_parse(script):
    proc = bash("-n", script)
    assert proc.returncode == 0, proc.stderr


def test_plan_lists_both_phases_within_their_budgets():
    proc = bash("bench/gpu_window.sh", "--plan")
    assert proc.returncode == 0, proc.stderr
    totals = {}
    for phase in BUDGETS:
        block = re.search(rf"^phase {phase} .*?^  total +(\d+) s of (\d+)$", proc.stdout, re.M | re.S)
        assert block, f"phase {phase} missing from the plan:\n{proc.stdout}"
        steps = re.findall(r"^  (\S+) +(\d+) s  ", block.group(0), re.M)
        assert steps and sum(int(s) for _, s in steps) == int(block.group(1))
        totals[phase] = int(block.group(1))
        assert totals[phase] <= int(block.group(2)) <= BUDGETS[phase]
    assert sum(totals.values()) <= 660
    assert "kernel-tests" in proc.stdout and "rollout-8k" in proc.stdout


def test_unknown_phase_is_refused_in_one_sentence():
    proc = bash("bench/gpu_window.sh", "c")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "unknown phase" in proc.stderr


def test_a_failed_step_makes_the_summary_fail_and_a_skipped_one_does_not(tmp_path):
    """The scripts end with `summary`, so its status is theirs: a wrapper (the window's call, a CI job)
    reads a failed or cut-off step from the exit status."""
    script = (f'OUT={tmp_path}; source bench/gpu_common.sh; step fine 5 true; BUDGET=1 T0=$((SECONDS - 5)); '
              'step late 10 true; BUDGET=0; summary; echo "ok=$?"; step broken 5 false; summary; '
              'echo "bad=$?"')
    proc = bash("-c", script)
    assert "ok=0" in proc.stdout and "bad=1" in proc.stdout, proc.stdout + proc.stderr
    assert re.search(r"^late +skipped", proc.stdout, re.M) and re.search(r"^broken +rc=1", proc.stdout, re.M)


@pytest.mark.parametrize("args", [["bench/gpu_checks.sh"], ["bench/gpu_checks.sh", "kernels"],
                                  ["bench/gpu_window.sh", "a"]])
def test_without_a_mode_or_a_gpu_the_scripts_refuse_before_any_step(args, tmp_path):
    proc = subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
