"""Options of the rollout engine that several subcommands share."""

from __future__ import annotations

import typer

from .common import UsageError

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def gpu_memory_option():
    return typer.Option(DEFAULT_GPU_MEMORY_UTILIZATION, "--gpu-memory-utilization",
                        help="On cuda, the share of the GPU's memory the rollout engine may fill (weights "
                             "and anything else in use counted), in (0, 1]: its KV cache is sized after "
                             "a profiling run, never larger than the rollouts can use (vLLM's and verl's "
                             "name). Ignored on a CPU.")


def check_gpu_memory(fraction: float) -> float:
    from sparrow.stages.engine.memory import check_memory_utilization  # light: no torch

    try:
        return check_memory_utilization(fraction)
    except ValueError as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------- KV compression (eviction, issue 28)

def kv_compression_option():
    return typer.Option(None, "--kv-compression", help="Roll out with a compressed KV cache, as Sparse-RL "
                        "does: snapkv or rkv. Per layer and KV head, the first 4 tokens and the last "
                        "--kv-window are always kept; whenever a sample's cache reaches --kv-budget + "
                        "--kv-buffer tokens it is compressed back to --kv-budget (SnapKV: the tokens the "
                        "window's queries attend to most; R-KV: that minus key redundancy), freeing pages "
                        "for more samples. The same as the spec snapkv:B or rkv:B. Not with --budget or "
                        "--schedule (block top-k keeps every token; the two do not combine).")


def kv_budget_option():
    return typer.Option(None, "--kv-budget", help="With --kv-compression: the tokens a compressed cache "
                        "keeps (Sparse-RL ran 512); more than the 4 sink tokens plus --kv-window.")


def kv_window_option():
    return typer.Option(None, "--kv-window", help="With --kv-compression: the observation window, the last "
                        "W queries that score the cache and the last W tokens always kept (default 8, "
                        "R-KV's and the Sparse-RL release's).")


def kv_buffer_option():
    return typer.Option(None, "--kv-buffer", help="With --kv-compression: the tokens a cache grows by "
                        "between compressions (default 128, R-KV's buffer and the release's divide length).")


def eviction_from_flags(kind: str | None, budget: int | None, window: int | None, buffer: int | None,
                        cfg=None, block_topk: dict[str, object] | None = None, need_budget: bool = True):
    """The eviction policy of --kv-compression/--kv-budget/--kv-window/--kv-buffer (None: not given),
    checked against the model's context (`cfg`) and the block top-k flags given with it
    (`block_topk`: flag -> value); one sentence otherwise, before any work."""
    from sparrow.stages.kv_policies import EVICTION_POLICIES

    if kind is None:
        for flag, value in (("--kv-budget", budget), ("--kv-window", window), ("--kv-buffer", buffer)):
            if value is not None:
                raise UsageError(f"{flag} applies only with --kv-compression snapkv or rkv")
        return None
    if kind.lower() not in EVICTION_POLICIES:
        raise UsageError(f"--kv-compression must be one of {', '.join(EVICTION_POLICIES)}, got {kind!r}")
    given = [flag for flag, value in (block_topk or {}).items() if value]
    if given:
        raise UsageError(f"--kv-compression and {given[0]} were given together: eviction and block top-k "
                         "selection do not combine; pick one")
    if budget is None and need_budget:
        raise UsageError(f"--kv-compression {kind} needs --kv-budget (the tokens a compressed cache keeps)")
    options = {k: v for k, v in (("window", window), ("buffer", buffer)) if v is not None}
    policy = EVICTION_POLICIES[kind.lower()](budget if budget is not None else 0, **options)
    if not need_budget:
        return policy
    try:
        return policy.validate(None if cfg is None else cfg.max_position_embeddings,
                               label=f"--kv-compression {kind} --kv-budget {budget}")
    except ValueError as e:
        raise UsageError(str(e)) from None
