"""The decode-step cost model: features, analytic presets, the fit, and `sparrow fit-cost`."""

import json
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact
from sparrow.stages import attention
from sparrow.stages.core.schedule import Schedule
from sparrow.stages.cost import (
    DEFAULT_DENSE_LAYERS,
    FEATURES,
    HARDWARE,
    PAGE_SIZE,
    CostError,
    CostModel,
    analytic,
    fit,
    get_hardware,
    load_cost,
    nnls,
)
from sparrow.stages.model.presets import get_preset

runner = CliRunner()
QWEN4B = get_preset("qwen3-4b").config


def test_constants_match_the_attention_package():
    assert PAGE_SIZE == attention.PAGE_SIZE
    assert DEFAULT_DENSE_LAYERS == attention.DEFAULT_DENSE_LAYERS


def test_features_follow_the_selection_rule():
    cm = analytic(QWEN4B, "h100")
    layers, sparse = QWEN4B.num_layers, QWEN4B.num_layers - 2
    step, seq, kv, page = cm.features(4, 10000, 0)
    assert (step, seq, kv, page) == (1, 4, 4 * layers * 10000, 0)
    _, _, kv, page = cm.features(4, 10000, 1024)
    assert kv == 4 * (2 * 10000 + sparse * 1024)
    assert page == 4 * sparse * np.ceil(10000 / 16)
    assert (cm.features(4, 1024, 1024) == cm.features(4, 1024, 0)).all()  # all pages fit: dense
    budgets = np.arange(48, 16000, 16)  # below the context: more budget, more cost
    assert (np.diff(cm.step_seconds(8, 16000, budgets)) > 0).all()
    assert cm.step_seconds(8, 16000, 16000) == cm.step_seconds(8, 16000, 0)


def test_analytic_step_respects_the_memory_bound():
    for name, hw in HARDWARE.items():
        cm = analytic(QWEN4B, name)
        context, batch = 32768, 64
        weights = cm.config.num_parameters * 2  # tied embeddings: all weights are read
        kv = batch * context * QWEN4B.kv_bytes_per_token(2)
        bound = (weights + kv) / hw.bandwidth
        assert bound < cm.step_seconds(batch, context, 0) < 1.5 * bound + hw.overhead


def test_analytic_speedup_grows_with_generation_length():
    cm = analytic(QWEN4B, "h200")
    s = Schedule(tuple(range(0, 40000, 2000)), (512, 768, 1024, 1280, 1536, 2048, 2560, 3584, 4096,
                                                  4096, 5120, 5120, 5120, 5120, 6144, 6144, 6144,
                                                  6144, 8192, 8192))
    speedups = [cm.speedup(s.budgets_at, n, 64) for n in (2048, 8192, 32768)]
    assert 1 < speedups[0] < speedups[1] < speedups[2]


def test_unknown_hardware_is_one_sentence():
    with pytest.raises(CostError, match="unknown hardware 'b300'.*h100, h200, a100"):
        get_hardware("b300")


def test_nnls_recovers_non_negative_coefficients():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (40, 4)) * np.array([1, 10, 1e5, 1e3])
    true = np.array([0.5, 0.0, 2e-6, 3e-4])
    assert np.allclose(nnls(a, a @ true), true, rtol=1e-6, atol=1e-12)
    x = nnls(a, a @ np.array([0.5, -0.2, 2e-6, 3e-4]))
    assert (x >= 0).all()


def test_fit_recovers_a_known_cost_model():
    truth = analytic(QWEN4B, "a100")
    points = [(b, c, k, float(truth.step_seconds(b, c, k)))
              for b in (1, 8, 32) for c in (1024, 4096, 16384) for k in (0, 256, 2048)]
    fitted = fit(QWEN4B, points, "synthetic")
    assert fitted.extra["median_relative_error"] < 1e-6
    for k in FEATURES:
        assert fitted.coefficients[k] == pytest.approx(truth.coefficients[k], rel=1e-4)


