"""Bench results name the CPU they were measured on (its model and the vector extensions our kernels and
oneDNN choose by), read here from /proc/cpuinfo independently."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
common = importlib.import_module("common")

CPUINFO = Path("/proc/cpuinfo")


@pytest.mark.skipif(not CPUINFO.exists(), reason="no /proc/cpuinfo")
def test_the_cpu_is_named_with_its_bf16_extensions():
    lines = CPUINFO.read_text().splitlines()
    model = next(line.partition(":")[2].strip() for line in lines if line.startswith("model name"))
    flags = next(line.partition(":")[2].split() for line in lines if line.startswith("flags"))
    name = common.device_name(torch.device("cpu"))
    assert name.startswith(model)
    assert ("AVX512-BF16" in name) == ("avx512_bf16" in flags)
    assert ("AMX" in name) == ("amx_bf16" in flags)
