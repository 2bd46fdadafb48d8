"""`sparrow fit-cost`: the decode-step cost model, measured on this device or from a hardware preset."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from .console import console
from .errors import UsageError, friendly_errors, stage_errors
from .messages import warn
from .option_values import check_device, parse_int_list
from .options import (
    check_gpu_memory,
    check_threads,
    device_option,
    gpu_memory_option,
    model_file,
    non_negative_seed,
    option_given,
    output_path,
)
from .output import emit, format_option, resolve_format
from .paths import check_output, force_option, output_help
from .progress import counting, say_loading

MEASURED_GRID = ("1,4", "1024,2048,4096", "dense,256,512")
ANALYTIC_GRID = ("1,16,64", "2048,8192,16384,32768", "dense,512,2048,4096")
NOISY_FIT = 0.25  # a median relative error above this says the timings, not the model, were measured
# parameter -> flag of the options that only timing reads: --hardware refuses them rather than ignore them
MEASURING_FLAGS = {"repeats": "--repeats", "warmup": "--warmup", "threads": "--threads", "seed": "--seed",
                   "dtype": "--dtype", "gpu_memory_utilization": "--gpu-memory-utilization"}


def parse_budgets(text: str) -> list[int]:
    """'dense,256,512' -> [0, 256, 512] (0 = dense)."""
    items = [x.strip().lower() for x in text.split(",") if x.strip()]
    if not items:
        raise UsageError("--budgets is empty; it takes comma-separated budgets in tokens, dense for none "
                         "(for example dense,256,512)")
    return [0 if x == "dense" else parse_int_list(x, "--budgets")[0] for x in items]


def once(values: list[int], flag: str, what: str) -> list[int]:
    """`values` of a grid list, refused in one sentence where one is listed twice: a grid point would be
    timed twice and counted twice in the fit's spare points."""
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        shown = ", ".join("dense" if flag == "--budgets" and v == 0 else str(v) for v in repeated)
        raise UsageError(f"{flag} lists {shown} more than once; give each {what} once")
    return values


def refuse_measuring_flags(ctx: typer.Context, hardware: str) -> None:
    """One sentence naming the timing flags given beside --hardware, which times nothing: ignored, they
    would look as if they took effect."""
    given = [flag for name, flag in MEASURING_FLAGS.items() if option_given(ctx, name)]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        raise UsageError(f"{', '.join(given)} {verb} only when measuring on a device; --hardware {hardware} "
                         "writes the analytic preset, which times nothing")


