"""`plan-schedule --export sglang-vortex` against what the Sparrow release's verl/SGLang reads.

The parsing below restates, in a few lines, what the release does with the form (Infini-AI-Lab/Sparrow,
read 2026-11): verl keeps the non-None entries of `actor_rollout_ref.rollout.engine_kwargs.sglang` and
passes them to SGLang as server arguments (verl/workers/rollout/sglang_rollout/sglang_rollout.py); a
named `vortex_schedule_policy` is looked up in `_SCHEDULE_POLICY_VALUES` and turned into the planner's
budget rule (vortex_torch/vortex_torch/indexer/utils_sglang.py: `_build_schedule_policy`, thresholds
125, 250, ... 2375 cached blocks zipped strictly with all values but the last); the decode planner keeps
min(budget, cached blocks) blocks, all of them when the budget covers the cache
(vortex_torch/vortex_torch/indexer/planner_sglang.py), with cached blocks = ceil(cached tokens / block).
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.stages.core.schedule import Plan, Schedule, export_sglang_vortex

# the server arguments the release's SGLang declares for these settings
# (sglang/python/sglang/srt/server_args.py)
SERVER_ARGS = {"enable_vortex_sparsity", "vortex_module_name", "attention_backend", "page_size",
               "vortex_block_size", "vortex_block_reserved_bos", "vortex_block_reserved_eos",
               "vortex_layers_skip", "vortex_schedule_policy", "vortex_topk_val", "vortex_topk_ratio",
               "disable_overlap_schedule", "disable_cuda_graph"}  # the last two: SGLang's own server args
# one of the release's own named schedules (utils_sglang.py), planned by its authors from the same tails
runner = CliRunner()
RELEASE_QWEN3_4B_086 = [29, 45, 61, 77, 93, 125, 157, 221, 253, 253, 317, 317, 317, 317, 381, 381, 381, 381,
                        509, 509]


def release_server_args(form: dict) -> dict:
    """What verl hands SGLang from the form's engine kwargs."""
    kwargs = form.get("engine_kwargs", {}).get("sglang", {}) or {}
    return {k: v for k, v in kwargs.items() if v is not None}


def release_budget_rule(values: list[int]):
    """The named schedule as the release compiles it: cached blocks -> budget in blocks, before the
    reserved ones are added (a list that is not 20 long fails as the release's strict zip does)."""
    thresholds = list(zip(range(125, 2500, 125), values[:-1], strict=True))

    def pages(cached_blocks: int) -> int:
        for bound, value in thresholds:
            if cached_blocks < bound:
                return value
        return values[-1]

    return pages


def release_attended_tokens(form: dict, cache_len: int) -> int | None:
    """The KV tokens the release's decode step reads at this cache length (None: all of them, dense)."""
    args = release_server_args(form)
    block = args["vortex_block_size"]
    blocks = math.ceil(cache_len / block)
    rule = release_budget_rule(form["num_selected_pages"])
    budget = rule(blocks) + args["vortex_block_reserved_bos"] + args["vortex_block_reserved_eos"]
    return None if blocks <= budget else budget * block


def export(tmp_path, *args) -> dict:
    target = tmp_path / "vortex.json"
    result = runner.invoke(app, ["plan-schedule", *args, "--export", "sglang-vortex", "--export-to",
                                 str(target)])
    assert result.exit_code == 0, result.output
    return json.loads(target.read_text())


def test_export_reads_as_the_releases_own_named_schedule(tmp_path):
    form = export(tmp_path, "--model", "qwen3-4b", "--threshold", "0.86")
    args = release_server_args(form)
    assert set(args) <= SERVER_ARGS
    assert args["vortex_schedule_policy"] == form["vortex_schedule_policy"] == "sparrow-qwen3-4b-0.86"
    assert args["vortex_block_reserved_bos"] + args["vortex_block_reserved_eos"] == 3  # sink + two recent
    assert args["vortex_layers_skip"] == [0, 1] and args["vortex_block_size"] == args["page_size"] == 16
    assert form["num_selected_pages"] == RELEASE_QWEN3_4B_086
    assert "+actor_rollout_ref.rollout.engine_kwargs.sglang.vortex_schedule_policy='sparrow-qwen3-4b-0.86'" \
        in form["verl_overrides"]
    overrides = form["verl_overrides"]
    assert "+actor_rollout_ref.rollout.engine_kwargs.sglang.vortex_layers_skip=[0,1]" in overrides
    # the release README's key block runs vortex with SGLang's overlap scheduler off and CUDA graphs on
    assert "+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_overlap_schedule=True" in overrides
    assert "+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_cuda_graph=False" in overrides


@pytest.mark.parametrize("starts, budgets, aligned", [
    ((0, 512, 1024, 1536), (64, 96, 160, 160), False),  # SmolLM2-sized bins, sparse to the end
    ((0, 1000, 2000, 3000), (64, 128, 128, 0), False),  # dense from 3,000 tokens on
    ((0, 2000, 4000), (512, 1024, 2048), True),  # the published bin width
])
def test_release_never_reads_fewer_tokens_than_the_schedule(starts, budgets, aligned):
    schedule = Schedule(starts, budgets)
    context = 8192
    form = export_sglang_vortex(Plan(schedule, 512, [0.9] * len(starts), 0.86, 0.05, "x"), context, "x")
    assert len(form["num_selected_pages"]) == 20
    for cache_len in range(1, context + 1):
        ours = schedule.budget_at(cache_len)
        theirs = release_attended_tokens(form, cache_len)
        if ours == 0 or cache_len <= ours:
            assert theirs is None, cache_len  # dense where the schedule is dense (or the cache fits)
        elif theirs is not None:
            assert theirs >= ours, cache_len
            # on 2,000-token bins, equal except within a block of a bin edge (the block count moves first)
            if aligned and schedule.budget_at(cache_len + 16) == ours:
                assert theirs == ours, cache_len


def test_export_refuses_pages_the_release_cannot_name():
    plan = Plan(Schedule((0,), (64,), page_size=32), 512, [0.9], 0.86, 0.05, "x")
    with pytest.raises(ValueError, match="pages of 16 tokens"):
        export_sglang_vortex(plan, 8192, "x")
