"""Collapse detectors, run tails and the threshold, on metric tables written to mimic real runs."""

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.calibrate import run_tail
from sparrow.stages.core.schedule import Schedule
from sparrow.stages.train.detectors import collapse_reasons

runner = CliRunner()
BUDGETS = (64, 128, 256, 512)


def synthetic_mismatch(rng):
    """Tokens in 4 bins of 512; alpha's spread shrinks with the budget and grows with the bin."""
    rows = {k: [] for k in ("prompt_id", "sample", "position", "bin", "budget", "token_id", "alpha",
                            "logp_dense", "logp_sparse", "log_ratio", "k1", "k2", "k3",
                            "entropy_dense")}
    positions = rng.integers(0, 2048, 4000)
    for budget in BUDGETS:
        spread = 0.4 * (64 / budget) * (1 + positions / 2048)
        alpha = np.clip(1 - rng.beta(0.5, 4, len(positions)) * spread, 0, 1)
        n = len(positions)
        rows["prompt_id"] += ["p"] * n
        for k, v in [("sample", np.zeros(n, int)), ("position", positions), ("bin", positions // 512),
                     ("budget", np.full(n, budget)), ("token_id", np.ones(n, int)), ("alpha", alpha),
                     ("logp_dense", -np.ones(n)), ("logp_sparse", -np.ones(n)),
                     ("log_ratio", np.zeros(n)), ("k1", np.zeros(n)), ("k2", np.zeros(n)),
                     ("k3", np.zeros(n)), ("entropy_dense", np.ones(n))]:
            rows[k] += v.tolist()
    return rows


def metrics(steps=60, collapse_at=None, kind="reward"):
    step = np.arange(steps)
    reward = np.minimum(0.2 + step * 0.01, 0.6)
    grad = np.full(steps, 1.0)
    kl = np.full(steps, 0.001)
    entropy = np.full(steps, 0.5)
    truncation = np.full(steps, 1.0 if kind == "capped" else 0.1)  # capped: every sample hits the cap
    repetition = np.zeros(steps)
    if collapse_at is not None:
        after = step >= collapse_at
        if kind == "reward":
            reward = np.where(after, 0.05, reward)
        elif kind == "grad":
            grad = np.where(step == collapse_at, 500.0, grad)
        elif kind == "kl":
            kl = np.where(after, 0.3, kl)
        elif kind == "entropy":
            entropy = np.where(after, 4.0, entropy)
        elif kind == "truncation":
            truncation = np.where(after, 0.9, truncation)
        elif kind == "repetition":
            repetition = np.where(after, 0.8, repetition)
    return {"run_id": ["r"] * steps, "step": step, "reward_mean": reward, "grad_norm": grad,
            "mismatch_kl": kl, "entropy": entropy, "truncation_rate": truncation,
            "repetition_rate": repetition, "reward_std": [None] * steps}


@pytest.mark.parametrize("kind,word", [("reward", "reward"), ("grad", "gradient"),
                                       ("entropy", "entropy"), ("truncation", "truncation rate rose"),
                                       ("repetition", "repetition rate rose")])
def test_detectors_fire_on_their_collapse(tmp_path, kind, word):
    import pyarrow as pa

    assert collapse_reasons(pa.table(metrics())) == []
    reasons = collapse_reasons(pa.table(metrics(collapse_at=40, kind=kind)))
    assert len(reasons) >= 1 and any(word in r for r in reasons)


def test_mismatch_kl_is_a_warning_never_a_collapse_reason():
    """DESIGN: the threshold is fitted to the labels, so mismatch must not make them."""
    import pyarrow as pa

    from sparrow.stages.train.detectors import mismatch_warnings

    table = pa.table(metrics(collapse_at=40, kind="kl"))  # KL 0.3 from step 40 on: 6x the warning level
    assert collapse_reasons(table) == []
    assert [w.split(" (")[0] for w in mismatch_warnings(table)] == ["mismatch KL reached 0.3"]
    assert mismatch_warnings(pa.table(metrics())) == []


def test_a_rate_high_from_the_start_is_no_surge():
    """Every sample truncated by a tight --max-new-tokens from step 0 on is not a collapse."""
    import pyarrow as pa

    assert collapse_reasons(pa.table(metrics(kind="capped"))) == []


def test_run_tail_brute_force():
    import pyarrow as pa

    rng = np.random.default_rng(0)
    t = pa.table(synthetic_mismatch(rng))
    sched = Schedule((0, 1024), (128, 512))
    got, notes = run_tail(t, sched)
    d = t.to_pandas()
    want_budget = np.where(d.position < 1024, 128, 512)
    kept = d[d.budget == want_budget]
    expected = min(np.percentile(g.alpha, 5) for _, g in kept.groupby("bin"))
    assert got == pytest.approx(expected)
    assert notes == []


def _run_dir(tmp_path, name, budgets, collapse):
    d = tmp_path / name
    write_artifact(metrics(collapse_at=30 if collapse else None), d / "metrics.parquet", "metrics")
    write_artifact({"bin": [0, 1], "bin_start": [0, 1024], "bin_end": [1024, None],
                    "budget": list(budgets), "tail": [None, None],
                    "predicted_step_seconds": [None, None]}, d / "schedule.parquet", "schedule")
    return d


def test_calibrated_threshold_separates_runs(tmp_path):
    rng = np.random.default_rng(1)
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(rng), prof, "mismatch")
    runs = [_run_dir(tmp_path, "aggressive", (64, 64), True),
            _run_dir(tmp_path, "medium", (64, 128), True),
            _run_dir(tmp_path, "safe", (256, 512), False),
            _run_dir(tmp_path, "safest", (512, 512), False)]
    out = tmp_path / "threshold.parquet"
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o", str(out),
                            *sum((["--runs", str(d)] for d in runs), [])])
    assert r.exit_code == 0, r.output
    row = read_artifact(out, "threshold").to_pylist()[0]
    import pyarrow as pa

    mm = read_artifact(prof, "mismatch")
    tails = [run_tail(mm, Schedule((0, 1024), b))[0] for b in [(64, 64), (64, 128), (256, 512),
                                                                (512, 512)]]
    assert row["source"] == "calibrated" and row["n_collapsed"] == 2
    assert row["threshold"] == pytest.approx((max(tails[:2]) + min(tails[2:])) / 2)
    assert max(tails[:2]) <= row["lower"] <= row["threshold"] <= row["upper"] <= min(tails[2:])
    assert isinstance(mm, pa.Table)


