"""Where artifacts go and come from: output locations that never destroy what they point at, and inputs
that need not be seekable.

Design decisions (one rule for every command that writes):
- `-` as an output is stdout: the artifact is written whole to a temporary file, then copied to stdout,
  so a pipe receives a valid Parquet file or nothing. As an input, `-` is stdin.
- A symlink is written through: the write lands on its final target, which is replaced atomically in
  its own folder (a temporary sibling, then a rename), so the link itself survives.
- A FIFO, a device or a socket is never an output, and a directory is not where a file is expected:
  refused in one sentence. (A FIFO or a device as an input, such as `/dev/stdin` in a pipe, is read
  whole into a private temporary file first, since Parquet is read by seeking to its footer.)
- An existing file is replaced only when it is an artifact of the kind being written (or empty);
  anything else needs `force`. A query result (`sparrow sql -o`) is not an artifact, so it is marked by
  QUERY_KEY in its footer: a Parquet file without that mark (a user's own dataset) is not replaced
  without `force`. A directory is replaced only when it is an output of the same kind:
  forcing never deletes a directory of someone else's files.
- The location is checked before any work: the nearest existing folder on the way must be a directory
  in which a file can be created (checked by creating and removing one), so that an unwritable `-o`
  fails at once, not after a long run. A symlink on the way counts as existing: one that leads to no
  folder (dangling, or a loop) is refused there, since nothing can be created under it. Nothing is
  created by the check. A name longer than the file system takes (PC_NAME_MAX, else 255 bytes) is
  refused there too; every shorter one can be written, since a hidden sibling of a name too long to
  take the sibling's marks is named by a digest of it (`hidden_stem`). A rollout's journal keeps the
  name the user gave (`OUT.partial`, so that `sparrow sql` tells whose journal it is), so an `-o` too
  long to take that suffix is refused, in one sentence, before any work.
- An existing output in a sticky folder (mode +t, as /tmp or a shared /scratch) that belongs to another
  user, in a folder of another user's, cannot be renamed over (the kernel refuses it, but to a process
  with CAP_FOWNER): it is refused before any work, since the write would fail only at its end. The rule
  is tested, not tried: no rename over someone else's file is a harmless probe.
- An output is never one of the files the command reads (the same file, through any link), nor a
  directory replaced whole that holds one: `force` does not allow it, since the write would destroy
  the input (a profile may be hours of GPU) that the run was made from.
- An artifact is Parquet whatever the file is called, so a file output whose suffix names a table format
  Sparrow prints or reads as text (.json, .jsonl, .ndjson, .csv, .tsv) is refused, even with `force`:
  the file would not be what its name says, and a reader going by the name would misread it. Any other
  name is taken. A path ending in a slash names a directory, never
  a file output (`check_file_path`, on the text the user gave, since a Path drops the slash).
- A folder that a long-running command writes (a training run) is held by an exclusive advisory lock
  (`hold_folder`: flock on FOLDER/.sparrow.lock), so a second writer is refused at once instead of
  mixing its files with the first's. The kernel drops the lock when its process ends, however it ends,
  so a killed writer never blocks the next one; the lock file is removed when the lock is released, and
  a lock is taken only on the file that is still at that path (a releaser may have just removed it).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from .artifacts import ArtifactError
from .footer import artifact_parts, kind_version, read_schema

STDIO = "-"


class OutputRefused(ArtifactError):
    """An existing output that is not of the kind written; `force` would replace it."""


class UnusableOutput(ArtifactError):
    """An output path that no `force` makes writable: a name too long for its file system, a path that
    cannot be looked at, or a file the command itself reads. Its message starts with the path, so that
    the CLI can put the flag before it."""


def is_stdio(path: str | os.PathLike | None) -> bool:
    return path is not None and os.fspath(path) == STDIO


def special_kind(path: Path) -> str | None:
    """'a FIFO', 'a character device', ... for a path (followed through symlinks) that exists and is
    neither a regular file nor a directory; None otherwise."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return None


