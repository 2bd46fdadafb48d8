"""Planning and calibration say what was measured: a measured plan schedules profiled budgets only and
prints their measured tails; calibrate-threshold reads a planned schedule at the plan's tails, refuses a
run below every profiled budget, records its model (which plan-schedule checks), its bootstrap seed and
draws; the report's figures name the calibrated quantile and the open last bin's real end."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact

runner = CliRunner()
WIDTH = 512
COLUMNS = ("prompt_id", "sample", "position", "bin", "budget", "token_id", "alpha", "logp_dense",
           "logp_sparse", "log_ratio", "k1", "k2", "k3", "entropy_dense")


def mismatch(path, alpha_by_budget: dict[int, np.ndarray], positions: np.ndarray, prompts: np.ndarray,
             model: str = "smollm2-135m"):
    """A mismatch artifact scoring the same tokens (prompt, position) at every budget."""
    n = len(positions)
    rows = {k: [] for k in COLUMNS}
    for budget, alpha in alpha_by_budget.items():
        for k, v in [("prompt_id", [f"p{i}" for i in prompts]), ("sample", np.zeros(n, int)),
                     ("position", positions), ("bin", positions // WIDTH), ("budget", np.full(n, budget)),
                     ("token_id", np.ones(n, int)), ("alpha", alpha), ("logp_dense", -np.ones(n)),
                     ("logp_sparse", -np.ones(n)), ("log_ratio", np.zeros(n)), ("k1", np.zeros(n)),
                     ("k2", np.zeros(n)), ("k3", np.zeros(n)), ("entropy_dense", np.ones(n))]:
            rows[k] += list(v)
    write_artifact(rows, path, "mismatch", metadata={"bin_width": WIDTH, "model": model, "page_size": 16})
    return path


def one_bin_profile(path, n_prompts=8, model="smollm2-135m"):
    """Budgets 80 and 128 over 16 tokens per prompt, all at positions 600-615 (bin 1 of 512): the p5 of
    alpha is about 0.19 at 80 and 0.39 at 128, so a threshold of 0.27 lies between them."""
    rng = np.random.default_rng(0)
    per = 16
    positions = np.tile(np.arange(600, 600 + per), n_prompts)
    prompts = np.repeat(np.arange(n_prompts), per)
    a80 = rng.uniform(0.15, 1.0, len(positions))
    return mismatch(path, {80: a80, 128: np.minimum(1.0, a80 + 0.2)}, positions, prompts, model)


def p5(path, budget, lo=None, hi=None):
    """The 0.05 quantile of alpha at `budget` over positions in [lo, hi), straight from the rows."""
    rows = read_artifact(path, "mismatch").to_pandas()
    sel = rows[rows.budget == budget]
    if lo is not None:
        sel = sel[(sel.position >= lo) & (sel.position < hi)]
    return float(np.quantile(sel.alpha.astype(np.float64), 0.05))


def plan(*args):
    return runner.invoke(app, ["plan-schedule", *map(str, args)])


def calibrate(*args):
    return runner.invoke(app, ["calibrate-threshold", *map(str, args)])


def run_dir(tmp_path, name, schedule_budgets, collapsed, schedule=None):
    """A run directory: a metrics artifact whose reward falls at step 30 when `collapsed`, and a one-bin
    schedule at `schedule_budgets` (or a copy of the schedule artifact `schedule`)."""
    d = tmp_path / name
    steps = np.arange(60)
    reward = np.minimum(0.2 + steps * 0.01, 0.6)
    if collapsed:
        reward = np.where(steps >= 30, 0.05, reward)
    write_artifact({"run_id": ["r"] * 60, "step": steps, "reward_mean": reward, "grad_norm": np.ones(60),
                    "mismatch_kl": np.full(60, 0.001), "entropy": np.full(60, 0.5),
                    "truncation_rate": np.full(60, 0.1), "repetition_rate": np.zeros(60),
                    "reward_std": [None] * 60}, d / "metrics.parquet", "metrics")
    if schedule is not None:
        (d / "schedule.parquet").write_bytes(schedule.read_bytes())
    else:
        write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [schedule_budgets],
                        "tail": [None], "predicted_step_seconds": [None]}, d / "schedule.parquet",
                       "schedule")
    return d


def run_name(run: str) -> str:
    """A run directory's folder name, as the artifact's `runs` metadata gives the directory."""
    return run.rstrip("/").rsplit("/", 1)[-1]


def error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


# ---------------------------------------------------------------- 1. profiled budgets only


def test_a_measured_plan_schedules_only_profiled_budgets_with_their_measured_tails(tmp_path):
    """Between p5 0.19 (budget 80) and 0.39 (128), a threshold of 0.27 needs 128: no budget between them
    was scored, so none is planned, and the tail written is 128's as the rows give it."""
    prof = one_bin_profile(tmp_path / "m.parquet")
    assert p5(prof, 80) < 0.27 <= p5(prof, 128)
    out = tmp_path / "s.parquet"
    r = plan("--model", "smollm2-135m", "--profile", prof, "--threshold", 0.27, "-o", out, "-f", "json")
    assert r.exit_code == 0, r.output
    table = read_artifact(out, "schedule").to_pylist()
    assert [row["budget"] for row in table] == [128, 128]
    assert table[0]["tail"] is None  # bin 0 holds no token: thin
    assert table[1]["tail"] == pytest.approx(p5(prof, 128), abs=1e-12)
    doc = json.loads(r.stdout)
    assert [b["tail"] for b in doc["schedule"]][1] == pytest.approx(p5(prof, 128), abs=1e-12)


