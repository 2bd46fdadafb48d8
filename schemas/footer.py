"""What an artifact file is, read from its Parquet footer alone: its kind, version, metadata and parts.

The checks run before any data is read: existence, the Parquet magic bytes at both ends (a missing
footer means a truncated file), then the kind and version from the schema's metadata.

pyarrow is handed an open file, never a path: it encodes a `str` path strictly as UTF-8, so a file name
that is not UTF-8 (a Latin-1 name from an old share, which Python holds with surrogate escapes) could not
be read. A read that fails for lack of memory or threads (under `ulimit -v`, as batch schedulers set it) is
said as such, never as a corrupt file: the file is fine, and the user should not regenerate it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .artifacts import KEY_KIND, KEY_META, KEY_VERSION, ArtifactError, first_line

MAGIC = b"PAR1"


def artifact_parts(path: str | os.PathLike) -> list[Path]:
    """The Parquet parts of a directory artifact, in name order (hidden files are temporaries)."""
    path = Path(path)
    parts = sorted(p for p in path.iterdir() if p.suffix == ".parquet" and not p.name.startswith("."))
    if not parts:
        raise ArtifactError(f"{path} is a directory without Parquet parts, not an artifact")
    return parts


def artifact_kind(path: str | os.PathLike) -> str | None:
    """The artifact kind from the Parquet footer (no data is read); None for other Parquet files. A
    directory of parts has the kind of its first part."""
    path = Path(path)
    if path.is_dir():
        path = artifact_parts(path)[0]
    return kind_version(read_schema(path))[0]


def artifact_metadata(table_or_path: pa.Table | pa.Schema | str | os.PathLike, key: str = KEY_META) -> dict:
    """The stage's own metadata (the `sparrow.meta` JSON object, or the one under footer key `key`) of a
    table, a schema or an artifact file (a directory of parts: its first part); {} when it has none."""
    if isinstance(table_or_path, pa.Table | pa.RecordBatch):
        schema, where = table_or_path.schema, "the table"
    elif isinstance(table_or_path, pa.Schema):
        schema, where = table_or_path, "the schema"
    else:
        where = Path(table_or_path)
        schema = read_schema(artifact_parts(where)[0] if where.is_dir() else where)
    return stage_metadata(schema, where, key)


def stage_metadata(schema: pa.Schema, where: object, key: str = KEY_META) -> dict:
    """`schema`'s `sparrow.meta` JSON object (or the one under footer key `key`; {} when it has none);
    ArtifactError naming `where` (a file, "the table") when it is not a JSON object."""
    raw = (schema.metadata or {}).get(key.encode())
    if raw is None:
        return {}
    try:
        meta = file_json(raw)
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise ArtifactError(f"{where} has '{key}' metadata that is not a JSON object")
    return meta


WHOLE = "a positive whole number"
OPEN_UNIT = "a number between 0 and 1 (both excluded)"
FOOTER_NUMBERS = {"bin_width": WHOLE, "min_tokens": WHOLE, "threshold": OPEN_UNIT, "quantile": OPEN_UNIT}


def footer_number(meta: dict, key: str, where: object) -> int | float | None:
    """The numeric `sparrow.meta` key `key` (one of FOOTER_NUMBERS) of the artifact `where`, whose metadata
    is `meta`: None when absent or null; an int for a whole number (512.0 as 512), a float in (0, 1) for
    the others. ArtifactError naming the file and the key when the value is anything else (text, a
    boolean, zero), so that no caller divides by it or converts it first."""
    value = meta.get(key)
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if FOOTER_NUMBERS[key] == WHOLE and number and value >= 1 and float(value).is_integer():
        return int(value)
    if FOOTER_NUMBERS[key] == OPEN_UNIT and number and 0 < value < 1:
        return float(value)
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
    raise ArtifactError(f"{where} records {key} {shown} in its '{KEY_META}' metadata, not "
                        f"{FOOTER_NUMBERS[key]}")


def file_json(text: str | bytes) -> object:
    """JSON text that a file supplies (a footer's metadata, a column of JSON objects), parsed: json.loads,
    whose ValueError is every failure, also for JSON nested deeper than Python's parser recurses (there
    json.loads raises RecursionError, which no caller takes for bad input: a command would end in a
    traceback), and for a string escape of half a UTF-16 surrogate pair (`"\\ud800"`), which JSON's
    grammar allows but no UTF-8 text holds (Arrow and Parquet would fail on it later, far from the line)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("the JSON nests too deeply to read") from None
    if _SURROGATE_ESCAPE.search(text if isinstance(text, str) else text.decode("utf-8", "replace")):
        if (half := _lone_surrogate(value)) is not None:
            raise ValueError(f"a string holds the escape \\u{ord(half):04x}, half of a UTF-16 surrogate pair "
                             "without its other half, which is not text")
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _lone_surrogate(value: object) -> str | None:
    """The first unpaired surrogate in the strings (keys too) of a parsed JSON value, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return value[e.start]
        return None
    parts = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    if not isinstance(parts, list):  # a number, a bool, null
        return None
    return next((half for part in parts if (half := _lone_surrogate(part)) is not None), None)


def read_schema(path: Path) -> pa.Schema:
    if not path.exists():
        raise ArtifactError(f"{path} does not exist")
    if path.is_dir():
        raise ArtifactError(f"{path} is a directory, not a Parquet file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(size - 4, 0))
            tail = f.read(4)
    except FileNotFoundError:  # removed since it was looked at
        raise ArtifactError(f"{path} does not exist") from None
    if size == 0:
        raise ArtifactError(f"{path} is an empty file, not a Parquet file")
    if head != MAGIC:
        what = "JSON text (only prompts may be JSON lines)" if json_text(path) else "not a Parquet file"
        raise ArtifactError(f"{path} is {what}: it does not start with the Parquet magic bytes")
    if size < 12 or tail != MAGIC:
        raise ArtifactError(f"{path} is a truncated Parquet file (its footer is missing; "
                            f"was its writer interrupted?)")
    try:
        with pa.OSFile(os.fsencode(path)) as f:
            return pq.read_schema(f)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # a name in the footer may not be UTF-8
        raise unreadable(path, e) from None


def read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    """The table of the Parquet file `path` (its `columns`, or all); ArtifactError naming the file when
    it cannot be read."""
    try:
        with pa.OSFile(os.fsencode(path)) as f:
            return pq.read_table(f, columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise unreadable(path, e) from None


BATCH_BYTES = 64 << 20  # what one batch of `parquet_batches` holds decoded, about
_WIDTH = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}


def parquet_batches(path: Path, columns: list[str] | None = None) -> Iterator[pa.Table]:
    """The rows of the Parquet file `path` (its `columns`, or all) as tables of about BATCH_BYTES each (rows
    counted from the average row of their row group, so a run of rows far longer than the group's average
    makes a larger batch), however large its row groups, the column chunks read a page at a time;
    ArtifactError naming the file when it cannot be read."""
    try:
        with (pa.OSFile(os.fsencode(path)) as raw,
              pq.ParquetFile(raw, buffer_size=1 << 20, pre_buffer=False) as f):
            for group in range(f.num_row_groups):  # sized by each group's own rows
                rows = max(1, BATCH_BYTES // max(1, _row_bytes(f.metadata.row_group(group), columns)))
                for batch in f.iter_batches(batch_size=rows, row_groups=[group], columns=columns,
                                            use_threads=False):
                    yield pa.Table.from_batches([batch])
    except (pa.ArrowException, OSError) as e:
        raise unreadable(path, e) from None


def _row_bytes(group: pq.RowGroupMetaData, columns: list[str] | None) -> int:
    """The decoded bytes of an average row of `columns` in a row group, at most: each leaf's values at their
    width, or its uncompressed pages when wider (strings), with an offset per value for nested leaves."""
    if not group.num_rows:
        return 1
    wanted = None if columns is None else set(columns)
    total = 0
    for c in range(group.num_columns):
        chunk = group.column(c)
        if wanted is not None and chunk.path_in_schema.split(".")[0] not in wanted:
            continue
        fixed = chunk.num_values * (_WIDTH.get(chunk.physical_type, 0) + 4)
        total += max(fixed, chunk.total_uncompressed_size)
    return total // group.num_rows + 1


_RESOURCE_WORDS = ("failed to launch worker thread", "resource temporarily unavailable",
                   "cannot allocate memory", "out of memory")


def unreadable(path: Path, e: BaseException) -> ArtifactError:
    """Why pyarrow could not read `path`: the process's limits (memory, threads), or a corrupt file."""
    if resource_failure(e):
        return ArtifactError(f"{path} could not be read for lack of memory or threads under this process's "
                             f"limits ({address_space_limit()}), not because the file is damaged "
                             f"({first_line(e)})")
    repeated = re.search(r"Multiple matches for FieldRef\.Name\((.+?)\)", str(e))
    if repeated:  # a valid file whose schema names a column twice (Arrow says so only in its message)
        return ArtifactError(f"{path} has more than one column named {repeated.group(1)!r}; give each column "
                             "its own name")
    return ArtifactError(f"{path} is a corrupt Parquet file ({first_line(e)})")