def test_prior_without_runs_or_without_separation(tmp_path):
    rng = np.random.default_rng(2)
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(rng), prof, "mismatch")
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o", str(out)])
    assert r.exit_code == 0, r.output
    row = read_artifact(out, "threshold").to_pylist()[0]
    assert row["source"] == "prior" and row["threshold"] == 0.86
    runs = [_run_dir(tmp_path, "a", (64, 64), False), _run_dir(tmp_path, "b", (512, 512), True)]
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o", str(out),
                            "--runs", str(runs[0]), "--runs", str(runs[1])])
    assert r.exit_code == 0, r.output
    row = read_artifact(out, "threshold").to_pylist()[0]
    assert row["source"] == "prior" and "overlap" in row["note"]


def test_bad_run_dir(tmp_path):
    rng = np.random.default_rng(3)
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(rng), prof, "mismatch")
    (tmp_path / "empty-run").mkdir()
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o",
                            str(tmp_path / "t.parquet"), "--runs", str(tmp_path / "empty-run")])
    assert r.exit_code != 0 and "exactly one metrics" in r.output
    assert not (tmp_path / "t.parquet").exists()
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o", str(tmp_path / "t.parquet"),
                            "--bootstrap", "0"])
    assert r.exit_code == 2 and "--bootstrap must be from 1 to 100,000" in r.output
    assert not (tmp_path / "t.parquet").exists()


def test_an_empty_path_is_refused_as_one(tmp_path, monkeypatch):
    """'' as a run (or as the profile) would be the working directory, whose files would be named
    instead; it is refused as an empty path, before any work."""
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(np.random.default_rng(3)), prof, "mismatch")
    (tmp_path / "empty.parquet").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "t.parquet"
    run = _run_dir(tmp_path, "a", (64, 64), False)
    for runs in (["--runs", ""], ["--runs", str(run), ""]):
        line = _one_error_line(runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o",
                                                   str(out), *runs]))
        assert line == "error: --runs has an empty path; give run directories"
    line = _one_error_line(runner.invoke(app, ["calibrate-threshold", "--profile", "", "-o", str(out)]))
    assert line == "error: --profile is an empty path; give a file (- = stdin)"
    assert not out.exists()


