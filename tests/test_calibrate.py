"""Collapse detectors, run tails and the threshold, on metric tables written to mimic real runs."""

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.calibrate import collapse_reasons, run_tail
from sparrow.stages.schedule import Schedule

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

    from sparrow.stages.calibrate import mismatch_warnings

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
