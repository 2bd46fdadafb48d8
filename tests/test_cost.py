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
    assert sorted({p[2] for p in points}) == [2, 5] and all(p[3] > 0 for p in points)
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


def test_a_grid_that_cannot_determine_a_coefficient_says_which_and_why():
    """The features of a grid's points decide which coefficients a fit can pin down: one context leaves
    the per-sequence and KV terms confounded; budgets never below a context time dense points only, so
    no page is scored; a full grid determines all four."""
    from sparrow.stages.cost import Grid, grid_warning, undetermined

    smol = get_preset("smollm2-135m").config
    probe = CostModel(smol, dict.fromkeys(FEATURES, 0.0), "probe")
    assert undetermined(probe, Grid([1, 2], [64], [48]).points()) == ["seq", "kv", "page"]
    assert grid_warning(smol, Grid([1, 2], [64], [48])).startswith(
        "the grid cannot determine the batch, KV token-layer and scored page-layer coefficients (one context "
        "(64); no dense point): ")
    assert grid_warning(smol, Grid([1, 2], [64, 128], [0, 256])).startswith(
        "the grid cannot determine the scored page-layer coefficient (budget 256 is never below a context, "
        "so those points are dense): ")
    assert "one batch size (1)" in grid_warning(smol, Grid([1], [128, 256], [0, 64]))
    assert grid_warning(smol, Grid([1, 2], [64, 128], [0, 48])) is None
    assert grid_warning(QWEN4B, Grid([1, 4], [1024, 2048, 4096], [0, 256, 512])) is None


def test_fit_cost_warns_before_timing_a_grid_that_cannot_determine_a_coefficient(tmp_path):
    import torch

    threads = torch.get_num_threads()
    out = tmp_path / "cost.parquet"
    try:
        result = runner.invoke(app, ["fit-cost", "--model", "tiny-llama", "--device", "cpu",
                                     "--batches", "1,2", "--contexts", "64", "--budgets", "48",
                                     "--repeats", "1", "--warmup", "0", "--threads", "1", "-o", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and warned[0].startswith("warning: the grid cannot determine the batch and KV "
                                                     "token-layer coefficients (one context (64)): ")
    assert result.stderr.index("warning: ") < result.stderr.index("fit over 2 points")


def test_plan_schedule_warns_once_when_it_prices_far_outside_the_fitted_grid(tmp_path):
    """A measured model fitted at batch 1 and contexts 128-256 (its decode steps exact for qwen3-4b's
    analytic model, so nothing but the range differs) plans the reference profile's 32,768 tokens at
    batch 64: one warning naming the fitted range; a fit over the planned range, and an analytic model,
    give none."""
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

    narrow = fitted("narrow.parquet", (1,), (128, 256))
    assert warnings("--cost", narrow) == [
        f"warning: the cost model {narrow} was fitted at batch 1 and contexts 128-256; this plan predicts at "
        "batch 64 and contexts up to 32767, far outside that grid, so its step times and speedup "
        "extrapolate the fit"]
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
