"""Outputs in shared folders: an existing output in a sticky folder (mode 1777, as /tmp or a cluster's
/scratch) that belongs to another user cannot be replaced, since the kernel refuses a rename over it
(EPERM) to anyone but the file's or the folder's owner or a process with CAP_FOWNER. It is refused before
any work, in one sentence, not after the whole run.

The tests run as root, who holds CAP_FOWNER: the rule is tested with the user id and the capability faked,
and against the kernel itself with root's owner capabilities dropped (setpriv), where a rename over the file
is tried first and must fail with EPERM: the independent expectation.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import sparrow.schemas.locations as locations
from sparrow.schemas import write_artifact
from sparrow.schemas.locations import UnusableOutput, check_output

OTHER = 4242  # a user that is not this process's
NOBODY = 65534
DROP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner,-chown,-fsetid"]


def artifact(path: Path) -> Path:
    n = 4
    z, i = np.zeros(n, np.float32), np.zeros(n, np.int32)
    return write_artifact({"prompt_id": ["p"] * n, "sample": i, "position": i, "bin": i, "budget": i + 64,
                           "token_id": i, "alpha": z, "logp_dense": z, "logp_sparse": z, "log_ratio": z,
                           "k1": z, "k2": z, "k3": z, "entropy_dense": z}, path, "mismatch")


@pytest.fixture()
def shared(tmp_path) -> Path:
    """A sticky folder holding an existing artifact, both owned by this process's user (root here)."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    folder.chmod(0o1777)
    artifact(folder / "theirs.parquet")
    return folder


@pytest.fixture()
def as_other(monkeypatch):
    """This process as another user without CAP_FOWNER, as an ordinary user on a cluster is."""
    monkeypatch.setattr(locations.os, "geteuid", lambda: OTHER)
    monkeypatch.setattr(locations, "has_fowner", lambda: False)


def test_another_users_file_in_a_sticky_folder_is_refused_before_work(shared, as_other):
    before = (shared / "theirs.parquet").read_bytes()
    with pytest.raises(UnusableOutput) as e:
        check_output(shared / "theirs.parquet", "mismatch")
    said = str(e.value)
    assert said.startswith(f"{shared / 'theirs.parquet'} belongs to another user in the sticky folder")
    assert "mode 1777" in said and "choose another path" in said and "\n" not in said
    assert (shared / "theirs.parquet").read_bytes() == before


@pytest.mark.parametrize("case", ["own file", "own folder", "not sticky", "CAP_FOWNER", "new file"])
def test_what_the_kernel_lets_replace_is_taken(shared, as_other, monkeypatch, case):
    target = shared / ("new.parquet" if case == "new file" else "theirs.parquet")
    if case == "own file":
        os.chown(target, OTHER, -1)
    elif case == "own folder":
        os.chown(shared, OTHER, -1)
    elif case == "not sticky":
        shared.chmod(0o777)
    elif case == "CAP_FOWNER":
        monkeypatch.setattr(locations, "has_fowner", lambda: True)
    check_output(target, "mismatch")


def test_through_a_symlink_the_targets_folder_counts(shared, as_other, tmp_path):
    link = tmp_path / "mine.parquet"
    link.symlink_to(shared / "theirs.parquet")
    with pytest.raises(UnusableOutput, match="belongs to another user in the sticky folder"):
        check_output(link, "mismatch")


def _run_dropped(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*DROP, sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to drop the owner capabilities")
def test_the_rule_agrees_with_the_kernel(shared):
    os.chown(shared, NOBODY, -1)
    os.chown(shared / "theirs.parquet", NOBODY, -1)
    rename = ("import errno, os\nopen('mine.tmp', 'w').close()\n"
              "try:\n    os.rename('mine.tmp', 'theirs.parquet')\nexcept OSError as e:\n    print(e.errno)\n"
              "    os.unlink('mine.tmp')\nelse:\n    print(0)")
    kernel = _run_dropped(rename, shared)
    assert kernel.stdout.split() == [str(errno.EPERM)], kernel.stderr
    check = ("from sparrow.schemas.locations import check_output, UnusableOutput, has_fowner\n"
             "print(has_fowner())\ntry:\n    check_output('theirs.parquet', 'mismatch')\n"
             "except UnusableOutput as e:\n    print(e)")
    ours = _run_dropped(check, shared)
    lines = ours.stdout.splitlines()
    assert lines[0] == "False" and lines[1].startswith("theirs.parquet belongs to another user"), ours.stderr
    check_output(shared / "theirs.parquet", "mismatch")  # root with CAP_FOWNER: the kernel lets it, so do we
    assert locations.has_fowner()
