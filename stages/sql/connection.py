"""The DuckDB connection over a run's views, read only twice over: only one read statement runs (as
DuckDB's own parser reads it), and DuckDB is locked to the run's files, which it reads through a file system
that opens them for reading only (files.py), before the views are made: no other file is read, no file is
written, no extension is loaded, no network is reached. Its spill folder is bounded, goes with it, and a
killed query's folder with the next query.

The statement check trusts DuckDB's parser, never the statement's first word: DuckDB types a statement by
its top node, so a write can hide in a statement typed SELECT (a COPY or an INSERT in a WITH clause), and
DuckDB types MULTI every statement that holds a PIVOT whose columns come from the data (`COPY (PIVOT ...)
TO`, `CREATE TABLE ... AS PIVOT` as much as `PIVOT ...`). A SELECT runs when the tree DuckDB serializes for
it (`json_serialize_sql`) holds query nodes only; a MULTI, which DuckDB cannot serialize, runs when DuckDB
parses it as a subquery (`SELECT * FROM (...)`, where only a query parses) and no keyword of a write
(INSERT, UPDATE, DELETE, MERGE, COPY) is in it: a column of such a name must then be quoted."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import duckdb

from sparrow.schemas.io import process_alive

from .files import local_paths, reading_only
from .limits import Limits, QueryError, default_spill
from .views import View, Warn, python_warning, quoted_identifier, run_changed, run_views, vanished, view_sql

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
        reading_only(con, files)  # the only way to the run's files: read only
        con.execute("SET enable_progress_bar = false")  # stdout holds only the result
        for view in views:
            _create_view(con, view, root, run_dir, warn)
        con.execute("SET lock_configuration = true")
    except BaseException:
        close_run(con, folder)
        raise
    return con, Path(folder)


def _create_view(con: duckdb.DuckDBPyConnection, view: View, root: Path, run_dir: str | Path,
                 warn: Warn) -> None:
    """Create `view`, or skip it with a `warn`; RunChanged when one of its files went since the run was
    listed (DuckDB reads their footers here). Its SQL must parse as one CREATE statement: a second guard,
    after the names and literals it is built from."""
    names = ", ".join(s.name for s in view.sources)
    try:
        columns = _json_columns(con, view, root) if view.json_lines else None
        sql = f"CREATE VIEW {quoted_identifier(view.name)} AS {view_sql(view, root, columns)}"
        statements = duckdb.extract_statements(sql)
        if len(statements) != 1 or statements[0].type != duckdb.StatementType.CREATE:
            raise ValueError("its SQL is not one CREATE VIEW statement")
        con.execute(sql)
    except (duckdb.Error, ValueError) as e:
        if (gone := vanished(view.sources)) is not None:
            raise run_changed(gone.path) from None
        warn(f"DuckDB cannot read {names} in {run_dir} ({first_line(e)}); skipped the view '{view.name}'")


def _json_columns(con: duckdb.DuckDBPyConnection, view: View, root: Path) -> list[tuple[str, str]]:
    """The (name, type) of a JSON lines view's columns, as DuckDB detects them, sampled once on one thread:
    the detection reads through RunFiles (Python) from DuckDB's threads while the caller waits in DuckDB,
    which a busy CPU slows by orders of magnitude each time a view is made or bound; the view is then made
    with these columns, so a query binds it without sampling again."""
    con.execute("SET threads = 1")
    try:
        return [(name, kind) for name, kind, *_ in con.execute(f"DESCRIBE {view_sql(view, root)}").fetchall()]
    finally:
        con.execute("RESET threads")


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
            mine = d.is_dir() and d.stat().st_uid == os.getuid()
            if pid.isdigit() and mine and not process_alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue




QUERY_NODES = {"SELECT_NODE", "SET_OPERATION_NODE", "CTE_NODE", "RECURSIVE_CTE_NODE"}
QUERY_WORDS = {"SELECT", "FROM", "WITH", "VALUES", "TABLE", "PIVOT", "UNPIVOT", "PIVOT_WIDER", "PIVOT_LONGER",
               "DESCRIBE", "SHOW", "SUMMARIZE"}
WRITE_WORDS = ("COPY", "INSERT", "UPDATE", "DELETE", "MERGE")  # the statements a WITH clause may hold
WHY = {"COPY": "it writes files; write a result with -o FILE.parquet, or --format csv and a shell "
               "redirect",
       "EXPORT": "it writes files; write a result with -o FILE.parquet",
       "ATTACH": "it opens a database outside the run",
       "INSTALL": "no extension is installed or loaded", "LOAD": "no extension is installed or loaded",
       **{w: f"it writes a table (a column named {w.lower()} is read when quoted: \"{w.lower()}\")"
          for w in ("INSERT", "UPDATE", "DELETE", "MERGE")}}
READS = "only SELECT queries (WITH, DESCRIBE, SHOW, SUMMARIZE, PIVOT, EXPLAIN) run"


def check_read_only(query: str) -> None:
    """Refuse, with one sentence, any statement but a read (see the module's docstring)."""
    for st in _statements(query):
        text = st.query.strip()
        words = _keywords(text)
        if words[:1] == ["EXPLAIN"]:
            check_read_only(_explained(text))
            continue
        write = _write_in(st, text, words)
        if write is not None:
            why = WHY.get(write, READS)
            raise QueryError(f"sparrow sql is read-only over the run's views, so {write} is refused: {why}")


def _write_in(st, text: str, words: list[str]) -> str | None:
    """The first word of what makes the statement `st` more than a read, or None for a read."""
    first = words[0] if words else "?"
    if st.type == duckdb.StatementType.SELECT:
        nodes = _serialized_nodes(text)
        if nodes is not None:
            other = [node.split("_")[0] for node in sorted(nodes - QUERY_NODES)]
            return next((w for w in other if w in WRITE_WORDS), first) if other else None
    elif st.type != duckdb.StatementType.MULTI:
        return first
    return _unparsed_write(text, words)


def _unparsed_write(text: str, words: list[str]) -> str | None:
    """For a statement DuckDB cannot serialize (a MULTI): its first word unless a query's, then the first
    keyword of a write in it, unless DuckDB parses it as a subquery; None for a read."""
    first = words[0] if words else "?"
    if first not in QUERY_WORDS and not text.lstrip().startswith("("):
        return first
    if write := next((w for w in words if w in WRITE_WORDS), None):
        return write
    try:
        subquery = duckdb.extract_statements(f"SELECT * FROM (\n{text}\n)")
    except duckdb.Error:
        return first
    return None if len(subquery) == 1 else first


def _serialized_nodes(text: str) -> set[str] | None:
    """The query node types of the tree DuckDB's parser builds for `text` (SELECT_NODE, INSERT_QUERY_NODE,
    COPY_QUERY_NODE, ...); None when DuckDB cannot serialize it."""
    con = duckdb.connect(":memory:", config={"autoinstall_known_extensions": False,
                                             "autoload_known_extensions": False})
    try:
        tree = json.loads(con.execute("SELECT json_serialize_sql(?::VARCHAR)", [text]).fetchone()[0])
    except (duckdb.Error, ValueError, RecursionError):
        return None
    finally:
        con.close()
    if tree.get("error") or not tree.get("statements"):
        return None
    return _node_types(tree["statements"], set())


def _node_types(tree: object, found: set[str]) -> set[str]:
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            kind = item.get("type")
            if isinstance(kind, str) and kind.endswith("_NODE"):
                found.add(kind)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _keywords(text: str) -> list[str]:
    """The keywords of `text` in order, upper case, as DuckDB's tokenizer finds them (not in comments,
    strings or quoted names)."""
    tokens = duckdb.tokenize(text)
    ends = [start for start, _ in tokens[1:]] + [len(text)]
    return [text[start:end].split(None, 1)[0].upper() for (start, kind), end in zip(tokens, ends)
            if kind == duckdb.token_type.keyword and text[start:end].strip()]


def _explained(text: str) -> str:
    """What an EXPLAIN statement explains: `text` after EXPLAIN and its options (ANALYZE, or a
    parenthesised list such as (FORMAT json, ANALYZE)), found by DuckDB's tokenizer, so that comments
    and spacing do not matter; always shorter than `text`."""
    tokens = [(start, kind) for start, kind in duckdb.tokenize(text) if kind != duckdb.token_type.comment]
    ends = [start for start, _ in tokens[1:]] + [len(text)]
    words = [text[start:end].strip().upper() for (start, _), end in zip(tokens, ends)]
    at, depth = 1, 0  # tokens[0] is EXPLAIN
    while at < len(tokens) and (depth or words[at] in ("ANALYZE", "(")):
        depth += words[at].count("(") - words[at].count(")")
        at += 1
    return text[tokens[at][0]:] if at < len(tokens) else ""


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
    """An error's first line, the run's file URLs back to their paths; for a Python exception raised inside
    DuckDB (its file system's), the traceback's last line, which says what failed."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    if lines and lines[0].startswith("Traceback (most recent call last)"):
        lines = lines[-1:]
    return local_paths((lines or [type(e).__name__])[0])
