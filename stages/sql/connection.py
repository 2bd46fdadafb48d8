"""The DuckDB connection over a run's views, read only twice over: only one read statement runs, and
DuckDB is locked to the run's files (no other file read or written, no extension, no network), before
the views are made. Its spill folder is bounded, goes with it, and a killed query's folder with the next
query."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

import duckdb

from .limits import Limits, QueryError, default_spill
from .views import View, Warn, python_warning, quoted_identifier, run_views, sql_literal, view_sql

SPILL_PREFIX = "sparrow-sql-"


def open_run(run_dir: str | Path, warn: Warn | None = None, memory: int | None = None,
             spill: int | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory, read-only DuckDB connection with the run's views (see `run_views`), sandboxed to the
    run's files (see the module's docstring), DuckDB's own memory at most `memory` bytes and its spill
    folder at most `spill` bytes (default: `default_spill`). A view DuckDB cannot read is skipped with a
    `warn`."""
    warn = warn or python_warning
    return open_views(run_dir, run_views(run_dir, warn), warn, memory, spill)[0]


def open_views(run_dir: str | Path, views: list[View], warn: Warn, memory: int | None,
               spill: int | None = None) -> tuple[duckdb.DuckDBPyConnection, Path]:
    """The connection of `open_run`, and its spill folder. The sandbox is on before any view exists: a
    view's SQL, built from the run's files, runs where only those files can be read."""
    _sweep_spills()
    folder = tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # also when a caller closes `con` itself
    config = {"autoinstall_known_extensions": False, "autoload_known_extensions": False,
              "temp_directory": folder}
    if memory is not None:
        config["memory_limit"] = f"{max(memory // 2**20, 1)}MiB"
    if spill is None:  # as a query's default: DuckDB's memory is half of the query's memory limit
        spill = default_spill(2 * memory if memory is not None else Limits().memory)
    config["max_temp_directory_size"] = f"{max(spill // 2**20, 1)}MiB"
    try:
        con = duckdb.connect(":memory:", config=config)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    root = Path(run_dir).resolve()
    try:
        files = sorted({str(p) for view in views for p in view.files})
        con.execute(f"SET allowed_paths = [{', '.join(sql_literal(p) for p in files)}]")
        con.execute("SET enable_progress_bar = false")  # stdout holds only the result
        con.execute("SET enable_external_access = false")
        for view in views:
            _create_view(con, view, root, run_dir, warn)
        con.execute("SET lock_configuration = true")
    except BaseException:
        close_run(con, folder)
        raise
    return con, Path(folder)


def _create_view(con: duckdb.DuckDBPyConnection, view: View, root: Path, run_dir: str | Path,
                 warn: Warn) -> None:
    """Create `view`, or skip it with a `warn`. Its SQL must parse as one CREATE statement: a second
    guard, after the names and literals it is built from."""
    names = ", ".join(s.name for s in view.sources)
    try:
        sql = f"CREATE VIEW {quoted_identifier(view.name)} AS {view_sql(view, root)}"
        statements = duckdb.extract_statements(sql)
        if len(statements) != 1 or statements[0].type != duckdb.StatementType.CREATE:
            raise ValueError("its SQL is not one CREATE VIEW statement")
        con.execute(sql)
    except (duckdb.Error, ValueError) as e:
        warn(f"DuckDB cannot read {names} in {run_dir} ({first_line(e)}); skipped the view '{view.name}'")


def close_run(con: duckdb.DuckDBPyConnection, folder: str | Path) -> None:
    try:
        con.interrupt()  # a query left running (stopped between two of its batches) ends now
        con.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _sweep_spills() -> None:
    """Remove the spill folders of earlier queries whose process is gone (killed before it could)."""
    for d in Path(tempfile.gettempdir()).glob(f"{SPILL_PREFIX}*-*"):
        pid = d.name[len(SPILL_PREFIX):].split("-", 1)[0]
        try:
            if pid.isdigit() and d.is_dir() and d.stat().st_uid == os.getuid() and not _alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


READ_ONLY = {duckdb.StatementType.SELECT, duckdb.StatementType.MULTI}  # MULTI: PIVOT
WHY = {"COPY": "it writes files; write a result with -o FILE.parquet, or --format csv and a shell "
               "redirect",
       "EXPORT": "it writes files; write a result with -o FILE.parquet",
       "ATTACH": "it opens a database outside the run",
       "INSTALL": "no extension is installed or loaded", "LOAD": "no extension is installed or loaded"}


def check_read_only(query: str) -> None:
    """Refuse, with one sentence, any statement but a read (see the module's docstring)."""
    for st in _statements(query):
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


def check_query(query: str) -> None:
    """One read statement, or one sentence saying why not."""
    check_read_only(query)  # first: a write is refused as one, whatever else the query holds
    n = len(_statements(query))
    if n == 0:
        raise QueryError("the query is empty; give one SQL statement, e.g. \"SHOW TABLES\"")
    if n > 1:
        raise QueryError(f"the query holds {n} statements, and sparrow sql runs one per call (each result "
                         f"is one table); run them one at a time")


def _statements(query: str) -> list:
    try:
        return duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise QueryError(first_line(e)) from None


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