def test_a_run_with_a_schedule_of_no_bins_is_refused_naming_it(tmp_path):
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(np.random.default_rng(4)), prof, "mismatch")
    run = _run_dir(tmp_path, "a", (64, 64), False)
    write_artifact({"bin": [], "bin_start": [], "bin_end": [], "budget": [], "tail": [],
                    "predicted_step_seconds": []}, run / "schedule.parquet", "schedule")
    line = _one_error_line(runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o",
                                               str(tmp_path / "t.parquet"), "--runs", str(run)]))
    assert line.startswith(f"error: {run / 'schedule.parquet'} is a schedule with no bins")


def test_a_profile_that_scores_other_tokens_at_each_budget_is_one_sentence(tmp_path):
    prof = tmp_path / "mismatch.parquet"
    rows = read_artifact(write_artifact(synthetic_mismatch(np.random.default_rng(4)), prof, "mismatch"))
    write_artifact(rows.slice(1), prof, "mismatch")  # a token scored at one budget short of the others
    line = _one_error_line(runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o",
                                               str(tmp_path / "t.parquet"),
                                               "--runs", str(_run_dir(tmp_path, "a", (64, 64), False))]))
    assert line == f"error: {prof}: the mismatch profile does not score the same tokens at every budget"
    assert not (tmp_path / "t.parquet").exists()


def _trace(reward_end: float, evals: tuple[float, float], steps: int = 16) -> dict:
    """A healthy-looking run of its own (no detector of its own curves fires) whose reward climbs
    linearly to `reward_end` from 0.05, with eval accuracy evals[0] at step 0 and evals[1] at the end."""
    step = np.arange(steps)
    reward = 0.05 + (reward_end - 0.05) * step / (steps - 1)
    eval_acc = [evals[0]] + [None] * (steps - 2) + [evals[1]]
    return {"run_id": ["r"] * steps, "step": step, "reward_mean": reward, "grad_norm": np.ones(steps),
            "mismatch_kl": np.full(steps, 0.3), "entropy": np.full(steps, 0.5),
            "eval_accuracy": eval_acc}


def _config_run(tmp_path, name, sparsity, seed, trace, budgets=(512, 512), meta=None):
    import json

    d = tmp_path / name
    config = {"model": "m", "lr": 2e-4, "seed": seed, "sparsity": sparsity, "correction": "tis",
              "prompts_sha256": "abc", "steps": 16}
    write_artifact(trace, d / "metrics.parquet", "metrics",
                   metadata={"config": json.dumps(config), **(meta or {})})
    write_artifact({"bin": [0, 1], "bin_start": [0, 1024], "bin_end": [1024, None],
                    "budget": [None, None] if sparsity == "dense" else list(budgets), "tail": [None, None],
                    "predicted_step_seconds": [None, None]}, d / "schedule.parquet", "schedule")
    return d


def test_reference_rule_from_its_definition():
    """Collapsed when the final smoothed reward (mean of the last `window` steps) plus the step-0 sampler
    gap, or the last eval accuracy, is below the dense reference's by more than max(floor, range of the
    dense finals over seeds); without a step-0 gap the reward is not compared."""
    import pyarrow as pa

    from sparrow.stages.calibrate import Detectors, reference_reasons

    det = Detectors()
    dense = [pa.table(_trace(0.9, (0.6, 0.8))), pa.table(_trace(0.7, (0.6, 0.65)))]
    final = lambda end: np.mean((0.05 + (end - 0.05) * np.arange(16) / 15)[-det.window:])
    spread = final(0.9) - final(0.7)
    assert spread > det.reward_margin  # so the seed spread, not the floor, sets the margin
    # within the spread: healthy; just beyond it: the reward reason, and nothing about eval (0.65 vs 0.8)
    within = reference_reasons(pa.table(_trace(0.75, (0.6, 0.75))), dense[0], dense, 0, det, 0.0)
    assert within == []
    beyond = reference_reasons(pa.table(_trace(0.1, (0.6, 0.75))), dense[0], dense, 0, det, 0.0)
    assert len(beyond) == 1 and beyond[0].startswith("reward") and "seed spread" in beyond[0]
    # the same deficit, all of it there at step 0 (the sampler's, not training's): no reason
    gap = final(0.9) - final(0.1)
    assert reference_reasons(pa.table(_trace(0.1, (0.6, 0.75))), dense[0], dense, 0, det, gap) == []
    assert reference_reasons(pa.table(_trace(0.1, (0.6, 0.75))), dense[0], dense, 0, det, None) == []
    # eval: 0.8 - 0.55 = 0.25 > max(0.1, spread of 0.8 and 0.65 = 0.15)
    worse_eval = reference_reasons(pa.table(_trace(0.9, (0.6, 0.55))), dense[0], dense, 0, det, 0.0)
    assert len(worse_eval) == 1 and worse_eval[0].startswith("eval accuracy")
    # one dense run: the floor alone
    close, far = pa.table(_trace(0.9 - 0.09, (0.6, 0.75))), pa.table(_trace(0.9 - 0.2, (0.6, 0.75)))
    assert reference_reasons(close, dense[0], dense[:1], 0, det, 0.0) == []
    assert reference_reasons(far, dense[0], dense[:1], 0, det, 0.0) != []


