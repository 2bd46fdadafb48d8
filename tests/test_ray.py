"""Rollouts on Ray workers (real processes, not local mode) against one process; directory artifacts.

The Ray test starts worker processes that import torch and load the model: run it with
`.venv/bin/python -m pytest -q -m slow tests/test_ray.py`."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import ArtifactError, artifact_kind, artifact_metadata, read_artifact, write_artifact
from sparrow.schemas.io import write_artifact_parts
from sparrow.stages.core.trajectories import read_rollouts
from sparrow.stages.sql import run_query

runner = CliRunner()


def _rollouts(prompt_id: str, n: int) -> dict:
    return {"prompt_id": [prompt_id] * n, "sample": list(range(n)), "prompt_token_ids": [[1, 2]] * n,
            "token_ids": [[3, 4, 5]] * n, "text": [None] * n, "logprobs": [[-0.5, -0.25, -1.0]] * n,
            "budgets": [[0, 48, 48]] * n, "finish_reason": ["length"] * n, "reward": [None] * n}


def test_a_directory_of_parts_reads_as_one_artifact(tmp_path):
    out = write_artifact_parts([_rollouts("a", 2), _rollouts("b", 3)], tmp_path / "r", "rollouts",
                               [{"temperature": 0.5, "part": 0}, {"temperature": 0.5, "part": 1}])
    assert sorted(p.name for p in out.iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    table = read_artifact(out, "rollouts")
    assert table.column("prompt_id").to_pylist() == ["a", "a", "b", "b", "b"]
    assert artifact_kind(out) == "rollouts" and artifact_metadata(out)["part"] == 0
    assert artifact_metadata(table)["temperature"] == 0.5
    assert read_rollouts(out).temperature == 0.5 and len(read_rollouts(out).rows) == 5  # profile --rollouts
    got = run_query(out, "SELECT count(*) AS n, count(DISTINCT source_file) AS parts FROM rollouts")
    assert got.to_pylist() == [{"n": 5, "parts": 2}]
    # replaced whole: a rerun with fewer parts leaves no stale part behind
    write_artifact_parts([_rollouts("c", 1)], out, "rollouts", [{}])
    assert read_artifact(out).column("prompt_id").to_pylist() == ["c"]
    write_artifact(_rollouts("d", 1), out / "part-00001.parquet", "rollouts")
    (out / "part-00002.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ArtifactError, match="part-00002.parquet"):
        read_artifact(out, "rollouts")
    with pytest.raises(ArtifactError, match="without Parquet parts"):
        (tmp_path / "empty").mkdir()
        read_artifact(tmp_path / "empty", "rollouts")


def _prompts(path):
    g = torch.Generator().manual_seed(1)
    rows = [{"prompt_id": f"p{i}", "task": "none", "prompt": "", "answer": None, "metadata": None,
             "prompt_token_ids": torch.randint(3, 500, (17 + 9 * i,), generator=g).tolist()}
            for i in range(5)]
    return write_artifact(rows, path, "prompts")


def test_workers_without_ray_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    prompts = _prompts(tmp_path / "p.parquet")
    r = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--prompts", str(prompts), "--workers", "2",
                            "-o", str(tmp_path / "out")])
    assert r.exit_code != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install -e '.[ray]'" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


def sparrow(*args: str, tmp: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """The CLI in a process of its own, with no RAY_ADDRESS and Ray's temp folder (its record of the last
    `ray start`, its sessions) under `tmp`."""
    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(tmp), **env}
    return subprocess.run([sys.executable, "-c", "from sparrow.cli.app import main; main()", *args],
                          env=environ, capture_output=True, text=True, timeout=timeout)


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as server:
        return server.getsockname()[1]  # nothing listens there once closed


def test_a_ray_address_where_no_cluster_answers_is_one_line_before_any_work(tmp_path):
    """A host:port where nothing listens (ray.init would retry it for minutes), and `auto` where the last
    `ray start`'s record names a cluster that is gone: one line and exit 2, in seconds, before Ray starts."""
    ray = pytest.importorskip("ray")
    prompts, port = _prompts(tmp_path / "p.parquet"), _closed_port()
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")  # a cluster that crashed
    # `auto` prefers a cluster running on this machine to the record
    for address in [f"127.0.0.1:{port}"] + ["auto"] * (not ray._private.services.find_gcs_addresses()):
        t0 = time.monotonic()
        r = sparrow("rollout", "--model", "tiny-qwen3", "--prompts", str(prompts), "--workers", "2",
                    "--ray-address", address, "-o", str(tmp_path / "out"), tmp=tmp_path, timeout=60)
        assert time.monotonic() - t0 < 30 and r.returncode == 2, r.stderr
        assert re.fullmatch(rf"error: --ray-address {address}: no Ray cluster answered at [0-9.]+:{port} "
                            r"\(connection refused\); start one with `ray start --head`, or leave out "
                            r"--ray-address for a local one\n", r.stderr), r.stderr
        assert r.stdout == "" and not (tmp_path / "out").exists()