def output_target(path: str | os.PathLike, directory: bool = False) -> Path:
    """The path a write to `path` replaces: its final target when `path` is a symlink. Refuses a FIFO,
    device or socket, a directory where a file is expected (a file where a directory is), a name longer
    than its file system takes, and a path that cannot be looked at (UnusableOutput)."""
    path = Path(path)
    check_name_lengths(path)
    with _looking_at(path):
        target = _link_target(path) if path.is_symlink() else path
        if target != path:
            check_name_lengths(target)
        shown = f"{path} (a symlink to {target})" if target != path else str(path)
        special = special_kind(target)
        if special:
            raise ArtifactError(f"{shown} is {special}, not a file that an artifact can be written to; give "
                                "a file path, or - for stdout")
        if not directory and target.is_dir():
            raise ArtifactError(f"{shown} is a directory; give a file path such as {path / 'out.parquet'}")
        if directory and target.exists() and not target.is_dir():
            raise ArtifactError(f"{shown} is a file, but a directory is written there")
    return target


@contextmanager
def _looking_at(path: Path) -> Iterator[None]:
    """A block that looks at an output path (stat, is_symlink): an OSError there (a folder on the way
    that may not be searched, a path longer than the system takes) is one sentence naming it."""
    try:
        yield
    except OSError as e:
        raise UnusableOutput(f"{_short(path)} cannot be written ({e.strerror or e})") from None


NAME_MAX = 255  # Linux's, where a file system does not tell its own
# what a hidden sibling adds to the name it is made for: `.NAME.<12 hex>-<pid>.tmp`, a pid of up to 7 digits
HIDDEN_MARKS = len("." + "." + "0" * 12 + "-" + "0" * 7 + ".tmp")


def name_max(folder: str | os.PathLike) -> int:
    """The most bytes a file name may have in `folder` (or, where it does not exist yet, in its nearest
    existing ancestor): its file system's PC_NAME_MAX, else NAME_MAX."""
    existing = Path(os.path.abspath(folder))
    while not os.path.isdir(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX


def check_name_lengths(path: Path) -> None:
    """Refuse a path with a name (the file's, or a folder's on the way) longer than its file system takes,
    in one sentence, before anything looks it up (which would fail with ENAMETOOLONG)."""
    limit = name_max(path.parent)
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > limit:
            what = "its name" if part == path.name else f"a folder on its way ({_short(part)})"
            raise UnusableOutput(f"{_short(path)} cannot be written: {what} is {size} bytes, and a file name "
                                 f"may have at most {limit} bytes here; choose a shorter name")


def hidden_stem(path: Path) -> str:
    """The NAME in the names of `path`'s hidden siblings (temporaries, versions moved aside, its lock):
    its own name, or where that name plus their marks (HIDDEN_MARKS) would be too long for its folder, a
    digest of it, so that every name its file system takes can be written."""
    if len(os.fsencode(path.name)) + HIDDEN_MARKS <= name_max(path.parent):
        return path.name
    return hashlib.sha256(os.fsencode(path.name)).hexdigest()[:32]


def _short(path: str | os.PathLike, keep: int = 40) -> str:
    """`path` as a message shows it: whole, but for a name in it too long to read, cut in the middle."""
    cut = [p if len(p) <= 2 * keep + 1 else f"{p[:keep]}…{p[-keep:]}" for p in os.fspath(path).split(os.sep)]
    return os.sep.join(cut)


def _link_target(link: Path) -> Path:
    """Where a write through the symlink `link` lands: its final target, which must be in an existing
    folder (a dangling link creates no folders on its way) and must not be the link again (a loop)."""
    try:
        os.stat(link)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ArtifactError(f"{link} is a symlink that loops back on itself, so it leads to no file; "
                                "remove it or give another path") from None
    target = Path(os.path.realpath(link))
    if not target.parent.is_dir():
        raise ArtifactError(f"{link} is a symlink to {target}, whose folder {target.parent} does not exist; "
                            "a symlink is written through, so create that folder or give another path")
    return target


def check_writable(folder: Path, shown: str | os.PathLike) -> None:
    """Refuse a folder that cannot be created or written: its nearest existing ancestor (a symlink
    included) must be a directory in which a file can be made (tried, then removed)."""
    folder = Path(os.path.abspath(folder))
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if existing.is_symlink() and not existing.exists():
        raise ArtifactError(f"{shown} cannot be written: {existing} is {_broken_link(existing)}, so no "
                            "folder can be created under it; fix the link or give another path")
    if not existing.is_dir():
        raise ArtifactError(f"{shown} cannot be written: {existing} is a file, so nothing can be created "
                            "under it")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".sparrow-probe-", dir=existing))
    except OSError as e:
        raise ArtifactError(f"{shown} cannot be written: no file can be created in {existing} "
                            f"({e.strerror or e})") from None


