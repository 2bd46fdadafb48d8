"""`sparrow report` on a run directory with every kind of artifact it draws, and a training run; the page is
self-contained, every artifact is drawn, and a figure with nothing to show says why (issue 26, item 16)."""

from __future__ import annotations

import base64
import re

import numpy as np
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact

from cli_checks import error_line


def _run_dir(tmp_path):
    rng = np.random.default_rng(0)
    run = tmp_path / "run"
    n = 600
    budgets = rng.choice([64, 128, 256], n)
    bins = rng.integers(0, 4, n)
    alpha = np.clip(1 - rng.exponential(0.05, n) * (1 + bins) * 64 / budgets, 0, 1)
    write_artifact({"prompt_id": ["p"] * n, "sample": [0] * n, "position": (bins * 512 + 10).tolist(),
                    "bin": bins.tolist(), "budget": budgets.tolist(), "token_id": [1] * n,
                    "alpha": alpha.tolist(), "logp_dense": [-1.0] * n, "logp_sparse": [-1.1] * n,
                    "log_ratio": [0.1] * n, "k1": [0.1] * n, "k2": [0.005] * n, "k3": [0.005] * n,
                    "entropy_dense": [1.0] * n}, run / "mismatch.parquet", "mismatch",
                   metadata={"bin_width": 512})
    write_artifact({"threshold": [0.86], "lower": [None], "upper": [None], "quantile": [0.05],
                    "source": ["prior"], "n_runs": [0], "n_collapsed": [0], "note": [None]},
                   run / "threshold.parquet", "threshold")
    write_artifact({"bin": [0, 1, 2], "bin_start": [0, 512, 1024], "bin_end": [512, 1024, None],
                    "budget": [64, 128, None], "tail": [0.9, 0.87, None],
                    "predicted_step_seconds": [None] * 3}, run / "schedule.parquet", "schedule",
                   metadata={"page_size": 16})
    write_artifact({"model": ["m"] * 4, "device": ["cpu"] * 4, "batch": [1, 8, 1, 8],
                    "context": [1024, 1024, 4096, 4096], "budget": [None, None, 256, 256],
                    "seconds": [0.01, 0.03, 0.012, 0.02], "predicted_seconds": [0.011, 0.028, 0.013, 0.022]},
                   run / "cost.parquet", "cost")
    write_artifact({"prompt_id": ["p0", "p0"], "sample": [0, 1], "prompt_token_ids": [[1, 2], [1, 2]],
                    "token_ids": [[7, 8, 9], [7]], "text": ["abc", None],
                    "logprobs": [[-0.1, -0.2, 0.0], [-1.5]], "budgets": [[0, 64, 64], [0]],
                    "finish_reason": ["stop", "length"], "reward": [1.0, 0.0]},
                   run / "rollouts.parquet", "rollouts")
    steps = 6
    write_artifact([{"run_id": "t", "step": s, "reward_mean": 0.1 * s, "grad_norm": 1.0, "entropy": 1.0,
                     "mismatch_kl": 1e-3, "eval_accuracy": 0.1 if s % 2 else None, "alpha_lb_p5": 0.8,
                     "collapse": "reward fell" if s == 5 else None} for s in range(steps)],
                   run / "train" / "metrics.parquet", "metrics", metadata={"label": "collapsed"})
    for s in range(steps):
        write_artifact({"step": [s] * 3, "prompt_id": ["p"] * 3, "sample": [0, 1, 2],
                        "position": [10, 11, 12], "bin": [0] * 3, "budget": [0, 64, 64],
                        "token_id": [1, 2, 3],
                        "logp_rollout": [-1.0] * 3, "logp_dense": [-1.1] * 3, "log_ratio": [0.1] * 3,
                        "k3": [0.005] * 3, "alpha_top20_lb": [0.9, 0.8, 0.7], "weight": [1.0] * 3,
                        "masked": [False] * 3, "vetoed": [False] * 3},
                       run / "train" / "mismatch" / f"step={s:05d}.parquet", "train_mismatch")
    return run


def _embedded(page: str) -> dict[str, bytes]:
    """The PNGs the page carries inline, by the figure's file name (its id)."""
    return {m[0]: base64.b64decode(m[1]) for m in
            re.findall(r"<figure id='([^']+)'><h2>[^<]*</h2><img src='data:image/png;base64,([^']+)'", page)}


