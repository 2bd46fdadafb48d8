"""Reading and writing artifacts: Parquet files whose schema metadata names their kind and version.

Design decisions:
- Metadata keys: `sparrow.artifact` (kind), `sparrow.version` ("1") and `sparrow.meta`, a JSON object
  with the stage's own metadata (page size, cost coefficients, ...). A table read from disk keeps all
  three, so `artifact_metadata(read_artifact(p))` works and `write_artifact` of such a table keeps
  its metadata unless new metadata is given.
- Every file written here, artifact or plain Parquet, also records `sparrow.provenance`: the versions of
  Sparrow, Python, torch, transformers and pyarrow that wrote it (provenance.py), always this process's,
  also for a table read from disk.
- The file is checked before its data is read: existence, Parquet magic bytes at both ends (a missing
  footer means a truncated file), then kind and version from the footer alone.
- Writing validates exactly as reading does (errors name the target path), except that nullable
  columns absent from the input are filled with nulls. The bytes go to a hidden temporary file in
  the target folder, which is fsynced and then renamed over the target with os.replace, so readers
  see the old artifact or the new one, never half of one; the temporary file is removed on any error.
- A replaced file keeps its mode, and its owner and group where this process may set them (the group
  alone otherwise), as editors do: a private artifact stays private. A replaced directory keeps its
  own, and so does each file in it that the new version has under the same name.
- A temporary is named `.NAME.<hex>-<pid>.tmp` (NAME a digest of a name too long for these marks to
  fit the file system's limit: `locations.hidden_stem`) and locked (flock) by its writer while it writes. A
  process killed there (SIGKILL, the OOM killer) cannot remove it, so the next write of the same path
  removes the temporaries whose writer is gone: its process is not running here and its lock is free
  (a writer on another host of a shared folder still holds its lock). Those of an older Sparrow, named
  without a pid, are left to `recover_replaced`.
- A directory of Parquet parts (`part-00000.parquet`, ...: one per Ray worker of `sparrow rollout
  --workers N`) is one artifact: `read_artifact` validates every part (all of one kind) and
  concatenates them in name order; its metadata and kind are those of the first part. Hidden files
  (temporaries) are ignored. `write_artifact_parts` writes such a directory and replaces it whole.
- Where a write lands is `locations.output_target`: a symlink's target (the link survives), never a
  FIFO or device; `-` is stdout (the whole file is written to a temporary file first, then copied, so
  a pipe gets a valid Parquet file or nothing). A folder that cannot be created or written is an
  ArtifactError naming it; so is a stdout that cannot be written (full, closed, an I/O error).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from .artifacts import (
    KEY_KIND,
    KEY_META,
    KEY_VERSION,
    SCHEMAS,
    VERSION,
    ArtifactError,
    ArtifactSpec,
    first_line,
)
from .footer import (
    artifact_parts,
    file_json,
    json_text,
    kind_version,
    parquet_batches,
    parquet_magic,
    read_parquet,
    read_schema,
    stage_metadata,
)
from .locations import hidden_stem, is_stdio, output_target
from .provenance import stamped
from .signals import held_signals

TableLike = pa.Table | pa.RecordBatch | Mapping[str, Sequence] | Sequence[Mapping[str, object]]


def write_artifact(data: TableLike, path: str | os.PathLike, kind: str,
                   metadata: Mapping[str, object] | None = None) -> Path:
    """Validate `data` against the `kind` schema and write it atomically to `path`; return the path."""
    path = Path(path)
    spec = _spec(kind)
    subject = f"the '{kind}' data for {path}"
    table = _to_table(data, spec, subject)
    if metadata is None:
        meta_json = (table.schema.metadata or {}).get(KEY_META.encode(), b"{}").decode()
    else:
        try:
            meta_json = json.dumps(dict(metadata), sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"the metadata for {path} is not JSON-serializable ({e})") from None
    table = spec.conform(table, subject, fill_missing=True)
    footer_keys = {**spec.schema.metadata, KEY_META.encode(): meta_json.encode()}
    table = table.replace_schema_metadata(stamped(footer_keys))

    _write(path, lambda f: pq.write_table(table, f, compression="zstd"))
    return path


def write_table(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write a plain Parquet file (no artifact kind: a query's result) by the artifacts' rule."""
    table = table.replace_schema_metadata(stamped(table.schema.metadata))
    _write(Path(path), lambda f: pq.write_table(table, f, compression="zstd"))
    return Path(path)


