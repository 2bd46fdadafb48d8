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
    from sparrow.stages.rollout.memory import check_memory_utilization  # light: no torch

    try:
        return check_memory_utilization(fraction)
    except ValueError as e:
        raise UsageError(str(e)) from None