def missing(path: str | os.PathLike) -> str:
    """Why the input `path` cannot be found, as the end of a sentence that starts with it: 'does not exist',
    or the broken symlink it is ('is a symlink to X, which does not exist', '... loops back on itself')."""
    return f"is {_broken_link(Path(path))}" if os.path.islink(path) else "does not exist"


def _broken_link(link: Path) -> str:
    """'a symlink to X, which does not exist' or 'a symlink that loops back on itself', for a link that
    leads nowhere."""
    try:
        os.stat(link)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink that loops back on itself"
    return f"a symlink to {os.path.realpath(link)}, which does not exist"


# the table formats Sparrow prints (--format) or reads (JSON lines prompts) as text: a file named so says it
# holds that format; a plain .txt says nothing of its layout and is taken
TEXT_SUFFIXES = {".json": "JSON", ".jsonl": "JSON lines", ".ndjson": "JSON lines", ".csv": "CSV",
                 ".tsv": "TSV"}


def check_parquet_name(path: str | os.PathLike) -> None:
    """Refuse a Parquet file output whose suffix names a text format (TEXT_SUFFIXES)."""
    suffix = Path(path).suffix.lower()
    if suffix in TEXT_SUFFIXES:
        raise ArtifactError(f"{path} would hold Parquet under a {TEXT_SUFFIXES[suffix]} name, so give a path "
                            f"ending in .parquet (not {Path(path).name}); sparrow sql --format csv or json "
                            "turns an artifact into text")


def check_file_path(text: str) -> None:
    """Refuse, as given on the command line, a file output that names a directory: a path ending in a
    slash (or in . or ..), which a Path would silently turn into a file of the folder's name."""
    if is_stdio(text):
        return
    if text.endswith(("/", os.sep)) or os.path.basename(text) in (".", ".."):
        folder = text.rstrip("/" + os.sep) or text
        raise ArtifactError(f"{text} names a directory; give a file path such as "
                            f"{os.path.join(folder, 'out.parquet')}")


PLAIN = "a Parquet file without Sparrow metadata"
QUERY_KEY = "sparrow.query"  # footer key of a `sparrow sql -o` result; its value is the query
QUERY_RESULT = "a query result of sparrow sql"
DATASET_KEY = "sparrow.dataset"  # footer key of a trainer's dataset (`sparrow prompts --layout`): the layout
DATASET = "a verl or TRL dataset written by sparrow prompts"
PLAIN_KINDS = {None: QUERY_RESULT, "dataset": DATASET}  # outputs that are no artifact, by their mark


def _empty(path: Path) -> bool:
    return not any(path.iterdir()) if path.is_dir() else path.stat().st_size == 0


def describe(path: Path) -> tuple[str | None, str]:
    """(artifact kind or None, a few words) of an existing file or directory of parts, from its footer:
    an artifact, a query result (QUERY_KEY), or another Parquet file."""
    try:
        schema = read_schema(artifact_parts(path)[0] if path.is_dir() else path)
    except ArtifactError:
        return None, "a directory that is not an artifact" if path.is_dir() else "not a Sparrow artifact"
    kind = kind_version(schema)[0]
    if kind is None:
        footer = schema.metadata or {}
        marked = next((words for key, words in ((QUERY_KEY, QUERY_RESULT), (DATASET_KEY, DATASET))
                       if key.encode() in footer), PLAIN)
        return None, marked
    return kind, f"a '{kind}' artifact"


