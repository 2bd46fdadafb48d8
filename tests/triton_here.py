"""Imported first by test modules that run the Triton kernels: on a machine without CUDA it turns the
Triton interpreter on before anything imports triton. When some earlier module imported triton without
it, the kernels cannot run in this process: `needs_triton` skips them and each module's
`test_in_fresh_process` (through `rerun_in_fresh_process`) runs the module again in a new one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

from sparrow.kernels._triton_utils import HAS_TRITON, interpreter_usable  # noqa: E402

TRITON_HERE = HAS_TRITON and (DEVICE == "cuda" or interpreter_usable())
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="triton was imported without the interpreter here; "
                                                          "test_in_fresh_process runs these")
in_fresh_process = pytest.mark.skipif(TRITON_HERE or not HAS_TRITON,
                                      reason="the interpreter works in this process")


def rerun_in_fresh_process(request, module_file: str) -> None:
    """Run the test module `module_file` again, in a new process with the interpreter on."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    marker = request.config.getoption("-m") or "not slow"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker,
                           module_file], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
