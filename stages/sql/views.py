"""The views of a run directory: one per artifact kind (the union of its files, by column name, with
`source_file` and the files' provenance as `source_*` columns), one per artifact file, one per other
Parquet file. Pooling files of different provenance is said, never silent.

A run directory is untrusted input (runs are downloaded and shared), so nothing read from it reaches SQL
as text: a kind must be one of Sparrow's (otherwise the file is skipped), view names are built from
[A-Za-z0-9_] only and quoted, and paths and provenance values are string literals (`sql_literal`).

Every file left out is said, naming it: a FIFO or a broken symlink as much as a truncated file, or a file
whose name is not UTF-8 (DuckDB takes paths as UTF-8 text only; the name is said with its bytes escaped).
A file of another schema version is read all the same (a view reads columns, not a schema), with a
warning naming its version, since every other command refuses it.

A run may change while it is read: a rollout that finishes writes OUT, then moves its journal away. A file
or folder listed that is gone when it is read is never said to be unreadable, nor skipped (the view would
silently miss its rows): it is RunChanged, and the query lists the run again (`query`)."""

from __future__ import annotations

import os
import re
import unicodedata
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

import pyarrow as pa

from sparrow.schemas import SCHEMAS, VERSION, ArtifactError, artifact_metadata
from sparrow.schemas.artifacts import KEY_VERSION
from sparrow.schemas.footer import kind_version, read_schema
from sparrow.schemas.locations import (
    JOURNAL_PART,
    JOURNAL_SUFFIX,
    command_output,
    journal_parts,
    journal_unscored,
    missing,
)
from sparrow.schemas.provenance import KEY_PROVENANCE, artifact_provenance

from .files import PREFIX, file_url


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
    reward: str | None = None  # what scored rollouts and training: a task's reward or --reward
    reward_fn: str | None = None  # --reward-fn path.py:function, and its file's digest
    reward_fn_sha256: str | None = None
    reward_kwargs: str | None = None  # --reward-kwargs: the function's keywords
    raw_prompts: str | None = None  # prompts tokenized as given, without the chat template
    temperature: str | None = None  # sampling: greedy evaluation and T=1 training rollouts differ in kind
    top_p: str | None = None
    top_k: str | None = None
    max_new_tokens: str | None = None  # where generations were cut: their length and truncation rate
    seed: str | None = None  # a column to group a seed sweep by; pooling seeds is how one gets more samples
    sparrow_version: str | None = None  # from the footer's `sparrow.provenance`: which code wrote the file
    torch_version: str | None = None

    @classmethod
    def of(cls, meta: dict, written_by: dict | None = None) -> Provenance:
        """From a file's `sparrow.meta` object and its `sparrow.provenance` object (none in older files)."""
        written_by = written_by or {}
        found = {**meta, "sparrow_version": written_by.get("sparrow"),
                 "torch_version": written_by.get("torch")}
        return cls(**{f.name: meta_text(found.get(f.name)) for f in fields(cls)})


POOLED_ON_PURPOSE = frozenset({"seed"})


@dataclass(frozen=True)
class Source:
    path: Path  # as DuckDB opens it: the run directory resolved, then the file's path inside it
    name: str  # the path inside the run directory: the `source_file` column
    provenance: Provenance = field(default_factory=Provenance)
    columns: frozenset[str] = frozenset()  # the file's columns, from its footer


@dataclass(frozen=True)
class View:
    name: str
    sources: tuple[Source, ...]
    artifact: bool  # files carry Sparrow metadata (then the view has `source_file` and `source_*`)
    union: bool = False  # every file of one artifact kind
    recorded: tuple[str, ...] = ()  # the Provenance fields that some file of the kind records
    kind: str | None = None  # the artifact kind of its files
    json_lines: bool = False  # a JSON lines file of the run's (a user's dataset), not Parquet

    @property
    def columns(self) -> set[str]:
        """The columns some file of the view has."""
        return set().union(*(s.columns for s in self.sources))

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(s.path for s in self.sources)

    def mixed(self) -> list[str]:
        """The provenance fields in which the view's files differ, but the seed: files of several seeds are
        more samples of one thing."""
        return [f.name for f in fields(Provenance) if f.name not in POOLED_ON_PURPOSE
                and len({getattr(s.provenance, f.name) for s in self.sources}) > 1]


Warn = Callable[[str], None]


class RunChanged(ArtifactError):
    """A file or folder of the run went between its listing and its read (a finished rollout moves its
    journal away); its message says so in one sentence, and to run the query again."""