def test_dense_eval_below_its_own_start_is_a_collapse():
    import pyarrow as pa

    trace = pa.table(_trace(0.8, (0.6, 0.55)))  # eval 0.55 at the end
    assert collapse_reasons(trace) == []  # no step-0 eval given: the rule cannot apply
    assert collapse_reasons(trace, start_eval=0.6) == []  # within the 0.1 margin
    reasons = collapse_reasons(trace, start_eval=0.7)
    assert len(reasons) == 1 and "fell from 0.700 at step 0 to 0.550" in reasons[0]


def test_a_sampler_gap_present_at_step_0_never_labels_a_run(tmp_path):
    """A sparse run whose reward trails dense by what its sampler already lost at step 0 (the same policy,
    scored by both samplers before any update) is stable; one whose deficit grew beyond it by more than
    the margin is collapsed by the reward rule, and says so."""
    from sparrow.stages.calibrate import Detectors, load_runs
    from sparrow.stages.train.detectors import InitialEval

    rng = np.random.default_rng(7)
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(rng), prof, "mismatch")
    start = InitialEval(accuracy=0.6, accuracy_sparse=0.3, reward=0.5, reward_sparse=0.2)  # gap 0.3
    dense = _config_run(tmp_path, "dense-0", "dense", 0, _trace(0.9, (0.6, 0.8)),
                        meta=InitialEval(0.6, None, 0.5).metadata())
    kept = _config_run(tmp_path, "kept-gap", "budget:64", 0, _trace(0.6, (0.6, 0.8)), (64, 64),
                       meta=start.metadata())
    grew = _config_run(tmp_path, "grew", "budget:64", 0, _trace(0.4, (0.6, 0.8)), (64, 64),
                       meta=start.metadata())
    runs = load_runs([dense, kept, grew], read_artifact(prof, "mismatch"), 0.05, Detectors())
    by = {Path(r.name).name: r for r in runs}
    assert not by["kept-gap"].collapsed and by["kept-gap"].sampler_gap == pytest.approx(0.3)
    assert by["grew"].collapsed and by["grew"].reasons[0].startswith("reward")
    assert "step-0 sampler gap 0.300" in by["grew"].reasons[0]
    assert by["kept-gap"].eval_change == pytest.approx(0.2)
    final = lambda end: np.mean((0.05 + (end - 0.05) * np.arange(16) / 15)[-Detectors().window:])
    assert by["kept-gap"].reward_gap == pytest.approx(final(0.9) - final(0.6))


def test_profile_tokens_from_the_definition():
    """Each token's alpha at a schedule is its profiled alpha at the largest profiled budget not above the
    scheduled one (1 where dense); the KV read is min(1, budget / position); a bootstrap draw takes whole
    prompts with replacement and tokens within each."""
    import pyarrow as pa

    from sparrow.stages.calibrate import ProfileTokens

    rows = synthetic_mismatch(np.random.default_rng(8))
    n = len(rows["alpha"]) // len(BUDGETS)
    rows["prompt_id"] = [f"p{i % 7}" for i in range(n)] * len(BUDGETS)
    tokens = ProfileTokens.from_table(pa.table(rows))
    d = pa.table(rows).to_pandas()
    schedule = Schedule((0, 1024), (100, 0))  # 100 is not profiled: 64's alpha; the second bin dense
    alpha, kv, notes = tokens.at(schedule)
    want = d[d.budget == 64].sort_values(["prompt_id", "sample", "position"])
    expect_alpha = np.where(want.position < 1024, want.alpha, 1.0)
    expect_kv = np.where(want.position < 1024, np.minimum(1, 100 / np.maximum(want.position, 1)), 1.0)
    assert np.allclose(alpha, expect_alpha) and np.allclose(kv, expect_kv)
    assert notes and "not profiled" in notes[0]
    sizes = np.bincount(tokens.prompt)
    for seed in range(5):
        idx = tokens.resample(np.random.default_rng(seed))
        counts = np.bincount(tokens.prompt[idx], minlength=len(sizes))
        assert np.all(counts % sizes == 0)  # every drawn prompt brings as many tokens as it has


