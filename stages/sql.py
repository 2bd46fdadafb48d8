"""DuckDB over a run directory: every artifact kind is a view, so questions about a run are SQL.

Views are named after the artifact kind in each Parquet footer, unioned by column name, with a
`source_file` column and the files' provenance as `source_*` columns; each file is also a view of its
own. Unreadable files are skipped with a warning. Read only, twice over: only one read statement runs,
and DuckDB is sandboxed to the run's files. Bounded: memory, time, and a Ctrl-C or SIGTERM stops the
query; the spill folder goes whatever happens. docs/sql.md gives the rules.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import duckdb
import pyarrow as pa

from sparrow.schemas import ArtifactError, artifact_metadata
from sparrow.schemas.footer import kind_version, read_schema

DEFAULT_TIMEOUT = 300.0
DEFAULT_MEMORY = "25%"
SPILL_PREFIX = "sparrow-sql-"
BATCH_ROWS = 8192


class QueryError(ValueError):
    """A query refused, or stopped at one of its limits; the message is one sentence."""


class QueryLimit(QueryError):
    """A query stopped at its memory or time limit."""


class Stopped(KeyboardInterrupt):
    """The query was stopped by a signal (SIGINT or SIGTERM); `signum` says which."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = signum


# ---------------------------------------------------------------- views

@dataclass(frozen=True)
class Provenance:
    """What made an artifact, from its metadata: artifacts that differ here should not be pooled
    unawares. Each field is a view column `source_<field>`."""

    model: str | None = None
    sampler: str | None = None  # the sampler of profiled trajectories (dense, budget:B, snapkv:B, ...)
    sparsity: str | None = None  # the sparsity of rollouts and training
    kv_compression: str | None = None
    adapter: str | None = None
    lora: str | None = None
    dtype: str | None = None
    engine: str | None = None

    @classmethod
    def of(cls, meta: dict) -> Provenance:
        return cls(**{f.name: _meta_text(meta.get(f.name)) for f in fields(cls)})


@dataclass(frozen=True)
class Source:
    path: Path  # as DuckDB opens it: the run directory resolved, then the file's path inside it
    name: str  # the path inside the run directory: the `source_file` column
    provenance: Provenance = field(default_factory=Provenance)


@dataclass(frozen=True)
class View:
    name: str
    sources: tuple[Source, ...]
    artifact: bool  # files carry Sparrow metadata (then the view has `source_file` and `source_*`)
    union: bool = False  # every file of one artifact kind
    recorded: tuple[str, ...] = ()  # the Provenance fields that some file of the kind records

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(s.path for s in self.sources)

    def mixed(self) -> list[str]:
        """The provenance fields in which the view's files differ."""
        return [f.name for f in fields(Provenance)
                if len({getattr(s.provenance, f.name) for s in self.sources}) > 1]


Warn = Callable[[str], None]


def run_views(run_dir: str | Path, warn: Warn | None = None) -> list[View]:
    """The views of a run directory: one per artifact kind (all its files), one per artifact file
    (`<kind>__<path>`), then one per other Parquet file (its stem). Files that are not readable Parquet
    are skipped, each with a `warn` (default: a Python warning)."""
    run_dir = Path(run_dir)
    warn = warn or _python_warning
    if not run_dir.exists():
        raise ArtifactError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise ArtifactError(f"{run_dir} is not a directory, and a run is a directory of artifacts")
    by_kind: dict[str, list[Source]] = {}
    plain: list[Source] = []
    root = run_dir.resolve()
    for p in _run_files(run_dir):
        try:
            schema = read_schema(p)
            kind, meta = kind_version(schema)[0], artifact_metadata(schema)
        except ArtifactError as e:
            warn(f"{e}; skipped it")
            continue
        rel = p.relative_to(run_dir)
        source = Source(root / rel, rel.as_posix(), Provenance.of(meta))
        (by_kind.setdefault(kind, []) if kind is not None else plain).append(source)
    kinds = sorted(by_kind.items())
    recorded = {kind: _recorded(sources) for kind, sources in kinds}
    views = [View(kind, tuple(sources), True, True, recorded[kind]) for kind, sources in kinds]
    taken = set(by_kind)
    for kind, sources in kinds:
        for s in sources:
            name = _free(f"{kind}__{_identifier(s.name.removesuffix('.parquet'))}", taken)
            views.append(View(name, (s,), True, False, recorded[kind]))
    views += [View(_free(_identifier(Path(s.name).stem), taken), (s,), False) for s in plain]
    return views


