"""DuckDB over a run directory: every artifact kind is a view, so questions about a run are SQL.

Design decisions:
- `*.parquet` directly inside the run directory, and the parts of partitioned artifacts: subfolders
  that hold nothing but Parquet files (a training run's `mismatch/step=N.parquet`), sorted by name.
  Other subfolders (a training run inside a pipeline's directory) are runs of their own; hidden ones
  (a directory of parts being written) are skipped.
- A view per artifact kind, named after the kind read from the Parquet footer (`artifact_kind`), not
  after the file name. All files of one kind are unioned by column name (`union_by_name`), and the
  view always has an extra column `source_file` (the file name) so that queries do not depend on how
  many files there are. Parquet files without Sparrow metadata get a view named after the file stem,
  sanitized into an identifier (and suffixed if it would clash), without `source_file`.
- Files are checked through their footers only (fast); a missing footer or non-Parquet file is an
  ArtifactError naming it. Views read the files lazily, so opening a large run costs nothing.
- Query errors become `QueryError` with DuckDB's first line, plus the list of views when a table is
  unknown.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
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


def run_views(run_dir: str | Path) -> list[View]:
    """The views of a run directory: artifact kinds first, then other Parquet files."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ArtifactError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise ArtifactError(f"{run_dir} is not a directory, and a run is a directory of artifacts")
    files = sorted(p for p in run_dir.glob("*.parquet") if p.is_file())
    for sub in sorted(p for p in run_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        entries = [e for e in sub.iterdir() if not e.name.startswith(".")]
        if entries and all(e.is_file() and e.suffix == ".parquet" for e in entries):
            files += sorted(entries)
    kinds = {p: artifact_kind(p) for p in files}
    by_kind: dict[str, list[Path]] = {}
    for p in files:
        if kinds[p] is not None:
            by_kind.setdefault(kinds[p], []).append(p)
    views = [View(kind, tuple(paths), True) for kind, paths in sorted(by_kind.items())]
    taken = set(by_kind)
    for p in files:
        if kinds[p] is None:
            name = base = _identifier(p.stem)
            i = 2
            while name in taken:
                name, i = f"{base}_{i}", i + 1
            taken.add(name)
            views.append(View(name, (p,), False))
    return views


def open_run(run_dir: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with one view per artifact kind (and per other Parquet file)."""
    views = run_views(run_dir)
    con = duckdb.connect(":memory:")
    for view in views:
        paths = ", ".join(_literal(str(p.resolve())) for p in view.files)
        if view.artifact:
            select = (f"SELECT * EXCLUDE (filename), parse_filename(filename) AS source_file "
                      f"FROM read_parquet([{paths}], union_by_name = true, filename = true)")
        else:
            select = f"SELECT * FROM read_parquet([{paths}])"
        try:
            con.execute(f'CREATE VIEW "{view.name}" AS {select}')
        except duckdb.Error as e:
            con.close()
            names = ", ".join(p.name for p in view.files)
            raise ArtifactError(f"DuckDB cannot read {names} in {run_dir} ({_first_line(e)})") from None
    return con


def run_query(run_dir: str | Path, query: str) -> pa.Table:
    """Run one SQL query against a run directory's views; return the result as an Arrow table."""
    with _connection(run_dir) as con:
        try:
            rel = con.sql(query)
            return rel.to_arrow_table() if rel is not None else pa.table({})
        except duckdb.Error as e:
            message = _first_line(e)
            if isinstance(e, duckdb.CatalogException):
                views = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() "
                                                   "WHERE NOT internal ORDER BY view_name").fetchall()]
                message += f" (views in {run_dir}: {', '.join(views) or 'none'})"
            raise QueryError(message) from None


@contextmanager
def _connection(run_dir: str | Path) -> Iterator[duckdb.DuckDBPyConnection]:
    con = open_run(run_dir)
    try:
        yield con
    finally:
        con.close()


def _identifier(stem: str) -> str:
    name = re.sub(r"\W+", "_", stem).strip("_") or "file"
    return f"_{name}" if name[0].isdigit() else name


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