def resource_failure(e: BaseException) -> bool:
    """An error of the process's resources, not of the file: pyarrow says so only in its message."""
    if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno in (errno.ENOMEM, errno.EAGAIN)):
        return True
    text = str(e).lower()
    return any(words in text for words in _RESOURCE_WORDS)


def address_space_limit() -> str:
    """The process's address space limit, in `ulimit -v`'s words (KiB)."""
    import resource  # POSIX only

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return "ulimit -v is unlimited; see ulimit -u for threads"
    return f"ulimit -v is {soft // 1024} KiB; raise it"


def parquet_magic(path: Path) -> bool:
    """A regular file that starts with the Parquet magic bytes: Parquet by content, whatever its name."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def json_text(path: Path) -> bool:
    """A regular file whose start is text (UTF-8, no control bytes but whitespace) and whose first non-blank
    byte opens a JSON object or array (JSON lines by content, whatever the file's suffix)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    return head[:1] in (b"{", b"[") and _text(head)


def _text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # more than a character cut at the end of the read
            return False
    return not any(b < 0x09 or 0x0E <= b < 0x20 or b == 0x7F for b in head)


def kind_version(schema: pa.Schema) -> tuple[str | None, str | None]:
    """The artifact kind and schema version a footer records; text that is not UTF-8 is read with its bad
    bytes replaced, so that it names no known kind and is refused as such."""
    meta = schema.metadata or {}
    kind, version = meta.get(KEY_KIND.encode()), meta.get(KEY_VERSION.encode())
    return (kind.decode(errors="replace") if kind is not None else None,
            version.decode(errors="replace") if version is not None else None)
