"""Helpers shared by the benchmarks: device sync, timing, copy bandwidth, glibc allocator settings, the
`sparrow` command of this environment."""

from __future__ import annotations

import subprocess
import sys
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


def write_results(rows: list[dict], name: str) -> None:
    """bench/results/<name>.parquet (machine-specific, not tracked)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(__file__).parent / "results" / f"{name}.parquet"
    out.parent.mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)
    print(f"wrote {out}")


SPARROW = str(Path(sys.executable).with_name("sparrow"))  # the CLI installed beside this interpreter


def sparrow(*args: str) -> None:
    """Run a sparrow command, echoed first; a failure stops the bench."""
    print("$ sparrow " + " ".join(args), flush=True)
    subprocess.run([SPARROW, *args], check=True)