@friendly_errors
def fit_cost(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", "--model", help="Preset, checkpoint dir or .gguf."),
    device: str = device_option(None, " Where the decode steps are measured (default cpu; not with "
                                "--hardware)."),
    hardware: str = typer.Option(None, "--hardware", help="Write the analytic model of a hardware "
                                 "preset (h100, h200, a100) instead of measuring; it times nothing, so "
                                 "--repeats, --warmup, --threads, --seed, --dtype and "
                                 "--gpu-memory-utilization are refused beside it."),
    batches: str = typer.Option(None, "--batches", help="Batch sizes of the grid, sequences decoded "
                                "together as rollout's --max-num-seqs (a list, as --contexts and --budgets; "
                                f"measured {MEASURED_GRID[0]}; analytic {ANALYTIC_GRID[0]})."),
    contexts: str = typer.Option(None, "--contexts", help="Cache lengths of the grid "
                                 f"(measured {MEASURED_GRID[1]}; analytic {ANALYTIC_GRID[1]})."),
    budgets: str = typer.Option(None, "--budgets", help="Budgets of the grid, 'dense' for dense "
                                f"(measured {MEASURED_GRID[2]}; analytic {ANALYTIC_GRID[2]}). Each list "
                                "names a value once."),
    repeats: int = typer.Option(5, "--repeats", help="Timed decode steps per point (the fastest is kept)."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed steps per point before timing."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch while timing (default: "
                                "torch's own choice; 1 gives steadier timings on a shared machine)."),
    seed: int = typer.Option(0, "--seed", callback=non_negative_seed,
                             help="Seed of the random weights and random prompt tokens whose decode "
                             "steps are timed."),
    dtype: str = typer.Option("auto", "--dtype", help="Weights and KV cache of the timed steps, as "
                              "rollout's --dtype: auto (bfloat16 on cuda, float32 on cpu), float32 or "
                              "bfloat16; time the dtype the rollouts run in (recorded in the artifact's "
                              "metadata, dtype, which plan-schedule names)."),
    gpu_memory_utilization: float = gpu_memory_option(),
    speculate: bool = typer.Option(False, "--speculate/--no-speculate", help="Also time the speculative "
                                   "verification forward (2 and 5 fed tokens per sample at every batch and "
                                   "context) and fit its coefficients, which plan-schedule --speculate then "
                                   "prices verification with; its points, each with its prediction, are "
                                   "printed as a second table and written to the artifact's metadata "
                                   "(verify_points), since the artifact's rows are decode steps."),
    output: Path = typer.Option(..., "-o", "--output", help=output_help("the cost artifact"),
                                parser=output_path()),
    force: bool = force_option(),
    format: str = format_option(),
) -> None:
    """Fit the decode-step cost model: time the rollout engine's decode steps, dense and sparse, over a
    (batch, context, budget) grid and fit the coefficients by least squares; or, with --hardware,
    write the analytic model of a hardware preset. A grid that cannot determine every coefficient is
    refused before any timing. Every decode-step point is printed and written as a row of the artifact
    with its prediction."""
    from sparrow.stages.core.definitions import validate_budget
    from sparrow.stages.cost import (
        VERIFY_TOKENS,
        Grid,
        context_problem,
        generated_tokens,
        get_hardware,
        grid_problem,
        write_analytic,
        write_fitted,
    )
    from sparrow.stages.model.loading import canonical_dtype, resolve_config
    from sparrow.stages.model.names import model_name

    fmt = resolve_format(format)
    try:
        dtype = canonical_dtype(dtype)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_output(output, "cost", force, inputs={"--model": model_file(model)})
    if device and hardware:
        raise UsageError("--device measures and --hardware writes an analytic preset; pass only one")
    if speculate and hardware:
        raise UsageError("--speculate times the verification forward on a device; --hardware writes an "
                         "analytic preset, whose verification plan-schedule derives from the decode step")
    if hardware:
        with stage_errors():
            get_hardware(hardware)
        refuse_measuring_flags(ctx, hardware)
    grid_defaults = ANALYTIC_GRID if hardware else MEASURED_GRID
    cfg = resolve_config(model)
    given = [default if value is None else value
             for default, value in zip(grid_defaults, (batches, contexts, budgets))]
    b_list = once(parse_int_list(given[0], "--batches"), "--batches", "batch size")
    c_list = once(parse_int_list(given[1], "--contexts"), "--contexts", "context")
    verify = VERIFY_TOKENS if speculate else ()
    if contexts is None:  # the default grid stays inside the model's context, with room for the tokens made
        room = cfg.max_position_embeddings - (0 if hardware else generated_tokens(warmup, repeats, verify))
        c_list = [c for c in c_list if c <= room] or [room]
    k_list = once(parse_budgets(given[2]), "--budgets", "budget")
    for flag, values in (("--batches", b_list), ("--contexts", c_list)):
        if min(values) < 1:
            raise UsageError(f"{flag} must be positive, got {min(values)}")
    if max(c_list) > cfg.max_position_embeddings:
        raise UsageError(f"--contexts {max(c_list)} exceeds the model's context of "
                         f"{cfg.max_position_embeddings}")
    for k in k_list:
        if k:
            try:
                validate_budget(k)
            except ValueError as e:
                raise UsageError(f"--budgets: {e}") from None
    for flag, value, low in (("--repeats", repeats, 1), ("--warmup", warmup, 0)):
        if value < low:
            raise UsageError(f"{flag} must be at least {low}, got {value}")
    if not hardware and len(set(b_list)) * len(set(c_list)) * len(set(k_list)) < 2:
        raise UsageError("fitting the cost model needs at least two grid points; give more than one value "
                         "to --batches, --contexts or --budgets")
    check_threads(threads)
    if device is not None:
        check_device(device)
    check_gpu_memory(gpu_memory_utilization)
    name, grid = model_name(model), Grid(b_list, c_list, k_list, warmup, repeats)
    if not hardware and (problem := context_problem(cfg, grid, verify) or grid_problem(cfg, grid, speculate)):
        raise UsageError(problem)
    with stage_errors():
        if hardware:
            cost, table = write_analytic(cfg, name, hardware, grid, output)
            print_coefficients(cost)
            console.print(f"wrote the analytic {hardware.lower()} model for {name} ({table.num_rows} points) "
                          f"to {output}")
            return print_predictions(table, fmt)
        device = device or "cpu"
        timed = measure(model, device, grid, seed, threads, gpu_memory_utilization, speculate, dtype)
        points, verify = timed.points, timed.verify
        cost, table = write_fitted(cfg, name, points, device, timed.threads, output, verify, timed.dtype)
    print_coefficients(cost)
    print_fit_quality(cost, "fit", len(points), "")
    if cost.verify is not None:
        print_fit_quality(cost, "verification fit", len(verify), "verify_")
    console.print(f"wrote {output} (decode steps timed in {timed.dtype})")
    print_points(table, fmt)
    if cost.verify is not None:
        print_verify_points(cost, fmt)


@dataclass(frozen=True)
class Timed:
    """What `measure` timed: the decode-step points, the verification forwards (with --speculate), the CPU
    threads torch used and the dtype of the weights the steps ran with (read off the loaded model)."""

    points: list[tuple[int, int, int, float]]
    verify: list[tuple[int, int, int, float]]
    threads: int
    dtype: str