InputPaths = Mapping[str, str | os.PathLike | Iterable[str | os.PathLike] | None]


def check_output(path: str | os.PathLike, kind: str | None, force: bool = False,
                 parts: bool = False, inputs: InputPaths | None = None) -> None:
    """Refuse, before any work, an output location that must not or cannot be written.

    `kind` is the artifact kind written (None: a query result, marked by QUERY_KEY; "dataset": a trainer's
    dataset, marked by DATASET_KEY); `parts`: a
    directory of Parquet parts (`--workers`); `inputs`: the files the command reads, by flag (a flag's
    several files as a list), none of which it may replace (`check_not_input`). A file named as a text
    format is refused (`check_parquet_name`). An existing artifact of `kind` (or query result, or an
    empty file) is replaced; anything else, a Parquet file without Sparrow's marks included, raises
    OutputRefused unless `force` (a directory that is not such an artifact: ArtifactError, since forcing
    would delete it)."""
    if is_stdio(path):
        if parts:
            raise ArtifactError("-o - writes one Parquet file to stdout, but --workers writes a directory "
                                "of parts; give a directory")
        return
    path = Path(path)
    target = output_target(path, directory=parts)
    check_not_input(target, path, inputs or {})
    if not parts:
        check_parquet_name(path)
    wanted = PLAIN_KINDS[kind] if kind in PLAIN_KINDS else f"a '{kind}' artifact"
    with _looking_at(path):
        if target.exists() and not _empty(target):
            found, words = describe(target)
            if words != wanted:
                if target.is_dir():
                    raise ArtifactError(f"{path} is {words}, not {wanted}, and replacing it would delete it; "
                                        "choose another path")
                if not force:
                    raise OutputRefused(f"{path} exists and is {words}, not {wanted}")
        check_replaceable(target, path)
        check_writable(target if parts and target.is_dir() else target.parent, path)


CAP_FOWNER = 3  # capabilities(7): the bit that lets a process act on files it does not own


def check_replaceable(target: Path, shown: str | os.PathLike) -> None:
    """Refuse an existing `target` that a rename cannot replace: in a sticky folder, where the kernel lets
    only the owner of the file or of the folder (or a process with CAP_FOWNER) rename over it."""
    try:
        found, folder = os.stat(target, follow_symlinks=False), os.stat(target.parent)
    except OSError:  # nothing to replace, or a way that `check_writable` names
        return
    if not folder.st_mode & stat.S_ISVTX or os.geteuid() in (folder.st_uid, found.st_uid) or has_fowner():
        return
    raise UnusableOutput(f"{shown} belongs to another user in the sticky folder {target.parent} (mode "
                         f"{stat.S_IMODE(folder.st_mode):o}), where only its owner may replace it; choose "
                         "another path, or ask its owner to remove it")


def has_fowner() -> bool:
    """Whether this process holds CAP_FOWNER (in /proc/self/status's CapEff); True where that cannot be
    read, so that a folder is never refused on a guess."""
    try:
        with open("/proc/self/status") as f:
            effective = next(line.split()[1] for line in f if line.startswith("CapEff:"))
        return bool(int(effective, 16) >> CAP_FOWNER & 1)
    except (OSError, StopIteration, IndexError, ValueError):
        return True


