"""The Ray pool's edges that need no Ray: shards never empty, the CLI's signal handlers kept across
ray.init, a worker's own exception, Ray's driver messages on stderr, an empty part merged
(stages/backends/ray_pool.py, stages/rollout.py: merge_summaries). tests/test_ray.py runs them on Ray."""

from __future__ import annotations

import signal
import sys
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
