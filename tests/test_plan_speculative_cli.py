"""`plan-schedule --speculate` as a user meets it: the draft artifact says what the drafts are, a plan
slower than dense is said to be slower, thin bins are thin for the drafts too, the lengths' defaults are
the ones the help names, and the json output carries the K and the speedups."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.calibrate import PRIOR_NOTE, ResolvedThreshold
from sparrow.stages.cost import analytic
from sparrow.stages.model.presets import get_preset
from sparrow.stages.speculative_plan import format_speedup, mean_alpha, plan_speculation

from cli_checks import error_line

runner = CliRunner()
WIDTH = 256
COLUMNS = ("prompt_id", "sample", "position", "bin", "budget", "token_id", "alpha", "logp_dense",
           "logp_sparse", "log_ratio", "k1", "k2", "k3", "entropy_dense")


def _rows(cells) -> dict[str, list]:
    """Mismatch rows of smollm2-135m: for each (trajectory, positions, alpha), every position scored at
    budgets 48 and 96 with that alpha."""
    rows = {c: [] for c in COLUMNS}
    for trajectory, positions, alpha in cells:
        for pos in positions:
            for budget in (48, 96):
                for c, v in zip(COLUMNS, (trajectory, 0, int(pos), int(pos) // WIDTH, budget, 1, alpha, -1.0,
                                          -1.0, 0.0, 0.0, 0.0, 0.0, 1.0)):
                    rows[c].append(v)
    return rows


def _profile(tmp_path, cells, name: str = "m.parquet"):
    return write_artifact(_rows(cells), tmp_path / name, "mismatch",
                          metadata={"model": "smollm2-135m", "bin_width": WIDTH})


def _plan(*args):
    return runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", *map(str, args)])


def _low_tail_profile(tmp_path):
    """Bin 0 holds 20 positions (thin at the default --min-tokens of 50), bin 1 holds 200; alpha spreads
    from 0.6 to 1, so no budget's tail reaches the prior 0.86 and the lossy plan is dense."""
    rng = np.random.default_rng(3)
    cells = [("p", [p], a) for p, a in zip(range(236, 256), rng.uniform(0.6, 1.0, 20))]
    cells += [("p", [p], a) for p, a in zip(range(256, 456), rng.uniform(0.6, 1.0, 200))]
    return _profile(tmp_path, cells)


def test_the_draft_artifact_describes_the_drafts_not_the_lossy_plan(tmp_path):
    """The lossy plan at the prior is dense in every bin; the drafts are sparse. The draft artifact and its
    json export carry no threshold or tail claim of the lossy plan, and its notes speak of the drafts."""
    profile, out, exported = _low_tail_profile(tmp_path), tmp_path / "draft.parquet", tmp_path / "d.json"
    r = _plan("--profile", profile, "--speculate", "-o", out, "--export", "json", "--export-to", exported)
    assert r.exit_code == 0, r.output
    assert "no profiled budget reaches a tail of 0.86" in r.stderr  # the lossy plan is dense
    budgets = read_artifact(out, "schedule").column("budget").to_pylist()
    assert all(b in (48, 96) for b in budgets)
    meta = artifact_metadata(out)
    assert not {"threshold", "threshold_source", "quantile"} & set(meta)
    notes = json.loads(meta["notes"])
    assert notes and not any("tail" in n or "dense" in n.split(":")[0] for n in notes)
    assert any(n.startswith("bin 0 (0-256): fewer profiled tokens than --min-tokens (50)") for n in notes)
    form = json.loads(exported.read_text())
    assert form["threshold"] is None and all(b["tail"] is None for b in form["bins"])
    assert [b["budget"] for b in form["bins"]] == budgets