def run_changed(path: Path) -> RunChanged:
    """RunChanged for the gone `path`: a rollout's journal (or one of its parts) is named as such."""
    folder = path if path.name.endswith(JOURNAL_SUFFIX) else path.parent
    if folder.name.endswith(JOURNAL_SUFFIX) and (folder == path or JOURNAL_PART.fullmatch(path.name)):
        out = folder.name.removesuffix(JOURNAL_SUFFIX)
        return RunChanged(f"the rollout writing {out} finished while this query read its journal {folder}/, "
                          f"so run the query again (it then reads {out})")
    return RunChanged(f"{path} went away while this query read it; run the query again")


def vanished(sources: Iterable[Source]) -> Source | None:
    """The first of `sources` whose file is no longer there; None when every one is."""
    return next((s for s in sources if not os.path.lexists(s.path)), None)


def run_views(run_dir: str | Path, warn: Warn | None = None) -> list[View]:
    """The views of a run directory: one per artifact kind (all its files), one per artifact file
    (`<kind>__<path>`), then one per other Parquet file (its stem). Files that are not readable Parquet
    are skipped, each with a `warn` (default: a Python warning); one listed that is gone when read is
    RunChanged."""
    run_dir = Path(run_dir)
    warn = warn or python_warning
    if not run_dir.exists():
        raise ArtifactError(f"run directory {run_dir} {missing(run_dir)}")
    if not run_dir.is_dir():
        raise ArtifactError(f"{run_dir} is not a directory, and a run is a directory of artifacts")
    by_kind: dict[str, list[Source]] = {}
    plain: list[Source] = []
    other_version: dict[tuple[str, str | None], list[Path]] = {}
    root = run_dir.resolve()
    for p in _run_files(run_dir, warn):
        try:
            if why := not_regular(p) or not_utf8(p, root / p.relative_to(run_dir)):
                raise ArtifactError(why)
            schema = read_schema(p)
            (kind, version), meta = kind_version(schema), file_metadata(schema, p)
            written_by = _written_by(schema, p, warn)
        except (ArtifactError, OSError) as e:
            if not os.path.lexists(p):
                raise run_changed(p) from None
            warn(f"{e if isinstance(e, ArtifactError) else unreadable(p, e)}; skipped it")
            continue
        rel = p.relative_to(run_dir)
        if kind is not None and kind not in SCHEMAS:
            warn(f"{p} names the artifact kind {_shown(kind)}, which is none of Sparrow's "
                 f"({', '.join(sorted(SCHEMAS))}); skipped it")
            continue
        if kind is not None and version != VERSION:
            other_version.setdefault((kind, version), []).append(p)
        source = Source(root / rel, rel.as_posix(), Provenance.of(meta, written_by), frozenset(schema.names))
        (by_kind.setdefault(kind, []) if kind is not None else plain).append(source)
    for (kind, version), paths in other_version.items():
        warn(version_warning(paths, kind, version))
    kinds = sorted(by_kind.items())
    recorded = {kind: _recorded(sources) for kind, sources in kinds}
    views = [View(kind, tuple(sources), True, True, recorded[kind], kind) for kind, sources in kinds]
    taken = set(by_kind)
    for kind, sources in kinds:
        for s in sources:
            name = _free(f"{kind}__{identifier(s.name.removesuffix('.parquet'))}", taken)
            views.append(View(name, (s,), True, False, recorded[kind], kind))
    for name, sources in _plain_views(plain):
        views.append(View(_free(identifier(name), taken), tuple(sources), False))
    views += [View(_free(_json_lines_name(p, taken), taken), (Source(root / p.name, p.name),), False,
                   json_lines=True) for p in _json_lines_files(run_dir, root, warn)]
    return views


def _json_lines_name(path: Path, taken: set[str]) -> str:
    """A JSON lines file's view: its stem, or with its suffix where the stem names a view already (a
    training run's metrics.jsonl beside its metrics artifact is `metrics_jsonl`)."""
    stem = identifier(path.stem)
    return identifier(path.name) if stem.lower() in taken else stem


SHARD = re.compile(r"(?P<split>.+)-\d+-of-\d+\.parquet")  # the Hugging Face Hub's shard names


def _plain_views(plain: list[Source]) -> list[tuple[str, list[Source]]]:
    """The views of the Parquet files that are no artifacts: one per file (its stem), but the Hub's shards
    of one split in one folder (train-00000-of-00002.parquet, ...), which are one dataset: one view, the
    split's name, as `datasets` reads them."""
    shards: dict[tuple[str, str], list[Source]] = {}
    out: list[tuple[str, list[Source]]] = []
    for s in plain:
        path = Path(s.name)
        if m := SHARD.fullmatch(path.name):
            key = (str(path.parent), m["split"])
            if key not in shards:
                shards[key] = []
                out.append((m["split"], shards[key]))
            shards[key].append(s)
        else:
            out.append((path.stem, [s]))
    return [(name, sorted(sources, key=lambda s: s.name)) for name, sources in out]


