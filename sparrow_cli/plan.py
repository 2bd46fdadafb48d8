"""`sparrow plan-schedule`: the cheapest per-bin budgets whose tail stays above the threshold."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from sparrow.stages.core.definitions import TAIL_QUANTILE
from sparrow.stages.core.published_schedules import REFERENCE_GEN_LEN
from sparrow.stages.core.schedule import MIN_TOKENS
from sparrow.stages.plan import export_text, profile_name
from sparrow.stages.speculative_plan import format_speedup

from .console import console, out, stdout_taken
from .errors import UsageError, friendly_errors, stage_errors
from .messages import fail, note, warn
from .options import check_tail, finite, given_path, model_file, output_path
from .output import ARTIFACT_FORMAT_HELP, FORMAT_METAVAR, emit, json_rows, resolve_format, write_out
from .paths import check_output, force_option, input_path, output_help

EXPORTS = ("json", "sglang-vortex")
EXPORT_TO_GIVE = "a file such as schedule.json (- = stdout)"  # what an empty --export-to is asked for
PARQUET_SUFFIXES = (".parquet", ".pq")  # a name that says Parquet, which the JSON export is not
FORMAT_TABLES_HELP = (f"{ARTIFACT_FORMAT_HELP} json is one object: the predicted speedup (speedup, "
                      "speedup_scope, decode_speedup, prefill_seconds, gen_len, prompt_len, batch, cost), "
                      "the threshold, quantile and the schedule's bins (schedule); --sweep adds frontier, "
                      "and --speculate the drafts (speculative), their K (speculate) and speedups "
                      "(speculative_speedup, speculation_pays, lossy_speedup, speedups_by_k). csv and tsv "
                      "carry one table, every float whole and a missing value null: the schedule, or with "
                      "--speculate the draft schedule that -o writes; the rest goes to stderr.")


def sweep_list(value: str) -> str:
    """typer parser of --sweep: thresholds are in (0, 1), so a value that starts with '-' is the next
    option taken as --sweep's value (`--sweep -f json`), refused as such while the command line is read."""
    if value.startswith("-"):
        fail(f"--sweep needs a comma-separated list of thresholds, got {value!r}")
    return value