def check_output_dir(path: str | os.PathLike, what: str, ours: Callable[[Path], bool],
                     replaceable: Callable[[Path], bool] = lambda d: False, force: bool = False,
                     inputs: InputPaths | None = None) -> Path:
    """Refuse, before any work, a directory output that is not `ours` (an output of the same kind) or
    empty: OutputRefused when `replaceable(dir)` (forcing may replace it), ArtifactError otherwise; and one
    that is or holds one of the command's `inputs` (`check_not_input`). Returns the directory written (a
    symlink's target)."""
    path = Path(path)
    if is_stdio(path):
        raise ArtifactError(f"-o - means stdout, but {what} is a directory; give a directory path")
    target = output_target(path, directory=True)
    check_not_input(target, path, inputs or {})
    with _looking_at(path):
        if target.is_dir() and any(target.iterdir()) and not ours(target):
            if not replaceable(target):
                raise ArtifactError(f"{path} is a directory that is not {what}; choose a new directory")
            if not force:
                raise OutputRefused(f"{path} exists and is not {what}")
        check_writable(target, path)
    return target


def check_not_input(target: Path, shown: str | os.PathLike, inputs: InputPaths) -> None:
    """Refuse an output whose `target` is one of `inputs` (flag -> a path or a list of paths; the same
    file through any symlink or hard link), or a directory, replaced whole, that holds one: writing it
    would destroy what the command reads, so no `force` allows it (UnusableOutput, in one sentence)."""
    for flag, given in inputs.items():
        one = isinstance(given, str | os.PathLike)
        paths = [given] if one else list(given or ())
        which = f"the {flag}" if one else f"a file of the {flag}"
        for read in paths:
            if _same_file(target, read):
                raise UnusableOutput(f"{shown} is {which} this command reads; choose another path")
            if _holds(target, read):
                raise UnusableOutput(f"{shown} holds {read}, {which} this command reads, and would be "
                                     "replaced whole; choose another directory")


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # either does not exist (a new output, stdin)
        return False


def _holds(folder: Path, path: str | os.PathLike) -> bool:
    """Whether `path` (followed through symlinks) lies inside the existing directory `folder`."""
    if not folder.is_dir():
        return False
    inside, outer = os.path.realpath(path), os.path.realpath(folder)
    return inside != outer and os.path.commonpath([inside, outer]) == outer

# ---------------------------------------------------------------- a folder's writer

LOCK_NAME = ".sparrow.lock"
_HELD: dict[str, tuple[int, int, Path]] = {}  # realpath of what is held -> (its lock's descriptor, pid, path)
_MADE: set[str] = set()  # held folders their holder made: removed when let go of empty


def command_output(folder: str | os.PathLike) -> bool:
    """Whether `folder` is a folder a Sparrow command holds or held as its output (its lock file is in it):
    a run of its own, never the parts of an artifact, even while it holds Parquet files alone (a training
    run that has written only its schedule)."""
    return os.path.lexists(Path(folder) / LOCK_NAME)


class FolderBusy(ArtifactError):
    """A folder that another process holds (`hold_folder`)."""


def hold_folder(folder: str | os.PathLike, writer: str, instead: str, made: bool = False) -> None:
    """Hold the exclusive lock of `folder` (which must exist) for this process until `release_folder`;
    holding it already is a no-op. FolderBusy in one sentence when another process holds it: `writer`
    names what writes the folder ("sparrow train"), `instead` what else to choose ("another run directory
    (-o)"). A filesystem without locks (or a lock file that cannot be opened) leaves the folder
    unlocked: the lock is advisory, and refusing every run there would be worse. `made`: the caller made
    the folder for this, so that one let go of empty (a run stopped while its model loaded) is removed."""
    key = os.path.realpath(folder)
    if made:
        _MADE.add(key)
    _hold(key, Path(key) / LOCK_NAME, writer, f"{folder} is being written by another {writer}{{holder}}, and "
          f"a second one would mix its files with that one's; wait for it to end, or choose {instead}")


def hold_output(path: str | os.PathLike, writer: str, instead: str) -> None:
    """`hold_folder` for an output that is replaced whole when its writer ends (an adapter directory), so
    may not exist yet: the lock is the hidden file `.NAME.sparrow.lock` beside it, and a second writer of
    the same output is refused at once instead of replacing the first one's result when it ends."""
    key = os.path.realpath(path)
    _hold(key, Path(key).with_name(f".{hidden_stem(Path(key))}{LOCK_NAME}"), writer,
          f"{path} is being written by another {writer}{{holder}}, and a second one would replace that "
          f"one's result when it ends; wait for it to end, or choose {instead}")