def test_fit_cost_hardware_writes_the_analytic_preset(tmp_path):
    out = tmp_path / "cost.parquet"
    result = runner.invoke(app, ["fit-cost", "--model", "qwen3-4b", "--hardware", "h200", "-o", str(out)])
    assert result.exit_code == 0, result.output
    table = read_artifact(out, "cost")
    assert table.column("seconds").null_count == table.num_rows
    assert set(table.column("device").to_pylist()) == {"h200"}
    meta = artifact_metadata(out)
    assert meta["source"] == "analytic:h200" and json.loads(meta["hardware"])["name"] == "h200"
    model = load_cost(out, QWEN4B)
    assert model.coefficients == analytic(QWEN4B, "h200").coefficients
    rows = table.to_pylist()
    pred = model.step_seconds(np.array([r["batch"] for r in rows]), np.array([r["context"] for r in rows]),
                              np.array([r["budget"] or 0 for r in rows]))
    assert np.allclose(pred, [r["predicted_seconds"] for r in rows])


def test_cost_artifact_for_another_shape_is_rejected(tmp_path):
    out = tmp_path / "cost.parquet"
    runner.invoke(app, ["fit-cost", "--model", "qwen3-8b", "--hardware", "h100", "-o", str(out)])
    with pytest.raises(CostError, match="another model shape"):
        load_cost(out, QWEN4B)