def test_the_threshold_source_names_the_prior_once(tmp_path):
    """SmolLM2-135M ships no calibration, so the lossy artifact's threshold is the published prior's, said
    once, not "published prior (published prior (...": in the artifact, the printed account and the
    threshold's own source."""
    out = tmp_path / "lossy.parquet"
    r = _plan("--profile", _low_tail_profile(tmp_path), "-o", out)
    assert r.exit_code == 0, r.output
    meta = artifact_metadata(out)
    assert meta["threshold_source"] == PRIOR_NOTE and meta["threshold_source"].count("published prior") == 1
    assert float(meta["threshold"]) == 0.86
    err = " ".join(r.stderr.split())
    assert err.count("published prior") == 1
    assert "published prior" in err.split("(Sparrow, arXiv 2606.08446): keep the per-bin 5th percentile")[0]
    shipped = ResolvedThreshold(0.8, 0.05, "shipped calibration for m", "a sweep of 12 runs")
    assert shipped.source == "shipped calibration for m (a sweep of 12 runs)"
    assert ResolvedThreshold(0.7, 0.05, "given").source == "given"


def test_speculation_slower_than_dense_is_said_plainly_and_no_rollout_is_advised(tmp_path):
    """A low alpha at short contexts: every K is predicted slower than dense. The user is told so (dense
    sampling is exact too) and not advised to roll out the drafts; -o still holds the drafts asked for,
    its notes carrying the same warning, and every printed speedup below 1 reads below 1."""
    cells = [("p", range(100, 500), 0.3)]
    out = tmp_path / "draft.parquet"
    r = _plan("--profile", _profile(tmp_path, cells), "--speculate", "--threshold", "0.2",
              "--min-tokens", "1", "-o", out)
    assert r.exit_code == 0, r.output
    meta = artifact_metadata(out)
    assert float(meta["predicted_speedup"]) < 1
    assert "roll out with: sparrow rollout" not in r.output
    warning = next(line for line in r.stderr.splitlines() if line.startswith("warning:"))
    assert warning.startswith("warning: speculation is not predicted to pay here (0.")
    assert "dense sampling is exact too" in warning and "--dense" in warning and str(out) in warning
    assert any(n.startswith("speculation is not predicted to pay here") for n in json.loads(meta["notes"]))
    assert meta["role"].endswith("; not predicted faster than dense)")
    assert read_artifact(out, "schedule").num_rows == 2 and int(meta["speculate"]) >= 1
    shown = re.findall(r"(\d+\.\d+)x", r.stderr.split("speculative (exact)")[1])
    speedups = json.loads(meta["speedups_by_k"])
    assert all(float(v) < 1 for v in speedups.values())
    assert [s for s in shown[2:] if not s.startswith("0.")] == []  # by K, all below 1


def test_speculation_that_pays_is_advised_without_a_warning(tmp_path):
    cells = [("p", range(3000, 4000), 0.97)]
    out = tmp_path / "draft.parquet"
    r = _plan("--profile", _profile(tmp_path, cells), "--speculate", "--threshold", "0.5", "-o", out)
    assert r.exit_code == 0, r.output
    k = int(artifact_metadata(out)["speculate"])
    assert f"roll out with: sparrow rollout --schedule {out} --speculate {k}" in r.stderr
    assert "warning: speculation" not in r.stderr
    assert "speculation is not" not in artifact_metadata(out)["notes"]
    assert artifact_metadata(out)["role"].endswith(f"--speculate {k})")


@pytest.mark.parametrize("speedup,shown", [(0.99556, "0.996x"), (0.9996, "0.9996x"),
                                           (0.99999996, "0.999999x"), (1.0, "1.000x"), (1.23456, "1.235x"),
                                           (0.744, "0.744x")])
def test_a_slowdown_never_prints_as_break_even(speedup, shown):
    assert format_speedup(speedup) == shown