def test_runs_are_judged_against_the_dense_run_of_their_seed(tmp_path):
    """A sparse run that learns nothing while its dense reference learns is collapsed though its own
    curves are flat; the mismatch KL (0.3 in every trace, 6x the warning level) stays a warning; the
    threshold falls in the gap of the tails; the mean of alpha is reported beside it."""
    from sparrow.stages.calibrate import Detectors, calibrate, load_runs

    rng = np.random.default_rng(4)
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(rng), prof, "mismatch")
    mm = read_artifact(prof, "mismatch")
    runs = []
    for seed in (0, 1):
        runs.append(_config_run(tmp_path, f"dense-{seed}", "dense", seed,
                                _trace(0.9 - 0.05 * seed, (0.6, 0.8))))
        runs.append(_config_run(tmp_path, f"low-{seed}", "budget:64", seed, _trace(0.1, (0.6, 0.5)),
                                (64, 64)))
        runs.append(_config_run(tmp_path, f"high-{seed}", "budget:512", seed, _trace(0.88, (0.6, 0.8)),
                                (256, 512)))
    results = load_runs(runs, mm, 0.05, Detectors())
    by = {r.name.rsplit("/", 1)[-1]: r for r in results}
    import pyarrow as pa

    assert collapse_reasons(pa.table(_trace(0.1, (0.6, 0.5)))) == []  # its own curves say nothing
    assert by["low-0"].collapsed and by["low-0"].reference.endswith("dense-0")
    assert by["low-1"].reference.endswith("dense-1")
    assert not by["high-0"].collapsed and not by["dense-0"].collapsed
    assert all(r.warnings for r in results)  # mismatch KL: warned, never a label
    from sparrow.stages.calibrate import ProfileTokens

    assert calibrate(results, n_boot=200).lower is None  # no profile to resample: no interval
    cal = calibrate(results, n_boot=200, tokens=ProfileTokens.from_table(mm))
    assert cal.source == "calibrated"
    lo, hi = max(by[f"low-{s}"].tail for s in (0, 1)), min(by[f"high-{s}"].tail for s in (0, 1))
    assert cal.separations[0].identified == (lo, hi)
    assert lo < cal.lower < cal.upper < hi  # the draws move the tails, within the gap here
    assert cal.separations[0].separating_share == 1.0
    assert cal.threshold == pytest.approx((lo + hi) / 2)
    assert cal.mean_threshold is not None and cal.mean_note.startswith("mean alpha: boundary ")


def test_the_mean_that_overlaps_is_reported_as_not_separating():
    """Tails separate but means overlap: the threshold comes from the tails, the note says the mean
    does not separate (the paper's claim, on synthetic runs)."""
    from sparrow.stages.calibrate import RunResult, calibrate

    runs = [RunResult("c1", 0.40, ["x"], mean=0.97), RunResult("c2", 0.45, ["x"], mean=0.90),
            RunResult("s1", 0.70, [], mean=0.93), RunResult("s2", 0.80, [], mean=0.99)]
    cal = calibrate(runs, n_boot=200)
    assert cal.source == "calibrated" and cal.threshold == pytest.approx(0.575)
    assert cal.mean_threshold is None
    assert cal.mean_note == ("mean alpha: no separation, collapsed runs up to 0.9700 overlap stable runs "
                             "from 0.9300")


def test_shipped_calibration_is_the_fallback_for_its_model(tmp_path, monkeypatch):
    """Without separating runs, a profile of a model that ships a calibration gets it, provenance and
    all; another model gets the published prior."""
    from sparrow.schemas import artifact_metadata

    _ship(tmp_path, monkeypatch, 0.45)
    rng = np.random.default_rng(5)
    for model, source in (("smollm2-135m", "calibrated"), ("other-model", "prior")):
        prof = tmp_path / f"{model}.parquet"
        write_artifact(synthetic_mismatch(rng), prof, "mismatch", metadata={"model": model})
        out = tmp_path / f"t-{model}.parquet"
        r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o", str(out)])
        assert r.exit_code == 0, r.output
        row = read_artifact(out, "threshold").to_pylist()[0]
        assert row["source"] == source
        if source == "calibrated":
            assert (row["threshold"], row["lower"], row["upper"]) == pytest.approx((0.45, 0.35, 0.55))
            assert artifact_metadata(out)["provenance"] == "a test sweep"
            assert "shipped calibration" in row["note"] and "no runs given" in row["note"]
        else:
            assert row["threshold"] == 0.86