def _json_lines_files(run_dir: Path, root: Path, warn: Warn) -> list[Path]:
    """The `*.jsonl` files directly in the run directory (users' datasets in TRL's layout), each a view of
    its own; one that is no regular file or has a name that is not UTF-8 is said and skipped."""
    found = []
    for p in sorted(run_dir.glob("*.jsonl")):
        if p.name.startswith("."):
            continue
        if why := not_regular(p) or not_utf8(p, root / p.name):
            warn(f"{why}; skipped it")
            continue
        found.append(p)
    return found


def _recorded(sources: list[Source]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(Provenance)
                 if any(getattr(s.provenance, f.name) is not None for s in sources))


def _run_files(run_dir: Path, warn: Warn) -> list[Path]:
    """The `*.parquet` entries that are not folders (a FIFO or a broken symlink among them, to be said),
    then those of each subfolder that holds nothing else (the parts of a partitioned artifact), and the
    parts of an unfinished rollout's journal (`_journal_files`). A subfolder that cannot be listed is
    skipped with a `warn`; one that went since the run was listed is RunChanged."""
    try:  # one listing for both: a rollout writes OUT, then moves its journal away, so one of the two is
        # in it (a journal gone when looked into is RunChanged)
        with os.scandir(run_dir) as listing:
            folders = {run_dir / e.name: _is_folder(e) for e in listing}
        files = sorted(p for p, folder in folders.items() if not folder and p.name.endswith(".parquet"))
        subs = sorted(p for p, folder in folders.items() if folder and not p.name.startswith("."))
    except OSError as e:
        raise ArtifactError(f"run directory {unreadable(run_dir, e)}") from None
    for sub in subs:
        try:
            files += _folder_files(sub, warn)
        except OSError as e:
            if not os.path.lexists(sub):
                raise run_changed(sub) from None
            warn(f"{unreadable(sub, e)}; skipped it")
    return files