def test_a_thin_bin_is_thin_for_the_drafts_too(tmp_path):
    """Bin 0 has 10 profiled positions at alpha 0.2, bin 1 has 200 at 0.95. At --min-tokens 50 the drafts'
    bin 0 is shown thin, as the lossy table shows it, and priced at bin 1's mean: the plan is the one of a
    profile without bin 0's tokens. At --min-tokens 5 its own 10 tokens are trusted."""
    few = [("p", range(246, 256), 0.2)]
    many = [("p", range(256, 456), 0.95)]
    profile = _profile(tmp_path, few + many)
    args = ["--profile", profile, "--speculate", "--threshold", "0.5", "-f", "json"]
    r = _plan(*args, "--min-tokens", "50")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schedule"][0]["tail"] is None  # the lossy plan's thin bin
    assert (doc["speculative"][0]["mean_alpha"], doc["speculative"][0]["tokens_per_cycle"]) == (None, None)
    assert doc["speculative"][1]["mean_alpha"] == pytest.approx(0.95)
    assert "bin 0 (0-256): fewer profiled tokens than --min-tokens (50), so its drafts are priced at the " \
           "mean alpha of bin 1" in r.stderr
    r = _plan(*args, "--min-tokens", "5")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["speculative"][0]["mean_alpha"] == pytest.approx(0.2)

    cost = analytic(get_preset("smollm2-135m").config, "h100")
    table = read_artifact(profile, "mismatch")
    alpha = mean_alpha(table, WIDTH, 2, min_tokens=50)
    assert alpha.thin.tolist() == [True, False]
    without = mean_alpha(table.filter(pa.compute.greater_equal(table["position"], 256)), WIDTH, 2)
    thin, bare = (plan_speculation(cost, a, 64, 246, 210) for a in (alpha, without))
    assert (thin.k, thin.budgets, thin.speedup) == (bare.k, bare.budgets, pytest.approx(bare.speedup))


def test_the_lengths_default_to_the_means_the_help_names(tmp_path):
    """Two trajectories: prompts of 100 and 300 tokens, 40 and 160 generated tokens. The plan is for their
    means (200 and 100), as --help says of --prompt-len and --gen-len."""
    profile = _profile(tmp_path, [("a", range(100, 140), 0.9), ("b", range(300, 460), 0.9)])
    r = _plan("--profile", profile, "--threshold", "0.5", "--min-tokens", "1")
    assert r.exit_code == 0, r.output
    assert "100 generated tokens after a 200-token prompt (the means over the profile's 2 trajectories)" \
           in r.stderr
    shown = " ".join(re.sub(r"[│╭╮╰╯─]", " ", runner.invoke(
        app, ["plan-schedule", "--help"], env={"COLUMNS": "500"}).stdout).split())
    gen = shown.split("--gen-len")[1].split("--prompt-len")[0]
    prompt = shown.split("--prompt-len")[1].split("--max-num-seqs")[0]
    for text in (gen, prompt):
        assert "with a measured one, the mean over its trajectories" in text
        assert "longest" not in text and "shortest" not in text