def test_report_draws_every_figure_with_data_into_a_self_contained_page(tmp_path):
    run = _run_dir(tmp_path)
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    out = run / "report"
    page = (out / "index.html").read_text()
    expected = {"tail.png": 12, "schedule.png": 3, "cost.png": 4, "rollouts.png": 2, "train-train.png": 6,
                "train-mismatch-train.png": 6}
    inline = _embedded(page)
    assert set(inline) == set(expected) and "src='" + "tail.png" not in page  # nothing but itself needed
    for name, points in expected.items():
        png = out / name
        assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
        assert inline[name] == png.read_bytes()
        assert f"{name}: " in result.output and f"({points} points)" in result.output.split(f"{name}: ")[1]


def test_report_of_an_empty_directory_is_one_sentence(tmp_path):
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["report", str(tmp_path / "empty")])
    assert result.exit_code != 0 and "holds nothing to plot" in result.output
    assert not (tmp_path / "empty" / "report").exists()


def test_every_artifact_is_drawn_and_what_is_not_is_named(tmp_path):
    """Two profiles draw two figures; a file that is not an artifact is named, on stderr and the page."""
    run = _run_dir(tmp_path)
    (run / "m.parquet").write_bytes((run / "mismatch.parquet").read_bytes())
    (run / "notes.parquet").write_text("not parquet")
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    page = (run / "report" / "index.html").read_text()
    assert {"tail-m.png", "tail-mismatch.png"} <= set(_embedded(page))
    err = " ".join(result.stderr.split())
    assert "not drawn: " in err and f"{run / 'notes.parquet'} is not a Parquet file" in err
    assert "Not drawn" in page and "notes.parquet is not a Parquet file" in page


def test_figures_with_nothing_to_draw_say_why(tmp_path):
    """An all-dense schedule, an analytic cost model (predicted points only), rollouts without rewards, a
    run without eval prompts: each figure is drawn, says in itself why a panel is empty, and the training
    figure tells the run's one story (stable, mismatch KL a warning)."""
    from sparrow.stages.cost import Grid, write_analytic
    from sparrow.stages.model.presets import PRESETS

    run = tmp_path / "run"
    write_artifact({"bin": [0, 1], "bin_start": [0, 512], "bin_end": [512, None], "budget": [None, None],
                    "tail": [None, None], "predicted_step_seconds": [None] * 2}, run / "schedule.parquet",
                   "schedule", metadata={"page_size": 16, "model": "smollm2-135m", "threshold": 0.86})
    grid = Grid([16, 64], [2048, 8192], [0, 512], 2, 5)
    write_analytic(PRESETS["qwen3-4b"].config, "qwen3-4b", "h100", grid, run / "cost.parquet")
    write_artifact({"prompt_id": ["p0", "p1"], "sample": [0, 0], "prompt_token_ids": [[1, 2]] * 2,
                    "token_ids": [[7, 8], [7]], "text": [None, None], "logprobs": [[-0.1, -0.2], [-1.5]],
                    "budgets": [[0, 0], [0]], "finish_reason": ["stop", "length"], "reward": [None, None]},
                   run / "rollouts.parquet", "rollouts")
    write_artifact([{"run_id": "t", "step": s, "reward_mean": 0.5, "mismatch_kl": 0.3, "collapse": None}
                    for s in range(4)], run / "train" / "metrics.parquet", "metrics",
                   metadata={"label": "stable", "warnings": "mismatch KL reached 0.3"})
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    listed = {line.split(": ")[0].strip(): line for line in result.stderr.splitlines() if ".png: " in line}
    page = (run / "report" / "index.html").read_text()
    caption = {f: re.search(rf"<figure id='{re.escape(f)}'>.*?<figcaption>(.*?)</figcaption>", page, re.S)[1]
               for f in _embedded(page)}
    assert "(2 points; Every bin is dense: no profiled budget" in listed["schedule.png"]
    assert "(8 points)" in listed["cost.png"] and "predicted only" in caption["cost.png"]
    assert "no rewards: the prompts carry no answer, or their task has no scorer" in listed["rollouts.png"]
    train = listed["train-train.png"]
    assert "Training run train: stable (4 points; no eval: the run had no --eval-prompts" in train
    assert "warning: mismatch KL reached 0.3" in caption["train-train.png"]
    assert "no step held a collapse reason" in caption["train-train.png"]


