"""The Ray pool's edges that need no Ray cluster: shards never empty, the CLI's signal handlers kept across
ray.init, a worker's own exception, Ray's driver messages on stderr, an empty part merged, and a worker that
Ray says is gone (killed by its memory monitor, crashed, its node dead) on a stand-in for Ray's runtime that
raises Ray's own exceptions (stages/backends/ray_pool.py, stages/rollout.py: merge_summaries).
tests/test_ray.py runs them on Ray."""

from __future__ import annotations

import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pyarrow as pa
import pytest

from sparrow.stages.backends.ray_pool import (
    _driver_messages_to_stderr,
    idle_note,
    init_keeping_handlers,
    plan_shards,
    worker_exception,
)
from sparrow.stages.rollout import RolloutSummary, merge_summaries
from sparrow.stages.train.run_dir import interrupts_deferred


def _sizes(shards: list[slice]) -> list[tuple[int, int]]:
    return [(s.start, s.stop) for s in shards]


def test_no_worker_is_given_an_empty_shard():
    assert _sizes(plan_shards(2, 3)) == [(0, 1), (1, 2)]  # 2 prompts on 3 workers: 2 shards
    assert _sizes(plan_shards(5, 2)) == [(0, 3), (3, 5)]
    assert _sizes(plan_shards(10, 4)) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert _sizes(plan_shards(3, 3)) == [(0, 1), (1, 2), (2, 3)]
    assert _sizes(plan_shards(0, 3)) == [(0, 0)]  # nothing: one empty shard, so the result has its columns
    assert idle_note(2, 3) == ("note: 3 Ray workers for 2 work items, so the work goes in 2 shards and 1 "
                               "worker would have nothing to do")


def _ray_like_init(**kwargs) -> None:
    """What ray.init does to the handlers: SIGTERM to sys.exit (ray/_private/worker.py, init)."""
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(s))


def test_the_handlers_in_place_before_ray_init_are_put_back():
    def cli_handler(signum, frame):  # as sparrow_cli.errors.sigterm_as_interrupt's
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, cli_handler)
    try:
        init_keeping_handlers(_ray_like_init, address=None)
        assert signal.getsignal(signal.SIGTERM) is cli_handler
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with interrupts_deferred() as deferral:  # the trainer's, around a step that starts the pool
            init_keeping_handlers(_ray_like_init)
            assert signal.getsignal(signal.SIGTERM) == deferral.handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_during_ray_init_takes_the_clis_path():
    received: list[int] = []

    def cli_handler(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    def init_then_sigterm(**kwargs):
        _ray_like_init()
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # Ray's handler: SystemExit(15)

    previous = signal.signal(signal.SIGTERM, cli_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            init_keeping_handlers(init_then_sigterm)
        assert received == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is cli_handler
    finally:
        signal.signal(signal.SIGTERM, previous)



def test_a_sigterm_during_ray_init_still_stops_where_the_handler_only_records_it():
    received: list[int] = []

    def init_then_sigterm(**kwargs):
        _ray_like_init()
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # Ray's handler: SystemExit(15)

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))  # a deferral
    try:
        with pytest.raises(KeyboardInterrupt):  # not Ray's SystemExit(15): the init did not finish
            init_keeping_handlers(init_then_sigterm)
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)

class RayTaskErrorLike(Exception):
    """As ray.exceptions.RayTaskError: the worker's traceback as its text, the exception as `cause`."""

    def __init__(self, text: str, cause: BaseException | None):
        super().__init__(text)
        self.cause = cause


def test_an_exception_raised_in_a_worker_comes_out_as_itself():
    from sparrow.schemas import ArtifactError

    cause = ArtifactError("p.parquet: column prompt_token_ids: expected a list of ints")
    tb = "ray::RolloutWorker.work()\nTraceback (most recent call last):\n  File ...\nArtifactError: ..."
    assert worker_exception(RayTaskErrorLike(tb, cause)) is cause
    got = worker_exception(RayTaskErrorLike(tb + "\n\nValueError: no tokens were generated\n", None))
    assert isinstance(got, RuntimeError)
    assert str(got) == "a Ray worker failed: ValueError: no tokens were generated"