def _recorded(sources: list[Source]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(Provenance)
                 if any(getattr(s.provenance, f.name) is not None for s in sources))


def _run_files(run_dir: Path) -> list[Path]:
    files = sorted(p for p in run_dir.glob("*.parquet") if p.is_file())
    for sub in sorted(p for p in run_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        entries = [e for e in sub.iterdir() if not e.name.startswith(".")]
        if entries and all(e.is_file() and e.suffix == ".parquet" for e in entries):
            files += sorted(entries)
    return files


def _free(name: str, taken: set[str]) -> str:
    """`name`, suffixed with _2, _3, ... while it is taken; then taken."""
    candidate, i = name, 2
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


def _view_sql(view: View, root: Path) -> str:
    files = ", ".join(_literal(str(p)) for p in view.files)
    if not view.artifact:
        return f"SELECT * FROM read_parquet([{files}])"
    columns = [f"substr(filename, {len(str(root)) + 2}) AS source_file"]
    columns += [f"{_by_file(view, name)} AS source_{name}" for name in view.recorded]
    return (f"SELECT * EXCLUDE (filename), {', '.join(columns)} "
            f"FROM read_parquet([{files}], union_by_name = true, filename = true)")


def _by_file(view: View, name: str) -> str:
    """A provenance field as an SQL expression: a constant, or a CASE over the files that differ."""
    files_by_value: dict[str | None, list[str]] = {}
    for s in view.sources:
        files_by_value.setdefault(getattr(s.provenance, name), []).append(_literal(str(s.path)))
    if len(files_by_value) == 1:
        value = next(iter(files_by_value))
        return "NULL::VARCHAR" if value is None else _literal(value)
    cases = " ".join(f"WHEN filename IN ({', '.join(files)}) THEN {_literal(value)}"
                     for value, files in files_by_value.items() if value is not None)
    return f"CASE {cases} ELSE NULL END"


def mixed_warning(view: View) -> str | None:
    """One sentence when a union view pools files of different provenance; None otherwise."""
    mixed = view.mixed() if view.union and len(view.sources) > 1 else []
    if not mixed:
        return None
    differ = "; ".join(f"{name}: " + ", ".join(sorted({str(getattr(s.provenance, name) or "none")
                                                         for s in view.sources})) for name in mixed)
    return (f"the view '{view.name}' pools {len(view.sources)} files of different provenance ({differ}); "
            f"filter on {', '.join(f'source_{n}' for n in mixed)}, or query one file's view "
            f"({view.name}__...)")


# ---------------------------------------------------------------- the connection

def open_run(run_dir: str | Path, warn: Warn | None = None, memory: int | None = None
             ) -> duckdb.DuckDBPyConnection:
    """An in-memory, read-only DuckDB connection with the run's views (see `run_views`), sandboxed to the
    run's files (see the module's docstring), DuckDB's own memory at most `memory` bytes where given.
    A view DuckDB cannot read is skipped with a `warn`."""
    warn = warn or _python_warning
    return _open(run_dir, run_views(run_dir, warn), warn, memory)[0]


def _open(run_dir: str | Path, views: list[View], warn: Warn, memory: int | None
          ) -> tuple[duckdb.DuckDBPyConnection, Path]:
    """The connection of `open_run`, and its spill folder."""
    _sweep_spills()
    spill = tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, spill, ignore_errors=True)  # also when a caller closes `con` itself
    config = {"autoinstall_known_extensions": False, "autoload_known_extensions": False,
              "temp_directory": spill}
    if memory is not None:
        config["memory_limit"] = f"{max(memory // 2**20, 1)}MiB"
    try:
        con = duckdb.connect(":memory:", config=config)
    except BaseException:
        shutil.rmtree(spill, ignore_errors=True)
        raise
    readable: list[str] = []
    root = Path(run_dir).resolve()
    try:
        for view in views:
            try:
                con.execute(f'CREATE VIEW "{view.name}" AS {_view_sql(view, root)}')
                readable += [str(p) for p in view.files]
            except duckdb.Error as e:
                names = ", ".join(s.name for s in view.sources)
                warn(f"DuckDB cannot read {names} in {run_dir} ({_first_line(e)}); skipped the view "
                     f"'{view.name}'")
        con.execute(f"SET allowed_paths = [{', '.join(_literal(p) for p in sorted(set(readable)))}]")
        con.execute("SET enable_progress_bar = false")  # stdout holds only the result
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except BaseException:
        _close(con, spill)
        raise
    return con, Path(spill)


