"""Where Sparrow keeps what it builds once: converted checkpoints and tokenizers ($SPARROW_HOME).

Design decisions:
- A home may be shared by a team: the converted model gets the builder's umask, as any file it writes
  does, so under a group-readable umask the others use it (a read-only home that holds it serves).
- A cache that is there but that this user cannot read (another user built it under a private umask) is
  said as such: building it again could not help, and "cannot build" would send the user after the
  wrong cause.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .config import ModelSpecError


def sparrow_home() -> Path:
    return Path(os.environ.get("SPARROW_HOME") or Path.home() / ".cache" / "sparrow")


@contextmanager
def building(what: str, folder: Path) -> Iterator[None]:
    """A block that builds `what` into `folder` under $SPARROW_HOME: an OSError there (a read-only or full
    home) is one sentence naming the folder and the variable that moves it."""
    try:
        yield
    except OSError as e:
        raise ModelSpecError(f"cannot build {what} in {folder} ({e.strerror or e}); set SPARROW_HOME to a "
                             "writable folder (a home that already holds it may be read-only)") from None


def check_readable(what: str, folder: Path) -> None:
    """Refuse, in one sentence, `what` in `folder` (under $SPARROW_HOME) when this user cannot read it: a
    folder on the way there that it cannot enter, the folder, or a file in it; nothing when all of it can
    be read or when it is not there."""
    way = _way_to(folder)
    denied = _first_unreadable(way, folder)
    if denied is None:
        return
    try:
        st = denied.stat()
    except OSError:  # gone meanwhile: building it says what stands in the way
        return
    access = f"mode {stat.S_IMODE(st.st_mode):04o}, owner {_user(st.st_uid)}"
    if denied in way:
        said, shared = f"cannot be reached by this user ({denied} has {access})", denied
    else:
        where = "" if denied == folder else f"{denied.name} in it has "
        said, shared = f"exists but cannot be read by this user ({where}{access})", folder
    raise ModelSpecError(f"{what} in {folder} {said}; ask its owner to run chmod -R a+rX {shared}, or set "
                         "SPARROW_HOME to a folder of your own")


def _way_to(folder: Path) -> list[Path]:
    """The folders from $SPARROW_HOME down to `folder`'s parent (its parent alone when it is elsewhere)."""
    home = sparrow_home()
    if not folder.is_relative_to(home) or folder == home:
        return [folder.parent]
    way = [home]
    for part in folder.relative_to(home).parts[:-1]:
        way.append(way[-1] / part)
    return way


def _first_unreadable(way: list[Path], folder: Path) -> Path | None:
    """The first folder of `way` that is there but that this user cannot enter, else `folder` or a file in
    it that this user cannot read; None when all can be, or when `way` ends before `folder`."""
    for path, need in (*((p, os.X_OK) for p in way), (folder, os.R_OK | os.X_OK)):
        if not os.path.lexists(path):
            return None
        if not _can_read(path, need):
            return path
    if not folder.is_dir():
        return None
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return folder
    return next((p for p in entries if not p.is_symlink() and not _can_read(p, os.R_OK)), None)


def _can_read(path: Path, need: int) -> bool:
    return os.access(path, need, effective_ids=os.access in os.supports_effective_ids)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
