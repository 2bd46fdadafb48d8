"""Helpers shared by the benchmarks: device sync, timing, copy bandwidth, glibc allocator settings."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> list[float]:
    """Seconds per call of fn, one sample per call (CUDA events on a GPU), after warm-up calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def timed_graph(fn: Callable[[], object], device: torch.device, reps: int) -> list[float]:
    """Seconds per replay of a CUDA graph of fn, as the engine's decode step replays its kernels: no
    launch gaps between the small kernels. Falls back to `timed` off CUDA."""
    if device.type != "cuda":
        return timed(fn, device, reps)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()  # compile and autotune outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, device, reps)


def copy_bandwidth(device: torch.device, gib: float = 1.0) -> float:
    """Bytes/s of a large device copy (read + write counted), best of 5."""
    src = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / min(timed(lambda: dst.copy_(src), device, 5))


def tune_cpu_allocator() -> bool:
    """Keep glibc from handing out every large block as a fresh mmap (and trimming the heap).

    Code that allocates tens of MB per step, such as a growing `torch.cat` KV cache, otherwise pays a
    page fault per 4 KiB every step (our engine's own step, before it reused its gather buffers: 0.90 s
    instead of 0.44 s with these settings). Our engine no longer needs this; the rollout bench applies
    it before the Hugging Face baseline so that the baseline runs at its best. Process-wide and irreversible;
    returns False where it does not apply (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(-3, ctypes.c_int(1 << 30))  # M_MMAP_THRESHOLD: 1 GiB
        ok &= libc.mallopt(-1, ctypes.c_int(2**31 - 1))  # M_TRIM_THRESHOLD: never trim
        ok &= libc.mallopt(-2, ctypes.c_int(1 << 30))  # M_TOP_PAD: grow the heap 1 GiB at a time
        return bool(ok)
    except (OSError, AttributeError):
        return False


def write_results(rows: list[dict], name: str) -> None:
    """bench/results/<name>.parquet (machine-specific, not tracked)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(__file__).parent / "results" / f"{name}.parquet"
    out.parent.mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)
    print(f"wrote {out}")