def test_rays_driver_messages_go_to_stderr():
    printed: list[dict] = []
    worker_module = SimpleNamespace(print_to_stdstream=lambda data, ignore_prefix: printed.append(data))
    ray = SimpleNamespace(_private=SimpleNamespace(worker=worker_module))
    _driver_messages_to_stderr(ray)
    _driver_messages_to_stderr(ray)  # a second pool wraps nothing twice
    worker_module.print_to_stdstream({"lines": ["A worker died"], "pid": "raylet", "is_err": False},
                                     ignore_prefix=False)
    assert printed == [{"lines": ["A worker died"], "pid": "raylet", "is_err": True}]
    _driver_messages_to_stderr(SimpleNamespace())  # a Ray without that printer: left alone


def _part(table: pa.Table, samples: int, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(table=table, summary=RolloutSummary(
        samples=samples, tokens=tokens, seconds=1.0, prefill_seconds=0.5, decode_seconds=0.5,
        mean_budget=None, dense_fraction=1.0, reward_mean=None, stop_fraction=0.0))


def test_an_empty_part_merges_as_nothing():
    rows = pa.table({"prompt_id": ["a", "a"], "sample": [0, 1], "budgets": [[0, 0, 0], [0, 0]],
                     "reward": pa.array([1.0, 0.0]), "finish_reason": ["length", "stop"],
                     "kv_policy": ["dense", "dense"]})
    empty = pa.table({k: [] for k in rows.column_names})  # what an empty shard's rollouts were: null columns
    assert empty.schema.field("sample").type == pa.null()
    merged = merge_summaries([_part(rows, 2, 5), _part(empty, 0, 0)], wall_seconds=3.0)
    assert (merged.samples, merged.tokens, merged.stop_fraction, merged.reward_mean) == (2, 5, 0.5, 0.5)
    assert merged.seconds == 3.0 and merged.prefill_seconds == 1.0


# ---- a worker that Ray says is gone, on a stand-in for Ray's runtime with Ray's own exception classes ----

class _Ref:
    def __init__(self, run: Callable[[], object]):
        self.run = run


class _Actor:
    """An actor handle: `handle.method.remote(*args)` gives a _Ref whose result the method computes when
    ray.get asks, or the exception the runtime's script gives for that shard and attempt."""

    def __init__(self, runtime: _Runtime, number: int):
        self.runtime, self.number = runtime, number

    def __getattr__(self, method: str):
        def remote(*args):
            if method == "work":
                return _Ref(lambda: self.runtime.work(self.number, *args))
            return _Ref(lambda: 1000 + self.number)  # pid()
        return SimpleNamespace(remote=remote)


class _Runtime:
    """What RolloutPool calls of Ray (remote, wait, get, kill), in this process. `losses[(shard, attempt)]`
    is the error Ray gives for that try of the shard; every try runs the task as a worker would."""

    def __init__(self, exceptions, losses: dict):
        self.exceptions, self.losses = exceptions, losses
        self.tries: dict[int, int] = {}
        self.started, self.killed = 0, []

    def is_initialized(self) -> bool:
        return True

    def remote(self, **options):
        def actor_class(cls):
            def start(*args):
                self.started += 1
                return _Actor(self, self.started)
            return SimpleNamespace(remote=start)
        return actor_class

    def work(self, number: int, task, shard: int, items: list, indices: list[int], *args):
        self.tries[shard] = self.tries.get(shard, 0) + 1
        lost = self.losses.get((shard, self.tries[shard]))
        if lost is not None:
            raise lost
        return task(None, items, indices, *args), 1000 + number

    def wait(self, refs: list, num_returns: int = 1):
        return refs[:1], refs[1:]

    def get(self, ref, timeout: float | None = None):
        return [self.get(r) for r in ref] if isinstance(ref, list) else ref.run()

    def kill(self, actor) -> None:
        self.killed.append(actor.number)


def _squares(loaded, items, indices):
    return [i * i for i in items]


def _pool_on(monkeypatch, losses: dict, workers: int = 2):
    from sparrow.stages.backends.ray_pool import RolloutPool

    exceptions = pytest.importorskip("ray.exceptions")
    runtime = _Runtime(exceptions, {k: make(exceptions) for k, make in losses.items()})
    monkeypatch.setitem(sys.modules, "ray", runtime)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return RolloutPool("tiny-llama", workers), runtime


def _oom(x):
    return x.OutOfMemoryError("2 worker(s) were killed due to the node running low on memory.\nMemory on the "
                              "node was 4.40GB used / 23.59GB limit\n...\nRefer to the documentation.")


def test_a_worker_that_rays_memory_monitor_kills_has_its_shard_redone(monkeypatch, capsys):
    pool, runtime = _pool_on(monkeypatch, {(0, 1): _oom, (1, 1): lambda x: x.WorkerCrashedError(),
                                           (1, 2): lambda x: x.NodeDiedError("node 10.0.0.2 died")})
    got = pool.map(_squares, [1, 2, 3, 4, 5])
    assert [r.value for r in got] == [[1, 4, 9], [16, 25]]  # 5 items on 2 workers: 3 and 2
    assert [r.attempts for r in got] == [2, 3]
    assert runtime.started == 5 and pool.replaced == 3 and runtime.killed == [1, 2, 4]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: Ray worker pid 1001 died during shard 0 of 2 (Ray's memory monitor killed it: the node ran "
        "low on memory); shard 0 is redone on a new worker (attempt 2 of 3)",
        "warning: Ray worker pid 1002 died during shard 1 of 2 (its process crashed); shard 1 is redone on a "
        "new worker (attempt 2 of 3)",
        "warning: Ray worker pid 1004 died during shard 1 of 2 (its node died); shard 1 is redone on a new "
        "worker (attempt 3 of 3)"]


def _died(x):
    return x.ActorDiedError()


def test_a_shard_that_takes_every_try_with_it_ends_in_one_sentence(monkeypatch):
    from sparrow.stages.backends.ray_pool import WorkersFailed

    pool, _ = _pool_on(monkeypatch, {(0, 1): _died, (0, 2): _oom, (0, 3): _oom}, workers=1)
    with pytest.raises(WorkersFailed) as e:
        pool.map(_squares, [1, 2])
    assert str(e.value) == ("shard 0 of 1 failed on 3 Ray workers; giving up (Ray's memory monitor killed "
                            "the last one: the node ran low on memory)")
    pool, _ = _pool_on(monkeypatch, {(0, 1): _died, (0, 2): _died}, workers=1)
    pool.max_attempts = 2
    with pytest.raises(WorkersFailed) as e:
        pool.map(_squares, [1, 2])
    assert str(e.value) == "shard 0 of 1 failed on 2 Ray workers; giving up (the last one's process died)"


def test_any_other_error_of_rays_is_one_sentence(monkeypatch):
    from sparrow.stages.backends.ray_pool import WorkersFailed

    pool, _ = _pool_on(monkeypatch, {(1, 1): lambda x: x.RaySystemError(
        "the raylet went away", "  File raylet.py, line 3\nRayletDied: no answer from the raylet")})
    with pytest.raises(WorkersFailed) as e:
        pool.map(_squares, [1, 2, 3])
    assert str(e.value) == ("Ray failed while the workers ran their shards: RaySystemError: RayletDied: no "
                            "answer from the raylet")


# ---- --ray-address: a cluster that does not answer is one sentence, before ray.init ----

def _no_ray_yet(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(is_initialized=lambda: False))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


SETTINGS = bytes(3) + bytes([4]) + bytes(5)  # an empty HTTP/2 SETTINGS frame, as a gRPC server's first


@contextmanager
def _serving(answer: bytes | None, host: str = "127.0.0.1") -> Iterator[int]:
    """A server on a free port of `host` that reads each connection's first bytes, answers `answer` and
    closes it (None: keeps it open and says nothing) -> its port."""
    server = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    server.settimeout(0.1)
    stop, held = threading.Event(), []

    def serve():
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:  # the accept's timeout: look at `stop` again
                continue
            if answer is None:
                held.append(connection)
                continue
            with connection:
                connection.settimeout(5)
                connection.recv(64)
                connection.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for connection in held:
            connection.close()
        server.close()


def test_the_address_forms_ray_takes_pass_where_a_grpc_server_listens(monkeypatch):
    from sparrow.stages.backends.ray_pool import check_cluster

    _no_ray_yet(monkeypatch)
    with _serving(SETTINGS) as port:
        for address in (None, "local", f"127.0.0.1:{port}", f"localhost:{port}", f"ray://127.0.0.1:{port}",
                        f"ray://127.0.0.1:{port}/namespace",
                        "anyscale://my-cluster"):  # a scheme of another Ray Client: left to Ray
            check_cluster(address)
    if _ipv6_loopback():
        with _serving(SETTINGS, "::1") as port:
            check_cluster(f"[::1]:{port}")


def _ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


def test_a_real_grpc_server_passes_the_probe(monkeypatch):
    """The probe against grpc's own server (a cluster's GCS and Ray Client's server are ones), not only
    against the frame written above."""
    grpc = pytest.importorskip("grpc")
    from concurrent.futures import ThreadPoolExecutor

    from sparrow.stages.backends.ray_pool import check_cluster

    _no_ray_yet(monkeypatch)
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        check_cluster(f"127.0.0.1:{port}")
        check_cluster(f"ray://127.0.0.1:{port}")
    finally:
        server.stop(None)


def test_a_port_that_is_not_a_ray_cluster_is_one_sentence(monkeypatch):
    """Something listens, but not a gRPC server: a web server, one that closes at once, one that says
    nothing (within the probe's time)."""
    from sparrow.stages.backends import ray_pool
    from sparrow.stages.backends.ray_pool import RayUnreachable, check_cluster

    _no_ray_yet(monkeypatch)
    monkeypatch.setattr(ray_pool, "PROBE_SECONDS", 1.0)
    for answer in (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", b""):
        with _serving(answer) as port, pytest.raises(RayUnreachable) as e:
            check_cluster(f"127.0.0.1:{port}")
        assert str(e.value) == (f"--ray-address 127.0.0.1:{port}: what listens at 127.0.0.1:{port} is not a "
                                "Ray cluster (it does not answer as a gRPC server); start one with `ray "
                                "start --head`, or leave out --ray-address for a local one")
    with _serving(None) as port, pytest.raises(RayUnreachable) as e:
        check_cluster(f"127.0.0.1:{port}")
    assert str(e.value).startswith(f"--ray-address 127.0.0.1:{port}: no Ray cluster answered at "
                                   f"127.0.0.1:{port} (no answer within 1 s)")
    monkeypatch.setenv("RAY_USE_TLS", "1")  # a TLS server answers a handshake first: the connection is enough
    with _serving(None) as port:
        check_cluster(f"127.0.0.1:{port}")


def test_an_address_where_nothing_listens_is_one_sentence(monkeypatch):
    from sparrow.stages.backends.ray_pool import RayUnreachable, check_cluster

    _no_ray_yet(monkeypatch)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]  # closed below: nothing listens there then
    with pytest.raises(RayUnreachable) as e:
        check_cluster(f"127.0.0.1:{port}")
    assert str(e.value) == (f"--ray-address 127.0.0.1:{port}: no Ray cluster answered at 127.0.0.1:{port} "
                            "(connection refused); start one with `ray start --head`, or leave out "
                            "--ray-address for a local one")
    with pytest.raises(RayUnreachable) as e:
        check_cluster(f"ray://127.0.0.1:{port}")
    assert str(e.value).startswith(f"--ray-address ray://127.0.0.1:{port}: no Ray cluster answered at "
                                   f"127.0.0.1:{port} (connection refused)")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # Ray's stand-in for a missing or `auto` address
    for address in (None, "auto"):
        with pytest.raises(RayUnreachable) as e:
            check_cluster(address)
        assert str(e.value).startswith(f"RAY_ADDRESS=127.0.0.1:{port}: no Ray cluster answered")
        assert str(e.value).endswith("`ray start --head`, or unset RAY_ADDRESS for a local one")
    with pytest.raises(RayUnreachable) as e:
        check_cluster("head-node")
    assert str(e.value) == ("--ray-address head-node: expected auto, local (a new Ray here), HOST:PORT (a "
                            "cluster's GCS) or ray://HOST:PORT (Ray Client), got 'head-node'")


def test_a_cluster_that_ray_init_cannot_reach_is_one_sentence():
    from sparrow.stages.backends.ray_pool import ClusterAddress, RayUnreachable, RolloutPool, WorkersFailed

    def init(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379\nsee gcs_server.out")

    ray = SimpleNamespace(init=init, exceptions=SimpleNamespace(RayError=type("RayError", (Exception,), {})))
    with pytest.raises(RayUnreachable) as e:
        RolloutPool._init_ray(ray, ClusterAddress("10.0.0.1:6379", "--ray-address 10.0.0.1:6379"), 2)
    assert str(e.value) == ("--ray-address 10.0.0.1:6379: Ray could not connect to the cluster (see "
                            "gcs_server.out); start one with `ray start --head`, or leave out --ray-address "
                            "for a local one")
    with pytest.raises(WorkersFailed, match="^a local Ray could not start: see gcs_server.out$"):
        RolloutPool._init_ray(ray, ClusterAddress(None, "--ray-address None"), 2)


def test_a_run_whose_workers_keep_being_killed_ends_in_one_line(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from sparrow.cli.app import app
    from sparrow.schemas import write_artifact

    _pool_on(monkeypatch, {(0, n): _oom for n in (1, 2, 3)})
    row = {"prompt_id": "p0", "task": "none", "prompt": "", "answer": None, "metadata": None,
           "prompt_token_ids": [5, 6, 7]}
    prompts = write_artifact([row], tmp_path / "p.parquet", "prompts")
    r = CliRunner().invoke(app, ["rollout", "--model", "tiny-qwen3", "--prompts", str(prompts), "--workers",
                                 "1", "--max-new-tokens", "4", "-o", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert lines[-1] == ("error: shard 0 of 1 failed on 3 Ray workers; giving up (Ray's memory monitor "
                         "killed the last one: the node ran low on memory)"), r.stderr
    assert sum(line.startswith("warning: Ray worker") for line in lines) == 2 and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_cluster_of_another_ray_version_is_one_sentence():
    """ray.init raises a plain RuntimeError when the driver's Ray or Python differs from the cluster's."""
    from sparrow.stages.backends.ray_pool import ClusterAddress, RayUnreachable, RolloutPool

    def init(**kwargs):
        raise RuntimeError("Version mismatch: The cluster was started with:\n    Ray: 2.59.0\n"
                           "This process on node 10.0.0.2 was started with:\n    Ray: 2.60.0")

    ray = SimpleNamespace(init=init, exceptions=SimpleNamespace(RayError=type("RayError", (Exception,), {})))
    with pytest.raises(RayUnreachable) as e:
        RolloutPool._init_ray(ray, ClusterAddress("head:6379", "--ray-address head:6379"), 2)
    assert str(e.value) == ("--ray-address head:6379: this process's Ray or Python differs from the "
                            "cluster's (Version mismatch: The cluster was started with: Ray: 2.59.0 This "
                            "process on node 10.0.0.2 was started with: Ray: 2.60.0); run with the cluster's "
                            "versions")


def test_closing_a_pool_whose_ray_is_gone_keeps_the_run_s_own_error(monkeypatch):
    import sparrow.stages.backends.ray_pool as ray_pool

    def gone(*args):
        raise ConnectionError("raylet is gone")

    pool = ray_pool.RolloutPool.__new__(ray_pool.RolloutPool)
    pool.workers, pool._pid_refs, pool.started_ray = [object(), object()], {}, True
    monkeypatch.setattr(ray_pool, "require_ray", lambda: SimpleNamespace(kill=gone, shutdown=gone))
    pool.close()  # raises nothing: a failed run's WorkersFailed is what the user reads
    assert pool.workers == []


def test_the_device_check_reads_the_cluster_address_as_ray_does(monkeypatch):
    """--device cuda is checked against this machine unless the workers run on a cluster elsewhere:
    --ray-address HOST:PORT, or RAY_ADDRESS for a missing or `auto` one; `local` is this machine."""
    from sparrow.cli.option_values import on_a_cluster

    monkeypatch.setenv("RAY_ADDRESS", "ray://gpu-head:10001")
    assert on_a_cluster(2, None) and on_a_cluster(2, "auto")
    assert not on_a_cluster(2, "local") and not on_a_cluster(0, None)
    monkeypatch.delenv("RAY_ADDRESS")
    assert not on_a_cluster(2, None) and on_a_cluster(2, "head:6379")
