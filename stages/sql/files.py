"""The run's files as DuckDB reads them: through a file system of their own (`RunFiles`, an fsspec file
system registered on the connection) that opens the run's files for reading and nothing else.

DuckDB's sandbox (`allowed_paths`) lets a statement write an allowed file as well as read it (`COPY ... TO`
it), and has no read-only setting. So the views name each file by its `sparrow-run://` URL, the URLs are
the only allowed paths, and every write through this file system fails: whatever a statement is, and
whatever DuckDB's parser makes of it, no file of the run can be written, truncated, moved or removed.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from fsspec import AbstractFileSystem

PROTOCOL = "sparrow-run"
PREFIX = f"{PROTOCOL}://"


def file_url(path: str | Path) -> str:
    """The URL through which DuckDB reads the run's file at the absolute `path`."""
    return PREFIX + str(path)


def local_paths(text: str) -> str:
    """`text` (a DuckDB message) with the run's file URLs back to their paths, as the user knows them."""
    return text.replace(PREFIX, "")


class RunFiles(AbstractFileSystem):
    """A file system of the given files, read only: each opens for reading; anything else (another file,
    a write, a directory made, a file removed or moved) is PermissionError, or the base class's
    NotImplementedError."""

    protocol = PROTOCOL
    cachable = False  # one per connection, with its own files

    def __init__(self, files: Iterable[str | Path]):
        super().__init__()
        self.files = frozenset(str(f) for f in files)

    def _path(self, path: str) -> str:
        path = str(path).removeprefix(PREFIX)
        if path not in self.files:
            raise PermissionError(f"{path} is not a file of the run")
        return path

    def _open(self, path: str, mode: str = "rb", **kwargs):
        if mode != "rb":
            raise PermissionError(f"{str(path).removeprefix(PREFIX)} is read only: sparrow sql writes no "
                                  "file of the run")
        return _File(self._path(path))

    def info(self, path: str, **kwargs) -> dict:
        local = self._path(path)
        st = os.stat(local)
        return {"name": local, "size": st.st_size, "type": "file", "mtime": st.st_mtime}

    def glob(self, path: str, **kwargs) -> list[str]:
        """The file itself: a view names each file, never a pattern (a `*`, `?` or `[` in a file's name is
        part of the name)."""
        return [self._path(path)]

    def ls(self, path: str, detail: bool = True, **kwargs) -> list:
        return [self.info(path)] if detail else [self._path(path)]

    def modified(self, path: str) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.info(path)["mtime"], tz=dt.timezone.utc)


def reading_only(con, files: Iterable[str | Path]) -> None:
    """Lock the DuckDB connection `con` to reading `files` (absolute paths) through `RunFiles`: their URLs
    are the only allowed paths, and nothing outside is reached. The caller sets lock_configuration once its
    views exist."""
    urls = ", ".join("'" + file_url(f).replace("'", "''") + "'" for f in files)  # SQL string literals
    con.register_filesystem(RunFiles(files))
    con.execute(f"SET allowed_paths = [{urls}]")
    con.execute("SET enable_external_access = false")


class _File(io.RawIOBase):
    """A file DuckDB reads, at a position of each thread's own, by `os.pread`.

    DuckDB reads one open file from several threads, each a seek and then a read; with one shared
    position, another thread's seek between the two made a read return bytes of the wrong place (a good
    file then read as corrupt, at random). DuckDB drops its files without closing them: closed here when
    collected."""

    _fd = -1  # until opened: a failed open leaves nothing to close

    def __init__(self, path: str):
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._size = os.fstat(self._fd).st_size
        self._local = threading.local()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return getattr(self._local, "position", 0)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        bases = {os.SEEK_SET: 0, os.SEEK_CUR: self.tell(), os.SEEK_END: self._size}
        if whence not in bases:
            raise ValueError(f"invalid whence ({whence})")
        self._local.position = max(0, bases[whence] + offset)
        return self._local.position

    def read(self, size: int | None = -1) -> bytes:
        start = self.tell()
        want = self._size - start if size is None or size < 0 else size
        data = bytearray()
        while len(data) < want:
            chunk = os.pread(self._fd, want - len(data), start + len(data))
            if not chunk:
                break
            data += chunk
        self._local.position = start + len(data)
        return bytes(data)

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()
