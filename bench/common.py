"""Helpers shared by the benchmarks: device sync, timing, copy bandwidth, glibc allocator settings, the
`sparrow` command of this environment, the parser every bench starts from, atomic result files, the one
line a resumable bench stops with, and the settings a resumable stage is reused by.

Decisions on result tables (`bench_parser`, `write_results`):
- A bench's table goes to `--results DIR`, else `$SPARROW_BENCH_RESULTS`, else bench/results beside the
  scripts; its --help names the table and the folder. The run folders a bench keeps beside its table
  (and the default --out of the resumable ones) follow the same folder, so one setting keeps a checkout
  clean. A table replaces the one of the same name: runs to compare go to folders of their own.
- --help shows the whole module docstring (what is measured, the smoke and full-size commands) and the
  default of every flag whose help does not already state it.

Decisions on resuming (`reuse_or_refuse`, `record_settings`):
- A stage's output (a file or a run folder) is reused only under the settings that made it: they are
  recorded beside it, in `NAME.settings.json`, and compared on every later call. Other settings are
  refused in one sentence naming the first that differs, both values, and what to do; a stale result
  under new labels is worse than a stopped bench.
- The record is written before the stage makes its output, never after: a record without its output is
  harmless (the output is made again and the record rewritten), and a stopped stage's partial output (a
  run's checkpoint, a matrix's first rows) is checked like a finished one.
- An output without a record (an older bench's, or one whose record was deleted) is refused too: its
  settings cannot be known.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
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


def device_name(device: torch.device) -> str:
    """What the numbers were measured on: the GPU's name, or the CPU's model with the vector extensions the
    CPU kernels and oneDNN choose by (x86_64 alone does not tell two CPUs apart)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cpu"
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)  # the CPUs are alike
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    model, flags = fields.get("model name", "cpu"), set(fields.get("flags", "").split())
    known = (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX"))
    extensions = [name for flag, name in known if flag in flags]
    return f"{model}, {' '.join(extensions)}" if extensions else model


RESULTS = Path(__file__).parent / "results"  # machine-specific, not tracked
RESULTS_ENV = "SPARROW_BENCH_RESULTS"


def default_results() -> Path:
    """The folder of result tables when --results is not given: $SPARROW_BENCH_RESULTS, else RESULTS."""
    return Path(os.environ.get(RESULTS_ENV) or RESULTS)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring as written, and each flag's default where its help does not already say it (a
    default of None or off is the flag's absence, and says nothing)."""

    def _format_action(self, action: argparse.Action) -> str:
        text = action.help or ""
        silent = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not silent and "default" not in text:
            action = copy.copy(action)  # the parser's own action keeps its help
            action.help = f"{text} (default: %(default)s)".lstrip()
        return super()._format_action(action)


def bench_parser(doc: str | None, *tables: str) -> argparse.ArgumentParser:
    """The parser of a bench whose module docstring is `doc`; with `tables` (result names, written by
    `write_results`), the --results option that says where they go."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)
    if tables:
        names = ", ".join(f"{t}.parquet" for t in tables)
        where = str(default_results()).replace("%", "%%")
        ap.add_argument("--results", type=Path, default=default_results(), metavar="DIR",
                        help=f"the folder {names} (and any run folders of this bench) go to; default "
                        f"${RESULTS_ENV}, else bench/results beside the scripts (here: {where})")
    return ap


def write_results(rows: list[dict], name: str, folder: Path | None = None) -> Path:
    """folder/<name>.parquet (folder: a bench's --results, by default `default_results()`), written
    atomically: a stop mid-write leaves the previous file."""
    import pyarrow as pa

    from sparrow.schemas.io import write_table

    out = (folder or default_results()) / f"{name}.parquet"
    columns = list(dict.fromkeys(k for r in rows for k in r))  # every row's keys: not only the first row's
    write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows]), out)
    print(f"wrote {out}")
    return out


def stop_on_interrupt(main: Callable[[], None], kept: str) -> None:
    """Run a resumable bench's `main`; an interrupt (Ctrl-C, or sparrow's TrainingInterrupted, a
    KeyboardInterrupt whose advice names `sparrow train`'s flags) ends it in one line saying what is
    `kept` and that the same command continues, exit status 130."""
    try:
        main()
    except KeyboardInterrupt:
        print(f"stopped: {kept}; the same command continues", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


SPARROW = str(Path(sys.executable).with_name("sparrow"))  # the CLI installed beside this interpreter


def sparrow(*args: str) -> None:
    """Run a sparrow command, echoed first; a failure stops the bench with its exit status (the command
    said why)."""
    print("$ sparrow " + " ".join(args), flush=True)
    code = subprocess.run([SPARROW, *args]).returncode
    if code:
        raise SystemExit(code)


def profile_once(path: Path, settings: Mapping[str, object], model: str, prompts: Path, budgets: str,
                 samples: int, max_new_tokens: int, bin_width: int, *extra: str) -> Path:
    """`sparrow profile` of the prompts into `path` (seed 0), unless an earlier call made it with the same
    `settings` (what decides it: the prompts' settings and these flags; `extra` must not change it)."""
    if not reuse_or_refuse(path, settings):
        record_settings(path, settings)
        sparrow("profile", "--model", model, "--prompts", str(prompts), "--budgets", budgets,
                "--samples", str(samples), "--max-new-tokens", str(max_new_tokens),
                "--bin-width", str(bin_width), "--seed", "0", "-o", str(path), *extra)
    return path


# ---------------------------------------------------------------- resuming under the same settings


def flags(args, *names: str) -> dict[str, object]:
    """The values of `names` in `args`, keyed by their flags (`--train-prompts`), as a refusal names them."""
    return {"--" + name.replace("_", "-"): getattr(args, name) for name in names}


def settings_path(output: Path) -> Path:
    """Where the settings that made `output` (a file or a folder) are recorded: beside it."""
    return output.with_name(output.name + ".settings.json")


def record_settings(output: Path, settings: Mapping[str, object]) -> None:
    """Record `settings` beside `output`, atomically, before the stage makes it."""
    from sparrow.schemas.io import write_bytes

    write_bytes(settings_path(output), (json.dumps(_plain(settings), indent=1) + "\n").encode())


def reuse_or_refuse(output: Path, settings: Mapping[str, object], quiet: bool = False) -> bool:
    """Whether a stage may reuse `output`: True when it exists and was made with `settings` (said unless
    `quiet`), False when it does not exist (record the settings, then make it). An output made with other
    settings, or without a record of them, is a SystemExit in one sentence."""
    if not output.exists():
        return False
    record = settings_path(output)
    instead = f"use another --out, or delete {output}"
    try:
        was = json.loads(record.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{output} has no record of the settings that made it ({record.name}: an older "
                         f"bench wrote it, or the record was deleted); {instead}") from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"{record} cannot be read ({e}); {instead}") from None
    now = _plain(settings)
    for key in [*now, *(k for k in was if k not in now)]:
        if was.get(key) != now.get(key):
            raise SystemExit(f"{output} was made with {key} {_shown(was.get(key))}, not "
                             f"{_shown(now.get(key))}; {instead}")
    if not quiet:
        print(f"reused {output} (same settings)", flush=True)
    return True


def _plain(settings: Mapping[str, object]) -> dict:
    """The settings as JSON gives them back (paths as text, tuples as lists), so a record compares equal."""
    return json.loads(json.dumps(dict(settings), default=str))


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


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