def test_cli_labels_against_dense_and_report_draws_the_calibration(tmp_path):
    """As a user: calibrate-threshold over a sweep folder prints the mean's verdict beside the threshold,
    records each run's tail, mean and reference, and `sparrow report` draws them against the outcome."""
    import json

    from sparrow.schemas import artifact_metadata

    rng = np.random.default_rng(6)
    sweep = tmp_path / "sweep"
    prof = sweep / "mismatch.parquet"
    write_artifact(synthetic_mismatch(rng), prof, "mismatch")
    runs = []
    for seed in (0, 1):
        runs.append(_config_run(sweep, f"dense-{seed}", "dense", seed, _trace(0.9, (0.6, 0.8))))
        runs.append(_config_run(sweep, f"low-{seed}", "budget:64", seed, _trace(0.1, (0.6, 0.5)), (64, 64)))
        runs.append(_config_run(sweep, f"high-{seed}", "budget:512", seed, _trace(0.88, (0.6, 0.8)),
                                (256, 512)))
    out = sweep / "threshold.parquet"
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o", str(out), "--format", "tsv",
                            "--runs", *map(str, runs)])
    assert r.exit_code == 0, r.output
    assert "(calibrated)" in r.output and "\nmean alpha: " in r.output
    assert "identified set [" in r.output and "95% interval" in r.output and "KV read" in r.output
    # the low runs' eval is 0.3 under dense's: collapsed at every margin up to 0.2
    for margin in ("0.05", "0.1", "0.15", "0.2"):
        assert f"margin {margin}: 2 of 6 runs collapsed; tails: identified set [" in r.output
    meta = artifact_metadata(out)
    assert [s["what"] for s in json.loads(meta["separations"])] == ["tails", "mean alpha", "KV read"]
    assert len(json.loads(meta["margin_sensitivity"])) == 4
    per_run = {Path(x["run"]).name: x for x in json.loads(artifact_metadata(out)["runs"])}
    assert per_run["low-0"]["collapsed"] and "dense run" in per_run["low-0"]["reasons"][0]
    assert per_run["low-0"]["reference"].endswith("dense-0") and 0 < per_run["low-0"]["mean"] <= 1
    r = runner.invoke(app, ["report", str(sweep)])
    assert r.exit_code == 0, r.output
    assert (sweep / "report" / "calibration.png").stat().st_size > 10_000
    assert "tail and mean alpha against their outcome" in (sweep / "report" / "index.html").read_text()


def _ship(tmp_path, monkeypatch, threshold=0.5):
    """A calibration shipped for smollm2-135m, in a stand-in for the package's data folder."""
    import sparrow.stages.calibrate as calibrate

    monkeypatch.setattr(calibrate, "SHIPPED", tmp_path / "shipped")
    write_artifact({"threshold": [threshold], "lower": [threshold - 0.1], "upper": [threshold + 0.1],
                    "quantile": [0.05], "source": ["calibrated"], "n_runs": [6], "n_collapsed": [2],
                    "note": ["sweep"]}, tmp_path / "shipped" / "threshold-smollm2-135m.parquet", "threshold",
                   metadata={"model": "smollm2-135m", "provenance": "a test sweep"})


def test_plan_schedule_defaults_to_the_calibration_shipped_for_the_model(tmp_path, monkeypatch):
    """No --threshold: the model's shipped calibration (said in the output and the metadata); a given
    threshold wins; a model without one gets the published prior."""
    from sparrow.schemas import artifact_metadata

    _ship(tmp_path, monkeypatch)
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(np.random.default_rng(7)), prof, "mismatch",
                   metadata={"model": "smollm2-135m"})
    for extra, model, want in (([], "smollm2-135m", 0.5), (["--threshold", "0.86"], "smollm2-135m", 0.86),
                               (["--allow-model-mismatch"], "qwen3-0.6b", 0.86)):
        out = tmp_path / f"s-{model}-{len(extra)}.parquet"
        r = runner.invoke(app, ["plan-schedule", "--model", model, "--profile", str(prof), "-o", str(out),
                                *extra])
        assert r.exit_code == 0, r.output
        meta = artifact_metadata(out)
        assert float(meta["threshold"]) == want
        assert ("shipped calibration for smollm2-135m (a test sweep)" in meta["threshold_source"]) == (
            want == 0.5)