def _close(con: duckdb.DuckDBPyConnection, spill: str | Path) -> None:
    try:
        con.interrupt()  # a query left running (stopped between two of its batches) ends now
        con.close()
    finally:
        shutil.rmtree(spill, ignore_errors=True)


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


# ---------------------------------------------------------------- statements

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
        raise QueryError(_first_line(e)) from None


# ---------------------------------------------------------------- limits

@dataclass(frozen=True)
class Limits:
    """What one query may take: `memory` bytes in all (DuckDB's working memory, half of it, plus the
    result on its way out) and `seconds` of wall time (None: no limit)."""

    memory: int = field(default_factory=lambda: parse_memory(DEFAULT_MEMORY))
    seconds: float | None = DEFAULT_TIMEOUT


def parse_memory(text: str) -> int:
    """Bytes from "4GB", "512MiB", "1.5GB" (B, KB, MB, GB, TB powers of 1000; KiB, MiB, GiB, TiB of
    1024) or "25%" of this machine's memory; ValueError with one sentence otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(%|[kmgt]i?b|b)?\s*", text, flags=re.IGNORECASE)
    if m is None:
        raise ValueError(f"must be a size such as 4GB, 512MiB or 25% (of this machine's memory), got "
                         f"{text!r}")
    number, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"must be a share of this machine's memory in (0, 100]%, got {text!r}")
        size = number / 100 * machine_memory()
    else:
        power = "bkmgt".index(unit[0])
        size = number * (1024 if "i" in unit else 1000) ** power
    if size < 2**24:
        raise ValueError(f"must be at least 16MiB, got {text!r}")
    return int(size)


def machine_memory() -> int:
    """This machine's memory in bytes, or its container's where that is less."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def memory_text(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


class _Guard:
    """The time, memory and signal bounds of one query while it runs."""

    def __init__(self, con: duckdb.DuckDBPyConnection, limits: Limits):
        self.con, self.limits = con, limits
        self.timed_out = threading.Event()
        self.signum: int | None = None  # the first SIGINT or SIGTERM
        self.raised = False

    def expire(self) -> None:
        self.timed_out.set()
        self.con.interrupt()

    def stop(self, signum: int, frame: object) -> None:
        """The Python handler (main thread, between two bytecodes)."""
        self.signum = self.signum or signum
        if not self.raised:  # a second signal while stopping waits for the first to finish
            self.raised = True
            raise Stopped(self.signum)

    def signalled(self, signum: int) -> None:
        """The watcher thread: DuckDB may not hand back to Python, where `stop` runs, until interrupted."""
        self.signum = self.signum or signum
        self.con.interrupt()

    def check(self) -> None:
        if self.timed_out.is_set():
            raise QueryLimit(self.timeout_message())

    def timeout_message(self) -> str:
        return (f"the query ran past its time limit of {self.limits.seconds:g} s and was stopped (raise it "
                f"with --timeout)")

    def memory_message(self) -> str:
        return (f"the query needed more memory than its limit of {memory_text(self.limits.memory)} and was "
                f"stopped (raise it with --memory-limit, or let SQL aggregate more)")