@pytest.mark.parametrize("args,phrase", [
    (["--hardware", "b300"], "unknown hardware 'b300'"),
    (["--hardware", "h100", "--device", "cpu"], "pass only one"),
    (["--device", "cpu", "--budgets", "dense,100"], "not a multiple of the page size"),
    (["--device", "cpu", "--contexts", "100000"], "exceeds the model's context"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--device", "cpu", "--batches", "0,2"], "error: --batches must be positive, got 0"),
    (["--device", "cpu", "--contexts", "0,256"], "error: --contexts must be positive, got 0"),
    (["--device", "cpu", "--repeats", "0"], "error: --repeats must be at least 1, got 0"),
    (["--device", "cpu", "--warmup", "-1"], "error: --warmup must be at least 0, got -1"),
])
def test_fit_cost_bad_input(tmp_path, args, phrase):
    out = tmp_path / "cost.parquet"
    result = runner.invoke(app, ["fit-cost", "--model", "smollm2-135m", *args, "-o", str(out)])
    assert result.exit_code != 0
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and phrase in lines[0], result.output
    assert not out.exists()


def _measure_smollm2(tmp_path):
    """A small grid of real decode steps of the 30-layer SmolLM2 shape (random weights) on the CPU."""
    import torch

    threads = torch.get_num_threads()
    try:
        out = tmp_path / "cost.parquet"
        result = runner.invoke(app, ["fit-cost", "--model", "smollm2-135m", "--device", "cpu",
                                     "--batches", "1,2", "--contexts", "256,512,1024",
                                     "--budgets", "dense,128", "--repeats", "5", "--warmup", "1",
                                     "--threads", "1", "-o", str(out)])  # 1 thread: steadier
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    return out, artifact_metadata(out), result


@pytest.mark.slow  # fit-cost's CPU timing stays in the fast set through its --speculate test
def test_measured_fit_on_cpu_writes_every_point(tmp_path):
    out, meta, _ = _measure_smollm2(tmp_path)
    assert meta["source"] == "measured:cpu" and meta["points"] == 12 and meta["threads"] == 1
    assert 0 <= meta["median_relative_error"] < float("inf")
    table = read_artifact(out, "cost")
    assert table.column("seconds").null_count == 0
    model = CostModel.from_metadata(meta, str(out))
    assert all(v >= 0 for v in model.coefficients.values())


@pytest.mark.slow  # depends on timing noise: run alone (make test-slow), not beside other workers
def test_measured_fit_on_cpu_is_within_ten_percent(tmp_path):
    _, meta, result = _measure_smollm2(tmp_path)
    assert meta["median_relative_error"] <= 0.10, result.output


def test_fit_cost_speculate_times_the_verification_and_the_planner_prices_with_it(tmp_path):
    """--speculate: verification forwards timed at 2 and 5 fed tokens per sample, their coefficients in the
    artifact; the speculative planner's verification seconds are then those coefficients' (not the decode
    step's); an artifact without them keeps the derived pricing."""
    import numpy as np
    import torch

    from sparrow.stages.cost import VERIFY_FEATURES, load_cost
    from sparrow.stages.model.presets import get_preset
    from sparrow.stages.speculative_plan import verify_seconds

    threads = torch.get_num_threads()
    out = tmp_path / "cost.parquet"
    try:
        result = runner.invoke(app, ["fit-cost", "--model", "tiny-llama", "--device", "cpu",
                                     "--batches", "1,2", "--contexts", "64,128", "--budgets", "dense,48",
                                     "--repeats", "3", "--warmup", "1", "--threads", "1", "--speculate",
                                     "-o", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    assert "verification fit over 8 points" in result.output
    cfg = get_preset("tiny-llama").config
    cost = load_cost(out, cfg)
    assert set(cost.verify) == set(VERIFY_FEATURES) and all(v >= 0 for v in cost.verify.values())
    points = json.loads(artifact_metadata(out)["verify_points"])
    assert sorted({p["tokens"] for p in points}) == [2, 5] and all(p["seconds"] > 0 for p in points)
    want = sum(cost.verify[f] * x for f, x in zip(VERIFY_FEATURES, (1.0, 2 * 4, 2 * cfg.num_layers * 100)))
    assert float(verify_seconds(cost, 2, np.array(100), 3)) == pytest.approx(want)
    derived = replace(cost, verify=None)
    assert float(verify_seconds(derived, 2, np.array(100), 3)) != pytest.approx(want)


def test_fit_cost_speculate_needs_a_device(tmp_path):
    out = tmp_path / "cost.parquet"
    result = runner.invoke(app, ["fit-cost", "--model", "qwen3-4b", "--hardware", "h100", "--speculate",
                                 "-o", str(out)])
    assert result.exit_code != 0 and "--speculate times the verification forward" in result.output
    assert not out.exists()


def test_a_grid_that_cannot_determine_a_coefficient_says_which_and_what_to_add():
    """The features of a grid's points decide which coefficients a fit can pin down: one context leaves
    the per-sequence and KV terms confounded; budgets never below a context time dense points only, so
    no page is scored; a full grid determines all four; a model without sparse layers has no page term."""
    from sparrow.stages.cost import Grid, grid_problem, undetermined

    smol = get_preset("smollm2-135m").config
    probe = CostModel(smol, dict.fromkeys(FEATURES, 0.0), "probe")
    assert undetermined(probe, Grid([1, 2], [64], [48]).points()) == ["seq", "kv", "page"]
    assert grid_problem(smol, Grid([1, 2], [64], [48])) == (
        "the grid cannot determine the decode step's batch, KV token-layer and scored page-layer "
        "coefficients (other values fit its points as well): add a second context to --contexts and 'dense' "
        "to --budgets; two batch sizes, two contexts, and 'dense' with a budget below a context in --budgets "
        "always suffice")
    assert "a context above 48 to --contexts with a budget below it in --budgets;" in grid_problem(
        smol, Grid([1, 2], [32, 48], [0, 48]))
    assert grid_problem(smol, Grid([1, 2], [64, 128], [0, 256])).startswith(
        "the grid cannot determine the decode step's scored page-layer coefficient (other values fit its "
        "points as well): add a budget below 128 to --budgets; ")
    assert "add a second batch size to --batches;" in grid_problem(smol, Grid([1], [128, 256], [0, 64]))
    assert grid_problem(smol, Grid([1, 2], [64, 128], [0, 48]), speculate=True) is None
    assert grid_problem(smol, Grid([1, 2], [512], [0, 64, 128])) is None  # one context, two sparse budgets
    assert grid_problem(QWEN4B, Grid([1, 4], [1024, 2048, 4096], [0, 256, 512])) is None
    tiny = get_preset("tiny-llama").config  # two layers, both dense
    assert grid_problem(tiny, Grid([1, 2], [64, 128], [0])) is None
    assert grid_problem(tiny, Grid([1, 2], [64], [0, 48])).endswith(
        "add a second context to --contexts; two batch sizes and two contexts always suffice (this model "
        "has no sparse layer)")


def _widened(grid, problem: str):
    """`grid` with what `problem` says to add (each value an instance of what it names)."""
    from sparrow.stages.cost import Grid

    b, c, k = list(grid.batches), list(grid.contexts), list(grid.budgets)
    if "a second batch size to --batches" in problem:
        b.append(max(b) + 1)
    if "a second context to --contexts" in problem:
        c.append(max(c) + 16)
    if "'dense' to --budgets" in problem:
        k.append(0)
    if "a budget below" in problem and "a context above 48" not in problem:
        k.append(48)
    if "a context above 48 to --contexts with a budget below it" in problem:
        c, k = [*c, 64], [*k, 48]
    return Grid(b, c, k)


@pytest.mark.parametrize("preset", ["smollm2-135m", "tiny-llama"])
def test_fit_cost_refuses_exactly_the_grids_without_full_column_rank_and_says_what_suffices(preset):
    """Over every small grid: refused exactly when the planned points' feature matrix (the page column
    dropped for a model with no sparse layer), or with --speculate the verification forwards', lacks full
    column rank; and adding what the refusal names always gives a grid that is not refused."""
    import itertools

    from sparrow.stages.cost import VERIFY_TOKENS, Grid, fitted_features, grid_problem

    cfg = get_preset(preset).config
    probe = CostModel(cfg, dict.fromkeys(FEATURES, 0.0), "probe")
    columns = len(fitted_features(probe))
    subsets = lambda values: [list(x) for r in (1, 2) for x in itertools.combinations(values, r)]

    def rank(m):  # of the columns in units of their largest value (an all-zero column stays zero)
        top = np.abs(m).max(axis=0)
        return np.linalg.matrix_rank(m / np.where(top > 0, top, 1.0))

    refused = 0
    for b, c, k in itertools.product(subsets([1, 2, 4]), subsets([32, 64, 128]), subsets([0, 48, 64, 128])):
        grid = Grid(b, c, k)
        x = probe.features(*np.array(grid.points()).T)[:, :columns]
        v = probe.verify_features(*np.array([(n, m, t) for t in VERIFY_TOKENS for n in b for m in c]).T)
        full, verify_full = rank(x) == columns, rank(v) == 3
        problem = grid_problem(cfg, grid, speculate=True)
        assert (problem is None) == (full and verify_full), (grid, problem)
        if problem is not None:
            refused += 1
            assert grid_problem(cfg, _widened(grid, problem), speculate=True) is None, (grid, problem)
    assert refused > 100


@pytest.mark.parametrize("args,phrase", [
    (["--model", "smollm2-135m", "--speculate", "--batches", "1", "--contexts", "512",
      "--budgets", "dense,64"],
     "the grid cannot determine the decode step's per-step, batch, KV token-layer and scored page-layer "
     "coefficients or the verification's per-forward and KV token-layer coefficients (other values fit its "
     "points as well): add a second batch size to --batches and a second context to --contexts; "),
    (["--model", "smollm2-135m", "--batches", "1,2", "--contexts", "512", "--budgets", "dense,64"],
     "cannot determine the decode step's batch, KV token-layer and scored page-layer coefficients"),
    (["--model", "smollm2-135m", "--batches", "1,2", "--contexts", "64,128", "--budgets", "dense"],
     "cannot determine the decode step's scored page-layer coefficient (other values fit its points as "
     "well): add a budget below 128 to --budgets; "),
    (["--model", "tiny-llama", "--batches", "1,2", "--contexts", "64", "--budgets", "48"],
     "cannot determine the decode step's batch and KV token-layer coefficients"),
])
def test_fit_cost_refuses_a_grid_that_cannot_determine_a_coefficient_before_timing(tmp_path, args, phrase):
    out = tmp_path / "cost.parquet"
    result = runner.invoke(app, ["fit-cost", "--device", "cpu", *args, "--repeats", "1", "--warmup", "0",
                                 "-o", str(out)])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], result.output
    assert "timing" not in result.output and not out.exists()


def test_fit_cost_speculate_prints_and_writes_every_verification_point_with_its_prediction(tmp_path):
    """--speculate on SmolLM2: the verification forwards come as a second table after the decode steps
    (with -f json on stderr, so that stdout is one JSON document), each with its prediction, the same
    points and predictions as the artifact's
    metadata (`verify_points`, where --help says they are; the rows are decode steps); the verification
    coefficients print in ms, us and ns as the decode step's do; no fit here is exact by construction."""
    import re

    import torch

    from sparrow.stages.cost import VERIFY_FEATURES

    threads = torch.get_num_threads()
    out = tmp_path / "cost.parquet"
    try:
        result = runner.invoke(app, ["fit-cost", "--model", "smollm2-135m", "--device", "cpu", "--speculate",
                                     "--batches", "1,2", "--contexts", "64,128", "--budgets", "dense,48",
                                     "--repeats", "1", "--warmup", "0", "--threads", "1", "-f", "json",
                                     "-o", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    decode = json.loads(result.stdout)  # one document
    assert len(decode) == read_artifact(out, "cost").num_rows == 8
    meta = artifact_metadata(out)
    written = json.loads(meta["verify_points"])
    assert [(r["batch"], r["context"], r["tokens"]) for r in written] == [
        (b, c, t) for t in (2, 5) for b in (1, 2) for c in (64, 128)]
    assert "verification forward (tokens fed per sample): measured vs fitted" in result.stderr
    table = [line.split("│")[1:-1] for line in result.stderr.splitlines() if line.count("│") == 7]
    shown = [[float(x) for x in row] for row in table if row[0].strip().isdigit()]
    assert [r[:3] for r in shown] == [[r["batch"], r["context"], r["tokens"]] for r in written]
    assert [r[3] for r in shown] == pytest.approx([r["seconds"] * 1e3 for r in written], rel=1e-4)
    assert [r[4] for r in shown] == pytest.approx([r["predicted_seconds"] * 1e3 for r in written], rel=1e-4)
    cost = CostModel.from_metadata(meta, str(out))
    coefficients = np.array([cost.verify[k] for k in VERIFY_FEATURES])
    want = [cost.verify_features(r["batch"], r["context"], r["tokens"]) @ coefficients for r in written]
    assert [r["predicted_seconds"] for r in written] == pytest.approx(want)
    unit = r"\d[\d.]* (s|ms|us|ns)"
    assert re.search(rf"^verification: forward {unit} \+ fed token x {unit} \+ KV token-layer x {unit}$",
                     result.stderr, re.M), result.stderr
    assert "verification fit over 8 points" in result.stderr and "by construction" not in result.stderr
    shown = " ".join(runner.invoke(app, ["fit-cost", "--help"], env={"COLUMNS": "500"}).stdout.split())
    assert "written to the artifact's metadata (verify_points)" in shown


def test_a_fit_without_spare_points_says_its_error_is_zero_by_construction(capsys):
    """As many independent points as coefficients: the fit passes through each of them, and fit-cost's
    summary says that its 0% error measures nothing; one more point gives a real error and no such note."""
    from sparrow.cli.cost import print_fit_quality
    from sparrow.stages.cost import fit, fit_verify

    truth = analytic(QWEN4B, "h100")
    points = [(1, 1024, 0), (4, 1024, 0), (1, 4096, 0), (1, 4096, 1024), (4, 4096, 1024)]
    timed = [(b, c, k, float(truth.step_seconds(b, c, k)) * (1.1 if i == 4 else 1.0))
             for i, (b, c, k) in enumerate(points)]
    forwards = [(1, 1024, 2), (1, 1024, 5), (2, 4096, 2)]
    seconds = truth.verify_features(*np.array(forwards).T) @ np.array([1e-3, 1e-5, 1e-9])
    exact = fit_verify(fit(QWEN4B, timed[:4], "synthetic"), [(*f, s) for f, s in zip(forwards, seconds)])
    assert exact.extra["max_relative_error"] < 1e-9 and exact.extra["verify_max_relative_error"] < 1e-9
    assert exact.extra["spare_points"] == 0 and exact.extra["verify_spare_points"] == 0
    print_fit_quality(exact, "fit", 4, "")
    print_fit_quality(exact, "verification fit", 3, "verify_")
    said = capsys.readouterr().err
    assert said.count("this error is 0 by construction") == 2, said
    spare = fit(QWEN4B, timed, "synthetic")
    assert spare.extra["spare_points"] == 1 and spare.extra["max_relative_error"] > 0.01
    print_fit_quality(spare, "fit", 5, "")
    assert "by construction" not in capsys.readouterr().err


def test_plan_schedule_warns_once_when_it_prices_far_outside_the_fitted_grid(tmp_path):
    """A measured model fitted at batches 1-2 and contexts 128-256 (its decode steps exact for qwen3-4b's
    analytic model, so nothing but the range differs) plans the reference profile's 32,768 tokens at
    batch 64: one warning naming the fitted range; a fit over the planned range, and an analytic model,
    give none. A fit at one batch size (which fit-cost now refuses to make) is said to be a guess."""
    from sparrow.stages.cost import write_fitted

    truth = analytic(QWEN4B, "h100")

    def fitted(name, batches, contexts):
        points = [(b, c, k, float(truth.step_seconds(b, c, k))) for b in batches for c in contexts
                  for k in (0, 64, 2048)]
        write_fitted(QWEN4B, "qwen3-4b", points, "cpu", 1, tmp_path / name)
        return tmp_path / name

    def warnings(*args):
        result = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", *map(str, args)])
        assert result.exit_code == 0, result.output
        return [line for line in result.stderr.splitlines() if line.startswith("warning: ")]

    narrow = fitted("narrow.parquet", (1, 2), (128, 256))
    assert warnings("--cost", narrow) == [
        f"warning: the cost model {narrow} was fitted at batch 1-2 and contexts 128-256; this plan predicts "
        "at batch 64 and contexts up to 32767, far outside that grid, so its step times and speedup "
        "extrapolate the fit"]
    single = fitted("single.parquet", (32,), (1024, 8192, 32768))
    assert warnings("--cost", single) == [
        f"warning: the cost model {single} was fitted from points that cannot determine the decode step's "
        "per-step and batch coefficients, so its predictions away from those points are guesses; refit it "
        "with sparrow fit-cost over two batch sizes and two contexts"]
    assert warnings("--cost", fitted("wide.parquet", (32, 64), (1024, 8192, 32768))) == []
    assert warnings("--hardware", "h100") == []


@pytest.mark.parametrize("fmt", ["json", "csv", "tsv"])
def test_fit_cost_hardware_prints_its_predictions_on_stdout(tmp_path, fmt):
    """An analytic preset's points, each with its prediction, go to stdout in --format as a measured fit's
    do; stdout is never empty."""
    import csv

    out = tmp_path / "cost.parquet"
    result = runner.invoke(app, ["fit-cost", "--model", "qwen3-4b", "--hardware", "h100", "-o", str(out),
                                 "-f", fmt])
    assert result.exit_code == 0, result.output
    table = read_artifact(out, "cost").to_pylist()
    if fmt == "json":
        rows = json.loads(result.stdout)
        assert [(r["batch"], r["context"], r["budget"]) for r in rows] == [
            (r["batch"], r["context"], r["budget"]) for r in table]
        predicted = [r["predicted_seconds"] * 1e3 for r in table]
        assert [r["predicted_ms"] for r in rows] == pytest.approx(predicted)
        return
    rows = list(csv.reader(result.stdout.splitlines(), delimiter="," if fmt == "csv" else "\t"))
    assert rows[0] == ["batch", "context", "budget", "predicted_ms"] and len(rows) == len(table) + 1
    assert {r[2] for r in rows[1:]} == {"dense", "512", "2048", "4096"}


def test_durations_print_in_the_unit_that_keeps_them_readable():
    from sparrow.cli.cost import duration

    assert [duration(x) for x in (0.4342, 0.2032, 2.5e-4, 1.076e-5, 3.3e-8, 0.0, 2.0)] == [
        "434.2 ms", "203.2 ms", "250 us", "10.76 us", "33 ns", "0 s", "2 s"]


def test_a_fit_that_misses_its_points_is_warned_about(capsys):
    """Timings a linear form cannot follow (as a busy machine gives them): the summary says the fit's
    predictions are not to be trusted and what to do; a fit within a few percent says nothing."""
    from sparrow.cli.cost import print_fit_quality
    from sparrow.stages.cost import fit

    truth = analytic(QWEN4B, "h100")
    points = [(b, c, k) for b in (1, 4) for c in (1024, 4096) for k in (0, 512)]
    rng = np.random.default_rng(0)
    noisy = [(b, c, k, float(rng.uniform(1e-3, 1.0))) for b, c, k in points]  # nothing of the features
    print_fit_quality(fit(QWEN4B, noisy, "synthetic"), "fit", len(points), "")
    said = " ".join(capsys.readouterr().err.split())
    assert "warning: the fit misses its points by a median" in said and "more --repeats" in said
    clean = [(b, c, k, float(truth.step_seconds(b, c, k)) * (1 + 0.01 * (i % 3))) for i, (b, c, k) in
             enumerate(points)]
    print_fit_quality(fit(QWEN4B, clean, "synthetic"), "fit", len(points), "")
    assert "warning" not in capsys.readouterr().err
