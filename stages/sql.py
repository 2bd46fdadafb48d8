"""DuckDB over a run directory: every artifact kind is a view, so questions about a run are SQL.

Views are named after the artifact kind in each Parquet footer, unioned by column name, with a
`source_file` column; unreadable files are skipped with a warning. Read only, twice over: only read
statements run, and DuckDB is sandboxed to the run's files. docs/sql.md gives the rules.
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from sparrow.schemas import ArtifactError, artifact_kind


class QueryError(ValueError):
    """A query DuckDB rejected; the message is one line."""


@dataclass(frozen=True)
class View:
    name: str
    files: tuple[Path, ...]
    artifact: bool  # files carry Sparrow metadata (then the view has `source_file`)


Warn = Callable[[str], None]


def run_views(run_dir: str | Path, warn: Warn | None = None) -> list[View]:
    """The views of a run directory: artifact kinds first, then other Parquet files. Files that are not
    readable Parquet are skipped, each with a `warn` (default: a Python warning)."""
    run_dir = Path(run_dir)
    warn = warn or _python_warning
    if not run_dir.exists():
        raise ArtifactError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise ArtifactError(f"{run_dir} is not a directory, and a run is a directory of artifacts")
    files = sorted(p for p in run_dir.glob("*.parquet") if p.is_file())
    for sub in sorted(p for p in run_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        entries = [e for e in sub.iterdir() if not e.name.startswith(".")]
        if entries and all(e.is_file() and e.suffix == ".parquet" for e in entries):
            files += sorted(entries)
    kinds: dict[Path, str | None] = {}
    for p in files:
        try:
            kinds[p] = artifact_kind(p)
        except ArtifactError as e:
            warn(f"{e}; skipped it")
    by_kind: dict[str, list[Path]] = {}
    for p, kind in kinds.items():
        if kind is not None:
            by_kind.setdefault(kind, []).append(p)
    views = [View(kind, tuple(paths), True) for kind, paths in sorted(by_kind.items())]
    taken = set(by_kind)
    for p, kind in kinds.items():
        if kind is None:
            name = base = _identifier(p.stem)
            i = 2
            while name in taken:
                name, i = f"{base}_{i}", i + 1
            taken.add(name)
            views.append(View(name, (p,), False))
    return views


def open_run(run_dir: str | Path, warn: Warn | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory, read-only DuckDB connection with one view per artifact kind (and per other Parquet
    file), sandboxed to the run's files (see the module's docstring). A view DuckDB cannot read is
    skipped with a `warn`."""
    warn = warn or _python_warning
    views = run_views(run_dir, warn)
    spill = tempfile.mkdtemp(prefix="sparrow-sql-")
    atexit.register(shutil.rmtree, spill, ignore_errors=True)  # also when a caller closes `con` itself
    con = duckdb.connect(":memory:", config={"autoinstall_known_extensions": False,
                                             "autoload_known_extensions": False, "temp_directory": spill})
    readable: list[str] = []
    try:
        for view in views:
            paths = [str(p.resolve()) for p in view.files]
            files = ", ".join(_literal(p) for p in paths)
            if view.artifact:
                select = (f"SELECT * EXCLUDE (filename), parse_filename(filename) AS source_file "
                          f"FROM read_parquet([{files}], union_by_name = true, filename = true)")
            else:
                select = f"SELECT * FROM read_parquet([{files}])"
            try:
                con.execute(f'CREATE VIEW "{view.name}" AS {select}')
                readable += paths
            except duckdb.Error as e:
                names = ", ".join(p.name for p in view.files)
                warn(f"DuckDB cannot read {names} in {run_dir} ({_first_line(e)}); skipped the view "
                     f"'{view.name}'")
        con.execute(f"SET allowed_paths = [{', '.join(_literal(p) for p in readable)}]")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except BaseException:
        _close(con)
        raise
    return con


READ_ONLY = {duckdb.StatementType.SELECT, duckdb.StatementType.MULTI}  # MULTI: PIVOT
WHY = {"COPY": "it writes files; write a result with -o FILE.parquet, or --format csv and a shell "
               "redirect",
       "EXPORT": "it writes files; write a result with -o FILE.parquet",
       "ATTACH": "it opens a database outside the run",
       "INSTALL": "no extension is installed or loaded", "LOAD": "no extension is installed or loaded"}


def check_read_only(query: str) -> None:
    """Refuse, with one sentence, any statement but a read (see the module's docstring)."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise QueryError(_first_line(e)) from None
    for st in statements:
        text = st.query.strip()
        if st.type == duckdb.StatementType.EXPLAIN:
            inner = re.sub(r"^EXPLAIN\s+(ANALYZE\s+)?", "", text, flags=re.IGNORECASE)
            if inner != text:
                check_read_only(inner)
                continue
        if st.type not in READ_ONLY:
            word = (text.split(None, 1) or ["?"])[0].upper()
            why = WHY.get(word, "only SELECT queries (WITH, DESCRIBE, SHOW, SUMMARIZE, PIVOT, EXPLAIN) run")
            raise QueryError(f"sparrow sql is read-only over the run's views, so {word} is refused: {why}")


def run_query(run_dir: str | Path, query: str, warn: Warn | None = None) -> pa.Table:
    """Run one read-only SQL query against a run directory's views; return the result as an Arrow
    table."""
    check_read_only(query)
    with _connection(run_dir, warn) as con:
        try:
            rel = con.sql(query)
            return rel.to_arrow_table() if rel is not None else pa.table({})
        except duckdb.Error as e:
            message = _first_line(e)
            if isinstance(e, duckdb.CatalogException):
                views = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() "
                                                   "WHERE NOT internal ORDER BY view_name").fetchall()]
                message += f" (views in {run_dir}: {', '.join(views) or 'none'})"
            elif isinstance(e, duckdb.PermissionException):
                message += " (sparrow sql reads only the run's artifacts, through their views)"
            raise QueryError(message) from None


@contextmanager
def _connection(run_dir: str | Path, warn: Warn | None) -> Iterator[duckdb.DuckDBPyConnection]:
    con = open_run(run_dir, warn)
    try:
        yield con
    finally:
        _close(con)


def _close(con: duckdb.DuckDBPyConnection) -> None:
    spill = con.execute("SELECT current_setting('temp_directory')").fetchone()[0]
    con.close()
    if spill and Path(spill).name.startswith("sparrow-sql-"):
        shutil.rmtree(spill, ignore_errors=True)


def _python_warning(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _identifier(stem: str) -> str:
    name = re.sub(r"\W+", "_", stem).strip("_") or "file"
    return f"_{name}" if name[0].isdigit() else name


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
