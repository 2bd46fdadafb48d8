"""Which Sparrow made a Parquet file: the versions recorded in the footer of every file Sparrow writes.

Design decisions:
- The footer key `sparrow.provenance` (beside `sparrow.artifact`, `sparrow.version` and `sparrow.meta`)
  holds a JSON object of versions: `sparrow` (as `sparrow --version` says it: the installed package's,
  or "unknown (not installed)" for a source tree that was never installed), `python`, `torch`,
  `transformers` and `pyarrow` ("not installed" for a package that is not). They come from the packages'
  installed metadata (importlib.metadata), so recording them imports nothing: `sparrow sql -o` does not
  import torch to say which torch is installed.
- Deterministic: versions only, no time, host or process, keys sorted and read once per process, so the
  same inputs through the same installation still give byte-identical files.
- Apart from the stage's own metadata (`sparrow.meta`), which stages compare (the rollout journal's
  manifest, resume checks): an upgraded torch neither changes nor invalidates what a stage records.
- A file records the Sparrow that wrote it: an artifact written again from a table read from disk (its
  `sparrow.meta` kept) is this Sparrow's work and records the current versions, never those of the
  file it was read from; a query result (`sparrow sql -o`, plain Parquet) records them too.
- Nothing reads it to work: every reader ignores the key, so files of an older Sparrow (or of another
  tool), which lack it, read as before; `artifact_provenance` gives {} for them.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass
from functools import cache
from importlib.metadata import PackageNotFoundError, version

import pyarrow as pa

from .footer import artifact_metadata

KEY_PROVENANCE = "sparrow.provenance"
DISTRIBUTION = "sparrow-rl"  # the package name in pyproject.toml
NOT_INSTALLED = "not installed"


@dataclass(frozen=True)
class Provenance:
    """The versions that wrote a file."""

    sparrow: str
    python: str
    torch: str
    transformers: str
    pyarrow: str

    def json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def sparrow_version() -> str:
    """Sparrow's version as its installed metadata records it (what `sparrow --version` prints)."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return f"unknown ({NOT_INSTALLED})"


def installed(package: str) -> str:
    """`package`'s installed version, read from its metadata without importing it."""
    try:
        return version(package)
    except PackageNotFoundError:
        return NOT_INSTALLED


@cache
def current() -> Provenance:
    """The versions of this process, read once."""
    return Provenance(sparrow=sparrow_version(), python=platform.python_version(), torch=installed("torch"),
                      transformers=installed("transformers"), pyarrow=installed("pyarrow"))


def stamped(metadata: dict[bytes, bytes] | None) -> dict[bytes, bytes]:
    """Footer metadata with this process's provenance in place of any it held."""
    return {**(metadata or {}), KEY_PROVENANCE.encode(): current().json().encode()}


def artifact_provenance(table_or_path: pa.Table | pa.Schema | str | os.PathLike) -> dict:
    """The recorded provenance (a JSON object) of a table, a schema or a Parquet file (a directory of parts:
    its first part); {} for a file without one (an older Sparrow's, another tool's); ArtifactError naming
    it when the record is not a JSON object."""
    return artifact_metadata(table_or_path, KEY_PROVENANCE)