def _is_folder(entry: os.DirEntry) -> bool:
    """Whether a listed entry is a folder; a link in a loop is none (a `.parquet` one is then said to be a
    broken link, as one to nothing)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _folder_files(sub: Path, warn: Warn) -> list[Path]:
    """The files of the subfolder `sub` that are the run's (see `_run_files`): none of a folder a Sparrow
    command holds or held as its output (its lock file), such as a training run that has so far written its
    schedule alone."""
    if (parts := journal_parts(sub)) is not None:
        return _journal_files(sub, parts, warn)
    if command_output(sub):
        return []
    entries = [e for e in sub.iterdir() if not e.name.startswith(".")]
    if entries and all(not e.is_dir() and e.suffix == ".parquet" for e in entries):
        return sorted(entries)
    return []


def unreadable(path: Path, e: OSError) -> str:
    """'PATH cannot be read (why)' for an OSError met reading `path`."""
    return f"{path} cannot be read ({e.strerror or e})"


def _journal_files(folder: Path, parts: list[Path], warn: Warn) -> list[Path]:
    """The parts of a rollout's journal (OUT.partial/) while the rollout is unfinished, said once, so that
    a long rollout can be queried as it runs; none once its artifact OUT is written, since they hold rows
    that OUT holds too."""
    finished = folder.with_name(folder.name.removesuffix(JOURNAL_SUFFIX))
    if finished.exists():
        if parts:
            warn(f"{folder}/ is the journal of the rollout {finished.name}, whose rows that file holds; "
                 "skipped it")
        return []
    unscored = journal_unscored(folder)
    files = f"{len(unscored)} file{'s' if len(unscored) > 1 else ''}"
    waiting = (f"; {files} of finished prompts that an interrupt left unscored (unscored-*.parquet) are read "
               "once `sparrow rollout --resume` scores them" if unscored else "")
    if parts:
        some = f"its {len(parts)} parts are" if len(parts) > 1 else "its part is"
        warn(f"{folder}/ is the journal of an unfinished rollout: {some} read as the rollouts it has "
             f"finished so far{waiting}")
    elif unscored:
        warn(f"{folder}/ is the journal of an unfinished rollout with no part yet{waiting}")
    return parts


def not_regular(path: Path) -> str | None:
    """Why `path` is no file to read, or None: a broken symlink, or a FIFO, socket or device (reading one
    could block)."""
    if path.is_symlink() and not path.exists():
        return f"{path} is a broken symlink (to {os.readlink(path)})"
    if not path.is_file():
        return f"{path} is not a regular file"
    return None


def not_utf8(path: Path, opened: Path | None = None, use: str = "query") -> str | None:
    """Why DuckDB cannot be given `opened` (default `path`; the file `path`), or None: a name that is not
    UTF-8 (which Python holds with surrogate escapes). `use`: what renaming it lets the user do with it."""
    try:
        str(path if opened is None else opened).encode("utf-8")
    except UnicodeEncodeError:
        return (f"{escaped(path)} has a name that is not UTF-8, which DuckDB cannot open; "
                f"rename it to {use} it")
    return None


def escaped(path: Path) -> str:
    """`path` for a message: bytes that are not UTF-8 as \\xNN escapes."""
    return os.fsencode(path).decode("utf-8", errors="backslashreplace")


def file_metadata(schema: pa.Schema, path: Path) -> dict:
    """The `sparrow.meta` object of `path`'s footer `schema`; ArtifactError naming the file when it is not
    a JSON object (read again by path, so that the one sentence every command gives names it)."""
    try:
        return artifact_metadata(schema)
    except ArtifactError:
        return artifact_metadata(path)


def _written_by(schema: pa.Schema, path: Path, warn: Warn) -> dict:
    """The versions that wrote `path` (its footer's `sparrow.provenance`); {} for a file without them, and
    for one whose record is damaged, said: the file's rows are still read."""
    try:
        return artifact_provenance(schema)
    except ArtifactError:
        warn(f"{path} has a '{KEY_PROVENANCE}' footer key that is not a JSON object; its "
             "source_sparrow_version and source_torch_version are null")
        return {}


def version_warning(paths: list[Path], kind: str, version: str | None) -> str:
    """One sentence for the artifacts of one kind whose footers record the same other schema version than
    this Sparrow's (or none): their views read their columns as they are, where every other command
    refuses them. One sentence for them all, since a run from another Sparrow has many (its steps)."""
    one = len(paths) == 1
    who = str(paths[0]) if one else f"{paths[0]} and {len(paths) - 1} more '{kind}' files"
    has = "has" if one else "have"
    which = (f"{has} no '{KEY_VERSION}' key" if version is None
             else f"{has} version {_shown(version)} of the '{kind}' schema")
    it, its = ("it", "its") if one else ("them", "their")
    hint = f"upgrade Sparrow to read {it}" if _newer(version) else f"regenerate {it} with this Sparrow"
    return (f"{who} {which}, but this Sparrow reads only version {VERSION}; {its} views read {its} columns "
            f"as they are, where other commands refuse {it} ({hint})")


def _newer(version: str | None) -> bool:
    try:
        return version is not None and int(version) > int(VERSION)
    except ValueError:
        return False


def _free(name: str, taken: set[str]) -> str:
    """`name`, suffixed with _2, _3, ... while it is taken in any case (`taken` holds names lower-cased, as
    DuckDB's names are case-insensitive: select.parquet and Select.parquet are `select` and `Select_2`);
    then taken."""
    candidate, i = name, 2
    while candidate.lower() in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate.lower())
    return candidate


def _shown(text: str, most: int = 40) -> str:
    """Untrusted text in a message: quoted, cut to `most` characters."""
    return repr(text if len(text) <= most else text[:most] + "...")


def view_sql(view: View, root: Path, columns: list[tuple[str, str]] | None = None) -> str:
    """The view's SELECT, reading its files through their URLs (files.py: read only); a JSON lines view's
    with its `columns` (name, DuckDB type) when known, so that binding it does not sample the file."""
    files = ", ".join(sql_literal(file_url(p)) for p in view.files)
    if view.json_lines:
        if not columns:
            return f"SELECT * FROM read_json_auto([{files}], format = 'newline_delimited')"
        typed = ", ".join(f"{sql_literal(name)}: {sql_literal(kind)}" for name, kind in columns)
        return (f"SELECT * FROM read_json([{files}], format = 'newline_delimited', auto_detect = false, "
                f"columns = {{{typed}}})")
    if not view.artifact:
        return f"SELECT * FROM read_parquet([{files}], union_by_name = true)"
    columns = absent_columns(view.kind, view.columns)
    columns += [f"substr(filename, {len(PREFIX) + len(str(root)) + 2}) AS source_file"]
    columns += [f"{_by_file(view, name)} AS source_{name}" for name in view.recorded]
    return (f"SELECT * EXCLUDE (filename), {', '.join(columns)} "
            f"FROM read_parquet([{files}], union_by_name = true, filename = true)")


