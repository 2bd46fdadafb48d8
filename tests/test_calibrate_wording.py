"""calibrate-threshold's verdicts read one way: `what: no separation, why` for the tails (in the threshold's
note and each margin's line), the mean of alpha and the KV read alike, with no parenthesis inside another;
the command prints the threshold, the mean's line, the KV read's and the margins' in that order, and
docs/calibration.md shows its block in that order and wording. Expected lines are written out here."""

import re
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.calibrate import RunResult, calibrate, separation

runner = CliRunner()
DOC = Path(__file__).resolve().parents[1] / "docs" / "calibration.md"
PRIOR = ("threshold 0.8600 (prior): published prior (Sparrow, arXiv 2606.08446): keep the per-bin 5th "
         "percentile above 0.86; published range 0.85-0.90 (no confidence interval was published); ")


def nested(text: str) -> bool:
    """Whether a parenthesis opens inside another."""
    depth = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth > 1:
            return True
    return False


def test_each_statistic_says_no_separation_one_way():
    c = np.array([True, False])
    assert separation(np.array([0.6629, 0.4023]), None, c, "KV read").line() == (
        "KV read: no separation, collapsed runs up to 0.6629 overlap stable runs from 0.4023")
    assert separation(np.array([0.5, 0.6]), None, np.array([False, False]), "mean alpha").line() == (
        "mean alpha: no separation, no run collapsed")
    assert separation(np.array([0.5, 0.6]), None, np.array([True, True]), "tails").line() == (
        "tails: no separation, all runs collapsed")


def test_a_separating_statistic_with_draws_nests_no_parentheses():
    c = np.array([True, False])
    draws = np.array([[0.2, 0.4], [0.3, 0.5], [0.9, 0.1], [0.1, 0.3]])  # boundaries 0.3, 0.4, none, 0.2
    line = separation(np.array([0.3, 0.5]), draws, c, "tails", seed=7).line()
    lo, hi = np.quantile([0.3, 0.4, 0.2], [0.025, 0.975])
    assert line == (f"tails: boundary 0.4000, identified set [0.3000, 0.5000], 95% interval "
                    f"{lo:.4f}-{hi:.4f} over the bootstrap draws in which the runs separate, 75% of "
                    "them; 1 collapsed run <= 0.3000, 1 stable run >= 0.5000; 4 bootstrap draws from "
                    "seed 7 over the profile's prompts and their tokens")
    assert not nested(line)


def test_the_prior_note_and_the_mean_line_read_as_the_kv_line():
    runs = [RunResult("c", 0.5325, ["x"], mean=0.8823, kv_read=0.6629),
            RunResult("s", 0.1824, [], mean=0.8793, kv_read=0.4023)]
    cal = calibrate(runs, n_boot=0, model="no-such-model")
    assert f"threshold {cal.threshold:.4f} ({cal.source}): {cal.note}" == (
        PRIOR + "tails: no separation, collapsed runs up to 0.5325 overlap stable runs from 0.1824")
    assert cal.mean_note == ("mean alpha: no separation, collapsed runs up to 0.8823 overlap stable runs "
                             "from 0.8793")
    assert cal.separations[2].line() == (
        "KV read: no separation, collapsed runs up to 0.6629 overlap stable runs from 0.4023")
    assert not any(nested(s) for s in (cal.note, cal.mean_note, cal.separations[2].line()))