def test_profile_summary_marks_the_shipped_threshold(monkeypatch, tmp_path):
    import sparrow.stages.calibrate as calibrate
    from sparrow.cli.errors import UsageError
    from sparrow.cli.options import default_threshold

    monkeypatch.setattr(calibrate, "SHIPPED", tmp_path / "nothing")
    assert default_threshold(None, "smollm2-135m", 0.05).value == 0.86
    _ship(tmp_path, monkeypatch, 0.4)
    assert default_threshold(None, "smollm2-135m", 0.05).value == 0.4
    assert default_threshold(0.7, "smollm2-135m", 0.05).value == 0.7
    with pytest.raises(UsageError, match="0.05 quantile of alpha, not on the 0.1 quantile"):
        default_threshold(None, "smollm2-135m", 0.1)  # shipped at another quantile, and no prior at 0.1
    assert default_threshold(None, "/some/checkpoint/smollm2-135m", 0.05).value == 0.86  # not the preset


def test_entropy_factor_reaches_the_entropy_detector(tmp_path):
    """--entropy-factor once landed in the surge constant (positional Detectors)."""
    import json

    rng = np.random.default_rng(8)
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(rng), prof, "mismatch")
    run = _run_dir(tmp_path, "hot", (512, 512), False)
    write_artifact(metrics(collapse_at=30, kind="entropy"), run / "metrics.parquet", "metrics")  # 0.5 -> 4
    for factor, collapsed in (("3", True), ("10", False)):
        out = tmp_path / f"t{factor}.parquet"
        r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o", str(out),
                                "--runs", str(run), "--entropy-factor", factor])
        assert r.exit_code == 0, r.output
        from sparrow.schemas import artifact_metadata

        assert json.loads(artifact_metadata(out)["runs"])[0]["collapsed"] is collapsed


def test_a_negative_margin_is_refused_before_anything_is_written(tmp_path):
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(np.random.default_rng(9)), prof, "mismatch")
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o", str(out),
                            "--reward-margin", "-0.1"])
    assert r.exit_code == 2 and "--reward-margin must be in [0, 1]" in r.output
    assert not out.exists()


def test_a_run_written_before_an_option_existed_still_finds_its_dense_reference():
    """A configuration without an option added since (its default applies) keys as one that has the
    default; speculation does not change the reference (speculative rollouts are dense samples)."""
    from dataclasses import asdict

    from sparrow.stages.calibrate import _config_key
    from sparrow.stages.train.config import TrainConfig

    now = asdict(TrainConfig(model="m", sparsity="dense"))
    before = {k: v for k, v in now.items() if k != "speculate"}
    assert _config_key(before, True) == _config_key(now, True)
    assert _config_key({**now, "speculate": 3, "sparsity": "budget:64"}, True) == _config_key(now, True)
    assert _config_key({**now, "lr": now["lr"] * 2}, True) != _config_key(now, True)


def _one_error_line(result) -> str:
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.mark.parametrize("flag,value,said", [
    ("--window", "0", "--window must be at least 1 (steps of smoothing), got 0"),
    ("--window", "-2", "--window must be at least 1 (steps of smoothing), got -2"),
    ("--reward-drop", "-1", "--reward-drop must be in [0, 1] (a share of the best reward), got -1.0"),
    ("--grad-norm-factor", "-3", "--grad-norm-factor must be at least 1 (a multiple of the early median "
     "grad norm), got -3.0"),
    ("--truncation-limit", "7", "--truncation-limit must be in [0, 1] (a rate), got 7.0"),
    ("--repetition-limit", "99", "--repetition-limit must be in [0, 1] (a rate), got 99.0"),
    ("--entropy-factor", "-1", "--entropy-factor must be at least 1 (a multiple of the starting entropy), "
     "got -1.0"),
    ("--mismatch-kl-limit", "-5", "--mismatch-kl-limit must be at least 0 (a KL divergence), got -5.0"),
])
def test_every_detector_flag_out_of_range_is_one_sentence_before_any_work(tmp_path, flag, value, said):
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(np.random.default_rng(10)), prof, "mismatch")
    run = _run_dir(tmp_path, "run", (64, 128), False)
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "--runs", str(run),
                            "--bootstrap", "10", flag, value, "-o", str(out)])
    assert _one_error_line(r) == f"error: {said}"
    assert not out.exists()