def test_an_interrupted_report_leaves_the_previous_figures_whole(tmp_path, monkeypatch):
    """A figure whose drawing fails midway (here: the PNG encoder writes half a file, then raises) leaves
    the previous report's PNG and page as they were, and no temporary file behind."""
    from matplotlib.figure import Figure

    run = _run_dir(tmp_path)
    assert CliRunner().invoke(app, ["report", str(run)]).exit_code == 0
    out = run / "report"
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken_savefig(self, target, *args, **kwargs):
        (target.write if hasattr(target, "write") else open(target, "wb").write)(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code != 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _profile_rows(prompt_lens: dict[str, int], generated: int, budgets=(64, 128)) -> list[dict]:
    """A profile of one sample per prompt: `generated` tokens after each prompt, alpha falling with the
    position."""
    return [{"prompt_id": pid, "sample": 0, "position": start + k, "bin": (start + k) // 512, "budget": b,
             "token_id": 1, "alpha": 1 - (start + k) / 4096 - 16 / b, "logp_dense": -1.0,
             "logp_sparse": -1.0, "log_ratio": 0.0, "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0}
            for pid, start in prompt_lens.items() for b in budgets for k in range(generated)]


def _caption(page: str, figure: str) -> str:
    return re.search(rf"<figure id='{re.escape(figure)}'>.*?<figcaption>(.*?)</figcaption>", page, re.S)[1]


def test_report_profile_and_plan_schedule_mark_the_same_threshold(tmp_path, monkeypatch):
    """No threshold artifact in the folder: all three take the calibration shipped for the model."""
    import sparrow.stages.calibrate as calibrate

    monkeypatch.setattr(calibrate, "SHIPPED", tmp_path / "shipped")
    write_artifact({"threshold": [0.5], "lower": [0.4], "upper": [0.6], "quantile": [0.05],
                    "source": ["calibrated"], "n_runs": [6], "n_collapsed": [2], "note": ["sweep"]},
                   tmp_path / "shipped" / "threshold-tiny-llama.parquet", "threshold",
                   metadata={"model": "tiny-llama", "provenance": "a test sweep"})
    rollouts = write_artifact({"prompt_id": ["p0"], "sample": [0], "prompt_token_ids": [list(range(1, 40))],
                               "token_ids": [[7, 8, 9, 10, 11, 12]], "text": [None],
                               "logprobs": [[-1.0] * 6], "budgets": [[0] * 6], "finish_reason": ["length"],
                               "reward": [None]}, tmp_path / "rollouts.parquet", "rollouts",
                              metadata={"temperature": 1.0})
    run = tmp_path / "run"
    profiled = CliRunner().invoke(app, ["profile", "--model", "tiny-llama", "--rollouts", str(rollouts),
                                        "--budgets", "48,64", "-o", str(run / "mismatch.parquet")])
    assert profiled.exit_code == 0, profiled.output
    planned = CliRunner().invoke(app, ["plan-schedule", "--model", "tiny-llama", "--profile",
                                       str(run / "mismatch.parquet"), "--min-tokens", "1"])
    assert planned.exit_code == 0, planned.output
    reported = CliRunner().invoke(app, ["report", str(run)])
    assert reported.exit_code == 0, reported.output
    caption = _caption((run / "report" / "index.html").read_text(), "tail.png")
    seen = {"profile": re.search(r"at or above the threshold ([\d.]+) \((.*?)\)", profiled.stderr),
            "plan-schedule": re.search(r"threshold ([\d.]+) on the 0.05 quantile of alpha: (.*)",
                                       planned.stderr),
            "report": re.search(r"the threshold ([\d.]+) \((.*?)\)", caption)}
    assert {k: (float(m[1]), m[2].strip()) for k, m in seen.items()} == dict.fromkeys(
        seen, (0.5, "shipped calibration for tiny-llama"))


def test_a_profile_with_nan_alpha_is_refused_as_every_command_refuses_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cli_checks import error_line

    run = tmp_path / "run"
    path = write_artifact(_profile_rows({"p": 100}, 40), run / "mismatch.parquet", "mismatch",
                          metadata={"bin_width": 512, "model": "smollm2-135m"})
    table = pq.read_table(path)
    alpha = table.column("alpha").to_numpy().copy()
    alpha[3] = np.nan
    pq.write_table(table.set_column(table.schema.get_field_index("alpha"), "alpha", pa.array(alpha)), path)
    said = f"{path} has 1 value of column 'alpha' outside the allowed range [0, 1] (first: nan in row 3)"
    planned = CliRunner().invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile", str(path)])
    assert error_line(planned) == f"error: {said}"
    reported = CliRunner().invoke(app, ["report", str(run)])
    assert reported.exit_code == 2 and error_line(reported) == f"error: {said}"
    assert sorted(p.name for p in run.iterdir()) == ["mismatch.parquet"]


def test_tail_points_sit_where_the_tokens_are_and_the_threshold_marks_the_tail_only(tmp_path, monkeypatch):
    """Tokens at 1500-1599 (in the 1024-1535 and 1536-2047 bins) are drawn at their mean positions, the
    threshold line is on the tail panel alone, and the caption rounds it to 3 significant digits."""
    from matplotlib.axes import Axes

    run = tmp_path / "run"
    write_artifact(_profile_rows({"p": 1500}, 100), run / "mismatch.parquet", "mismatch",
                   metadata={"bin_width": 512, "model": "smollm2-135m"})
    write_artifact({"threshold": [0.4678437262773514], "lower": [None], "upper": [None], "quantile": [0.05],
                    "source": ["calibrated"], "n_runs": [0], "n_collapsed": [0], "note": [None]},
                   run / "threshold.parquet", "threshold")
    drawn, lines = [], []
    plot, axhline = Axes.plot, Axes.axhline
    monkeypatch.setattr(Axes, "plot", lambda ax, x, *a, **k: (k.get("ls") == "none"  # a thin bin's mark
                                                              or drawn.append((ax, list(x))))
                        or plot(ax, x, *a, **k))
    monkeypatch.setattr(Axes, "axhline", lambda ax, y, *a, **k: lines.append((ax, y))
                        or axhline(ax, y, *a, **k))
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    want = [np.mean(range(1500, 1536)), np.mean(range(1536, 1600))]
    assert [(ax.get_title(), x) for ax, x in drawn] == [
        (title, want) for _ in (64, 128) for title in ("p5 of alpha (the tail)", "mean alpha")]
    assert [(ax.get_title(), y) for ax, y in lines] == [("p5 of alpha (the tail)", 0.4678437262773514)]
    caption = _caption((run / "report" / "index.html").read_text(), "tail.png")
    assert "threshold 0.468 (calibrated" in caption and "0.46784" not in caption


def test_a_run_with_ignore_eos_names_no_eos_stops_in_its_length_legend(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    run = tmp_path / "run"
    write_artifact({"prompt_id": ["p0", "p0"], "sample": [0, 1], "prompt_token_ids": [[1, 2]] * 2,
                    "token_ids": [[7, 8, 9], [7, 8, 9]], "text": [None, None], "logprobs": [[-0.1] * 3] * 2,
                    "budgets": [[0] * 3] * 2, "finish_reason": ["length", "length"], "reward": [0.0, 1.0]},
                   run / "rollouts.parquet", "rollouts", metadata={"ignore_eos": True})
    labels = []
    hist = Axes.hist
    monkeypatch.setattr(Axes, "hist", lambda ax, x, *a, **k: labels.append(k.get("label"))
                        or hist(ax, x, *a, **k))
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert labels[0] == ["ran to --max-new-tokens (--ignore-eos)"]
    caption = _caption((run / "report" / "index.html").read_text(), "rollouts.png")
    assert "every sample ran to --max-new-tokens (--ignore-eos)" in caption and "EOS" not in caption.replace(
        "--ignore-eos", "")


def test_two_profiles_of_different_provenance_in_one_folder_are_drawn_apart(tmp_path):
    """distill writes its profiles before and after the adapter into one folder: each gets its own figure
    with its own tokens, never one pooled curve; parts of one provenance (a --workers output) stay one."""
    run = tmp_path / "run"
    for name, meta, alpha in (("before", {}, 0.5), ("after", {"adapter": "ad"}, 0.9)):
        rows = [{**r, "alpha": alpha} for r in _profile_rows({"p": 100}, 30)]
        write_artifact(rows, run / "mismatch" / f"{name}.parquet", "mismatch",
                       metadata={"bin_width": 512, "model": "smollm2-135m", **meta})
    for part in ("part-0", "part-1"):
        write_artifact(_profile_rows({part: 100}, 20), run / "workers" / f"{part}.parquet", "mismatch",
                       metadata={"bin_width": 512, "model": "smollm2-135m"})
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    page = (run / "report" / "index.html").read_text()
    assert set(_embedded(page)) == {"tail-mismatch-before.png", "tail-mismatch-after.png", "tail-workers.png"}
    assert "30 generated tokens" in _caption(page, "tail-mismatch-before.png")
    assert "30 generated tokens" in _caption(page, "tail-mismatch-after.png")
    assert "40 generated tokens" in _caption(page, "tail-workers.png")


def test_a_folder_of_several_kinds_is_skipped_in_one_line_and_the_rest_is_drawn(tmp_path):
    run = _run_dir(tmp_path)
    archive = run / "archive"
    for name in ("rollouts.parquet", "schedule.parquet"):
        (archive / name).parent.mkdir(exist_ok=True)
        (archive / name).write_bytes((run / name).read_bytes())
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    skipped = [line for line in result.stderr.splitlines() if line.startswith("not drawn: ")]
    assert skipped == [f"not drawn: {archive} holds files of several kinds (rollouts, schedule), not the "
                       "parts of one artifact"]
    drawn = set(_embedded((run / "report" / "index.html").read_text()))
    assert {"tail.png", "schedule.png", "rollouts.png"} <= drawn


def test_a_training_runs_dense_schedule_says_it_was_dense_by_choice(tmp_path):
    """`sparrow train` without --schedule records its dense sampler as a one-bin schedule: no profile or
    threshold was involved, and the figure says so (a planned all-dense schedule keeps its own words)."""
    run = tmp_path / "run"
    write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [None], "tail": [None],
                    "predicted_step_seconds": [None]}, run / "schedule.parquet", "schedule",
                   metadata={"page_size": 16, "source": "dense"})
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    listed = next(line for line in result.stderr.splitlines() if "schedule.png: " in line)
    assert "Dense run (no schedule)" in listed and "no profile or threshold was involved" in listed
    assert "profiled budget" not in listed and "threshold reached" not in listed
    assert "the sampler a training run used (dense), not a plan" in _caption(
        (run / "report" / "index.html").read_text(), "schedule.png")



def test_a_training_runs_all_dense_schedule_file_is_not_called_no_schedule(tmp_path):
    """A run given --schedule FILE whose bins are all dense sampled with that file: the figure names it."""
    run = tmp_path / "run"
    write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [None], "tail": [None],
                    "predicted_step_seconds": [None]}, run / "schedule.parquet", "schedule",
                   metadata={"page_size": 16, "source": "schedule:/data/s.parquet"})
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    listed = next(line for line in result.stderr.splitlines() if "schedule.png: " in line)
    assert "no schedule" not in listed
    assert "the training run's schedule (schedule:/data/s.parquet) has the whole cache" in listed