def _hold(key: str, lock: Path, writer: str, busy: str) -> None:
    """Lock `lock` for `key`, or FolderBusy(`busy` with the holder's pid at {holder})."""
    if key in _HELD:
        return
    for _ in range(100):
        fd = _open_lock(lock)
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise FolderBusy(busy.replace("{holder}", holder, 1)) from None
        except OSError:
            os.close(fd)
            return
        if _still_there(fd, lock):
            break
        os.close(fd)  # its holder removed it as it let go: lock the file now at the path
    else:  # the file keeps changing under us: not a filesystem whose lock can be told
        return
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {writer}\n".encode(), 0)
    except OSError:  # opened read-only (another user's lock file): held all the same
        pass
    _HELD[key] = (fd, os.getpid(), lock)


def release_folder(folder: str | os.PathLike) -> None:
    """Let go of the lock `hold_folder` or `hold_output` took on `folder` (nothing when this process holds
    none); its lock file is removed first, so a finished writer leaves nothing behind."""
    key = os.path.realpath(folder)
    fd, pid, lock = _HELD.pop(key, (None, None, None))
    if fd is None or pid != os.getpid():  # a forked child's copy is its parent's lock
        return
    try:
        os.unlink(lock)
    except OSError:
        pass
    os.close(fd)
    if key in _MADE:
        _MADE.discard(key)
        with contextlib.suppress(OSError):  # not empty: the writer wrote something, which stays
            os.rmdir(key)


@atexit.register
def release_all() -> None:
    """Every lock this process still holds let go of, so that no lock file stays behind: when a command
    ends (its outputs' locks), and at exit (a command refused after taking one)."""
    for folder in list(_HELD):
        release_folder(folder)


def _open_lock(lock: Path) -> int | None:
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    for mode in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            return os.open(lock, mode | flags, 0o644)
        except OSError:
            continue
    return None


