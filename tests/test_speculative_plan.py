"""`plan-schedule --speculate` (stages/speculative_plan.py) against a brute force over every K and every
non-decreasing assignment of profiled budgets to bins, written from the pricing the module documents."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact
from sparrow.stages.cost import analytic
from sparrow.stages.model.presets import get_preset
from sparrow.stages.speculative_plan import LOSSY_ALPHA_NOTE, mean_alpha, plan_speculation

runner = CliRunner()
BUDGETS = (256, 1024, 4096)
WIDTH = 8192


def _mismatch(alphas: np.ndarray, per_cell: int = 60) -> pa.Table:
    """Tokens spread over the bins, per budget alpha drawn around alphas[bin, budget]."""
    rng = np.random.default_rng(0)
    rows = {"position": [], "budget": [], "alpha": []}
    for i, j in itertools.product(range(alphas.shape[0]), range(alphas.shape[1])):
        pos = rng.integers(i * WIDTH, (i + 1) * WIDTH, per_cell)
        rows["position"] += pos.tolist()
        rows["budget"] += [BUDGETS[j]] * per_cell
        rows["alpha"] += np.clip(alphas[i, j] + rng.normal(0, 0.01, per_cell), 0, 1).tolist()
    return pa.table(rows)


def _brute_force(cost, means, batch, prompt_len, gen_len, kept: bool):
    """The best speedup over every K and assignment: a cycle is a draft step at the bin's budget, K - 1
    more (on the first one's pages when `kept`: the page-scoring feature, the last, is not paid), and a
    dense forward whose per-row feature is paid K + 1 times."""
    contexts = np.arange(prompt_len + 1, prompt_len + gen_len)
    bins = np.minimum(contexts // WIDTH, means.shape[0] - 1)
    dense = float(cost.step_seconds(batch, contexts, 0).sum())
    best = 0.0
    for k in range(1, 9):
        f = cost.features(batch, contexts, 0).copy()
        f[..., 1] *= k + 1
        verify = f @ cost.vector
        for choice in itertools.combinations_with_replacement(range(len(BUDGETS)), means.shape[0]):
            total = 0.0
            for i, j in enumerate(choice):
                at = bins == i
                a = means[i, j]
                tokens = sum(a ** n for n in range(k + 1))
                draft = cost.features(batch, contexts[at], BUDGETS[j])
                later = draft * ([1, 1, 1, 0] if kept else 1)
                cycle = draft @ cost.vector + (k - 1) * (later @ cost.vector) + verify[at]
                total += float(cycle.sum()) / tokens
            best = max(best, dense / total)
    return best


@pytest.mark.parametrize("alphas", [
    np.array([[0.97, 0.99, 1.0], [0.85, 0.95, 0.99], [0.7, 0.9, 0.98]]),
    np.array([[0.5, 0.6, 0.7], [0.99, 0.995, 1.0], [0.6, 0.97, 0.99]]),  # the best budgets would decrease
])
@pytest.mark.parametrize("source", ["analytic:h100", "measured:cpu"])
def test_the_plan_is_the_brute_force_optimum(alphas, source):
    """A GPU's cost model prices the later drafts on kept pages (the static step's), a CPU's measured one
    at every draft's own selection (the plain step's)."""
    cost = replace(analytic(get_preset("qwen3-4b").config, "h100"), source=source)
    table = _mismatch(alphas)
    alpha = mean_alpha(table, WIDTH, 3)
    plan = plan_speculation(cost, alpha, 64, 1024, 3 * WIDTH - 1024)
    want = _brute_force(cost, alpha.mean, 64, 1024, 3 * WIDTH - 1024, kept=source.startswith("analytic"))
    assert plan.speedup == pytest.approx(want, rel=1e-9)
    assert plan.budgets == sorted(plan.budgets)
    assert plan.speedups_by_k[plan.k] == max(plan.speedups_by_k.values())


def test_cli_plans_drafts_that_rollout_reads(tmp_path):
    profile = tmp_path / "m.parquet"
    from sparrow.schemas import write_artifact

    n = 200
    rng = np.random.default_rng(1)
    pos = np.repeat(rng.integers(100, 500, n // 2), 2)  # each token at both budgets
    zeros = [0.0] * n
    write_artifact({"prompt_id": ["p"] * n, "sample": [0] * n, "position": pos.tolist(),
                    "bin": (pos // 256).tolist(), "budget": [48, 96] * (n // 2), "token_id": [1] * n,
                    "alpha": rng.uniform(0.7, 1.0, n).tolist(), "logp_dense": [-1.0] * n,
                    "logp_sparse": [-1.0] * n, "log_ratio": zeros, "k1": zeros, "k2": zeros, "k3": zeros,
                    "entropy_dense": [1.0] * n},
                   profile, "mismatch", metadata={"model": "smollm2-135m", "bin_width": 256, "page_size": 16})
    out = tmp_path / "draft.parquet"
    r = runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile", str(profile),
                            "--speculate", "--threshold", "0.5", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "speculative (exact)" in r.output and "by K:" in r.output
    meta = artifact_metadata(out)
    assert 1 <= int(meta["speculate"]) <= 8
    assert read_artifact(out, "schedule").column("budget").to_pylist() in ([48, 48], [48, 96], [96, 96])
    r = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--speculate"])
    assert r.exit_code != 0 and "measured --profile" in r.output


def test_bins_without_profiled_tokens_are_marked_thin_not_given_made_up_values(tmp_path):
    """Tokens only in bin 1 (positions 300-499, bins of 256): bin 0 has no mean alpha to show, so the table
    marks it thin, as the lossy table marks its tail, and no 0.000 / 1.00 appears for it."""
    import json

    from sparrow.schemas import write_artifact

    n = 200
    rng = np.random.default_rng(2)
    pos = rng.integers(300, 500, n)
    zeros = [0.0] * n
    profile = write_artifact(
        {"prompt_id": ["p"] * n, "sample": [0] * n, "position": pos.tolist(), "bin": (pos // 256).tolist(),
         "budget": [48, 96] * (n // 2), "token_id": [1] * n, "alpha": rng.uniform(0.7, 1.0, n).tolist(),
         "logp_dense": [-1.0] * n, "logp_sparse": [-1.0] * n, "log_ratio": zeros, "k1": zeros, "k2": zeros,
         "k3": zeros, "entropy_dense": [1.0] * n},
        tmp_path / "m.parquet", "mismatch", metadata={"model": "smollm2-135m", "bin_width": 256})
    alpha = mean_alpha(read_artifact(profile, "mismatch"), 256, 2)
    plan = plan_speculation(analytic(get_preset("smollm2-135m").config, "h100"), alpha, 64, 0, 500)
    assert plan.mean_alpha[0] is None and plan.tokens_per_cycle[0] is None
    assert plan.notes == ["bin 0 (0-256): no profiled tokens, so its drafts are priced at the mean alpha of "
                          "bin 1, the first bin with enough", LOSSY_ALPHA_NOTE]
    assert 0.7 < plan.mean_alpha[1] < 1 and plan.tokens_per_cycle[1] > 1
    assert plan.speedup > 0.5  # bin 0's positions are priced at bin 1's mean alpha, not as impossible
    out = tmp_path / "draft.parquet"
    r = runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile", str(profile),
                            "--speculate", "--threshold", "0.5", "--min-tokens", "1", "--prompt-len", "0",
                            "--gen-len", "500", "-o", str(out), "-f", "json"])
    assert r.exit_code == 0, r.output
    speculative = json.loads(r.stdout)["speculative"]
    assert (speculative[0]["mean_alpha"], speculative[0]["tokens_per_cycle"]) == (None, None)
    assert json.loads(artifact_metadata(out)["speculative_tokens_per_cycle"])[0] is None
    r = runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile", str(profile),
                            "--speculate", "--threshold", "0.5", "--min-tokens", "1", "--prompt-len", "0",
                            "--gen-len", "500", "-f", "tsv"])
    rows = [line.split("\t") for line in r.stdout.splitlines()]  # tsv: the drafts, the schedule -o writes
    assert rows[0][-2:] == ["mean_alpha", "tokens_per_cycle"] and rows[1][-2:] == ["\\N", "\\N"]
    r = runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile", str(profile),
                            "--speculate", "--threshold", "0.5", "--min-tokens", "1", "--prompt-len", "0",
                            "--gen-len", "500", "-f", "table"])
    cells = [[c.strip() for c in line.strip().strip("│").split("│")] for line in r.stdout.splitlines()
             if line.strip().startswith("│")]
    assert next(c for c in cells if c[0] == "0" and len(c) == 6)[4:] == ["thin", "thin"]  # the drafts' bin 0


def _profile(tmp_path, positions=(100, 500), alpha=(0.7, 1.0)):
    """A smollm2-135m profile of one trajectory over `positions`, its alpha uniform in `alpha`, each token
    scored at both budgets."""
    from sparrow.schemas import write_artifact

    n = 200
    rng = np.random.default_rng(1)
    pos = np.repeat(rng.integers(*positions, n // 2), 2)
    zeros = [0.0] * n
    return write_artifact(
        {"prompt_id": ["p"] * n, "sample": [0] * n, "position": pos.tolist(), "bin": (pos // 256).tolist(),
         "budget": [48, 96] * (n // 2), "token_id": [1] * n, "alpha": rng.uniform(*alpha, n).tolist(),
         "logp_dense": [-1.0] * n, "logp_sparse": [-1.0] * n, "log_ratio": zeros, "k1": zeros, "k2": zeros,
         "k3": zeros, "entropy_dense": [1.0] * n},
        tmp_path / "m.parquet", "mismatch", metadata={"model": "smollm2-135m", "bin_width": 256})


@pytest.mark.parametrize("fmt", ["json", "csv", "tsv"])
def test_speculate_and_sweep_print_one_document_on_stdout(tmp_path, fmt):
    """The lossy schedule, the frontier and the drafts: one JSON object with a key per table, or one CSV/TSV
    table (the drafts, the schedule -o writes; the others on stderr), never two documents one after the
    other."""
    import csv
    import json

    r = runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile", str(_profile(tmp_path)),
                            "--speculate", "--sweep", "0.5,0.6", "--threshold", "0.5", "--min-tokens", "1",
                            "-f", fmt])
    assert r.exit_code == 0, r.output
    if fmt == "json":
        doc = json.loads(r.stdout)
        assert {"schedule", "frontier", "speculative", "speculate", "speculative_speedup",
                "speculation_pays", "lossy_speedup", "speedups_by_k", "speedup"} <= set(doc)
        assert doc["speculation_pays"] == (doc["speculative_speedup"] > 1)
        assert len(doc["frontier"]) == 2 and len(doc["speculative"]) == len(doc["schedule"])
        return
    rows = list(csv.reader(r.stdout.splitlines(), delimiter="," if fmt == "csv" else "\t"))
    assert rows[0] == ["bin", "start", "end", "draft_budget", "mean_alpha", "tokens_per_cycle"]
    assert all(len(row) == 6 for row in rows[1:])
    assert "dense_ms" in r.stderr and "frontier" in r.stderr


def test_the_export_holds_the_schedule_that_o_writes(tmp_path):
    """With --speculate, -o writes the drafts, so --export json exports the drafts (with their K), and the
    rollout command names that -o (long contexts and a high alpha: speculation pays); sglang-vortex, a lossy
    schedule for SGLang, is refused beside it."""
    import json

    profile = _profile(tmp_path, positions=(3000, 4000), alpha=(0.9, 1.0))
    out, exported = tmp_path / "draft.parquet", tmp_path / "draft.json"
    args = ["plan-schedule", "--model", "smollm2-135m", "--profile", str(profile), "--speculate",
            "--threshold", "0.5", "--min-tokens", "1"]
    r = runner.invoke(app, [*args, "--export", "json", "--export-to", str(exported), "-o", str(out)])
    assert r.exit_code == 0, r.output
    form = json.loads(exported.read_text())
    assert [b["budget"] for b in form["bins"]] == read_artifact(out, "schedule").column("budget").to_pylist()
    assert form["speculate"] == int(artifact_metadata(out)["speculate"])
    assert f"roll out with: sparrow rollout --schedule {out} --speculate {form['speculate']}" in r.stderr
    r = runner.invoke(app, [*args, "--export", "sglang-vortex", "--export-to", str(tmp_path / "v.json")])
    assert r.exit_code == 2 and r.output.strip().startswith("error: --export sglang-vortex names a lossy")
    assert not (tmp_path / "v.json").exists()


def test_drafts_are_priced_at_their_own_alpha_where_the_profile_has_it():
    """A profile with alpha_draft (profile --draft-alpha) prices drafts at it, with no note; without it,
    at the lossy alpha, with the note that says the speedups are then conservative."""
    n = 400
    rng = np.random.default_rng(5)
    table = pa.table({"position": rng.integers(0, 2 * WIDTH, n), "budget": [1024] * n,
                      "alpha": np.full(n, 0.8), "alpha_draft": np.full(n, 0.95)})
    cost = analytic(get_preset("qwen3-4b").config, "h100")
    drafts = plan_speculation(cost, mean_alpha(table, WIDTH, 2), 64, 1024, 2 * WIDTH - 1024)
    lossy = plan_speculation(cost, mean_alpha(table.drop_columns(["alpha_draft"]), WIDTH, 2), 64, 1024,
                             2 * WIDTH - 1024)
    assert drafts.mean_alpha == [pytest.approx(0.95)] * 2 and LOSSY_ALPHA_NOTE not in drafts.notes
    assert lossy.mean_alpha == [pytest.approx(0.8)] * 2 and LOSSY_ALPHA_NOTE in lossy.notes
    assert drafts.speedup > lossy.speedup
