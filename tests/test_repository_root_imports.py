"""Python started in the repository root sees its kernels/ folder (installed as sparrow.kernels) as a
top-level `kernels`, the name of the Hugging Face package transformers imports for its hub kernels."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _installed_kernels() -> Path | None:
    try:
        return Path(distribution("kernels").locate_file("kernels")).resolve()
    except PackageNotFoundError:
        return None


@pytest.mark.skipif(_installed_kernels() is None, reason="the kernels package is not installed")
def test_the_installed_kernels_package_is_imported_from_the_repository_root():
    code = ("import transformers.integrations.hub_kernels, kernels, sparrow.kernels.ops; "
            "print(kernels.__file__)")
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()).resolve().parent == _installed_kernels()


def test_without_the_package_the_refusal_names_the_folder():
    proc = _python("-S", "-c", "import kernels")  # -S: no site-packages, so no kernels package
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named 'kernels'")
    assert "sparrow.kernels" in last


def test_a_missing_dependency_of_the_installed_package_is_named_as_itself(tmp_path):
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import a_dependency_nobody_has\n")
    code = f"import sys; sys.path[:0] = ['', {str(fake.parent)!r}]; import kernels"
    proc = _python("-S", "-c", code)
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "ModuleNotFoundError: No module named 'a_dependency_nobody_has'"
