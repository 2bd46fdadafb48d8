"""A bench script runs with bench/ first on sys.path (and the GPU scripts put bench/ on PYTHONPATH), so a
script named like an installed top-level package shadows it for every import, transformers' own included:
no bench script may take such a name."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_no_bench_script_shadows_an_installed_package():
    taken = set(packages_distributions()) | set(sys.stdlib_module_names)
    clashes = sorted(p.stem for p in BENCH.glob("*.py") if p.stem in taken)
    assert not clashes, f"bench scripts named like installed packages: {clashes}"


def test_transformers_imports_with_bench_first_on_the_path():
    code = "import transformers.activations, transformers.integrations.hub_kernels"
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCH)!r}); {code}"],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