def test_a_file_given_as_a_run_is_named_a_file(tmp_path):
    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(np.random.default_rng(11)), prof, "mismatch")
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "--runs", str(prof),
                            "-o", str(tmp_path / "t.parquet")])
    assert _one_error_line(r).startswith(f"error: {prof} is a file, not a run directory")
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "--runs", str(tmp_path / "none"),
                            "-o", str(tmp_path / "t.parquet")])
    assert "run directory does not exist" in _one_error_line(r)


def test_without_runs_the_threshold_row_goes_to_stdout_in_the_format_asked(tmp_path):
    import json

    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(np.random.default_rng(12)), prof, "mismatch")
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o", str(out), "-f", "json"])
    assert r.exit_code == 0, r.output
    [row] = json.loads(r.stdout)
    assert row == read_artifact(out, "threshold").to_pylist()[0]
    assert (row["threshold"], row["lower"], row["upper"], row["source"]) == (0.86, None, None, "prior")
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "-o", str(out), "-f", "tsv"])
    header, line = r.stdout.splitlines()
    assert dict(zip(header.split("\t"), line.split("\t")))["threshold"] == "0.86"


def test_a_run_given_twice_counts_once(tmp_path):
    import json

    from sparrow.schemas import artifact_metadata

    prof = tmp_path / "mismatch.parquet"
    write_artifact(synthetic_mismatch(np.random.default_rng(13)), prof, "mismatch")
    run = _run_dir(tmp_path, "run", (64, 128), False)
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(prof), "--bootstrap", "10",
                            "-o", str(out), "--runs", str(run), f"{tmp_path}/./run/../run"])
    assert r.exit_code == 0, r.output
    assert read_artifact(out, "threshold").to_pylist()[0]["n_runs"] == 1
    assert len(json.loads(artifact_metadata(out)["runs"])) == 1
    assert "given more than once (the same run directory); counted once" in r.stderr
    assert "0 of 1 runs collapsed" in r.stderr


def test_a_nan_or_infinite_metric_labels_the_run_collapsed_and_a_null_does_not():
    """A step without a measurement is a null; a NaN or an infinity is a diverged training."""
    import pyarrow as pa

    steps = list(range(1, 9))
    steady = [0.5] * 8
    assert collapse_reasons(pa.table({"step": steps, "reward_mean": steady[:3] + [None] + steady[4:]})) == []
    nan = pa.table({"step": steps, "reward_mean": steady[:2] + [float("nan")] + steady[3:],
                    "grad_norm": [1.0] * 7 + [float("inf")]})
    assert collapse_reasons(nan) == ["grad_norm is inf at step 8 (training diverged)",
                                     "reward_mean is nan at step 3 (training diverged)"]


def test_runs_of_another_model_than_the_profiles_are_refused():
    """By name: a preset's, or a checkpoint's path, whose parts a run records as it was given (relative or
    not) must end the profile's absolute one."""
    from types import SimpleNamespace

    from sparrow.schemas import ArtifactError
    from sparrow.stages.calibrate import check_run_models

    run = SimpleNamespace(name="runs/a", config={"model": "smollm2-135m"})
    check_run_models([run], "smollm2-135m")
    check_run_models([SimpleNamespace(name="r", config={"model": "ckpt/"})], "/data/ckpt")
    check_run_models([SimpleNamespace(name="r", config={"model": "./step_50/hf"})], "/data/step_50/hf")
    with pytest.raises(ArtifactError, match="trained ../step_100/hf "):  # the same last folder, another run
        check_run_models([SimpleNamespace(name="r", config={"model": "../step_100/hf"})], "/data/step_50/hf")
    check_run_models([SimpleNamespace(name="r", config={})], "tiny-llama")  # records none
    with pytest.raises(ArtifactError) as e:
        check_run_models([run], "tiny-llama", "p.parquet")
    assert str(e.value) == ("runs/a trained smollm2-135m (its metrics' config), but p.parquet was measured "
                            "on tiny-llama; give runs and a profile of one model")