def _still_there(fd: int, lock: Path) -> bool:
    """Whether the locked descriptor `fd` is the file now at `lock`."""
    try:
        here, held = os.stat(lock, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _holder(fd: int) -> str:
    """' (pid N)' as the holder recorded it in its lock file; '' when it has not yet."""
    try:
        pid = os.pread(fd, 64, 0).split()[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


# ---------------------------------------------------------------- inputs

# ---------------------------------------------------------------- a rollout's journal

JOURNAL_SUFFIX = ".partial"  # OUT.partial/ beside a rollout's -o holds its finished prompts while it runs
JOURNAL_MANIFEST = "manifest.json"
JOURNAL_PART = re.compile(r"part-(\d{5,})\.parquet")
JOURNAL_UNSCORED = re.compile(r"unscored-(\d{5,})\.parquet")  # finished prompts an interrupt wrote, unscored


def journal_folder(output: str | os.PathLike) -> Path:
    """The journal of a rollout writing `output`: `OUT.partial` beside it, under the name the user gave;
    UnusableOutput, in one sentence, for an `output` whose name is too long for its file system to take
    the suffix."""
    output = Path(output)
    folder = output.with_name(output.name + JOURNAL_SUFFIX)
    size, limit = len(os.fsencode(folder.name)), name_max(output.parent)
    if size > limit:
        raise UnusableOutput(f"{_short(output)} cannot be written by a rollout: its journal "
                             f"{_short(folder.name)} beside it would have a name of {size} bytes, and a file "
                             f"name may have at most {limit} bytes here; choose a name of at most "
                             f"{limit - len(os.fsencode(JOURNAL_SUFFIX))} bytes")
    return folder


def journal_parts(folder: Path) -> list[Path] | None:
    """The parts of the rollout journal `folder`, in the order they were written; None when `folder` is no
    journal (a folder named OUT.partial holding a manifest). Every part is a whole `rollouts` artifact."""
    if not folder.name.endswith(JOURNAL_SUFFIX) or not (folder / JOURNAL_MANIFEST).is_file():
        return None
    parts = (p for p in folder.iterdir() if JOURNAL_PART.fullmatch(p.name))
    return sorted(parts, key=lambda p: int(JOURNAL_PART.fullmatch(p.name).group(1)))


def journal_unscored(folder: Path, stale: bool = False) -> list[Path]:
    """The files of finished prompts that an interrupt wrote unscored into the journal `folder` (rewards null
    until `--resume` scores them and writes each as the part of its number), in the order they were
    written: those without a part of their number (with `stale`, those with one: scored by a resume that
    was stopped before it removed them)."""
    if not folder.is_dir():
        return []
    scored = {journal_file_number(p) for p in journal_parts(folder) or []}
    found = (p for p in folder.iterdir() if JOURNAL_UNSCORED.fullmatch(p.name))
    return sorted((p for p in found if (journal_file_number(p) in scored) == stale), key=journal_file_number)


def journal_file_number(file: Path) -> int:
    """A journal file's number: part-NNNNN.parquet or unscored-NNNNN.parquet."""
    return int((JOURNAL_PART.fullmatch(file.name) or JOURNAL_UNSCORED.fullmatch(file.name)).group(1))


def _piped(path: str | os.PathLike) -> bool:
    """Stdin, /dev/stdin and the like, or a FIFO: an input something is meant to be piped into."""
    if is_stdio(path) or str(path).startswith("/dev/std"):
        return True
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def spool_input(path: str | os.PathLike, flag: str) -> Path:
    """`-` (stdin), or a FIFO or device such as /dev/stdin in a pipe, read whole into a private
    temporary file (removed at exit) whose path is returned; any other path as it is. Parquet or JSONL
    is told apart by the Parquet magic bytes."""
    if not is_stdio(path) and not special_kind(Path(path)):
        return Path(path)
    name = "stdin" if is_stdio(path) else Path(path).name
    try:
        if is_stdio(path):
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        raise ArtifactError(f"{flag} {path} cannot be read ({e.strerror or e})") from None
    if not data:
        hint = ("pipe a Parquet or JSONL file into it; stdin serves one input only" if _piped(path) else
                "it holds nothing; give a Parquet or JSONL file")
        raise ArtifactError(f"{flag} {path}: nothing was read ({hint})")
    folder = Path(tempfile.mkdtemp(prefix="sparrow-input-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    suffix = ".parquet" if data[:4] == b"PAR1" else ".jsonl"
    spooled = folder / (name if name.endswith(suffix) else name + suffix)
    spooled.write_bytes(data)
    _SPOOLED[spooled] = "-" if is_stdio(path) else str(Path(path).absolute())
    return spooled


_SPOOLED: dict[Path, str] = {}  # a spooled input's private copy -> what the user named


def input_name(path: str | os.PathLike) -> str:
    """What a user gave for an input, as an artifact's metadata records it: its absolute path (symlinks
    kept as named), `-` for stdin and the FIFO's own path for a spooled pipe, never the private temporary
    copy that is gone when the command ends."""
    given = _SPOOLED.get(Path(path))
    return given if given is not None else str(Path(path).absolute())


def input_path(path: str | os.PathLike) -> str:
    """An input file as a spec records it for later reading (`schedule:PATH`): its absolute path, or what
    the user gave (`-`, a FIFO) for a spooled one, whose private copy is gone when the command ends."""
    given = _SPOOLED.get(Path(path))
    return given if given is not None else str(Path(path).resolve())


def name_inputs(text: str) -> str:
    """`text` (an error message) with every spooled input's private copy named as the user gave it:
    `- (stdin)` for stdin, the FIFO's own path for a pipe."""
    for spooled, given in _SPOOLED.items():
        text = text.replace(str(spooled), "- (stdin)" if is_stdio(given) else given)
    return text