_DUCKDB_TYPES = {pa.float32(): "FLOAT", pa.float64(): "DOUBLE", pa.int32(): "INTEGER", pa.int64(): "BIGINT",
                 pa.string(): "VARCHAR", pa.bool_(): "BOOLEAN"}


def absent_columns(kind: str | None, present: Iterable[str]) -> list[str]:
    """`NULL::TYPE AS "name"` for each nullable column of `kind`'s schema that no file has (one written
    before the column was added, or by a writer that left it out, as the schema allows), so that a query
    naming it reads NULL, as from a file that holds it; none for a kind that is not Sparrow's."""
    if kind not in SCHEMAS:
        return []
    have = set(present)
    return [f"NULL::{_duckdb_type(c.type)} AS \"{c.name}\"" for c in SCHEMAS[kind].columns
            if c.nullable and c.name not in have and _duckdb_type(c.type)]


def _duckdb_type(arrow: pa.DataType) -> str | None:
    """DuckDB's name of a schema column's type (a list's as ITEM[]); None for a type without one here."""
    if pa.types.is_list(arrow):
        item = _duckdb_type(arrow.value_type)
        return f"{item}[]" if item else None
    return _DUCKDB_TYPES.get(arrow)


def _by_file(view: View, name: str) -> str:
    """A provenance field as an SQL expression: a constant, or a CASE over the files that differ."""
    files_by_value: dict[str | None, list[str]] = {}
    for s in view.sources:
        files_by_value.setdefault(getattr(s.provenance, name), []).append(sql_literal(file_url(s.path)))
    if len(files_by_value) == 1:
        value = next(iter(files_by_value))
        return "NULL::VARCHAR" if value is None else sql_literal(value)
    cases = " ".join(f"WHEN filename IN ({', '.join(files)}) THEN {sql_literal(value)}"
                     for value, files in files_by_value.items() if value is not None)
    return f"CASE {cases} ELSE NULL END"


def mixed_warning(view: View, sql: str = "") -> str | None:
    """One sentence when a union view pools files of different provenance; None otherwise, or when the
    query `sql` names the columns that tell the files apart (`source_file` or a differing `source_*`):
    then it filters or groups by them."""
    mixed = view.mixed() if view.union and len(view.sources) > 1 else []
    named = sql.lower()
    if not mixed or any(f"source_{n}" in named for n in ("file", *mixed)):
        return None
    differ = "; ".join(f"{name}: " + ", ".join(sorted({str(getattr(s.provenance, name) or "none")
                                                         for s in view.sources})) for name in mixed)
    return (f"the view '{view.name}' pools {len(view.sources)} files of different provenance ({differ}); "
            f"filter on {', '.join(f'source_{n}' for n in mixed)}, or query one file's view "
            f"({view.name}__...)")


def meta_text(value: object) -> str | None:
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else str(value)


def python_warning(message: str) -> None:
    warnings.warn(message, stacklevel=3)


IDENTIFIER = re.compile(r"[^\W\d]\w*")  # letters of any script, digits and _, not a digit first


def identifier(stem: str) -> str:
    """A view name from a file's name, one a query can write unquoted: a Latin letter with accents as its
    ASCII letter (ü.parquet is `u`, as people type it), letters of other scripts as they are (日本.parquet
    is `日本`), then runs of anything but letters, digits and `_` become one `_`."""
    kept, base = [], ""
    for c in unicodedata.normalize("NFKD", stem):
        if not unicodedata.combining(c):
            base = c
        elif base.isascii():  # an accent of a Latin letter (ệ has two): dropped, as people type it
            continue
        kept.append(c)
    name = re.sub(r"\W+", "_", unicodedata.normalize("NFC", "".join(kept))).strip("_") or "file"
    return f"_{name}" if name[0].isdigit() else name


def quoted_identifier(name: str) -> str:
    """`name` as an SQL identifier; ValueError unless it is letters, digits and `_` (as every view name
    is: no quote, space, control or format character), so that quoting is a second guard, never the only
    one."""
    if not IDENTIFIER.fullmatch(name):
        raise ValueError(f"{_shown(name)} is not a view name (letters, digits and _)")
    return '"' + name + '"'


def sql_literal(text: str) -> str:
    """`text` as a DuckDB string literal: standard SQL strings, where only `'` is special (doubled)."""
    return "'" + text.replace("'", "''") + "'"
