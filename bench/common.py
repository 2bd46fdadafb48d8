"""Helpers shared by the benchmarks: device sync, timing, copy bandwidth, glibc allocator settings, the
`sparrow` command of this environment."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
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
    columns = list(dict.fromkeys(k for r in rows for k in r))  # every row's keys: not only the first row's
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows]), out)
    print(f"wrote {out}")


SPARROW = str(Path(sys.executable).with_name("sparrow"))  # the CLI installed beside this interpreter


def sparrow(*args: str) -> None:
    """Run a sparrow command, echoed first; a failure stops the bench."""
    print("$ sparrow " + " ".join(args), flush=True)
    subprocess.run([SPARROW, *args], check=True)


def profile_once(path: Path, model: str, prompts: Path, budgets: str, samples: int, max_new_tokens: int,
                 bin_width: int, *extra: str) -> Path:
    """`sparrow profile` of the prompts into `path`, unless a stopped bench already wrote it (seed 0)."""
    if not path.exists():
        sparrow("profile", "--model", model, "--prompts", str(prompts), "--budgets", budgets,
                "--samples", str(samples), "--max-new-tokens", str(max_new_tokens),
                "--bin-width", str(bin_width), "--seed", "0", "-o", str(path), *extra)
    return path


# the 0.975 quantile of Student's t by degrees of freedom 1-30 (two-sided 95% intervals)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def t_half_width(values) -> float:
    """Half the width of the 95% t-interval of the mean of `values` (nan for fewer than two); beyond 30
    degrees of freedom the first-order expansion of t around the normal quantile."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) < 2:
        return float("nan")
    df, z = len(x) - 1, 1.959964
    t = T975[df - 1] if df <= len(T975) else z + (z ** 3 + z) / (4 * df)
    return float(t * x.std(ddof=1) / np.sqrt(len(x)))