def parse_thresholds(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--sweep expects comma-separated thresholds, got {text!r}") from None
    if not values:
        raise UsageError("--sweep is empty; it takes comma-separated thresholds (for example 0.5,0.6,0.7)")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise UsageError(f"--sweep lists {', '.join(f'{v:g}' for v in repeated)} more than once; give each "
                         "threshold once")
    return values


@friendly_errors
def plan_schedule(
    model: str = typer.Option(None, "--model", show_default="the profile's model",
                              help="Preset, checkpoint dir or .gguf (default: the model the --profile "
                              "records, else the --threshold-file's; required where neither records one)."),
    profile: Path = typer.Option(None, "--profile", callback=input_path, parser=given_path("--profile"),
                                 help="A mismatch artifact (sparrow profile); default: the reference "
                                 "profile of a Qwen3 preset."),
    threshold: float = typer.Option(None, "--threshold", callback=finite, help="Tail threshold (default: the "
                                    "calibration shipped for --model at --quantile if there is one, "
                                    "else the published prior 0.86, a rule on the 0.05 quantile only: "
                                    "another --quantile needs a threshold)."),
    threshold_file: Path = typer.Option(None, "--threshold-file", callback=input_path,
                                        parser=given_path("--threshold-file"),
                                        help="A threshold artifact (sparrow calibrate-threshold); one "
                                        "calibrated on another model than --model is refused without "
                                        "--allow-model-mismatch."),
    quantile: float = typer.Option(None, "--quantile", callback=finite, help="Tail quantile of alpha per bin "
                                   "(default 0.05, or the threshold file's)."),
    cost: Path = typer.Option(None, "--cost", callback=input_path, parser=given_path("--cost"),
                              help="A cost artifact (sparrow fit-cost)."),
    hardware: str = typer.Option(None, "--hardware", help="Analytic cost model of a hardware preset "
                                 "(h100, h200, a100; default h100 when no --cost)."),
    gen_len: int = typer.Option(None, "--gen-len", help="Generated tokens per rollout for the "
                                f"predicted speedup (default {REFERENCE_GEN_LEN} with the reference "
                                "profile; with a measured one, the mean over its trajectories, rounded "
                                "half up; one that rounds to 1 is refused: the first token comes from "
                                "the prefill, so no decode step is left to price)."),
    prompt_len: int = typer.Option(None, "--prompt-len", help="Prompt tokens before generation (default 0 "
                                   "with the reference profile; with a measured one, the mean over its "
                                   "trajectories)."),
    batch: int = typer.Option(64, "--max-num-seqs", "--batch", help="Sequences decoded together (per GPU) "
                              "that the step times are predicted at (vLLM's name). Default 64, a GPU "
                              "rollout's batch; sparrow rollout's own default of 16 suits a CPU."),
    bin_width: int = typer.Option(None, "--bin-width", help="Position bin width in tokens (default: "
                                  "the profile's; the reference profile has 2,000-token bins)."),
    min_tokens: int = typer.Option(MIN_TOKENS, "--min-tokens", help="Bins of a measured profile with fewer "
                                   "tokens are not trusted: they take the budget of the bin before (the "
                                   "first trusted bin's, for leading ones)."),
    allow_model_mismatch: bool = typer.Option(False, "--allow-model-mismatch/--no-allow-model-mismatch",
                                              help="Plan for --model from "
                                              "a --profile measured on another model, or with a calibrated "
                                              "--threshold-file of another model (their metadata names "
                                              "the model); refused without this flag."),
    sweep: str = typer.Option(None, "--sweep", parser=sweep_list, help="Also print the predicted speedup "
                              "at each of these thresholds, e.g. 0.80,0.83,0.86,0.90,0.92."),
    export: str = typer.Option(None, "--export", help="Also print the schedule as json, or as "
                               "sglang-vortex: the named schedule and SGLang settings the Sparrow "
                               "release's verl/SGLang reads (stdout, or --export-to), case-insensitive. With "
                               "--speculate, json holds the draft schedule that -o writes."),
    export_to: Path = typer.Option(None, "--export-to", help="Write the --export form here (an existing file "
                                   "only if it holds the same form, or --force).",
                                   parser=given_path("--export-to", EXPORT_TO_GIVE)),
    output: Path = typer.Option(None, "-o", "--output", help=output_help("the schedule artifact"),
                                parser=output_path()),
    force: bool = force_option(),
    compare_published: bool = typer.Option(False, "--compare-published/--no-compare-published",
                                           help="Instead of one plan, "
                                           "print the predicted speedup of every Qwen3 model with "
                                           "published schedules next to the published speedup."),
    kv_compression: str = typer.Option(None, "--kv-compression", help="Plan an eviction policy's KV budget "
                                       "(snapkv, rkv) from a --profile that `sparrow profile "
                                       "--kv-compression` measured: an evicted token is gone for every "
                                       "later position, so the plan is one budget, the cheapest profiled "
                                       "one whose tail holds in every position bin, printed as the "
                                       "--kv-budget flags of rollout and train (no schedule artifact). A "
                                       "profile of eviction budgets is planned so even without this flag."),
    speculate: bool = typer.Option(False, "--speculate/--no-speculate", help="Also plan exact "
                                   "speculative rollouts (sparrow rollout --speculate K) from the "
                                   "--profile's mean alpha per bin: the draft budget per bin and the K (1-8) "
                                   "of the fewest predicted seconds per token, printed beside the lossy "
                                   "plan; -o then writes the draft schedule (its K in the metadata), with a "
                                   "warning where no K is predicted to beat dense sampling, and csv or tsv "
                                   "on stdout is that draft schedule (the lossy one goes to stderr)."),
    format: str = typer.Option(None, "--format", "-f", metavar=FORMAT_METAVAR, help=FORMAT_TABLES_HELP),
) -> None:
    """Plan the sparsity schedule: for each position bin the cheapest budget whose tail statistic is
    at or above the threshold (of a measured --profile, the cheapest profiled budget: a budget it never
    scored is never planned), non-decreasing across bins; prints the table and the predicted speedup
    over dense: of the whole rollout (the prompt's dense prefill on both sides) where the cost model
    prices a prefill, as the analytic presets do, else of decode alone, labelled so."""
    from sparrow.stages.cost import get_hardware, timed_dtype
    from sparrow.stages.plan import PlanRequest, plan_kv_budget, plan_schedule

    fmt = resolve_format(format)
    export = export.lower() if export is not None else None
    if hardware is not None:  # an empty name too, which would otherwise read as no --hardware
        with stage_errors():
            get_hardware(hardware)
    req = PlanRequest(model, profile, threshold, threshold_file, quantile, cost, hardware, gen_len,
                      prompt_len, batch, bin_width, min_tokens, allow_model_mismatch, export=export,
                      speculate=speculate)
    evicting = _eviction_profile(profile, kv_compression)
    if evicting is not None:
        given = [f for f, v in (("-o", output), ("--export", export), ("--export-to", export_to),
                                ("--sweep", sweep), ("--cost", cost), ("--hardware", hardware),
                                ("--compare-published", compare_published),
                                ("--gen-len", gen_len is not None), ("--prompt-len", prompt_len is not None),
                                ("--max-num-seqs", batch != 64), ("--speculate", speculate)) if v]
        if given:
            raise UsageError(f"{given[0]} does not apply to an eviction plan ({profile} profiles {evicting} "
                             "KV budgets): the plan is one --kv-budget, printed, with no schedule or speedup")
        _check_plan_inputs(req)
        for flag, value in (("--bin-width", bin_width), ("--min-tokens", min_tokens)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} must be at least 1, got {value}")
        with stage_errors():
            result = plan_kv_budget(req)
        return print_eviction_plan(result, fmt)
    if compare_published:
        refuse_unused("--compare-published", "prints the published Qwen3 models' comparison and takes only "
                      "--hardware, --threshold, --gen-len, --prompt-len and --max-num-seqs",
                      {"-o": output is not None, "--model": model is not None,
                       "--profile": profile is not None, "--threshold-file": threshold_file is not None,
                       "--quantile": quantile is not None,
                       "--cost": cost is not None, "--bin-width": bin_width is not None,
                       "--min-tokens": min_tokens != MIN_TOKENS,
                       "--allow-model-mismatch": allow_model_mismatch,
                       "--sweep": sweep is not None, "--export": export is not None,
                       "--export-to": export_to is not None, "--speculate": speculate})
        with stage_errors():
            return print_comparison(hardware or "h100", threshold, gen_len, batch, prompt_len or 0, fmt)
    _check_plan_inputs(req)
    if cost is not None and hardware is not None:
        raise UsageError("pass --cost or --hardware, not both")
    if export is not None and export not in EXPORTS:
        raise UsageError(f"--export must be one of {', '.join(EXPORTS)}, got {export!r}")
    if export_to is not None and export is None:
        raise UsageError("--export-to needs --export json or --export sglang-vortex")
    if speculate and export == "sglang-vortex":
        raise UsageError("--export sglang-vortex names a lossy schedule for SGLang, which has no exact "
                         "speculative rollouts, while --speculate makes -o write the draft schedule; export "
                         "json (the drafts) or drop --speculate")
    if export_to is not None and str(export_to) == "-":
        export_to = None  # stdout is where --export prints anyway
    inputs = {"--profile": profile, "--threshold-file": threshold_file, "--cost": cost,
              "--model": model_file(req.model)}
    check_output(output, "schedule", force, inputs=inputs)
    if export is not None and export_to is None and output is not None and str(output) == "-":
        raise UsageError("--export without --export-to prints to stdout, which -o - takes; give --export-to")
    if export_to is not None and output is not None and str(output) != "-" \
            and export_to.resolve() == output.resolve():
        raise UsageError(f"--export-to and -o both name {output}; the schedule artifact and its "
                         f"--export {export} form need two files")
    check_export_to(export_to, export, force, inputs)
    for flag, value, low in (("--max-num-seqs", batch, 1), ("--prompt-len", prompt_len, 0),
                             ("--gen-len", gen_len, 2), ("--bin-width", bin_width, 1),
                             ("--min-tokens", min_tokens, 1)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be at least {low}, got {value}")
    req.sweep = parse_thresholds(sweep) if sweep is not None else []
    with stage_errors():
        planned = plan_schedule(req, output, export_to)
    result = planned.plan
    # stdout carries one product: the --export text when it goes there, else the plan's tables
    tables = PlanTables(None if planned.exported is not None and export_to is None else fmt,
                        "schedule" if planned.speculative is None else "speculative")
    put_speedup(planned, tables)
    print_plan(planned, tables)
    for line in result.notes:
        note(line)
    for warning in planned.warnings:
        warn(warning)
    print_speedup(planned, timed_dtype(cost) if cost is not None else None)
    console.print(f"  profile: {profile_name(result.source)}", highlight=False, markup=False)
    for line in planned.threshold.lines():
        console.print("  " + line, highlight=False, markup=False)
    if planned.frontier:
        print_frontier(planned, tables)
    if planned.speculative is not None:
        print_speculative(planned, tables, output)
    tables.close()
    if planned.exported is not None:
        if export_to is not None:
            console.print(f"wrote the {export} form to {export_to}")
        else:
            out.print(export_text(planned.exported, export), highlight=False, soft_wrap=True)
    if output is not None:
        console.print(f"wrote {output}")


def refuse_unused(mode: str, what: str, given: dict[str, bool]) -> None:
    """One sentence naming every flag of `given` that was given although `mode` does not read it: a flag
    silently ignored (an -o that writes nothing) would look like it took effect."""
    unused = [flag for flag, was_given in given.items() if was_given]
    if unused:
        raise UsageError(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to {mode}, "
                         f"which {what}")


def _check_plan_inputs(req) -> None:
    """The checks that a schedule and an eviction plan share, one sentence before any work; --model
    defaulted to the model its inputs record (`recorded_model`)."""
    if req.threshold is not None and req.threshold_file is not None:
        raise UsageError("pass --threshold or --threshold-file, not both")
    check_tail(TAIL_QUANTILE if req.quantile is None else req.quantile, req.threshold)
    req.model = req.model or recorded_model(req.profile, req.threshold_file)


def recorded_model(profile: Path | None, threshold_file: Path | None) -> str:
    """The model a plan is for when --model is not given: the one the --profile's metadata records (sparrow
    profile's, a preset's name or a checkpoint's path), else the --threshold-file's; one sentence where
    neither records one."""
    from sparrow.schemas import artifact_metadata

    for path in (profile, threshold_file):
        recorded = artifact_metadata(path).get("model") if path is not None else None
        if recorded:
            return str(recorded)
    given = [f"{flag} {path}" for flag, path in (("--profile", profile), ("--threshold-file", threshold_file))
             if path is not None]
    if not given:
        raise UsageError("--model is required without a --profile that records it (a preset such as "
                         "qwen3-4b, planned from its reference profile, a checkpoint dir or a .gguf)")
    raise UsageError(f"--model is required: {' and '.join(given)} record{'s' * (len(given) == 1)} no model "
                     "(give a preset such as qwen3-4b, a checkpoint dir or a .gguf)")


def _eviction_profile(profile: Path | None, kv_compression: str | None) -> str | None:
    """The eviction policy a plan is for: the one --profile scored (checked against --kv-compression
    when given), or None for a block top-k plan."""
    from sparrow.stages.kv_policies import EVICTION_POLICIES
    from sparrow.stages.plan import eviction_policy_of

    if kv_compression is not None and kv_compression.lower() not in EVICTION_POLICIES:
        raise UsageError(f"--kv-compression must be one of {', '.join(EVICTION_POLICIES)}, got "
                         f"{kv_compression!r}")
    measured = eviction_policy_of(profile) if profile is not None and profile.exists() else None
    if kv_compression is None:
        return measured
    if profile is None:
        raise UsageError(f"--kv-compression {kv_compression} plans from a --profile measured with `sparrow "
                         f"profile --kv-compression {kv_compression.lower()} --budgets ...`; give it")
    if measured != kv_compression.lower():
        what = f"{measured} KV budgets" if measured else "block top-k budgets"
        raise UsageError(f"--kv-compression {kv_compression}: --profile {profile} measured {what}; profile "
                         f"with `sparrow profile --kv-compression {kv_compression.lower()}` first")
    return measured


def print_eviction_plan(result, fmt: str) -> None:
    """The profiled KV budgets, and the plan: in json one object with the chosen budget (kv_budget, null
    where none holds), its rollout flags, the threshold and the budgets' rows (budgets)."""
    tables = PlanTables(fmt, "budgets")
    for name, value in (("policy", result.policy), ("kv_budget", result.budget),
                        ("flags", result.flags() if result.budget is not None else None),
                        ("threshold", result.threshold), ("quantile", result.quantile),
                        ("bin_width", result.bin_width)):
        tables.put(name, value)
    columns = ("kv_budget", "tail", "weakest_bin", "mean_alpha", "tokens", "holds", "evicted")
    rows = [[r["budget"], *(r[c] for c in columns[1:])] for r in result.rows]
    tables.show("budgets", columns, rows,
                f"{result.policy} KV budgets (tail = {result.quantile:g} quantile of alpha, the weakest of "
                f"the {result.bin_width}-token bins; threshold {result.threshold:g})",
                reading={"tail": _fixed(4, missing="thin"), "mean_alpha": _fixed(4)})
    tables.close()
    for line in result.notes:
        note(line)
    threshold = result.resolved
    idle = [str(r["budget"]) for r in result.rows if not r["evicted"]]
    if idle:
        them, their = ("them", "their") if len(idle) > 1 else ("it", "its")
        console.print(f"KV budget{'s' * (len(idle) > 1)} {', '.join(idle)} never compressed a profiled "
                      f"sequence (no prompt plus its tokens outgrew {them}), so {their} alpha of 1 is the "
                      f"dense cache's: not planned; profile longer trajectories to judge {them}",
                      highlight=False)
    if result.budget is None:
        console.print(f"no profiled {result.policy} budget keeps the tail at or above the threshold: "
                      "sample dense, or profile larger --budgets", highlight=False)
    else:
        console.print(f"plan: [bold]{result.flags()}[/] (the cheapest profiled budget whose tail holds; "
                      f"{result.source})", highlight=False)
    for line in threshold.lines() if threshold is not None else ():
        console.print("  " + line, highlight=False, markup=False)


def _export_form(path: Path) -> str | None:
    """Which --export form a file holds (json, sglang-vortex), or None."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(doc, dict) and {"bins", "threshold"} <= doc.keys():
        return "json"
    if isinstance(doc, dict) and "num_selected_pages" in doc:
        return "sglang-vortex"
    return None


def check_export_to(path: Path | None, export: str | None, force: bool,
                    inputs: dict[str, Path | None] | None = None) -> None:
    """--export-to follows the -o rule: a symlink is written through, a FIFO, device or directory is
    refused, and an existing file is replaced only if it holds the same form (or with --force), never
    when it is one of the command's `inputs`."""
    from sparrow.schemas import ArtifactError
    from sparrow.schemas.locations import check_not_input, check_writable, output_target

    if path is None:
        return
    if os.path.isdir(path):  # False for a name too long to look up: output_target says so
        raise UsageError(f"--export-to {path} is a directory; give a file path such as "
                         f"{path / 'schedule.json'}")
    if path.suffix.lower() in PARQUET_SUFFIXES:
        raise UsageError(f"--export-to {path} would hold the {export} form, which is JSON text, under a "
                         f"Parquet name; give a path ending in .json (-o writes the Parquet schedule)")
    try:
        target = output_target(path)
        check_not_input(target, path, inputs or {})
        check_writable(target.parent, path)
    except ArtifactError as e:
        raise UsageError(f"--export-to {e}") from None
    if target.exists() and target.stat().st_size and _export_form(target) != export and not force:
        raise UsageError(f"--export-to {path} exists and does not hold the {export} form; pass --force to "
                         "replace it, or choose another path")


def _show(columns, rows, fmt: str | None, title: str, render=None, reading=None) -> None:
    """A table on stdout in `fmt`, or (fmt None: stdout is taken) as a rich table on stderr. `render`
    gives a column's text in every text format (a dense budget as "dense"); `reading` only in a table,
    for the eye (rounded floats, "thin" or "open" for a missing value): csv and tsv lose nothing, a float
    whole and a missing value null, as every command's do."""
    table = fmt in (None, "table") or stdout_taken()
    shown = {**(render or {}), **(reading or {})} if table else render
    emit(columns, rows, fmt or "table", title=title, to=None if fmt is not None else console, render=shown)


class PlanTables:
    """The plan's tables (schedule, then --sweep's frontier and --speculate's drafts) as one document on
    stdout, so a reader parses it whole: json is one object, the values `put` beside a key per table,
    whatever the flags; csv and tsv are one table, the `primary` one (the schedule, or with --speculate
    the drafts, the schedule that -o writes), and the others go to stderr as tables (two CSV headers in
    one stream would parse as neither). A table goes where it is shown, in order, except in json, which is
    written whole by `close`. fmt None: stdout is taken, all to stderr."""

    def __init__(self, fmt: str | None, primary: str = "schedule") -> None:
        self.fmt = fmt
        self.primary = primary
        self.collected: dict[str, object] = {}

    def show(self, name: str, columns, rows, title: str, render=None, reading=None) -> None:
        if self._json():
            self.collected[name] = json_rows(columns, rows)
        elif self.fmt in ("csv", "tsv") and name != self.primary:
            _show(columns, rows, None, title, render, reading)
        else:
            _show(columns, rows, self.fmt, title, render, reading)

    def put(self, name: str, value: object) -> None:
        """A value beside the tables in the json document (the text formats print it as a message)."""
        if self._json():
            self.collected[name] = value

    def _json(self) -> bool:
        return self.fmt == "json" and not stdout_taken()

    def close(self) -> None:
        if not self._json():
            return
        write_out(json.dumps(self.collected) + "\n")


def _fixed(digits: int, suffix: str = "", missing: str = "-"):
    return lambda v: missing if v is None else f"{v:.{digits}f}{suffix}"


DENSE = {"budget": lambda b: "dense" if b is None else str(b)}
PLAN_READING = {"end": lambda e: "open" if e is None else str(e), "tail": _fixed(4, missing="thin"),
                "step_ms": _fixed(2), "dense_ms": _fixed(2)}


def put_speedup(planned, tables: PlanTables) -> None:
    """The predicted speedup and what it is for, first in the json document (the keys of the schedule
    artifact's metadata, shorter: speedup, decode_speedup), then the plan's threshold."""
    fields = planned.speedup_fields()
    names = {"predicted_speedup": "speedup", "predicted_decode_speedup": "decode_speedup"}
    for key, value in fields.items():
        tables.put(names.get(key, key), value)
    tables.put("threshold", planned.plan.threshold)
    tables.put("quantile", planned.plan.quantile)


def print_speedup(planned, dtype: str | None = None) -> None:
    """The headline on stderr: the predicted speedup, labelled with what it covers (SpeedupScope), the
    lengths and batch it is for, the prefill on both sides (or why there is none) and the cost model, with
    the dtype its decode steps were timed in where the cost artifact records one (`dtype`)."""
    scope, lengths = planned.scope, planned.lengths
    console.print(f"predicted {scope.label()}: [bold]{format_speedup(planned.speedup)}[/]", highlight=False)
    lines = [f"  for {lengths.describe(planned.batch)}"]
    if scope.prefill_s is None:
        lines.append(f"  prefill: not priced ({planned.cost_source} times decode steps only), so this is "
                     "decode alone; with the prompt's prefill the rollout's speedup is nearer 1x")
    elif lengths.prompt_len:
        lines.append(f"  prefill: {scope.prefill_s * 1e3:.4g} ms, dense, on both sides of the ratio (decode "
                     f"alone: {format_speedup(planned.decode_speedup)})")
    lines.append(f"  cost: {planned.cost_source}")
    if dtype is not None:
        lines.append(f"  cost timed in: {dtype} (the weights and KV cache of fit-cost's decode steps)")
    for line in lines:
        console.print(line, highlight=False, markup=False)


def print_plan(planned, tables: PlanTables) -> None:
    result = planned.plan
    rows = [[i, result.schedule.bin_starts[i], result.bin_end(i), budget or None, result.tails[i],
             float(planned.sparse_s[i] * 1e3), float(planned.dense_s[i] * 1e3)]
            for i, budget in enumerate(result.schedule.budgets)]
    tables.show("schedule", ("bin", "start", "end", "budget", "tail", "step_ms", "dense_ms"), rows,
                f"schedule (threshold {result.threshold:g}, tail = {result.quantile:g} quantile of alpha; "
                f"step times at batch {planned.batch}, mid-bin)", render=DENSE, reading=PLAN_READING)


def print_frontier(planned, tables: PlanTables) -> None:
    rows = [[p.threshold, p.speedup, p.mean_budget, p.dense_bins] for p in planned.frontier]
    tables.show("frontier", ("threshold", "speedup", "mean_budget", "dense_bins"), rows,
                f"stability-speed frontier ({planned.scope.name} speedup; {planned.cost_source}, "
                f"{planned.lengths.gen_len} tokens, batch {planned.batch})",
                reading={"threshold": lambda t: f"{t:g}", "speedup": _fixed(2, "x"),
                         "mean_budget": _fixed(0)})


def print_speculative(planned, tables: PlanTables, output: Path | None = None) -> None:
    """The drafts' table, K and speedups (json: beside the tables). The rollout command names the -o that
    holds the drafts, when there is one to name, and only where speculation is predicted to pay: where
    no K beats dense, a warning says so instead (dense sampling is exact too)."""
    spec, result = planned.speculative, planned.plan
    rows = [[i, result.schedule.bin_starts[i], result.bin_end(i), b, a, t] for i, (b, a, t) in
            enumerate(zip(spec.budgets, spec.mean_alpha, spec.tokens_per_cycle))]
    columns = ("bin", "start", "end", "draft_budget", "mean_alpha", "tokens_per_cycle")
    tables.show("speculative", columns, rows,
                f"exact speculative rollouts: K = {spec.k} drafts a cycle (the draft schedule -o writes)",
                reading={"end": PLAN_READING["end"], "mean_alpha": _fixed(3, missing="thin"),
                         "tokens_per_cycle": _fixed(2, missing="thin")})
    if tables.fmt in ("csv", "tsv") and not stdout_taken():
        console.print(f"stdout holds the draft schedule (the one -o writes) as {tables.fmt}; the lossy "
                      "schedule is the table on stderr", highlight=False, markup=False)
    for name, value in (("speculate", spec.k), ("priced_at", spec.priced_at),
                        ("speculative_speedup", spec.speedup), ("speculation_pays", spec.pays),
                        ("lossy_speedup", planned.speedup),
                        ("speedups_by_k", {str(k): v for k, v in spec.speedups_by_k.items()})):
        tables.put(name, value)
    for line in spec.notes:
        note(line)
    if spec.priced_at == "alpha_draft":
        console.print("drafts priced at the profile's alpha_draft (a draft's own alpha, over the dense KV "
                      "that verification keeps)", highlight=False, markup=False)
    by_k = ", ".join(f"K={k} {format_speedup(v)}" for k, v in spec.speedups_by_k.items())
    exact, lossy = format_speedup(spec.speedup), format_speedup(planned.speedup)
    console.print(f"predicted {planned.scope.label()}: speculative (exact) [bold]{exact}[/] at K = {spec.k}, "
                  f"lossy schedule {lossy}", highlight=False)
    console.print(f"  by K: {by_k}", highlight=False, markup=False)
    written = output is not None and str(output) != "-"
    if not spec.pays:
        warn(f"{spec.warning}, so roll out with --dense"
             + (f"; {output} holds the drafts all the same" if written else ""))
        return
    console.print(f"  roll out with: sparrow rollout --schedule {output if written else '<-o of this plan>'} "
                  f"--speculate {spec.k}", highlight=False, markup=False)


def print_comparison(hardware: str, threshold: float | None, gen_len: int | None, batch: int,
                     prompt_len: int, fmt: str = "table") -> None:
    from sparrow.stages.plan import compare_published_at

    threshold, gen_len, rows = compare_published_at(hardware, threshold, gen_len, batch, prompt_len)
    table = [[r["model"], r["published"], r["predicted"], r["ratio"]] for r in rows]
    _show(("model", "published", "predicted", "predicted_over_published"), table, fmt,
          f"rollout speedup over dense at threshold {threshold:g}: analytic {hardware} model "
          f"({gen_len} tokens after a {prompt_len}-token prompt, batch {batch}) vs published (4 x H200, "
          "AIME24)",
          reading={"published": _fixed(2, "x"), "predicted": _fixed(2, "x"),
                   "predicted_over_published": _fixed(2)})