@contextmanager
def _guarded(con: duckdb.DuckDBPyConnection, limits: Limits) -> Iterator[_Guard]:
    guard = _Guard(con, limits)
    timer = threading.Timer(limits.seconds, guard.expire) if limits.seconds else None
    handlers = _install_stop(guard)
    try:
        with _signal_watch(guard, tuple(handlers)), _memory_bound(limits.memory):
            if timer:
                timer.daemon = True
                timer.start()
            yield guard
    finally:
        if timer:
            timer.cancel()
        for signum, previous in handlers.items():
            signal.signal(signum, previous)


def _install_stop(guard: _Guard) -> dict[int, object]:
    """SIGINT and SIGTERM stop the query (main thread only: Python's signal handlers live there)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) in (signal.SIG_IGN, None):  # as a background job: left ignored
            continue
        handlers[signum] = signal.signal(signum, guard.stop)
    return handlers


@contextmanager
def _signal_watch(guard: _Guard, signums: tuple[int, ...]) -> Iterator[None]:
    """A thread that learns of `signums` through Python's wakeup fd, which is written even while the main
    thread is inside DuckDB, and tells `guard`."""
    if not signums:
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        while data := reader.recv(64):
            for signum in data:
                if signum in signums:
                    guard.signalled(signum)

    watcher = threading.Thread(target=watch, name="sparrow-sql-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        writer.close()  # the watcher reads the end of the stream and returns
        watcher.join()
        reader.close()


@contextmanager
def _memory_bound(budget: int) -> Iterator[None]:
    """The process may take `budget` more bytes of data than it holds now, while the block runs, so that
    what DuckDB does not count (a huge string) or the result on its way out fails with MemoryError rather
    than meet the OOM killer. Linux only (elsewhere DuckDB's own limit is the bound)."""
    try:
        import resource

        used = _data_bytes()
    except (ImportError, OSError, ValueError):
        yield
        return
    import numpy  # noqa: F401  (imported lazily by pyarrow, and BLAS aborts when it cannot allocate)
    import pyarrow.parquet  # noqa: F401

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    bound = used + budget if hard == resource.RLIM_INFINITY else min(hard, used + budget)
    if soft != resource.RLIM_INFINITY:
        bound = min(bound, soft)
    resource.setrlimit(resource.RLIMIT_DATA, (bound, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _data_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    m = re.search(r"^VmData:\s+(\d+)\s+kB", status, flags=re.MULTILINE)
    if m is None:
        raise ValueError("no VmData")
    return int(m.group(1)) * 1024


# ---------------------------------------------------------------- queries

@dataclass
class Result:
    """A query's result as it streams: its schema (unique column names) and its record batches, read
    while the `query` block is open."""

    schema: pa.Schema
    batches: Iterator[pa.RecordBatch]


@contextmanager
def query(run_dir: str | Path, sql: str, limits: Limits | None = None, warn: Warn | None = None
          ) -> Iterator[Result]:
    """Run one read statement against a run directory's views within `limits`; the result streams
    while the block is open. Refusals, errors and limits are QueryError (one sentence); SIGINT and
    SIGTERM are `Stopped`; the connection and its spill folder are gone when the block ends."""
    limits = limits or Limits()
    warn = warn or _python_warning
    check_query(sql)
    views = run_views(run_dir, warn)
    used = _used_views(sql)
    for view in views:
        said = mixed_warning(view) if view.name in used else None
        if said:
            warn(said)
    con, spill = _open(run_dir, views, warn, limits.memory // 2)
    try:
        with _guarded(con, limits) as guard:
            translate = functools.partial(_translated, guard=guard, con=con, run_dir=run_dir)
            try:
                rel = con.sql(sql)
                reader = rel.to_arrow_reader(BATCH_ROWS) if rel is not None else None
            except (Exception, KeyboardInterrupt) as e:
                raise translate(e) from None
            if reader is None:
                yield Result(pa.schema([]), iter(()))
                return
            schema = _unique_names(reader.schema)
            try:
                yield Result(schema, _batches(reader, schema, guard, translate))
            except MemoryError:
                raise QueryLimit(guard.memory_message()) from None
            except KeyboardInterrupt as e:
                stopped = guard.signum is not None and not isinstance(e, Stopped)
                raise (Stopped(guard.signum) if stopped else e) from None
    finally:
        _close(con, spill)


def run_query(run_dir: str | Path, sql: str, warn: Warn | None = None, limits: Limits | None = None
              ) -> pa.Table:
    """Run one read-only SQL statement against a run directory's views; the whole result as an Arrow
    table."""
    with query(run_dir, sql, limits, warn) as result:
        return pa.Table.from_batches(list(result.batches), schema=result.schema)


def _batches(reader: pa.RecordBatchReader, schema: pa.Schema, guard: _Guard,
             translate: Callable[[BaseException], BaseException]) -> Iterator[pa.RecordBatch]:
    """The reader's batches under `schema`; what stops the stream (an error, a limit, a signal) as the
    caller should see it."""
    batches = iter(reader)
    while True:
        try:
            guard.check()
            batch = next(batches)
        except StopIteration:
            return
        except (Exception, KeyboardInterrupt) as e:
            raise translate(e) from None
        yield pa.RecordBatch.from_arrays(batch.columns, schema=schema)


def _translated(e: BaseException, guard: _Guard, con: duckdb.DuckDBPyConnection, run_dir: str | Path
                ) -> BaseException:
    """What the caller sees of an exception DuckDB (or the stream from it) raised while a query ran."""
    if guard.signum is not None:
        return e if isinstance(e, Stopped) else Stopped(guard.signum)
    if isinstance(e, QueryError | KeyboardInterrupt):
        return e
    engine = isinstance(e, duckdb.Error | OSError | pa.ArrowException | RuntimeError)
    if guard.timed_out.is_set() and engine:
        return QueryLimit(guard.timeout_message())
    if isinstance(e, MemoryError) or (engine and re.search(r"out of memory|bad_alloc", str(e), re.I)):
        return QueryLimit(guard.memory_message())
    if not engine:
        return e
    message = _first_line(e)
    if isinstance(e, duckdb.CatalogException):
        views = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() "
                                           "WHERE NOT internal ORDER BY view_name").fetchall()]
        message += f" (views in {run_dir}: {_listing(views)})"
    elif isinstance(e, duckdb.PermissionException):
        message += " (sparrow sql reads only the run's artifacts, through their views)"
    return QueryError(message)


def _listing(views: list[str], most: int = 12) -> str:
    """The view names of an error message: every one, or the kinds' and a count of the per-file ones."""
    if len(views) <= most:
        return ", ".join(views) or "none"
    per_file = [v for v in views if "__" in v]
    return (", ".join(v for v in views if "__" not in v) + f", and {len(per_file)} per-file views "
            "(<kind>__<file>; SHOW TABLES lists them all)")


def _used_views(sql: str) -> set[str]:
    try:
        return set(duckdb.get_table_names(sql))
    except duckdb.Error:
        return set()


def _unique_names(schema: pa.Schema) -> pa.Schema:
    """The schema with repeated column names made unique: alpha, alpha_1, alpha_2, ..."""
    seen: set[str] = set(schema.names)
    names, first = [], set()
    for name in schema.names:
        if name not in first:
            first.add(name)
            names.append(name)
            continue
        i = 1
        while f"{name}_{i}" in seen:
            i += 1
        seen.add(f"{name}_{i}")
        names.append(f"{name}_{i}")
    return pa.schema([f.with_name(n) for f, n in zip(schema, names)], metadata=schema.metadata)


# ---------------------------------------------------------------- text

def _meta_text(value: object) -> str | None:
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else str(value)


def _python_warning(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _identifier(stem: str) -> str:
    name = re.sub(r"\W+", "_", stem).strip("_") or "file"
    return f"_{name}" if name[0].isdigit() else name


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