ROW_GROUP_ROWS = 128 * 1024  # a streamed result's row group: what a scan skips or reads at once
ROW_GROUP_BYTES = 64 * 1024 * 1024  # ... or fewer rows when they are this large in memory


def write_batches(schema: pa.Schema, batches: Iterable[pa.RecordBatch], path: str | os.PathLike) -> int:
    """Write record batches as they come as one plain Parquet file (a streamed query result), by the
    artifacts' rule; the rows written. Batches are gathered into row groups of ROW_GROUP_ROWS rows, or
    fewer of ROW_GROUP_BYTES, so that memory holds one row group, not the result."""
    rows = 0
    schema = schema.with_metadata(stamped(schema.metadata))

    def write(f: BinaryIO) -> None:
        nonlocal rows
        with pq.ParquetWriter(f, schema, compression="zstd") as writer:
            for group in _row_groups(batches):
                table = pa.Table.from_batches(group, schema=schema)
                writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
                rows += table.num_rows

    _write(Path(path), write)
    return rows


def _row_groups(batches: Iterable[pa.RecordBatch]) -> Iterator[list[pa.RecordBatch]]:
    """The batches gathered up to ROW_GROUP_ROWS rows or ROW_GROUP_BYTES bytes each (a larger batch
    alone), in order."""
    group: list[pa.RecordBatch] = []
    rows = size = 0
    for batch in batches:
        if group and (rows + batch.num_rows > ROW_GROUP_ROWS or size + batch.nbytes > ROW_GROUP_BYTES):
            yield group
            group, rows, size = [], 0, 0
        group.append(batch)
        rows, size = rows + batch.num_rows, size + batch.nbytes
    if group:
        yield group


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write a file that is not an artifact (an exported schedule) by the same rule: atomically,
    through a symlink, `-` to stdout."""
    _write(Path(path), lambda f: f.write(data))
    return Path(path)


def _write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(f)` into a hidden temporary sibling of where `path` lands, fsynced, then renamed over it
    (keeping the replaced file's mode and group); for `-`, into an anonymous temporary file whose bytes
    are then copied to stdout."""
    if is_stdio(path):
        with tempfile.TemporaryFile() as f:
            write(f)
            f.seek(0)
            _copy_to_stdout(f)
        return
    target = output_target(path)
    tmp = temporary(target, "tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead(leftovers(target)[0])
        with open(tmp, "xb") as f:
            _lock_quietly(f.fileno())
            write(f)
            f.flush()
            os.fsync(f.fileno())
            _keep_access(target, f.fileno())
            os.replace(tmp, target)  # still locked: never taken for a dead writer's
    except OSError as e:
        _discard(tmp)
        raise ArtifactError(f"cannot write {path} ({e.strerror or first_line(e)})") from None
    except BaseException:
        _discard(tmp)
        raise


def _discard(tmp: Path) -> None:
    """Remove a temporary after a failed write; a failure here (it was never made, the folder is gone)
    must not hide the write's own error, and a dead writer's temporary is removed by the next write."""
    try:
        _remove(tmp)
    except OSError:
        pass


def _copy_to_stdout(f: BinaryIO) -> None:
    """The whole file `f` onto stdout. A failure (its reader gone, a full disk, a closed stdout) is an
    ArtifactError, stdout then pointed at /dev/null so that Python's flush at exit does not fail again."""
    if sys.stdout is None:
        raise ArtifactError("cannot write stdout (it is closed)")
    try:
        shutil.copyfileobj(f, sys.stdout.buffer)
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        raise ArtifactError("stdout was closed before the whole file was written to it") from None
    except OSError as e:
        _drop_stdout()
        raise ArtifactError(f"cannot write stdout ({e.strerror or first_line(e)})") from None


def _drop_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (under a test runner)
        pass


def temporary(path: Path, kind: str) -> Path:
    """`.NAME.<hex>-<pid>.<kind>` beside `path`: hidden, unique, and telling whose it is (NAME is a digest
    of a name too long to take these marks: `hidden_stem`); the name `leftovers` finds, for a file or a
    folder that replaces `path`."""
    return path.with_name(f".{hidden_stem(path)}.{uuid.uuid4().hex[:12]}-{os.getpid()}.{kind}")



def _lock_quietly(fd: int) -> None:
    """Lock a temporary while it is written (what tells a live writer from a dead one); a filesystem
    without locks goes without."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass


def _keep_access(replaced: Path, fd: int | None = None, new: Path | None = None) -> None:
    """Give the new file (open as `fd`, or at `new`) the mode of `replaced`, and its owner and group
    where allowed (the group alone when the owner cannot be; neither when the group cannot be either).
    Nothing when `replaced` does not exist."""
    try:
        old = os.stat(replaced)
    except OSError:
        return
    target: int | Path = fd if fd is not None else new
    for uid in (old.st_uid, -1):
        try:
            os.chown(target, uid, old.st_gid)
            break
        except OSError:
            continue
    try:
        os.chmod(target, stat.S_IMODE(old.st_mode))
    except OSError:  # a filesystem without modes
        pass


def read_artifact(path: str | os.PathLike, kind: str | None = None) -> pa.Table:
    """Read and validate an artifact; `kind=None` accepts any known kind.

    With an explicit `kind`, files from other tools are first-class: a Parquet file without Sparrow's
    metadata (written by DuckDB, pandas, polars...) and, for prompts, a JSONL file are validated by
    their columns alone (columns the schema does not have are dropped, integer and string widths are
    cast), and refused with one sentence only when a column is missing or of the wrong type."""
    path = Path(path)
    if kind is not None:
        _spec(kind)
    if path.is_dir():
        return _read_parts(path, kind)
    if _jsonl_prompts(path, kind):
        return _read_foreign(_read_jsonl(path), path, kind)
    schema = read_schema(path)
    found = _known_kind(path, schema, kind)
    if found is None:  # another tool's file: its columns of the schema, each once
        known = [name for name in schema.names if name in SCHEMAS[kind].names]
        _refuse_twice(known, _foreign(path, kind))
        return _read_foreign(read_parquet(path, known), path, kind)
    _refuse_twice(schema.names, str(path))  # pyarrow would not read it, and call it corrupt
    table = read_parquet(path)
    # a nullable column this artifact lacks was added to the schema after it was written: null, so that a
    # newer Sparrow reads the run directories of an older one (sql, report, calibrate-threshold, --resume)
    table = SCHEMAS[found].conform(table, str(path), fill_missing=True)
    return table.replace_schema_metadata(schema.metadata)


def check_artifact(path: str | os.PathLike, kind: str | None = None) -> int:
    """Validate an artifact as `read_artifact` does, with the same sentence on the same file and row,
    holding a bounded batch of rows at a time instead of the whole table; returns its number of rows."""
    path = Path(path)
    if kind is not None:
        _spec(kind)
    if not path.is_dir():
        return _check_file(path, kind)[1]
    parts = artifact_parts(path)
    found, rows = _check_file(parts[0], kind)
    return rows + sum(_check_file(p, found)[1] for p in parts[1:])


def read_columns(path: str | os.PathLike, kind: str, columns: Sequence[str]) -> pa.Table:
    """`columns` of a `kind` artifact (a file or its parts), checked whole first as `read_artifact` checks
    it (`check_artifact`, a batch at a time), then read without its other columns: the memory of what a
    stage uses, not of the artifact. Columns are of the schema's types, a nullable one a file lacks is null,
    and the table keeps the artifact's metadata."""
    schema = _columns(kind, columns)
    check_artifact(path, kind)
    table = pa.concat_tables(_column_tables(Path(path), kind, schema, whole=True))
    return table.replace_schema_metadata(_metadata(Path(path), kind))


def column_reader(path: str | os.PathLike, kind: str, columns: Sequence[str]) -> pa.RecordBatchReader:
    """`columns` of a `kind` artifact that `check_artifact` has checked, as `read_columns` gives them, a
    bounded batch of rows at a time (`parquet_batches`): what DuckDB aggregates in the memory of its
    state, not of the artifact. Read once; make another for another query."""
    schema = _columns(kind, columns)
    batches = (b for t in _column_tables(Path(path), kind, schema, whole=False) for b in t.to_batches())
    return pa.RecordBatchReader.from_batches(schema, batches)


def _columns(kind: str, columns: Sequence[str]) -> pa.Schema:
    """The fields of `columns` in the `kind` schema."""
    spec = _spec(kind)
    if unknown := [c for c in columns if c not in spec.names]:
        raise ArtifactError(f"'{kind}' artifacts have no column {', '.join(map(repr, unknown))}")
    return pa.schema([spec.schema.field(c) for c in columns])


def _column_tables(path: Path, kind: str, schema: pa.Schema, whole: bool) -> Iterator[pa.Table]:
    """The `schema` columns of each part, whole or a bounded batch at a time, cast to their types; a
    nullable column a part lacks is null."""
    for part in artifact_parts(path) if path.is_dir() else [path]:
        if _jsonl_prompts(part, kind):
            yield read_artifact(part, kind).select(schema.names)
            continue
        have = [c for c in schema.names if c in read_schema(part).names]
        for found in [read_parquet(part, have)] if whole else parquet_batches(part, have):
            yield pa.table([found[f.name].cast(f.type) if f.name in have else pa.nulls(found.num_rows, f.type)
                            for f in schema], schema=schema)


def _metadata(path: Path, kind: str) -> dict[bytes, bytes] | None:
    """The metadata `read_artifact` gives a `kind` artifact: its own, or the schema's for another tool's."""
    first = artifact_parts(path)[0] if path.is_dir() else path
    if not _jsonl_prompts(first, kind) and kind_version(schema := read_schema(first))[0] is not None:
        return schema.metadata
    return SCHEMAS[kind].schema.metadata


def _check_file(path: Path, kind: str | None) -> tuple[str | None, int]:
    if _jsonl_prompts(path, kind):
        return kind, read_artifact(path, kind).num_rows  # a prompt set: read whole wherever it is used
    schema = read_schema(path)
    found = _known_kind(path, schema, kind)
    if found is not None:
        return found, SCHEMAS[found].check_batches(schema, parquet_batches(path), str(path))
    spec = SCHEMAS[kind]
    known = [f for f in schema if f.name in spec.names]
    _refuse_twice([f.name for f in known], _foreign(path, kind))
    batches = parquet_batches(path, [f.name for f in known])
    return kind, spec.check_batches(pa.schema(known), batches, _foreign(path, kind))


def _foreign(path: Path, kind: str) -> str:
    """How a refusal names another tool's file."""
    return f"{path} (read as '{kind}' by its columns)"


def _refuse_twice(names: list[str], subject: str) -> None:
    """The sentence `conform` gives a column that is there twice, from the footer's names."""
    if twice := sorted({n for n in names if names.count(n) > 1}):
        shown = ", ".join(f"'{n}'" for n in twice)
        raise ArtifactError(f"{subject} has column {shown} more than once")


def _jsonl_prompts(path: Path, kind: str | None) -> bool:
    named_jsonl = path.suffix in (".jsonl", ".ndjson") and not parquet_magic(path)
    return kind == "prompts" and (named_jsonl or json_text(path))


def _known_kind(path: Path, schema: pa.Schema, kind: str | None) -> str | None:
    """The Sparrow kind the footer `schema` names, checked against `kind` and this Sparrow's version; None
    for another tool's Parquet file read as `kind`."""
    found, version = kind_version(schema)
    if found is None:
        if kind is not None:
            return None
        raise ArtifactError(f"{path} is a Parquet file without Sparrow artifact metadata "
                            f"(no '{KEY_KIND}' key), so its kind is unknown; read it where a specific "
                            "artifact kind is expected")
    if kind is not None and found != kind:
        raise ArtifactError(f"{path} is a '{found}' artifact, expected '{kind}'")
    if found not in SCHEMAS:
        raise ArtifactError(f"{path} is a '{found}' artifact, a kind this Sparrow does not know "
                            f"(known kinds: {', '.join(SCHEMAS)})")
    if version is None:
        raise ArtifactError(f"{path} is a '{found}' artifact without a '{KEY_VERSION}' key, "
                            f"but this Sparrow reads only version {VERSION}")
    if version != VERSION:
        hint = "upgrade Sparrow to read it" if _newer(version) else "regenerate it with this Sparrow"
        raise ArtifactError(f"{path} has version {version} of the '{found}' schema but this Sparrow reads "
                            f"only version {VERSION}, so {hint}")
    stage_metadata(schema, path)  # a damaged record is refused for every kind, not read as empty
    return found


def _read_parts(path: Path, kind: str | None) -> pa.Table:
    parts = artifact_parts(path)
    first = read_artifact(parts[0], kind)
    found = kind_version(first.schema)[0]
    tables = [first] + [read_artifact(p, found) for p in parts[1:]]
    if found is None:  # foreign parts: conformed to `kind` already
        return pa.concat_tables(tables)
    plain = [t.replace_schema_metadata(None) for t in tables]
    return pa.concat_tables(plain).replace_schema_metadata(first.schema.metadata)


def write_artifact_parts(tables: Sequence[TableLike], path: str | os.PathLike, kind: str,
                         metadata: Sequence[Mapping[str, object]]) -> Path:
    """Write `tables[i]` as `path/part-0000i.parquet` (metadata[i]) into a fresh hidden directory, then
    put it in place of `path`: readers see the old directory or the new one, never a mix."""
    if is_stdio(path):
        raise ArtifactError("a directory of parts cannot be written to stdout (-)")
    shown, path = path, output_target(path, directory=True)

    def fill(tmp: Path) -> None:
        for i, (table, meta) in enumerate(zip(tables, metadata, strict=True)):
            write_artifact(table, tmp / f"part-{i:05d}.parquet", kind, meta)

    replace_dir(path, fill)
    return Path(shown)


def replace_dir(path: Path, fill: Callable[[Path], None]) -> None:
    """`fill` a fresh hidden directory beside `path`, then put it in place of `path`: readers see the old
    directory or the new one, never a mix; the hidden one is removed on any error, and an OSError is an
    ArtifactError naming `path` (a full disk, a folder that cannot be written). The new directory
    keeps the old one's mode and group, and so do its files that the old one had. A process killed
    inside leaves hidden siblings: the next replacement removes those whose process is gone, and
    `recover_replaced` puts back a version moved aside."""
    tmp, old = temporary(path, "tmp"), temporary(path, "old")
    try:
        _remove_dead(leftovers(path)[0])
        tmp.mkdir(parents=True)
        fill(tmp)
        _keep_tree_access(path, tmp)
    except OSError as e:
        _undo_replace(path, tmp, old)
        raise ArtifactError(f"cannot write {path} ({e.strerror or first_line(e)})") from None
    except ArtifactError as e:  # a file of the new version: named where it was going
        _undo_replace(path, tmp, old)
        raise ArtifactError(str(e).replace(str(tmp), str(path))) from None
    except BaseException:
        _undo_replace(path, tmp, old)
        raise
    with held_signals():  # both renames or neither, and the old version gone, whenever Ctrl-C comes
        try:
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
        except OSError as e:
            _undo_replace(path, tmp, old)
            raise ArtifactError(f"cannot write {path} ({e.strerror or first_line(e)})") from None
        shutil.rmtree(old, ignore_errors=True)
    _remove_dead(leftovers(path)[1])  # versions moved aside by dead writers: `path` is whole again



def _undo_replace(path: Path, tmp: Path, old: Path) -> None:
    """After a failed `replace_dir`: the new directory removed and, when stopped between the two renames,
    the old one put back. A failure here must not hide the replacement's own error: what is left is
    what a killed writer leaves, which `recover_replaced` and the next replacement undo."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if os.path.lexists(old) and not os.path.lexists(path):
            os.replace(old, path)
    except OSError:
        pass


def _keep_tree_access(old: Path, new: Path) -> None:
    """`new` (a directory) and each file in it given the access of its namesake in `old`, if any."""
    if not old.is_dir():
        return
    for f in sorted(new.rglob("*"), reverse=True):  # a folder after what it holds
        was = old / f.relative_to(new)
        if not f.is_symlink() and not was.is_symlink():
            _keep_access(was, new=f)
    _keep_access(old, new=new)


LEFTOVER = r"\.{name}\.[0-9a-f]{{8,32}}(?:-(\d+))?\.(tmp|old)"  # a replacement's hidden sibling of NAME


def leftovers(path: Path) -> tuple[list[Path], list[Path]]:
    """The hidden siblings that a killed `replace_dir` or `_write` of `path` leaves: its temporaries
    (`.NAME.<hex>-<pid>.tmp`, half-written) and the previous versions it had moved aside
    (`.NAME.<hex>-<pid>.old`), each list oldest first (an older Sparrow's names have no `-<pid>`)."""
    pattern = re.compile(LEFTOVER.format(name=re.escape(hidden_stem(path))))
    found: dict[str, list[Path]] = {"tmp": [], "old": []}
    if path.parent.is_dir():
        for f in path.parent.iterdir():
            match = pattern.fullmatch(f.name)
            if match:
                found[match.group(2)].append(f)
    return sorted(found["tmp"], key=_mtime), sorted(found["old"], key=_mtime)


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:  # gone meanwhile (its writer finished)
        return 0.0


def writer_pid(leftover: Path) -> int | None:
    """The process that made a hidden sibling `.NAME.<hex>-<pid>.tmp|old` (None: an older name)."""
    match = re.search(r"-(\d+)\.(tmp|old)$", leftover.name)
    return int(match.group(1)) if match else None


def dead_writer(leftover: Path) -> bool:
    """Whether the process that made `leftover` is gone: it names one that is not running here, and
    (for a file) nobody holds its lock, so no writer on another host of a shared folder has it either.
    False for an older name without a pid: nothing tells."""
    pid = writer_pid(leftover)
    if pid is None or process_alive(pid):
        return False
    if leftover.is_dir() or leftover.is_symlink():
        return True
    try:
        fd = os.open(leftover, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # no locks here: the pid alone tells
        pass
    finally:
        os.close(fd)
    return True


def process_alive(pid: int) -> bool:
    """Whether a process of this id runs (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _remove_dead(found: Iterable[Path]) -> None:
    for f in found:
        if dead_writer(f):
            _remove(f)


def recover_replaced(path: Path) -> bool:
    """Undo what a process killed while it replaced `path` left: its temporaries are removed, and when
    `path` itself is missing (killed between moving the old version aside and putting the new one in
    place) the newest version moved aside is put back; returns whether one was. A temporary may be
    complete, but nothing says so: the version moved aside is the one known whole."""
    tmps, olds = leftovers(path)
    restored = bool(olds) and not os.path.lexists(path)
    if restored:
        os.replace(olds.pop(), path)
    for f in (*tmps, *olds):
        _remove(f)
    return restored


def remove_leftovers(path: Path) -> None:
    """Remove every hidden sibling a killed replacement of `path` left (`path` itself stays as it is)."""
    for f in (f for found in leftovers(path) for f in found):
        _remove(f)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def opens_json(path: Path) -> bool:
    """A file whose first non-blank byte (after a UTF-8 byte order mark) opens a JSON object or array."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(64).lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()[:1] in (b"{", b"[")


def utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of a JSON lines file, each line decoded as UTF-8 on its own (a byte
    order mark at the start skipped), split on line breaks only (a U+2028 inside a string stays); a line
    that is not UTF-8 raises ArtifactError naming it."""
    for i, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            yield i, raw.decode("utf-8-sig" if i == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise ArtifactError(f"{path} line {i} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1}); Sparrow reads JSON lines as UTF-8, so re-encode the file "
                                "as UTF-8") from None


def _read_jsonl(path: Path) -> pa.Table:
    """One JSON object per line; nested values of string columns (metadata) are kept as JSON text."""
    if not path.exists():
        raise ArtifactError(f"{path} does not exist")
    rows = []
    for i, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            row = file_json(line)
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{path} line {i} is not JSON ({e.msg})") from None
        except ValueError as e:
            raise ArtifactError(f"{path} line {i} cannot be read: {e}") from None
        if not isinstance(row, dict):
            raise ArtifactError(f"{path} line {i} is not a JSON object")
        if isinstance(row.get("metadata"), dict):
            row["metadata"] = json.dumps(row["metadata"])
        rows.append(row)
    if not rows:
        raise ArtifactError(f"{path} holds no JSON lines")
    keys = list(dict.fromkeys(k for row in rows for k in row))  # a key absent from a line is null there
    try:
        return pa.table({k: [row.get(k) for row in rows] for k in keys})
    except (pa.ArrowException, TypeError) as e:
        raise ArtifactError(f"{path}: its lines do not form one table ({first_line(e)})") from None


def _read_foreign(table: pa.Table, path: Path, kind: str) -> pa.Table:
    spec = SCHEMAS[kind]
    table = table.select([c for c in table.column_names if c in spec.names])
    table = spec.conform(table, _foreign(path, kind), fill_missing=True)
    return table.replace_schema_metadata(spec.schema.metadata)


def _spec(kind: str) -> ArtifactSpec:
    if kind not in SCHEMAS:
        raise ArtifactError(f"'{kind}' is not an artifact kind (known kinds: {', '.join(SCHEMAS)})")
    return SCHEMAS[kind]


def _to_table(data: TableLike, spec: ArtifactSpec, subject: str) -> pa.Table:
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, Mapping):
        arrays = {}
        for name, values in data.items():
            try:
                arrays[name] = values if isinstance(values, pa.Array | pa.ChunkedArray) else pa.array(values)
            except (pa.ArrowException, TypeError, ValueError) as e:
                raise ArtifactError(f"{subject} has column '{name}' that Arrow cannot convert "
                                    f"({first_line(e)})") from None
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) > 1:
            raise ArtifactError(f"{subject} has columns of different lengths ({sorted(lengths)})")
        return pa.table(arrays) if arrays else spec.schema.empty_table()
    if isinstance(data, Sequence) and not isinstance(data, str | bytes):
        if not data:
            return spec.schema.empty_table()
        try:
            return pa.Table.from_pylist(list(data))
        except (pa.ArrowException, TypeError, ValueError, AttributeError) as e:
            raise ArtifactError(f"{subject} cannot be converted to an Arrow table "
                                f"({first_line(e)})") from None
    raise ArtifactError(f"{subject} is a {type(data).__name__}, expected an Arrow table, a dict of "
                        f"columns or a list of row dicts")


def _newer(version: str) -> bool:
    try:
        return int(version) > int(VERSION)
    except ValueError:
        return False