def test_a_bin_that_keeps_the_bin_befores_budget_reports_its_measured_tail_and_says_so(tmp_path):
    """Bin 0 needs 128; bin 1 reaches the threshold at 80 but measures slightly lower at 128, which it
    keeps (budgets never fall): its tail is 128's as measured, below the threshold, and a note says so."""
    rng = np.random.default_rng(1)
    n = 200
    pos0, pos1 = rng.integers(0, WIDTH, n), rng.integers(WIDTH, 2 * WIDTH, n)
    positions = np.concatenate([pos0, pos1])
    prompts = np.arange(2 * n) % 10
    b0_80, b0_128 = rng.uniform(0.1, 1, n), rng.uniform(0.6, 1, n)
    b1_80 = rng.uniform(0.5, 1, n)
    b1_128 = b1_80 - 0.03
    prof = mismatch(tmp_path / "m.parquet", {80: np.concatenate([b0_80, b1_80]),
                                             128: np.concatenate([b0_128, b1_128])}, positions, prompts)
    t80, t128 = p5(prof, 80, WIDTH, 2 * WIDTH), p5(prof, 128, WIDTH, 2 * WIDTH)
    threshold = round((t80 + t128) / 2, 6)
    assert t128 < threshold <= t80 and p5(prof, 80, 0, WIDTH) < threshold <= p5(prof, 128, 0, WIDTH)
    out = tmp_path / "s.parquet"
    r = plan("--model", "smollm2-135m", "--profile", prof, "--threshold", threshold, "-o", out,
             "--gen-len", 1000, "--prompt-len", 0)
    assert r.exit_code == 0, r.output
    table = read_artifact(out, "schedule").to_pylist()
    assert [row["budget"] for row in table] == [128, 128]
    assert table[1]["tail"] == pytest.approx(t128, abs=1e-12)
    notes = json.loads(artifact_metadata(out)["notes"])
    assert any(note.startswith("bin 1 (512+)") and "below" in note for note in notes), notes


# ---------------------------------------------------------------- 2. one rule across stages


def test_a_planned_schedule_calibrates_at_the_tail_the_plan_printed(tmp_path):
    """plan-schedule then calibrate-threshold on the same profile: the run's tail is the plan's. A budget
    the profile did not score (96) reads 80's alpha, a lower bound, while its KV read is 96's, and the
    run's notes say which budget each came from."""
    prof = one_bin_profile(tmp_path / "m.parquet")
    sched = tmp_path / "s.parquet"
    assert plan("--model", "smollm2-135m", "--profile", prof, "--threshold", 0.27, "-o", sched).exit_code == 0
    planned_tail = read_artifact(sched, "schedule").to_pylist()[1]["tail"]
    planned = run_dir(tmp_path, "planned", None, False, schedule=sched)
    b96 = run_dir(tmp_path, "b96", 96, False)
    out = tmp_path / "th.parquet"
    r = calibrate("--profile", prof, "--runs", planned, b96, "--bootstrap", 20, "-o", out, "-f", "json")
    assert r.exit_code == 0, r.output
    runs = {run_name(x["run"]): x for x in json.loads(artifact_metadata(out)["runs"])}
    assert runs["planned"]["tail"] == pytest.approx(planned_tail, abs=1e-12)
    assert runs["b96"]["tail"] == pytest.approx(p5(prof, 80), abs=1e-12)
    positions = np.arange(600, 616)
    assert runs["b96"]["kv_read"] == pytest.approx(float(np.mean(np.minimum(1, 96 / positions))))
    assert any("budget 96 not profiled" in n and "budget 80's" in n and "KV read is budget 96's" in n
               for n in runs["b96"]["notes"]), runs["b96"]["notes"]