def _profile(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """5 prompts x 4 tokens at positions 600-619 (one bin), budgets 80 and 128: alpha 0.10..0.86 at 80,
    0.05 more at 128."""
    n = 20
    position = np.arange(600, 600 + n)
    a80 = np.linspace(0.10, 0.86, n)
    rows = {"prompt_id": [f"p{i // 4}" for i in range(n)] * 2, "sample": [0] * 2 * n,
            "position": [*position, *position], "bin": [1] * 2 * n, "budget": [80] * n + [128] * n,
            "token_id": [1] * 2 * n, "alpha": [*a80, *(a80 + 0.05)], "logp_dense": [-1.0] * 2 * n,
            "logp_sparse": [-1.0] * 2 * n, "log_ratio": [0.0] * 2 * n, "k1": [0.0] * 2 * n,
            "k2": [0.0] * 2 * n, "k3": [0.0] * 2 * n, "entropy_dense": [1.0] * 2 * n}
    write_artifact(rows, path, "mismatch", metadata={"bin_width": 512, "model": "no-such-model",
                                                     "page_size": 16})
    return position, a80, a80 + 0.05


def _run(root: Path, name: str, budget: int, collapsed: bool) -> Path:
    """A run whose reward falls to 0.05 at step 30 when `collapsed` (its own curves label it)."""
    steps = np.arange(60)
    reward = np.minimum(0.2 + steps * 0.01, 0.6)
    reward = np.where(steps >= 30, 0.05, reward) if collapsed else reward
    write_artifact({"run_id": ["r"] * 60, "step": steps, "reward_mean": reward, "grad_norm": np.ones(60),
                    "mismatch_kl": np.full(60, 0.001), "entropy": np.full(60, 0.5),
                    "truncation_rate": np.full(60, 0.1), "repetition_rate": np.zeros(60),
                    "reward_std": [None] * 60}, root / name / "metrics.parquet", "metrics")
    write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [budget], "tail": [None],
                    "predicted_step_seconds": [None]}, root / name / "schedule.parquet", "schedule")
    return root / name


def test_calibrate_threshold_prints_its_lines_in_this_order(tmp_path):
    position, a80, a128 = _profile(tmp_path / "m.parquet")
    collapsed, stable = _run(tmp_path, "c", 128, True), _run(tmp_path, "s", 80, False)
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(tmp_path / "m.parquet"), "--runs",
                            str(collapsed), str(stable), "--bootstrap", "5", "-o", str(out), "-f", "tsv"])
    assert r.exit_code == 0, r.output

    def overlap(c: float, s: float) -> str:
        return f"no separation, collapsed runs up to {c:.4f} overlap stable runs from {s:.4f}"

    tails = overlap(np.quantile(a128, 0.05), np.quantile(a80, 0.05))
    said = [line for line in r.stderr.splitlines() if not line.startswith("warning")]
    assert said == [PRIOR + f"tails: {tails}",
                    f"mean alpha: {overlap(a128.mean(), a80.mean())}",
                    f"KV read: {overlap(np.mean(128 / position), np.mean(80 / position))}",
                    *(f"margin {m}: 1 of 2 runs collapsed; tails: {tails}"
                      for m in ("0.05", "0.1", "0.15", "0.2")),
                    f"wrote {out}"]


def test_the_docs_block_is_in_the_commands_order_and_wording():
    """docs/calibration.md's block: the threshold line first, then the mean's, the KV read's, the margins';
    each overlap line as the code words it for the numbers the block states."""
    text = DOC.read_text()
    block = text.split("`calibrate-threshold` over these runs", 1)[1].split("```text\n", 1)[1].split("```")[0]
    lines = block.splitlines()
    heads = [line.split(":", 1)[0] for line in lines]
    assert heads == ["threshold 0.8600 (prior)", "mean alpha", "KV read", "margin 0.05", "margin 0.1",
                     "margin 0.15", "margin 0.2"]
    assert lines[0].startswith(PRIOR + "tails: no separation, collapsed runs up to ")
    for line in lines:
        found = re.search(r"collapsed runs up to (\S+) overlap stable runs from (\S+)$", line)
        c, s = map(float, found.groups())
        what = "tails" if not line.startswith(("mean alpha", "KV read")) else line.split(":")[0]
        assert line.endswith(separation(np.array([c, s]), None, np.array([True, False]), what).line())
        assert not nested(line)
