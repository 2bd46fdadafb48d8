"""The files `sparrow sql`'s DuckDB reads through `RunFiles` keep a position per thread.

DuckDB reads one handle from several threads, each a seek then a read. The reference is the file's own
bytes: a thread's read returns the bytes at its own last seek, whatever another thread did between the two.
"""

from __future__ import annotations

import os
import threading

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from sparrow.stages.sql.files import RunFiles, file_url, reading_only


def test_a_seek_in_another_thread_does_not_move_this_threads_read(tmp_path):
    path = tmp_path / "f.bin"
    data = os.urandom(4096)
    path.write_bytes(data)
    handle = RunFiles([path]).open(file_url(path), "rb")
    sought, moved = threading.Event(), threading.Event()
    got = {}

    def first() -> None:
        handle.seek(100)
        sought.set()
        moved.wait()
        got["first"] = handle.read(50)

    def second() -> None:
        sought.wait()
        handle.seek(3000)
        got["second"] = handle.read(20)
        moved.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {"first": data[100:150], "second": data[3000:3020]}
    handle.seek(-10, os.SEEK_END)
    assert handle.read() == data[-10:] and handle.tell() == len(data) and handle.read(5) == b""
    buffer = bytearray(8)
    handle.seek(8)
    assert handle.readinto(buffer) == 8 and bytes(buffer) == data[8:16]
    handle.close()


def test_duckdb_reads_a_file_of_many_row_groups_as_pyarrow_does(tmp_path):
    path = tmp_path / "r.parquet"
    rows = 20_000
    table = pa.table({"id": pa.array(range(rows), pa.int64()),
                      "tokens": pa.array([[i % 97] * (i % 50) for i in range(rows)], pa.list_(pa.int32()))})
    pq.write_table(table, path, row_group_size=1000)
    con = duckdb.connect()
    reading_only(con, [str(path)])
    got = con.execute(f"SELECT sum(id), sum(len(tokens)), sum(list_sum(tokens)) "
                      f"FROM read_parquet('{file_url(path)}')").fetchone()
    lengths = [i % 50 for i in range(rows)]
    assert got == (sum(range(rows)), sum(lengths), sum((i % 97) * n for i, n in enumerate(lengths)))