def test_a_draft_schedule_is_drawn_as_one(tmp_path):
    """plan-schedule --speculate's draft budgets (metadata `speculate`: K) are named drafts for K, planned
    for speed with no threshold, not a lossy plan."""
    run = tmp_path / "run"
    write_artifact({"bin": [0, 1], "bin_start": [0, 2000], "bin_end": [2000, None], "budget": [512, 1024],
                    "tail": [None, None], "predicted_step_seconds": [None, None]}, run / "draft.parquet",
                   "schedule", metadata={"page_size": 16, "model": "smollm2-135m", "speculate": 4})
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    caption = _caption((run / "report" / "index.html").read_text(), "schedule.png")
    assert "draft budgets for exact speculative rollouts (--speculate 4)" in caption
    assert "The draft schedule for --speculate 4: budget per position bin" in result.stderr


def test_a_file_given_as_the_run_is_named_a_file(tmp_path):
    from cli_checks import error_line

    path = write_artifact(_profile_rows({"p": 100}, 4), tmp_path / "mismatch.parquet", "mismatch")
    result = CliRunner().invoke(app, ["report", str(path)])
    assert result.exit_code == 2
    assert error_line(result).startswith(f"error: {path} is a file, not a run directory")
    assert error_line(CliRunner().invoke(app, ["report", str(tmp_path / "none")])).endswith(
        "no such run directory")