def measure(model: str, device: str, grid, seed: int, threads: int | None = None,
            gpu_memory_utilization: float = 0.9, speculate: bool = False, dtype: str = "auto") -> Timed:
    """Time the rollout engine's decode step (and, with `speculate`, its verification forward) on `device`
    with weights and KV cache in `dtype` (--dtype's names; auto as rollout resolves it)."""
    import torch

    from sparrow.stages.cost import time_decode_steps, time_verifications
    from sparrow.stages.model.loading import load_model, resolve_dtype

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but torch sees no CUDA device")
    if threads is not None:
        torch.set_num_threads(threads)
    say_loading(f"{model} (its shapes, random weights)", device)
    loaded = load_model(model, device=device, dtype=resolve_dtype(dtype, device), random_weights=True,
                        seed=seed)
    weights = str(loaded.model.embed_tokens.weight.dtype).removeprefix("torch.")
    # the time left is the points' mean so far: later points (larger batches, longer contexts) take longer
    with counting("timing the engine's decode step (points)", after=0) as on_point:
        points = time_decode_steps(loaded, grid, device, seed, on_point, gpu_memory_utilization)
    verify = []
    if speculate:
        console.print("timing the speculative verification forward (2 and 5 tokens per sample) ...")
        verify = time_verifications(loaded, grid, seed=seed, gpu_memory_utilization=gpu_memory_utilization)
    return Timed(points, verify, torch.get_num_threads(), weights)


def print_points(table, fmt: str) -> None:
    """Measured vs fitted step time per grid point, on stdout (budget empty = dense)."""
    rows = []
    for r in table.to_pylist():
        err = (r["predicted_seconds"] - r["seconds"]) / r["seconds"]
        rows.append([r["batch"], r["context"], r["budget"], r["seconds"] * 1e3, r["predicted_seconds"] * 1e3,
                     err])
    emit(("batch", "context", "budget", "measured_ms", "predicted_ms", "relative_error"), rows, fmt,
         title="decode step: measured vs fitted",
         render={"budget": lambda b: "dense" if b is None else str(b)})


def print_verify_points(cost, fmt: str) -> None:
    """Measured vs fitted seconds per timed verification forward: a second table after the decode steps on
    a terminal; with csv, json or tsv on stderr, so that stdout stays one document (scripts read them from
    the artifact's `verify_points`)."""
    from sparrow.stages.cost import verify_rows

    rows = [[r["batch"], r["context"], r["tokens"], r["seconds"] * 1e3, r["predicted_seconds"] * 1e3,
             (r["predicted_seconds"] - r["seconds"]) / r["seconds"]] for r in verify_rows(cost)]
    emit(("batch", "context", "tokens", "measured_ms", "predicted_ms", "relative_error"), rows, "table",
         title="verification forward (tokens fed per sample): measured vs fitted",
         to=None if fmt == "table" else console)


def print_fit_quality(cost, what: str, points: int, prefix: str) -> None:
    """A fit's relative errors, and, where it has no spare point, that they are 0 by construction."""
    median, worst, spare = (cost.extra[prefix + k] for k in ("median_relative_error", "max_relative_error",
                                                             "spare_points"))
    exact = ("; as many independent points as coefficients, so the fit can pass through every point: this "
             "error is 0 by construction (unless a coefficient would be negative), not a measure of accuracy "
             "(widen the grid to measure it)" if spare == 0 else "")
    console.print(f"{what} over {points} points: median relative error {median:.1%}, worst "
                  f"{worst:.1%}{exact}", highlight=False)
    if median > NOISY_FIT:
        warn(f"the {what} misses its points by a median {median:.0%}, so its predictions are not to be "
             "trusted: the timings were noisy (another process on the machine?) or the model's linear form "
             "does not fit this device; rerun on a quiet machine with more --repeats")


def print_predictions(table, fmt: str) -> None:
    """An analytic model's predicted step time per grid point, on stdout (budget empty = dense): what the
    artifact holds, as a measured fit prints its points; there is nothing measured to compare with."""
    rows = [[r["batch"], r["context"], r["budget"], r["predicted_seconds"] * 1e3] for r in table.to_pylist()]
    emit(("batch", "context", "budget", "predicted_ms"), rows, fmt,
         title=f"decode step: predicted by the {table.column('device')[0].as_py()} model",
         render={"budget": lambda b: "dense" if b is None else str(b)})


def print_coefficients(cost) -> None:
    """The decode step's coefficients, and the verification forward's where fitted, in ms, us and ns."""
    c = cost.coefficients
    console.print(f"{cost.source}: step {duration(c['step'])} + batch x {duration(c['seq'])} + KV "
                  f"token-layer x {duration(c['kv'])} + scored page-layer x {duration(c['page'])}")
    if cost.verify is not None:
        v = cost.verify
        console.print(f"verification: forward {duration(v['step'])} + fed token x {duration(v['token'])} + "
                      f"KV token-layer x {duration(v['kv'])}")


def duration(seconds: float) -> str:
    """Seconds in the unit that keeps 1-999 of them: "434.2 ms", "3.5 us", "0 s"."""
    for unit, scale in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if abs(seconds) * scale >= 1:
            return f"{seconds * scale:.4g} {unit}"
    return f"{seconds * 1e9:.4g} ns" if seconds else "0 s"