# ---------------------------------------------------------------- 3. below every profiled budget


def test_a_run_below_every_profiled_budget_is_refused_before_anything_is_written(tmp_path):
    prof = one_bin_profile(tmp_path / "m.parquet")
    runs = [run_dir(tmp_path, "b48", 48, False), run_dir(tmp_path, "b80", 80, True),
            run_dir(tmp_path, "b128", 128, False)]
    out = tmp_path / "th.parquet"
    line = error_line(calibrate("--profile", prof, "--runs", *runs, "--bootstrap", 20, "-o", out))
    assert "b48" in line and "budget 48 is below every budget" in line and "(80, 128)" in line
    assert not out.exists()


# ---------------------------------------------------------------- 4. the calibration's model


def calibrated_threshold(tmp_path, model="smollm2-135m"):
    prof = one_bin_profile(tmp_path / f"m-{model}.parquet", model=model)
    runs = [run_dir(tmp_path, f"{model}-b80a", 80, True), run_dir(tmp_path, f"{model}-b80b", 80, True),
            run_dir(tmp_path, f"{model}-b128a", 128, False), run_dir(tmp_path, f"{model}-b128b", 128, False)]
    out = tmp_path / f"th-{model}.parquet"
    r = calibrate("--profile", prof, "--runs", *runs, "--bootstrap", 50, "-o", out, "-f", "json")
    assert r.exit_code == 0, r.output
    assert read_artifact(out, "threshold").to_pylist()[0]["source"] == "calibrated"
    return out


def test_plan_schedule_refuses_a_threshold_calibrated_on_another_model(tmp_path):
    th = calibrated_threshold(tmp_path)
    assert artifact_metadata(th)["model"] == "smollm2-135m"
    line = error_line(plan("--model", "qwen3-4b", "--threshold-file", th))
    assert "--threshold-file" in line and "smollm2-135m" in line and "qwen3-4b" in line
    assert plan("--model", "qwen3-4b", "--threshold-file", th, "--allow-model-mismatch").exit_code == 0
    prof = one_bin_profile(tmp_path / "same.parquet")
    assert plan("--model", "smollm2-135m", "--profile", prof, "--threshold-file", th).exit_code == 0
    # the published prior is no model's calibration; an artifact that records no model is accepted
    for name, source, meta in (("prior", "prior", {"model": "smollm2-135m"}), ("bare", "calibrated", {})):
        path = tmp_path / f"{name}.parquet"
        write_artifact({"threshold": [0.86], "lower": [None], "upper": [None], "quantile": [0.05],
                        "source": [source], "n_runs": [0], "n_collapsed": [0], "note": [None]},
                       path, "threshold", metadata=meta)
        assert plan("--model", "qwen3-4b", "--threshold-file", path).exit_code == 0, name


# ---------------------------------------------------------------- 5. the calibration figure's quantile


def test_the_calibration_figure_names_the_calibrated_quantile(tmp_path):
    from sparrow.stages.report.artifact_figures import calibration_figure
    from sparrow.stages.report.canvas import pyplot

    prof = one_bin_profile(tmp_path / "m.parquet")
    runs = [run_dir(tmp_path, "a", 80, True), run_dir(tmp_path, "b", 128, False)]
    th = tmp_path / "th.parquet"
    r = calibrate("--profile", prof, "--runs", *runs, "--bootstrap", 20, "--quantile", 0.25, "-o", th)
    assert r.exit_code == 0, r.output

    class Recorder:  # pyplot, keeping the figure it made
        def __init__(self):
            self.plt = pyplot()

        def subplots(self, *args, **kwargs):
            self.fig, axes = self.plt.subplots(*args, **kwargs)
            return self.fig, axes

        def close(self, fig):
            self.plt.close(fig)

    rec = Recorder()
    figure = calibration_figure(th, "calibration.png", tmp_path, rec)
    assert rec.fig.axes[0].get_xlabel() == "tail: min over bins of p25 alpha"
    assert "0.25 quantile (p25)" in figure.caption and "p5 " not in figure.caption


