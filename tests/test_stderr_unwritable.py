"""A stderr that cannot be written (a log on a full disk: `2>/dev/full`) loses the messages, never the run:
the command carries on, writes its artifact and prints its result, as with a stderr whose reader is gone."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_cli_pass9 import _script

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")


def test_a_full_stderr_loses_messages_not_the_result(tmp_path: Path):
    out = tmp_path / "q.parquet"
    with open("/dev/full", "w") as full:
        done = subprocess.run([*_script(), "sql", "--run", str(tmp_path), "SELECT 42 AS a", "-o", str(out)],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=full, text=True, timeout=120)
    assert done.returncode == 0
    assert pq.read_table(out).to_pylist() == [{"a": 42}]
