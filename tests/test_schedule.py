"""The schedule planner: published schedules reproduced, interpolation, measured profiles against a
brute force, exports, and one clear sentence for each bad input."""

import csv
import json
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.core.published_schedules import (
    PUBLISHED_PAGES,
    published_budgets,
    published_models,
    published_thresholds,
)
from sparrow.stages.core.reference_profiles import reference_profile
from sparrow.stages.core.schedule import Schedule, TailProfile, plan
from sparrow.stages.plan import compare_published

runner = CliRunner()
CSV = Path(__file__).resolve().parents[2] / "shared" / "reference" / "sparrow_published_schedules.csv"
PUBLISHED = sorted(PUBLISHED_PAGES)


def invoke(*args):
    return runner.invoke(app, ["plan-schedule", *map(str, args)])


def one_error_line(result) -> str:
    assert result.exit_code != 0, result.output
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


@pytest.mark.skipif(not CSV.exists(), reason="the shared reference CSV is not beside the repository")
def test_packaged_copy_equals_the_shared_csv():
    rows = list(csv.DictReader(CSV.open()))
    assert len(rows) == sum(len(p) for p in PUBLISHED_PAGES.values())
    for r in rows:
        pages = PUBLISHED_PAGES[(r["model"], float(r["threshold"]))]
        i = int(r["bin"])
        assert int(r["total_pages"]) == pages[i]
        assert int(r["selected_pages"]) == pages[i] - 3
        assert int(r["budget_tokens"]) == pages[i] * 16
        assert int(r["bin_start_tokens"]) == 2000 * i
        assert r["bin_end_tokens"] == ("" if i == 19 else str(2000 * (i + 1)))


@pytest.mark.parametrize("model,threshold", PUBLISHED)
def test_cli_reproduces_every_published_schedule(tmp_path, model, threshold):
    out = tmp_path / "schedule.parquet"
    result = invoke("--model", model, "--threshold", threshold, "-o", out)
    assert result.exit_code == 0, result.output
    table = read_artifact(out, "schedule")
    assert table.column("budget").to_pylist() == list(published_budgets(model, threshold))
    assert table.column("bin_start").to_pylist() == [2000 * i for i in range(20)]
    assert table.column("bin_end").to_pylist()[-1] is None
    assert all(t >= threshold for t in table.column("tail").to_pylist())
    assert Schedule.from_artifact(out).budgets == published_budgets(model, threshold)


def test_default_invocation_plans_qwen3_4b_at_the_prior(tmp_path):
    result = invoke("--model", "qwen3-4b")
    assert result.exit_code == 0, result.output
    assert "speedup over dense" in result.output
    assert "threshold 0.86 on the 0.05 quantile of alpha: published prior" in result.output
    assert "8192" in result.output


@pytest.mark.parametrize("model", published_models())
def test_between_published_thresholds_budgets_lie_between_the_neighbours(model):
    profile = reference_profile(model)
    ts = published_thresholds(model)
    for lo, hi in zip(ts, ts[1:]):
        for t in np.linspace(lo, hi, 5)[1:-1]:
            got = np.array(plan(profile, float(t)).schedule.budgets)
            assert (np.array(published_budgets(model, lo)) <= got).all()
            assert (got <= np.array(published_budgets(model, hi))).all()
    one = ts[0]
    assert plan(profile, one + 1e-9).schedule.budgets >= published_budgets(model, one)


def test_plans_are_non_decreasing_page_multiples():
    rng = np.random.default_rng(0)
    for model in published_models():
        profile = reference_profile(model)
        for t in rng.uniform(0.5, 0.99, 12):
            budgets = np.array(plan(profile, float(t)).schedule.budgets)
            assert (np.diff(budgets) >= 0).all()
            assert (budgets % 16 == 0).all() and (budgets >= 48).all()


def test_extrapolation_outside_the_published_range_is_reported():
    profile = reference_profile("qwen3-4b")
    assert plan(profile, 0.86).notes == []
    assert "extrapolates" in plan(profile, 0.95).notes[0]


# ---------------------------------------------------------------- measured profiles

BUDGETS = (64, 128, 256, 512)
WIDTH = 512