# ---------------------------------------------------------------- 6. the bootstrap's seed and draws


def test_separation_interval_is_over_the_separating_draws_only():
    from sparrow.stages.calibrate import separation

    collapsed = np.array([True, False])
    # boundaries of the separating draws: 0.3, 0.4, 0.5, 0.6; the last two draws overlap (no boundary)
    draws = np.array([[0.2, 0.4], [0.3, 0.5], [0.4, 0.6], [0.5, 0.7], [0.6, 0.5], [0.9, 0.1]])
    sep = separation(np.array([0.3, 0.5]), draws, collapsed, "tails", seed=7)
    assert (sep.lower, sep.upper) == pytest.approx(tuple(np.quantile([0.3, 0.4, 0.5, 0.6], [0.025, 0.975])))
    assert sep.separating_share == pytest.approx(4 / 6) and sep.seed == 7
    assert "seed 7" in sep.line() and "in which the runs separate" in sep.line()


def test_calibrate_threshold_seed_is_recorded_printed_and_reproducible(tmp_path):
    prof = one_bin_profile(tmp_path / "m.parquet")
    runs = [run_dir(tmp_path, "a", 80, True), run_dir(tmp_path, "b", 128, False)]
    rows = {}
    for name, seed in (("s3", 3), ("s3again", 3), ("s0", None)):
        out = tmp_path / f"{name}.parquet"
        r = calibrate("--profile", prof, "--runs", *runs, "--bootstrap", 40, "-o", out, "-f", "json",
                      *(("--seed", seed) if seed is not None else ()))
        assert r.exit_code == 0, r.output
        meta = artifact_metadata(out)
        assert meta["bootstrap"] == 40 and meta["bootstrap_seed"] == (seed or 0)
        assert f"from seed {seed or 0} " in r.stderr
        assert all(s["seed"] == (seed or 0) for s in json.loads(meta["separations"]))
        assert "fewer than 5" not in r.stderr  # 8 prompts
        rows[name] = read_artifact(out, "threshold").to_pylist()[0]
    assert rows["s3"] == rows["s3again"]


def test_a_profile_of_few_prompts_warns_that_its_bootstrap_means_little(tmp_path):
    prof = one_bin_profile(tmp_path / "m.parquet", n_prompts=2)
    runs = [run_dir(tmp_path, "a", 80, True), run_dir(tmp_path, "b", 128, False)]
    r = calibrate("--profile", prof, "--runs", *runs, "--bootstrap", 20, "-o", tmp_path / "th.parquet")
    assert r.exit_code == 0, r.output
    said = " ".join(r.stderr.split())
    assert "warning:" in said and "has 2 prompts, fewer than 5" in said


# ---------------------------------------------------------------- 7. small points


def test_the_schedule_figure_says_where_the_open_last_bin_really_ends(tmp_path):
    from sparrow.stages.report.artifact_figures import schedule_figure
    from sparrow.stages.report.canvas import pyplot

    prof = one_bin_profile(tmp_path / "m.parquet")
    sched = tmp_path / "s.parquet"
    assert plan("--model", "smollm2-135m", "--profile", prof, "--threshold", 0.27, "-o", sched).exit_code == 0
    context = json.loads(artifact_metadata(sched)["model_config"])["max_position_embeddings"]
    caption = " ".join(schedule_figure(sched, "schedule.png", tmp_path, pyplot()).caption.split())
    assert f"drawn to position {2 * WIDTH:,}" in caption and f"({context:,} tokens)" in caption


def test_the_plan_table_rounds_as_the_docs_say(tmp_path):
    """commands.md and cost-model.md: the terminal table shows the tail to 4 decimals, step times to 2."""
    prof = one_bin_profile(tmp_path / "m.parquet")
    r = plan("--model", "smollm2-135m", "--profile", prof, "--threshold", 0.27, "-f", "table")
    assert r.exit_code == 0, r.output
    assert f"{p5(prof, 128):.4f}" in r.stdout
    doc = json.loads(plan("--model", "smollm2-135m", "--profile", prof, "--threshold", 0.27, "-f",
                          "json").stdout)
    assert f"{doc['schedule'][1]['step_ms']:.2f}" in r.stdout