def test_ray_address_auto_without_a_cluster_is_one_line(tmp_path):
    ray = pytest.importorskip("ray")
    if ray._private.services.find_gcs_addresses():  # `auto` takes any cluster running on this machine
        pytest.skip("a Ray cluster runs on this machine")
    prompts = _prompts(tmp_path / "p.parquet")
    r = sparrow("rollout", "--model", "tiny-qwen3", "--prompts", str(prompts), "--workers", "2",
                "--ray-address", "auto", "-o", str(tmp_path / "out"), tmp=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr == (
        "error: --ray-address auto: no running Ray cluster was found on this machine; start one with `ray "
        "start --head`, or leave out --ray-address for a local one\n"), r.stderr


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=3, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _die_once_on_shard(monkeypatch, shard: int, marker: Path) -> None:
    """Make the pool's workers exit hard (no exception reaches Ray) the first time they are given
    `shard`, leaving `marker` with the dead worker's pid: the driver's recovery path then redoes it."""
    from sparrow.stages.backends import ray_pool

    class DieOnce(ray_pool.RolloutWorker):
        def work(self, task, k: int, *args):
            if k == shard and not marker.exists():
                marker.write_text(str(os.getpid()))
                os._exit(1)
            return super().work(task, k, *args)

    monkeypatch.setattr(ray_pool.RolloutPool, "worker_class", DieOnce)  # a local class: pickled by value


@pytest.mark.slow  # starts 3 worker processes (each imports torch): about 2 minutes on 2 shared cores
def test_two_workers_equal_one_process_and_a_dead_workers_shard_is_redone(ray_cluster, tmp_path,
                                                                         monkeypatch):
    prompts = _prompts(tmp_path / "p.parquet")
    args = ["rollout", "--model", "tiny-qwen3", "--prompts", str(prompts), "--budget", "48", "--samples", "2",
            "--max-new-tokens", "12", "--temperature", "0.9", "--max-batch", "4", "--seed", "7"]
    one = runner.invoke(app, [*args, "-o", str(tmp_path / "one.parquet")])
    assert one.exit_code == 0, one.output
    marker = tmp_path / "died"
    _die_once_on_shard(monkeypatch, 0, marker)
    two = runner.invoke(app, [*args, "--workers", "2", "-o", str(tmp_path / "two")])
    assert two.exit_code == 0, two.output
    dead_pid = int(marker.read_text())
    parts = sorted((tmp_path / "two").iterdir())
    assert [p.name for p in parts] == ["part-00000.parquet", "part-00001.parquet"]
    metas = [artifact_metadata(p) for p in parts]
    assert metas[0]["attempts"] == 2 and metas[0]["worker_pid"] != dead_pid and metas[1]["attempts"] == 1
    assert [read_artifact(p).num_rows for p in parts] == [6, 4]  # prompts 0-2 and 3-4, 2 samples each
    a, b = read_artifact(tmp_path / "one.parquet"), read_artifact(tmp_path / "two", "rollouts")
    for col in ("prompt_id", "sample", "prompt_token_ids", "token_ids", "budgets", "finish_reason"):
        assert a.column(col).to_pylist() == b.column(col).to_pylist(), col
    for x, y in zip(a.column("logprobs").to_pylist(), b.column("logprobs").to_pylist()):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)  # other batch mates only
    assert metas[0]["summary"]["samples"] == 10 and metas[0]["summary"]["tokens"] == 120
    assert pa.concat_tables([read_artifact(p) for p in parts]).num_rows == 10  # nothing counted twice
    assert "wrote 10 rollouts in 2 parts" in two.stderr
    assert (f"warning: Ray worker pid {dead_pid} died during shard 0 of 2; shard 0 is redone on a new worker "
            "(attempt 2 of 3)") in two.stderr
    assert "(raylet)" not in two.stdout and two.stdout.startswith("samples\t")  # stdout: the summary only