def test_json_carries_the_k_and_the_speedups(tmp_path):
    """-f json: beside the tables, the chosen K and the predicted speedups under their own keys, the same
    numbers that the draft artifact records."""
    out = tmp_path / "draft.parquet"
    r = _plan("--profile", _profile(tmp_path, [("p", range(3000, 4000), 0.97)]), "--speculate",
              "--threshold", "0.5", "-o", out, "-f", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    meta = artifact_metadata(out)
    assert doc["speculate"] == int(meta["speculate"])
    assert doc["speculative_speedup"] == pytest.approx(float(meta["predicted_speedup"]))
    assert doc["speculative_speedup"] == pytest.approx(max(doc["speedups_by_k"].values()))
    assert doc["speedups_by_k"][str(doc["speculate"])] == pytest.approx(doc["speculative_speedup"])
    assert sorted(doc["speedups_by_k"], key=int) == [str(k) for k in range(1, 9)]
    assert doc["lossy_speedup"] > 0 and len(doc["speculative"]) == len(doc["schedule"])


def test_a_lossy_plan_predicted_slower_than_dense_is_dense_and_said(tmp_path):
    """A cost model whose scored pages cost more than the KV they save (a step's page term at a
    millisecond): the sparse budgets the tails ask for would make the rollout slower than dense, so the
    cheapest schedule is dense, which the plan says in one warning with what to do."""
    from dataclasses import replace

    from sparrow.stages.cost import cost_table

    cfg = get_preset("smollm2-135m").config
    slow = analytic(cfg, "h100")
    slow = replace(slow, coefficients={**slow.coefficients, "page": 1e-3}, source="measured:cpu")
    cost = tmp_path / "cost.parquet"
    write_artifact(cost_table(slow, "smollm2-135m", "cpu", [(1, 512, 0, 1.0), (2, 1024, 48, 1.0)]), cost,
                   "cost", metadata=slow.metadata() | {"model": "smollm2-135m"})
    cells = [("p", range(236, 456), 0.99)]  # every tail above the threshold: the plan is sparse
    r = _plan("--profile", _profile(tmp_path, cells), "--cost", cost, "--threshold", "0.5",
              "--min-tokens", "1", "-o", tmp_path / "s.parquet")
    assert r.exit_code == 0, r.output
    err = " ".join(r.stderr.split())
    assert "warning: the cost model prices every budget that reaches 0.5 above dense decoding for" in err
    assert "so the schedule is dense: roll out --dense, or plan for longer contexts (--gen-len)" in err
    assert read_artifact(tmp_path / "s.parquet").column("budget").to_pylist() in ([None, None], [0, 0])
    assert "predicted decode speedup over dense (prefill excluded): 1.000x" in err
    fast = _plan("--profile", _profile(tmp_path, cells, "m2.parquet"), "--threshold", "0.5", "--min-tokens",
                 "1")  # the analytic H100 model: 1.19x
    assert fast.exit_code == 0 and "predicted slower than dense" not in fast.stderr


def test_the_plan_says_which_alpha_priced_the_drafts(tmp_path):
    """A profile with alpha_draft in every row prices the drafts at it and says so (stderr and -f json's
    `priced_at`); without it the lossy alpha, with the note that the speedups are then conservative."""
    rows = _rows([("p", range(3000, 3400), 0.9)])
    rows["alpha_draft"] = [0.97] * len(rows["alpha"])
    spec = _profile(tmp_path, [("p", range(3000, 3400), 0.9)])
    drafted = write_artifact(rows, tmp_path / "drafted.parquet", "mismatch",
                             metadata={"model": "smollm2-135m", "bin_width": WIDTH})
    for profile, priced_at in ((drafted, "alpha_draft"), (spec, "alpha")):
        r = _plan("--profile", profile, "--speculate", "--threshold", "0.5", "-f", "json")
        assert r.exit_code == 0, r.output
        doc, said = json.loads(r.stdout), " ".join(r.stderr.split())
        assert doc["priced_at"] == priced_at
        assert ("drafts priced at the profile's alpha_draft" in said) == (priced_at == "alpha_draft")
        assert ("drafts priced at the profile's lossy alpha" in said) == (priced_at == "alpha")
        expected = 0.97 if priced_at == "alpha_draft" else 0.9
        priced = [row["mean_alpha"] for row in doc["speculative"] if row["mean_alpha"] is not None]
        assert priced and priced == [pytest.approx(expected)] * len(priced)


def test_the_json_export_names_the_profile_as_the_schedule_records_it(tmp_path, monkeypatch):
    """The path given, absolute, as the schedule's metadata `profile` holds it, whatever the working
    directory; a reference profile by its name."""
    _profile(tmp_path, [("p", range(236, 456), 0.99)])
    monkeypatch.chdir(tmp_path)
    r = _plan("--profile", "m.parquet", "--threshold", "0.5", "--min-tokens", "1", "--export", "json", "-o",
              "s.parquet")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["source"] == str(tmp_path / "m.parquet")
    assert artifact_metadata(tmp_path / "s.parquet")["profile"] == str(tmp_path / "m.parquet")
    r = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--export", "json"])
    assert json.loads(r.stdout)["source"] == "reference:qwen3-4b"


def test_a_profile_with_rows_missing_at_one_budget_is_refused(tmp_path):
    """Every token is scored at every budget: a file filtered on something besides the budget (here the
    alpha of budget 48's rows) compares tails of different tokens, so it is refused naming the bin."""
    rows = _rows([("p", range(236, 456), 0.9)])
    keep = [i for i, (b, p) in enumerate(zip(rows["budget"], rows["position"])) if not (b == 48 and p < 246)]
    cut = write_artifact({c: [rows[c][i] for i in keep] for c in COLUMNS}, tmp_path / "cut.parquet",
                         "mismatch", metadata={"model": "smollm2-135m", "bin_width": WIDTH})
    r = _plan("--profile", cut, "--threshold", "0.5", "--min-tokens", "1")
    assert error_line(r) == (f"error: {cut}: bin 0 holds 20 tokens at budget 96 but 10 at budget 48, where a "
                             "profile scores every token at every budget, so rows are missing (a filtered or "
                             "truncated file?); profile again, or keep the same tokens at every budget")
