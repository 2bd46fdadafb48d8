"""The package's shape: imports point down (no cycles among modules, the engine imports no stage), and
the installed wheel holds every module of the tree."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]  # dotted package -> folder


def modules() -> dict[str, Path]:
    """Every module of the tree by its installed dotted name."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `name` imports anywhere in its body (function-level imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    shown = [" <-> ".join(c) for c in cycles(graph)]
    assert not shown, "import cycles: " + "; ".join(shown)


def test_cycle_finder_sees_function_level_imports(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from .b import g\n")
    b = tmp_path / "b.py"
    b.write_text("from .a import f\n")
    known = {"p.a", "p.b"}
    graph = {"p.a": imports("p.a", a, known), "p.b": imports("p.b", b, known)}
    assert cycles(graph) == [["p.a", "p.b"]]


def folder_of(name: str) -> str:
    """A module's part of the tree: the sub-package of stages/ it lies in (sparrow.stages.engine for
    sparrow.stages.engine.gpu.runner), else the top package (sparrow.cli, sparrow.kernels, ...)."""
    parts = name.split(".")
    if parts[:2] == ["sparrow", "stages"] and len(parts) > 3:
        return ".".join(parts[:3])
    return name if parts[:2] == ["sparrow", "stages"] else ".".join(parts[:2])


def test_folders_import_each_other_one_way():
    """No loop among the parts either: two sub-packages never import each other, not even through a
    third, so every part of stages/ stands on the ones it uses."""
    graph: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        graph.setdefault(folder_of(name), set()).update(folder_of(t) for t in targets)
    graph = {f: targets - {f} for f, targets in graph.items()}
    shown = [" <-> ".join(c) for c in cycles(graph)]
    assert not shown, "folders importing each other: " + "; ".join(shown)


STAGE_LAYERS = ("sparrow.cli", "sparrow.stages.train", "sparrow.stages.scoring", "sparrow.stages.backends",
                "sparrow.stages.tasks")


def test_the_engine_imports_no_stage():
    """stages/engine/ sits below every stage: it may import the model, attention, KV policies, the shared
    vocabulary (stages/core), kernels and schemas, never a stage module or what stands on the engine."""
    graph = import_graph()
    flat_stages = {n for n, p in modules().items()
                   if p.parent == ROOT / "stages" and p.name != "__init__.py"}
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("sparrow.stages.engine")
                   for t in targets if t in flat_stages or t.startswith(STAGE_LAYERS))
    assert not wrong, "the engine imports above itself: " + "; ".join(wrong)


def test_no_part_imports_a_stage():
    """The flat modules of stages/ and the stages of several modules (sql/, report/: docs/layout.md) are the
    stages the CLI calls; what they are built from (the other sub-packages, kernels, schemas) imports none
    of them, nor the CLI."""
    graph, mods = import_graph(), modules()
    stages = {n for n, p in mods.items()
              if (p.parent == ROOT / "stages" and p.name != "__init__.py")
              or p.parent in (ROOT / "stages" / "sql", ROOT / "stages" / "report")}
    parts = [m for m in graph if m not in stages and not m.startswith("sparrow.cli")]
    wrong = sorted(f"{m} -> {t}" for m in parts for t in graph[m]
                   if t in stages or t.startswith("sparrow.cli"))
    assert not wrong, "a part imports a stage: " + "; ".join(wrong)


def test_package_list_is_the_tree():
    """pyproject's package list (setuptools cannot discover packages under package-dir) names every
    folder of the tree that is a package, and nothing else."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    tree = {n for n, p in modules().items() if p.name == "__init__.py"}
    assert listed == tree, f"missing from pyproject: {sorted(tree - listed)}; not in the tree: " \
                           f"{sorted(listed - tree)}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tracked tree: setuptools' build/ folder in the checkout could hold modules
    that are gone from it."""
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True)
    for name in tracked.stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--wheel-dir", str(out), str(source)], check=True, cwd=source, capture_output=True)
    return next(out.glob("sparrow_rl-*.whl"))


def test_the_wheel_holds_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
                for name, path in modules().items()}
    assert not expected - names, f"the wheel lacks {sorted(expected - names)}"
    data = {f"sparrow/stages/data/{p.name}" for p in (ROOT / "stages" / "data").glob("*.parquet")}
    data |= {f"sparrow/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.cpp")}
    assert data and not data - names, f"the wheel lacks {sorted(data - names)}"


@pytest.mark.slow
def test_the_wheel_rolls_out_in_a_fresh_venv(wheel, tmp_path):
    """A non-editable install of the wheel alone (its dependencies seen through this venv's site-packages,
    not its source tree) runs `sparrow rollout` on a tiny model."""
    from tiny_models import tiny_chat_llama

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "deps.pth").write_text("\n".join(deps) + "\n")  # a path entry: its .pth files are not run
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    where = subprocess.run([python, "-c", "import sparrow.stages.engine.engine as e; print(e.__file__)"],
                           check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert where.startswith(str(site)), where
    model = tiny_chat_llama(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_id": "a", "task": "chain_sum", "prompt": "What is 2 + 3?", "answer": "5"}\n')
    sparrow = [python, "-c", "from sparrow.cli.app import main; main()"]
    run = subprocess.run([*sparrow, "rollout", "--model", model, "--prompts", str(prompts), "--budget", "48",
                          "--max-new-tokens", "4", "-o", str(tmp_path / "r.parquet")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "r.parquet").stat().st_size > 0