def test_workers_that_rays_memory_monitor_kills_are_replaced_then_the_run_ends_in_one_line(tmp_path):
    """Ray's memory monitor with a threshold below what the machine already uses kills every worker: each
    is replaced and its shard given to the new one, and the third loss ends the run in one sentence that
    names the cause, not in Ray's OutOfMemoryError report. No --ray-address: a local Ray starts, even where
    the record of a `ray start` names a cluster (a stale one here)."""
    pytest.importorskip("ray")
    prompts = _prompts(tmp_path / "p.parquet")
    short = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Ray's socket paths must stay short
    try:
        (short / "ray").mkdir()
        (short / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{_closed_port()}")
        r = sparrow("rollout", "--model", "tiny-qwen3", "--prompts", str(prompts), "--max-new-tokens", "4",
                    "--workers", "1", "-o", str(tmp_path / "out"), tmp=short, timeout=300,
                    RAY_memory_usage_threshold="0.01", RAY_memory_monitor_refresh_ms="100")
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert lines[-1] == ("error: shard 0 of 1 failed on 3 Ray workers; giving up (Ray's memory monitor "
                         "killed the last one: the node ran low on memory)"), r.stderr
    warned = [line for line in lines if line.startswith("warning: Ray worker")]
    assert [w.split(" died during ")[1] for w in warned] == [
        f"shard 0 of 1 (Ray's memory monitor killed it: the node ran low on memory); shard 0 is redone on a "
        f"new worker (attempt {n} of 3)" for n in (2, 3)], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == "" and not (tmp_path / "out").exists()


@pytest.mark.slow  # 3 worker processes, then 3 more: about 2 minutes on 2 shared cores
def test_more_workers_than_work_and_an_exception_inside_a_worker(ray_cluster, tmp_path, capsys):
    """No worker is given an empty shard (a note says how many would have nothing to do), and an exception
    a task raises in its worker comes out as that exception, not as Ray's wrapper."""
    from sparrow.stages.backends.ray_pool import RolloutPool

    def shard_of(loaded, items, indices):  # local: pickled by value
        return list(zip(items, indices))

    def refuses(loaded, items, indices):
        raise ArtifactError("p.parquet: column prompt_token_ids holds a string, expected token ids")

    pool = RolloutPool("tiny-llama", 3)
    try:
        got = pool.map(shard_of, ["a", "b"])
        assert [(r.shard, r.value) for r in got] == [(0, [("a", 0)]), (1, [("b", 1)])]
        with pytest.raises(ArtifactError) as e:
            pool.map(refuses, ["a", "b", "c"])
        assert str(e.value) == "p.parquet: column prompt_token_ids holds a string, expected token ids"
    finally:
        pool.close()
    assert capsys.readouterr().err.count("note: 3 Ray workers for 2 work items, so the work goes in 2 shards "
                                         "and 1 worker would have nothing to do") == 1

    rows = read_artifact(_prompts(tmp_path / "p5.parquet")).slice(0, 2)  # 2 prompts on 3 workers
    prompts = write_artifact(rows, tmp_path / "p.parquet", "prompts")
    r = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--prompts", str(prompts), "--samples", "2",
                            "--max-new-tokens", "4", "--dense", "--workers", "3", "-o", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    table = read_artifact(tmp_path / "o", "rollouts")
    assert list(zip(table.column("prompt_id").to_pylist(), table.column("sample").to_pylist())) == [
        ("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sparrow.stages.tasks import TASKS

    sys.path.insert(0, str(Path(__file__).parent))
    from dist_helper import make_tiny, register_vowels

    register_vowels()
    yield make_tiny(tmp_path_factory.mktemp("tiny-llama"))
    TASKS.pop("vowels", None)


@pytest.mark.slow  # 2 worker processes and 3 short training runs: about 2 minutes on 2 shared cores
def test_train_on_two_workers_equals_one_process_with_weights_synced(ray_cluster, tiny, tmp_path):
    """Training whose rollouts come from 2 Ray workers, the LoRA pushed to them before every step, is the
    run of one process: same tokens and rewards, metrics and weights up to float rounding."""
    from dist_helper import assert_same_run

    model, prompts = tiny
    args = ["train", "--model", model, "--prompts", prompts, "--prompts-per-step", "3", "--samples", "2",
            "--max-new-tokens", "6", "--lora-rank", "2", "--lr", "5e-2", "--budget", "48", "--steps", "3"]
    one = runner.invoke(app, [*args, "-o", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    two = runner.invoke(app, [*args, "--workers", "2", "-o", str(tmp_path / "two")])
    assert two.exit_code == 0, two.output
    assert_same_run(tmp_path / "one", tmp_path / "two")
    rows = read_artifact(tmp_path / "two" / "metrics.parquet", "metrics").to_pylist()
    assert all(0 < r["weight_sync_seconds"] < r["rollout_seconds"] for r in rows)
    assert read_artifact(tmp_path / "one" / "metrics.parquet").column("weight_sync_seconds").null_count == 3
    assert "mean_weight_sync_seconds" in two.stdout.splitlines()[0]


def summary_cells(stdout: str) -> tuple[list[str], list[float]]:
    """A summary table's text cells and its numbers (the workers' rows sum in another order)."""
    text, numbers = [], []
    for cell in (c for line in stdout.splitlines() for c in line.split("\t")):
        try:
            numbers.append(float(cell))
        except ValueError:
            text.append(cell)
    return text, numbers


@pytest.mark.slow  # 2 worker processes: about a minute on 2 shared cores
def test_profile_on_two_workers_equals_one_process(ray_cluster, tmp_path):
    prompts = _prompts(tmp_path / "p.parquet")
    args = ["profile", "--model", "tiny-qwen3", "--prompts", str(prompts), "--budgets", "48,64", "--samples",
            "2", "--max-new-tokens", "10", "--sampler", "budget:48", "--bin-width", "16", "--seed", "3"]
    one = runner.invoke(app, [*args, "-o", str(tmp_path / "one.parquet")])
    assert one.exit_code == 0, one.output
    two = runner.invoke(app, [*args, "--workers", "2", "-o", str(tmp_path / "two")])
    assert two.exit_code == 0, two.output
    assert len(list((tmp_path / "two").iterdir())) == 2
    (text1, num1), (text2, num2) = summary_cells(one.stdout), summary_cells(two.stdout)
    assert text1 == text2 and num1 == pytest.approx(num2, rel=1e-6)  # the same summary, up to sum order
    keys = [(k, "ascending") for k in ("prompt_id", "sample", "position", "budget")]
    a = read_artifact(tmp_path / "one.parquet", "mismatch").sort_by(keys)
    b = read_artifact(tmp_path / "two", "mismatch").sort_by(keys)
    assert a.num_rows == b.num_rows == 5 * 2 * 10 * 2
    for col in a.column_names:
        x, y = a.column(col).to_pylist(), b.column(col).to_pylist()
        if isinstance(x[0], float):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5), col
        else:
            assert x == y, col
