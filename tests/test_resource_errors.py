"""A read that fails for lack of memory or threads (under `ulimit -v`) is said as such, never as a corrupt
file; a damaged file is still called corrupt."""

from __future__ import annotations

import errno

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow.schemas import ArtifactError, read_artifact, write_artifact

PROMPTS = pa.table({"prompt_id": ["p1"], "task": ["chain_sum"], "prompt_token_ids": [[1, 2]],
                    "answer": ["3"]})
THREAD = "Unknown error: Failed to launch worker thread: Resource temporarily unavailable"


def failing(error: BaseException):
    def read(*args, **kwargs):
        raise error
    return read


@pytest.mark.parametrize("error", [pa.ArrowException(THREAD), pa.ArrowMemoryError("malloc of size 64 failed"),
                                   OSError(errno.ENOMEM, "Cannot allocate memory")])
@pytest.mark.parametrize("reader", ["read_table", "read_schema"])
def test_resource_failure_is_not_corruption(tmp_path, monkeypatch, error, reader):
    path = write_artifact(PROMPTS, tmp_path / "p.parquet", "prompts")
    monkeypatch.setattr(pq, reader, failing(error))
    with pytest.raises(ArtifactError) as e:
        read_artifact(path, "prompts")
    message = str(e.value)
    assert message.startswith(f"{path} could not be read for lack of memory or threads")
    assert "ulimit -v" in message
    assert "corrupt" not in message


def test_format_error_is_still_corruption(tmp_path, monkeypatch):
    path = write_artifact(PROMPTS, tmp_path / "p.parquet", "prompts")
    monkeypatch.setattr(pq, "read_table", failing(pa.ArrowInvalid("Couldn't deserialize thrift")))
    with pytest.raises(ArtifactError, match="is a corrupt Parquet file"):
        read_artifact(path, "prompts")