def synthetic_mismatch(rng, positions, thin_bin=None):
    """alpha's spread shrinks with the budget and grows with the position; one bin nearly empty."""
    if thin_bin is not None:
        in_bin = positions // WIDTH == thin_bin
        positions = np.concatenate([positions[~in_bin], positions[in_bin][:10]])
    rows = {k: [] for k in ("prompt_id", "sample", "position", "bin", "budget", "token_id", "alpha",
                            "logp_dense", "logp_sparse", "log_ratio", "k1", "k2", "k3",
                            "entropy_dense")}
    n = len(positions)
    for budget in BUDGETS:
        spread = 0.5 * (64 / budget) ** 0.7 * (1 + positions / 2048)
        alpha = np.clip(1 - rng.beta(0.6, 4, n) * spread, 0, 1)
        for k, v in [("prompt_id", np.array(["p"] * n)), ("sample", np.zeros(n, int)),
                     ("position", positions), ("bin", positions // WIDTH), ("budget", np.full(n, budget)),
                     ("token_id", np.ones(n, int)), ("alpha", alpha), ("logp_dense", -np.ones(n)),
                     ("logp_sparse", -np.ones(n)), ("log_ratio", np.zeros(n)), ("k1", np.zeros(n)),
                     ("k2", np.zeros(n)), ("k3", np.zeros(n)), ("entropy_dense", np.ones(n))]:
            rows[k].append(v)
    return {k: np.concatenate(v) for k, v in rows.items()}


def brute_force(rows, threshold, quantile, min_tokens, num_bins):
    """Straight from the definitions: quantile per bin and budget, running max over budgets, smallest
    profiled budget (never one between two profiled ones) at or above the threshold, running max over
    bins, thin bins inheriting; None = dense."""
    cands = np.array(BUDGETS)
    choice, thin = [], []
    for b in range(num_bins):
        sel = rows["position"] // WIDTH == b
        tails = []
        for budget in BUDGETS:
            a = rows["alpha"][sel & (rows["budget"] == budget)].astype(np.float32).astype(np.float64)
            tails.append(np.quantile(a, quantile) if len(a) else -1)
        tails = np.maximum.accumulate(tails)
        ok = cands[tails >= threshold]
        thin.append(sel.sum() / len(BUDGETS) < min_tokens)
        choice.append(int(ok[0]) if len(ok) else None)
    out, current = [], None
    for b in range(num_bins):
        if thin[b]:
            out.append(current)
            continue
        big = 10**9 if choice[b] is None else choice[b]
        current = big if current is None else max(current, big)
        out.append(current)
    first = thin.index(False)
    out = [out[first] if v is None else v for v in out]
    return [None if v == 10**9 else v for v in out]


@pytest.mark.parametrize("threshold", [0.6, 0.75, 0.86, 0.9])
def test_measured_profile_plan_matches_brute_force(tmp_path, threshold):
    rng = np.random.default_rng(1)
    rows = synthetic_mismatch(rng, rng.integers(0, 4 * WIDTH, 6000), thin_bin=1)
    path = tmp_path / "mismatch.parquet"
    write_artifact(rows, path, "mismatch", metadata={"bin_width": WIDTH})
    out = tmp_path / "schedule.parquet"
    result = invoke("--model", "smollm2-135m", "--profile", path, "--threshold", threshold,
                    "--hardware", "h100", "-o", out)
    assert result.exit_code == 0, result.output
    got = read_artifact(out, "schedule").column("budget").to_pylist()
    assert got == brute_force(rows, threshold, 0.05, 50, 4)
    assert "bin 1 (512-1024): fewer tokens" in result.output.replace("\n", " ")  # the thin bin
    assert artifact_metadata(out)["gen_len"] == int(rows["position"].max()) + 1


def test_bins_that_reach_no_budget_are_dense_and_reported(tmp_path):
    rng = np.random.default_rng(2)
    rows = synthetic_mismatch(rng, rng.integers(0, 4 * WIDTH, 6000))
    path = tmp_path / "mismatch.parquet"
    write_artifact(rows, path, "mismatch", metadata={"bin_width": WIDTH})
    expected = brute_force(rows, 0.97, 0.05, 50, 4)
    assert None in expected
    out = tmp_path / "s.parquet"
    result = invoke("--model", "smollm2-135m", "--profile", path, "--threshold", 0.97, "-o", out)
    assert result.exit_code == 0, result.output
    assert read_artifact(out, "schedule").column("budget").to_pylist() == expected
    assert "so is every later bin" in result.output.replace("\n", " ")


def test_threshold_file_sets_threshold_and_quantile(tmp_path):
    thr = tmp_path / "threshold.parquet"
    write_artifact({"threshold": [0.88], "lower": [None], "upper": [None], "quantile": [0.05],
                    "source": ["prior"], "n_runs": [0], "n_collapsed": [0], "note": [None]},
                   thr, "threshold")
    out = tmp_path / "s.parquet"
    result = invoke("--model", "qwen3-1.7b", "--threshold-file", thr, "-o", out)
    assert result.exit_code == 0, result.output
    assert tuple(Schedule.from_artifact(out).budgets) == published_budgets("qwen3-1.7b", 0.88)


@pytest.mark.slow  # a timing bound: run alone (make test-slow), never beside other workers
def test_planning_twenty_bins_by_twenty_budgets_is_instant():
    rng = np.random.default_rng(3)
    cands = np.arange(1, 21) * 256
    tail = np.sort(rng.uniform(0.5, 1, (20, 20)), axis=1)
    profile = TailProfile(np.arange(20) * 2000, 2000, cands, tail, 0.05, "synthetic")
    t0 = time.perf_counter()
    for _ in range(10):
        plan(profile, 0.86)
    assert time.perf_counter() - t0 < 2.0
    t0 = time.perf_counter()
    plan(reference_profile("qwen3-8b"), 0.86)
    assert time.perf_counter() - t0 < 2.0


# ---------------------------------------------------------------- outputs


def test_sweep_prints_the_frontier():
    """In json the schedule and the frontier are keys of the plan's one object; in a pipe (tsv) stdout is
    the schedule table alone, and the frontier goes to stderr: one parseable document either way."""
    result = invoke("--model", "qwen3-4b", "--sweep", "0.80,0.83,0.86,0.90,0.92", "-f", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert {"schedule", "frontier", "speedup"} <= set(doc)
    speeds = [p["speedup"] for p in doc["frontier"]]
    assert [p["threshold"] for p in doc["frontier"]] == [0.80, 0.83, 0.86, 0.90, 0.92]
    assert len(speeds) == 5 and speeds == sorted(speeds, reverse=True) and speeds[-1] > 1
    assert [b["budget"] for b in doc["schedule"]] == list(published_budgets("qwen3-4b", 0.86))
    for fmt, sep in (("tsv", "\t"), ("csv", ",")):
        result = invoke("--model", "qwen3-4b", "--sweep", "0.80,0.86", "-f", fmt)
        assert result.exit_code == 0, result.output
        rows = list(csv.reader(result.stdout.splitlines(), delimiter=sep))
        assert rows[0] == ["bin", "start", "end", "budget", "tail", "step_ms", "dense_ms"]
        assert all(len(r) == 7 for r in rows) and "frontier" in result.stderr
    table = invoke("--model", "qwen3-4b", "--sweep", "0.80,0.86", "--format", "table")
    assert "frontier" in table.stdout


def test_export_sglang_vortex_is_selected_pages_per_2000_token_bin(tmp_path):
    target = tmp_path / "vortex.json"
    result = invoke("--model", "qwen3-8b", "--threshold", 0.86, "--export", "sglang-vortex",
                    "--export-to", target)
    assert result.exit_code == 0, result.output
    form = json.loads(target.read_text())
    assert form["num_selected_pages"] == [b // 16 - 3 for b in published_budgets("qwen3-8b", 0.86)]
    assert form["bin_tokens"] == 2000 and form["page_size"] == 16


def test_export_json_to_stdout():
    result = runner.invoke(app, ["plan-schedule", "--model", "qwen3-14b", "--export", "json"])
    assert result.exit_code == 0, result.output
    text = result.stdout
    form = json.loads(text[text.index("{"):text.rindex("}") + 1])
    assert [b["budget"] for b in form["bins"]] == list(published_budgets("qwen3-14b", 0.86))
    assert form["bins"][-1]["end"] is None and form["predicted_speedup"] > 1


def test_vortex_export_resamples_other_bin_widths():
    from sparrow.stages.core.schedule import Plan, export_sglang_vortex

    p = Plan(Schedule((0, 1000, 2000, 3000), (64, 128, 128, 0)), 1000, [0.9] * 4, 0.86, 0.05, "x")
    form = export_sglang_vortex(p, context=8192, name="x")
    assert form["num_selected_pages"] == [128 // 16 - 3] + [8192 // 16 - 3] * 19  # the release's 20 bins


def test_compare_published_table():
    rows = compare_published("h200")
    assert [r["model"] for r in rows] == ["qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b"]
    assert [r["published"] for r in rows] == [2.21, 2.41, 2.06, 1.49]
    assert all(1 < r["predicted"] < 5 for r in rows)
    result = invoke("--compare-published", "--hardware", "h200")
    assert result.exit_code == 0, result.output
    assert "\t2.41\t" in result.output and "qwen3-14b" in result.output  # tsv: numbers, no "x"


# ---------------------------------------------------------------- bad input: one sentence each


def test_profile_that_does_not_cover_a_bin(tmp_path):
    rng = np.random.default_rng(4)
    path = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(rng, rng.integers(0, 2 * WIDTH, 2000)), path, "mismatch",
                   metadata={"bin_width": WIDTH})
    out = tmp_path / "s.parquet"
    line = one_error_line(invoke("--model", "smollm2-135m", "--profile", path, "--gen-len", 4000,
                                 "-o", out))
    assert "missing" in line and "--gen-len" in line
    assert not out.exists()


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.2"])
def test_threshold_outside_the_unit_interval(tmp_path, value):
    out = tmp_path / "s.parquet"
    line = one_error_line(invoke("--model", "qwen3-4b", "--threshold", value, "-o", out))
    assert "(0, 1)" in line
    assert not out.exists()


def test_sweep_threshold_outside_the_unit_interval(tmp_path):
    out = tmp_path / "s.parquet"
    assert "(0, 1)" in one_error_line(invoke("--model", "qwen3-4b", "--sweep", "0.8,1.3", "-o", out))
    assert not out.exists()


def test_unknown_hardware(tmp_path):
    out = tmp_path / "s.parquet"
    line = one_error_line(invoke("--model", "qwen3-4b", "--hardware", "tpu-v9", "-o", out))
    assert "unknown hardware 'tpu-v9'" in line and "h100" in line
    assert not out.exists()


def test_cost_artifact_for_another_model_shape(tmp_path):
    cost = tmp_path / "cost.parquet"
    assert runner.invoke(app, ["fit-cost", "--model", "qwen3-1.7b", "--hardware", "h200",
                               "-o", str(cost)]).exit_code == 0
    out = tmp_path / "s.parquet"
    line = one_error_line(invoke("--model", "qwen3-4b", "--cost", cost, "-o", out))
    assert "another model shape" in line
    assert not out.exists()
    assert invoke("--model", "qwen3-1.7b", "--cost", cost, "-o", out).exit_code == 0


def test_model_without_a_reference_profile_says_to_profile_first(tmp_path):
    line = one_error_line(invoke("--model", "qwen3-0.6b"))
    assert "sparrow profile" in line and "--profile" in line


@pytest.mark.parametrize("args,phrase", [
    (["--threshold", "0.9", "--threshold-file", "x.parquet"], "not both"),
    (["--cost", "c.parquet", "--hardware", "h100"], "not both"),
    (["--export", "yaml"], "--export must be"),
    (["--quantile", "0.1", "--threshold", "0.9"], "needs a measured --profile"),
    (["--quantile", "0.1"], "give --threshold for the 0.1 quantile"),  # the prior is a 0.05 rule
    (["--bin-width", "512"], "needs a measured --profile"),
    (["--gen-len", "50000"], "exceeds the model's context"),
])
def test_other_bad_options(args, phrase):
    assert phrase in one_error_line(invoke("--model", "qwen3-4b", *args))


def test_the_speedup_is_predicted_for_the_profiled_trajectories_and_the_threshold_reads_on_short_lines(
        tmp_path):
    """Four prompts of 994 to 1102 tokens, each followed by 32 generated tokens: the speedup is for 32
    tokens after the mean prompt (1038), not the longest position after the shortest prompt; the prior's
    provenance comes on short lines of its own (SmolLM2-135M ships no calibration)."""
    rows = {k: [] for k in ("prompt_id", "sample", "position", "bin", "budget", "token_id", "alpha",
                            "logp_dense", "logp_sparse", "log_ratio", "k1", "k2", "k3", "entropy_dense")}
    for i, start in enumerate((994, 1006, 1050, 1102)):
        for budget in (64, 128):
            for pos in range(start, start + 32):
                for k, v in (("prompt_id", f"p{i}"), ("sample", 0), ("position", pos), ("bin", pos // 512),
                             ("budget", budget), ("token_id", 1), ("alpha", 0.95), ("logp_dense", -1.0),
                             ("logp_sparse", -1.0), ("log_ratio", 0.0), ("k1", 0.0), ("k2", 0.0),
                             ("k3", 0.0), ("entropy_dense", 1.0)):
                    rows[k].append(v)
    path = write_artifact(rows, tmp_path / "m.parquet", "mismatch", metadata={"bin_width": 512,
                                                                               "model": "smollm2-135m"})
    out = tmp_path / "s.parquet"
    result = invoke("--model", "smollm2-135m", "--profile", path, "--min-tokens", "1", "-o", out)
    assert result.exit_code == 0, result.output
    err = result.stderr
    assert ("32 generated tokens after a 1038-token prompt (the means over the profile's 4 trajectories)"
            in err)
    meta = artifact_metadata(out)
    assert (meta["gen_len"], meta["prompt_len"]) == (32, 1038)
    assert max(len(line) for line in err.splitlines() if line.startswith("  ")) <= 110
    lines = [line.strip() for line in err.splitlines()]
    assert "threshold 0.86 on the 0.05 quantile of alpha: published prior" in lines


def test_compare_published_refuses_the_flags_it_would_ignore(tmp_path):
    """--compare-published prints a comparison and writes nothing: an -o, a --model or a --profile given
    beside it would be silently ignored, so they are refused, all named in one sentence."""
    path = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(np.random.default_rng(5), np.arange(0, 2 * WIDTH)), path, "mismatch",
                   metadata={"bin_width": WIDTH})
    out = tmp_path / "s.parquet"
    line = one_error_line(invoke("--compare-published", "--hardware", "h200", "--model", "smollm2-135m",
                                 "--profile", path, "-o", out))
    assert line.startswith("error: -o, --model, --profile do not apply to --compare-published, which prints")
    assert "--hardware, --threshold, --gen-len, --prompt-len and --max-num-seqs" in line
    assert not out.exists()
    assert one_error_line(invoke("--compare-published", "--speculate")).startswith(
        "error: --speculate does not apply to --compare-published")
    result = invoke("--compare-published", "--hardware", "h200", "--threshold", "0.9", "--gen-len", 4096,
                    "--max-num-seqs", 16, "--prompt-len", 100)
    assert result.exit_code == 0, result.output


def test_a_schedule_with_no_bins_is_refused_naming_it_before_the_model_loads(tmp_path, prompts_file,
                                                                            monkeypatch):
    """A schedule artifact with no rows has no budget for any position: rollout, profile and train each
    refuse it in one sentence that names the input file (not an output), before any model loads."""
    import sparrow.stages.model.loading as loading
    from sparrow.schemas import ArtifactError

    empty = write_artifact({"bin": [], "bin_start": [], "bin_end": [], "budget": [], "tail": [],
                            "predicted_step_seconds": []}, tmp_path / "empty.parquet", "schedule",
                           metadata={"page_size": 16, "model": "smollm2-135m"})
    with pytest.raises(ArtifactError, match="empty.parquet is a schedule with no bins"):
        Schedule.from_artifact(empty)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the schedule was checked")

    monkeypatch.setattr(loading, "load_model", no_model)
    common = ["--prompts", prompts_file, "--samples", 1, "--max-new-tokens", 4, "--threads", 1]
    for args in (["rollout", *common, "--schedule", empty, "-o", tmp_path / "r.parquet"],
                 ["profile", *common, "--sampler", f"schedule:{empty}", "--budgets", 64,
                  "-o", tmp_path / "p.parquet"],
                 ["train", "--prompts", prompts_file, "--schedule", empty, "--steps", 1, "--samples", 2,
                  "--prompts-per-step", 1, "--max-new-tokens", 4, "-o", tmp_path / "run"]):
        line = one_error_line(runner.invoke(app, [*map(str, args)]))
        assert line == (f"error: {empty} is a schedule with no bins, so it gives no budget at any position; "
                        "plan one with `sparrow plan-schedule`"), args[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--profile", "--cost", "--threshold-file"])
def test_an_empty_input_path_is_refused_as_one(tmp_path, flag):
    """'' would be the working directory (and a Parquet file found there would be named instead)."""
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.MonkeyPatch.context() as m:
        m.chdir(tmp_path)
        line = one_error_line(invoke("--model", "qwen3-4b", flag, ""))
    assert line == f"error: {flag} is an empty path; give a file (- = stdin)"


def test_export_to_the_file_of_o_is_refused_and_writes_nothing(tmp_path):
    """--export-to and -o on one path would leave the JSON where the schedule artifact should be."""
    same = tmp_path / "same.parquet"
    result = invoke("--model", "qwen3-4b", "--export", "json", "--export-to", same, "-o", same)
    assert one_error_line(result) == f"error: --export-to and -o both name {same}; the schedule artifact " \
                                     "and its --export json form need two files"
    assert not same.exists()


@pytest.mark.parametrize("form", ["json", "sglang-vortex"])
def test_export_to_a_parquet_name_is_refused_and_writes_nothing(tmp_path, form):
    """Both export forms are JSON text; a .parquet name would make every reader take the file for a
    Parquet artifact."""
    target = tmp_path / "sched.Parquet"
    line = one_error_line(invoke("--model", "qwen3-4b", "--export", form, "--export-to", target))
    assert line.startswith(f"error: --export-to {target} would hold the {form} form, which is JSON text, ")
    assert not target.exists()


def test_export_names_a_json_file_and_takes_any_case(tmp_path):
    """The export is JSON: a folder or '' as --export-to is answered with a .json name, and --export
    takes any case, as --format does."""
    line = one_error_line(invoke("--model", "qwen3-4b", "--export", "json", "--export-to", tmp_path))
    assert line == f"error: --export-to {tmp_path} is a directory; give a file path such as " \
                   f"{tmp_path / 'schedule.json'}"
    line = one_error_line(invoke("--model", "qwen3-4b", "--export", "json", "--export-to", ""))
    assert line == "error: --export-to is an empty path; give a file such as schedule.json (- = stdout)"
    target = tmp_path / "s.json"
    result = invoke("--model", "qwen3-4b", "--export", "JSON", "--export-to", target)
    assert result.exit_code == 0, result.output
    assert [b["budget"] for b in json.loads(target.read_text())["bins"]] == list(
        published_budgets("qwen3-4b", 0.86))
    assert invoke("--model", "qwen3-8b", "--export", "SGLang-Vortex").exit_code == 0


@pytest.mark.parametrize("page_size", ["x", 16.5, None, 0, True])
def test_a_schedule_whose_page_size_is_not_a_whole_number_is_refused_naming_it(tmp_path, page_size):
    from sparrow.schemas import ArtifactError
    from sparrow.stages.core.schedule import Schedule

    path = write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [64], "tail": [None],
                           "predicted_step_seconds": [None]}, tmp_path / "s.parquet", "schedule",
                          {"page_size": page_size})
    with pytest.raises(ArtifactError, match=f"gives page_size {page_size!r}, expected a positive whole"):
        Schedule.from_artifact(path)
    write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [64], "tail": [None],
                    "predicted_step_seconds": [None]}, path, "schedule", {"page_size": "16"})
    assert Schedule.from_artifact(path).page_size == 16