def test_artifacts_with_no_rows_say_so_once_with_no_python_warning(tmp_path):
    """0-row copies of a profile, a schedule, a cost model and rollouts: each figure says in one true
    sentence that it has nothing (a schedule with no bins is not "every bin is dense"), each reason once,
    and no Python warning reaches the terminal."""
    import warnings

    import pyarrow.parquet as pq

    full, run = _run_dir(tmp_path), tmp_path / "empty"
    run.mkdir()
    for name in ("mismatch", "schedule", "cost", "rollouts"):
        table = pq.read_table(full / f"{name}.parquet")
        pq.write_table(table.slice(0, 0), run / f"{name}.parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert "Warning" not in result.stderr
    listed = {line.split(": ")[0].strip(): line for line in result.stderr.splitlines() if ".png: " in line}
    assert listed["schedule.png"].endswith("(0 points; the schedule has no bins)")
    assert listed["tail.png"].endswith("(0 points; the profile has no scored tokens)")
    assert listed["rollouts.png"].endswith("(0 points; the rollouts artifact has no samples)")
    assert listed["cost.png"].endswith("(0 points; the cost artifact has no points)")
    page = (run / "report" / "index.html").read_text()
    assert "dense" not in _caption(page, "schedule.png") and "no bins" in _caption(page, "schedule.png")
    assert "generated tokens" not in _caption(page, "tail.png")


def test_a_figure_whose_artifact_is_gone_leaves_with_it_and_other_files_stay(tmp_path):
    """The report removes the PNGs its previous page listed and this one does not draw; a file the report
    never wrote (the user's) stays."""
    run = _run_dir(tmp_path)
    assert CliRunner().invoke(app, ["report", str(run)]).exit_code == 0
    out = run / "report"
    (out / "mine.png").write_bytes(b"the user's")
    (run / "schedule.parquet").unlink()
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert not (out / "schedule.png").exists() and (out / "mine.png").read_bytes() == b"the user's"
    assert set(_embedded((out / "index.html").read_text())) == {
        p.name for p in out.iterdir() if p.suffix == ".png"} - {"mine.png"}


def _training_run(tmp_path, name: str):
    """A training run of `_run_dir`'s (6 steps, each step's tokens in bin 0) with its schedule, at `name`."""
    import shutil

    full = _run_dir(tmp_path / f"{name}-source")
    run = tmp_path / name
    shutil.copytree(full / "train", run)
    shutil.copy(full / "schedule.parquet", run / "schedule.parquet")
    return run, full


def _not_drawn(result) -> list[str]:
    return [line.removeprefix("not drawn: ") for line in result.stderr.splitlines()
            if line.startswith("not drawn: ")]


def test_a_truncated_step_file_is_named_and_the_runs_other_steps_are_drawn(tmp_path):
    """A run killed while writing a step leaves a truncated mismatch/step=N.parquet: it is skipped in one
    line (the sentence `sql` gives), the run's curves and its other five steps are drawn, and the file
    is left as it was."""
    run, _ = _training_run(tmp_path, "p3")
    step = run / "mismatch" / "step=00001.parquet"
    step.write_bytes(step.read_bytes()[:500])
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert _not_drawn(result) == [f"{step} is a truncated Parquet file (its footer is missing; was its "
                                  "writer interrupted?)"]
    page = (run / "report" / "index.html").read_text()
    assert set(_embedded(page)) == {"schedule.png", "train-p3.png", "train-mismatch-p3.png"}
    assert "(5 points)" in result.output.split("train-mismatch-p3.png: ")[1].splitlines()[0]
    assert "5 train_mismatch files in p3/mismatch (1 unreadable file left out" in _caption(
        page, "train-mismatch-p3.png")
    assert "Not drawn" in page and "step=00001.parquet is a truncated Parquet file" in page
    assert len(step.read_bytes()) == 500


def test_a_folder_of_runs_with_one_truncated_step_draws_every_run(tmp_path):
    import shutil

    outer = tmp_path / "outer"
    outer.mkdir()
    good, full = _training_run(tmp_path, "good")
    shutil.copytree(good, outer / "runA")
    shutil.copytree(good, outer / "runB")
    shutil.copy(full / "rollouts.parquet", outer / "rollouts.parquet")
    step = outer / "runB" / "mismatch" / "step=00003.parquet"
    step.write_bytes(step.read_bytes()[:-8])
    result = CliRunner().invoke(app, ["report", str(outer)])
    assert result.exit_code == 0, result.output
    inside = [f"{outer / r / 'schedule.parquet'} (inside the training run {r}; `sparrow report {outer / r}` "
              "draws it)" for r in ("runA", "runB")]
    assert _not_drawn(result)[:2] == inside and len(_not_drawn(result)) == 3
    assert _not_drawn(result)[2].startswith(f"{step} is a truncated")
    assert set(_embedded((outer / "report" / "index.html").read_text())) == {
        "rollouts.png", "train-runA.png", "train-mismatch-runA.png", "train-runB.png",
        "train-mismatch-runB.png"}
    lines = {line.split(": ")[0].strip(): line for line in result.stderr.splitlines() if ".png: " in line}
    assert "(6 points)" in lines["train-mismatch-runA.png"]
    assert "(5 points)" in lines["train-mismatch-runB.png"]


def test_runs_of_a_sweep_folder_are_drawn_and_deeper_parquet_is_named(tmp_path):
    """A sweep's folder of runs (run/sweep/<run>, as calibrate-threshold reads them) is drawn beside the
    folder's own artifacts, each figure named by the run's path; Parquet further down is named, not
    silently passed over; a folder holding nothing to draw says what it holds."""
    import shutil

    good, full = _training_run(tmp_path, "good")
    outer = tmp_path / "outer"
    for run in ("sweep/dense", "sweep/b64"):
        shutil.copytree(good, outer / run)
    shutil.copy(full / "rollouts.parquet", outer / "rollouts.parquet")
    deep = outer / "old" / "a" / "b"
    deep.mkdir(parents=True)
    shutil.copy(full / "rollouts.parquet", deep / "rollouts.parquet")
    result = CliRunner().invoke(app, ["report", str(outer)])
    assert result.exit_code == 0, result.output
    assert set(_embedded((outer / "report" / "index.html").read_text())) == {
        "rollouts.png", "train-sweep-b64.png", "train-mismatch-sweep-b64.png", "train-sweep-dense.png",
        "train-mismatch-sweep-dense.png"}
    assert f"{outer / 'old'} (its Parquet files lie in its subfolders" in "\n".join(_not_drawn(result))
    empty = tmp_path / "empty-ish"
    (empty / "notes").mkdir(parents=True)
    (empty / "readme.txt").write_text("hi")
    line = error_line(CliRunner().invoke(app, ["report", str(empty)]))
    assert line.endswith("it holds notes/, readme.txt)"), line


def test_a_run_without_metrics_has_its_mismatch_drawn_and_its_curves_named(tmp_path):
    run, _ = _training_run(tmp_path, "p1")
    (run / "metrics.parquet").unlink()
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert _not_drawn(result) == [f"the training curves of {run} ({run / 'metrics.parquet'} does not exist)"]
    page = (run / "report" / "index.html").read_text()
    assert set(_embedded(page)) == {"schedule.png", "train-mismatch-p1.png"}
    assert "(6 points)" in result.output.split("train-mismatch-p1.png: ")[1].splitlines()[0]
    assert "training curves of" in page


def _rewards(path):
    return write_artifact({"prompt_id": ["p0", "p0"], "sample": [0, 1], "task": ["math"] * 2,
                           "reward": [1.0, 0.0], "status": [None, None], "tests_passed": [None, None],
                           "tests_total": [None, None], "reward_extra": [None, None]}, path, "rewards")


def _prompts(path):
    return write_artifact({"prompt_id": ["a"], "task": ["math"], "prompt": ["What is 2 + 3?"],
                           "prompt_token_ids": [None], "answer": ["5"], "metadata": [None]}, path, "prompts")


def test_an_artifact_without_a_figure_gets_its_not_drawn_line(tmp_path):
    """Beside rollouts: a prompts artifact, a plain Parquet file and a threshold without calibrated runs
    that no profile uses are each named once, and the rollouts are drawn."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    full, ds = _run_dir(tmp_path), tmp_path / "ds"
    ds.mkdir()
    shutil.copy(full / "rollouts.parquet", ds / "rollouts.parquet")
    shutil.copy(full / "threshold.parquet", ds / "threshold.parquet")
    _prompts(ds / "prompts.parquet")
    pq.write_table(pa.table({"x": [1]}), ds / "gsm8k.parquet")
    result = CliRunner().invoke(app, ["report", str(ds)])
    assert result.exit_code == 0, result.output
    assert _not_drawn(result) == [
        f"{ds / 'gsm8k.parquet'} is a Parquet file without Sparrow artifact metadata",
        f"{ds / 'prompts.parquet'} (a 'prompts' artifact has no figure)",
        f"{ds / 'threshold.parquet'} (a 'threshold' artifact without calibrated runs has no figure of its "
        "own)"]
    page = (ds / "report" / "index.html").read_text()
    assert set(_embedded(page)) == {"rollouts.png"}
    assert "prompts.parquet (a &#x27;prompts&#x27; artifact has no figure)" in page


def test_a_folder_of_artifacts_without_figures_is_refused_naming_each(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cli_checks import error_line

    only = tmp_path / "only"
    _prompts(only / "prompts.parquet")
    pq.write_table(pa.table({"x": [1]}), only / "gsm8k.parquet")
    (only / "notes.csv").write_text("a,b\n")
    before = {p.name: p.read_bytes() for p in only.iterdir()}
    result = CliRunner().invoke(app, ["report", str(only)])
    assert result.exit_code == 2
    assert error_line(result) == (
        f"error: {only} holds nothing to plot (no mismatch, schedule, cost, rollouts, rewards, calibrated "
        f"threshold or training run; not drawn: {only / 'gsm8k.parquet'} is a Parquet file without Sparrow "
        f"artifact metadata; {only / 'prompts.parquet'} (a 'prompts' artifact has no figure); it also holds "
        "notes.csv, which is not Parquet)")
    assert {p.name: p.read_bytes() for p in only.iterdir()} == before


def test_the_run_directory_may_be_given_as_run(tmp_path):
    """`sparrow report --run RUN` as `sparrow sql --run RUN`; given twice, or not at all, one sentence."""
    from cli_checks import error_line

    run = _run_dir(tmp_path)
    result = CliRunner().invoke(app, ["report", "--run", str(run), "-o", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rep" / "index.html").is_file()
    twice = error_line(CliRunner().invoke(app, ["report", str(run), "--run", str(tmp_path)]))
    assert twice == (f"error: the run directory was given twice, as {run} and as --run {tmp_path}; give it "
                     "once")
    assert error_line(CliRunner().invoke(app, ["report"])) == (
        "error: give the run directory to draw: sparrow report RUN (or --run RUN)")


def test_a_training_runs_completions_are_said_not_drawn_and_never_said_drawn_elsewhere(tmp_path):
    """report.md: what is left out is said. A run's completions/ (text) has no figure: the report of the run
    says so, and the report of the folder that holds the run does not send the user there for it."""
    import shutil

    run, full = _training_run(tmp_path, "p4")
    (run / "completions").mkdir()
    shutil.copy(full / "rollouts.parquet", run / "completions" / "step=00001.parquet")
    why = "a training run's sampled completions, text that no figure draws; `sparrow sql` reads them"
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert _not_drawn(result) == [f"{run / 'completions'} ({why})"]
    parent = tmp_path / "pipeline"
    parent.mkdir()
    shutil.copytree(run, parent / "train", ignore=shutil.ignore_patterns("report"))
    result = CliRunner().invoke(app, ["report", str(parent)])
    assert result.exit_code == 0, result.output
    assert _not_drawn(result) == [
        f"{parent / 'train' / 'schedule.parquet'} (inside the training run train; `sparrow report "
        f"{parent / 'train'}` draws it)", f"{parent / 'train' / 'completions'} ({why})"]


def test_a_file_name_with_a_control_character_is_escaped_in_the_figure_and_the_page(tmp_path):
    """A name holding ESC (a terminal's escape sequence) is shown as \\x1b in the PNG's title and the page,
    as a terminal is shown it: never drawn as a missing glyph (a matplotlib warning on stderr) nor written
    raw into the HTML."""
    import shutil
    import warnings

    full = _run_dir(tmp_path / "source")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(full / "mismatch.parquet", run / "a\x1b[2Jb.parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's missing-glyph UserWarning would fail the report
        result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    page = (run / "report" / "index.html").read_text()
    assert "\x1b" not in page and "a\\x1b[2Jb.parquet" in page


def test_a_training_run_that_has_written_its_schedule_alone_is_not_drawn_as_a_folder_of_parts(tmp_path):
    """As `sparrow train -o run/train` starts, its folder holds its schedule and its lock file: the report of
    run/ says so instead of drawing the folder as a schedule artifact's parts."""
    import shutil

    from sparrow.schemas.locations import hold_folder, release_folder

    full = _run_dir(tmp_path / "source")
    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    shutil.copy(full / "cost.parquet", run / "cost.parquet")
    hold_folder(run / "train", "sparrow train", "another run directory (-o)")
    try:
        shutil.copy(full / "schedule.parquet", run / "train" / "schedule.parquet")
        result = CliRunner().invoke(app, ["report", str(run)])
    finally:
        release_folder(run / "train")
    assert result.exit_code == 0, result.output
    assert _not_drawn(result) == [
        f"{run / 'train'} (a Sparrow command's output folder, not an artifact's parts: a training run "
        "that has logged no step yet, say; `sparrow report` draws it once it has)"]
    assert set(_embedded((run / "report" / "index.html").read_text())) == {"cost.png"}


def test_a_tail_drawn_against_another_threshold_than_the_schedules_is_warned_about(tmp_path):
    """report.md: the tail figure and the schedule beside it tell one story. A threshold artifact (the prior
    0.86) beside a schedule planned at 0.5: the tail is drawn against the artifact's, and a warning says the
    schedule answers to another."""
    import shutil

    full = _run_dir(tmp_path / "source")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("mismatch.parquet", "threshold.parquet"):
        shutil.copy(full / name, run / name)
    write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [64], "tail": [0.9],
                    "predicted_step_seconds": [None]}, run / "schedule.parquet", "schedule",
                   metadata={"page_size": 16, "threshold": 0.5, "quantile": 0.05})
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert ("warning: the tail of mismatch.parquet is drawn against threshold.parquet's threshold 0.86, but "
            "the folder's schedules were planned at another (schedule.parquet at 0.5): their budgets answer "
            "to that one") in " ".join(result.stderr.split())
