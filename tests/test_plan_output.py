"""What `plan-schedule`, `calibrate-threshold` and `fit-cost` print, held to expectations computed here:
csv and tsv lose nothing (whole floats, nulls), the headline speedup is the whole rollout's with the
prompt's dense prefill on both sides (or says it is decode alone), -f json is one object whatever the
flags, a stable run's notes are not collapse reasons, fit-cost refuses a grid value listed twice and
timing flags beside --hardware, and under --speculate stdout's csv is the draft schedule -o writes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.cost import HARDWARE, analytic, write_fitted
from sparrow.stages.model.presets import get_preset

runner = CliRunner()
MODEL = "smollm2-135m"
WIDTH = 256
PROMPT, GENERATED = 300, 160  # the profile's one trajectory: positions 300-459
COLUMNS = ("prompt_id", "sample", "position", "bin", "budget", "token_id", "alpha", "logp_dense",
           "logp_sparse", "log_ratio", "k1", "k2", "k3", "entropy_dense")


def _profile(path: Path, seed: int = 0) -> tuple[Path, np.ndarray]:
    """A smollm2-135m profile of one trajectory (positions 300-459, so bin 0 has no token and bin 1 is the
    open last bin), each position scored at budgets 48 and 96 -> (path, the alphas at budget 48)."""
    rng = np.random.default_rng(seed)
    rows = {c: [] for c in COLUMNS}
    at48 = []
    for pos in range(PROMPT, PROMPT + GENERATED):
        for budget in (48, 96):
            alpha = float(rng.uniform(0.6, 1.0))
            at48 += [alpha] if budget == 48 else []
            for c, v in zip(COLUMNS, ("p", 0, pos, pos // WIDTH, budget, 1, alpha, -1.0, -1.0, 0.0, 0.0, 0.0,
                                      0.0, 1.0)):
                rows[c].append(v)
    write_artifact(rows, path, "mismatch", metadata={"model": MODEL, "bin_width": WIDTH})
    return path, np.array(at48)


def _plan(*args) -> object:
    r = runner.invoke(app, ["plan-schedule", "--model", MODEL, "--threshold", "0.5", "--min-tokens", "1",
                            *map(str, args)])
    assert r.exit_code == 0, r.output
    return r


def _error_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    return lines[0]


# ---------------------------------------------------------------- csv and tsv lose nothing


def test_csv_and_tsv_of_the_plan_hold_whole_floats_and_nulls(tmp_path):
    """The tail is numpy's 5th percentile of the profile's alpha at the chosen budget, the step times the
    cost model's at mid-bin, both as they are (not rounded); bin 0's missing tail and the last bin's open
    end are null (empty in CSV, \\N in TSV), never a word in a numeric column; the table still rounds."""
    profile, at48 = _profile(tmp_path / "m.parquet")
    cost = analytic(get_preset(MODEL).config, "h100")
    stored = at48.astype(np.float32).astype(np.float64)  # alpha is stored as float32
    expected_tail = float(np.percentile(stored, 5))  # the cheapest budget, 48, holds at 0.5
    mids = np.array([WIDTH // 2, WIDTH + WIDTH // 2])
    step_ms = cost.step_seconds(64, mids, np.array([48, 48])) * 1e3
    dense_ms = cost.step_seconds(64, mids, 0) * 1e3
    for fmt, sep, null in (("csv", ",", ""), ("tsv", "\t", "\\N")):
        rows = list(csv.reader(_plan("--profile", profile, "-f", fmt).stdout.splitlines(), delimiter=sep))
        header, first, last = rows[0], dict(zip(rows[0], rows[1])), dict(zip(rows[0], rows[2]))
        assert header == ["bin", "start", "end", "budget", "tail", "step_ms", "dense_ms"]
        assert (first["tail"], last["end"]) == (null, null)
        assert float(last["tail"]) == pytest.approx(expected_tail, rel=1e-12, abs=1e-12)
        for row, i in ((first, 0), (last, 1)):
            assert float(row["step_ms"]) == pytest.approx(step_ms[i], rel=1e-12)
            assert float(row["dense_ms"]) == pytest.approx(dense_ms[i], rel=1e-12)
            assert row["budget"] == "48"
    table = _plan("--profile", profile, "-f", "table").stdout
    assert "thin" in table and "open" in table and f"{expected_tail:.4f}" in table


def test_the_drafts_and_an_eviction_plan_in_csv_lose_nothing_too(tmp_path):
    """--speculate's draft table (stdout's csv) and an eviction plan's budgets: a thin bin's mean alpha
    and tokens per cycle null, floats whole."""
    profile, _ = _profile(tmp_path / "m.parquet")
    rows = list(csv.DictReader(_plan("--profile", profile, "--speculate", "-f", "csv").stdout.splitlines()))
    assert (rows[0]["mean_alpha"], rows[0]["tokens_per_cycle"], rows[1]["end"]) == ("", "", "")
    doc = json.loads(_plan("--profile", profile, "--speculate", "-f", "json").stdout)
    assert float(rows[1]["mean_alpha"]) == doc["speculative"][1]["mean_alpha"]
    table = read_artifact(profile, "mismatch").to_pylist()
    mean = float(np.mean([r["alpha"] for r in table if r["budget"] == int(rows[1]["draft_budget"])]))
    assert float(rows[1]["mean_alpha"]) == pytest.approx(mean, rel=1e-12)

    rng = np.random.default_rng(3)
    alphas = {b: rng.uniform(0.7, 1.0, 50) for b in (64, 128)}
    evict = [{"prompt_id": "p", "sample": 0, "position": 100 + i, "bin": 0, "budget": b, "token_id": 1,
              "alpha": float(a), "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0, "k1": 0.0,
              "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0} for b, v in alphas.items() for i, a in enumerate(v)]
    path = write_artifact(evict, tmp_path / "kv.parquet", "mismatch", metadata={
        "model": MODEL, "bin_width": WIDTH, "kv_compression": "snapkv", "budgets": "[64, 128]",
        "kv_policies": json.dumps([f"snapkv:{b},window=8,buffer=32,sink=4" for b in (64, 128)])})
    rows = list(csv.DictReader(_plan("--profile", path, "-f", "csv").stdout.splitlines()))
    for row in rows:
        a = alphas[int(row["kv_budget"])].astype(np.float32).astype(np.float64)  # stored as float32
        assert float(row["tail"]) == pytest.approx(np.percentile(a, 5), rel=1e-9)
        assert float(row["mean_alpha"]) == pytest.approx(a.mean(), rel=1e-9)


# ---------------------------------------------------------------- the headline: whole rollout or decode


def _by_hand_prefill(batch: int, prompt: int) -> float:
    """The dense prefill of `batch` prompts of `prompt` tokens on the h100 preset, counted here: every
    token through the weights (2 FLOPs a parameter; SmolLM2 ties its embedding, so all are active),
    query t attending to t positions in every layer (4 FLOPs per head dim per position), the weights read
    once and K and V written in bf16, plus the preset's fixed overhead."""
    cfg, hw = get_preset(MODEL).config, HARDWARE["h100"]
    assert cfg.tie_word_embeddings
    attention = sum(4 * cfg.num_heads * cfg.head_dim * t for t in range(1, prompt + 1)) * cfg.num_layers
    flops = batch * (2 * cfg.num_parameters * prompt + attention)
    written = batch * prompt * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    return hw.overhead + flops / hw.flops + (cfg.num_parameters * 2 + written) / hw.bandwidth


def _decode_seconds(cost, budgets_by_bin: list[int | None]) -> tuple[float, float]:
    """(dense, scheduled) decode seconds of the profile's trajectory: positions 301-459, each a step."""
    positions = np.arange(PROMPT + 1, PROMPT + GENERATED)
    budgets = np.array([budgets_by_bin[min(p // WIDTH, len(budgets_by_bin) - 1)] or 0 for p in positions])
    return (float(cost.step_seconds(64, positions, 0).sum()),
            float(cost.step_seconds(64, positions, budgets).sum()))


def test_the_headline_is_the_whole_rollout_with_the_prompts_prefill(tmp_path):
    """The analytic model prices the prompt's prefill, so the speedup printed, in json and in the
    artifact is (prefill + dense decode) / (prefill + scheduled decode), below decode alone."""
    profile, _ = _profile(tmp_path / "m.parquet")
    out = tmp_path / "s.parquet"
    r = _plan("--profile", profile, "-o", out, "-f", "json")
    doc = json.loads(r.stdout)
    prefill = _by_hand_prefill(64, PROMPT)
    dense, sparse = _decode_seconds(analytic(get_preset(MODEL).config, "h100"),
                                    [b["budget"] for b in doc["schedule"]])
    whole = (prefill + dense) / (prefill + sparse)
    assert doc["prefill_seconds"] == pytest.approx(prefill, rel=1e-9)
    assert doc["speedup"] == pytest.approx(whole, rel=1e-9)
    assert doc["decode_speedup"] == pytest.approx(dense / sparse, rel=1e-9) and whole < dense / sparse
    assert (doc["speedup_scope"], doc["prompt_len"], doc["gen_len"]) == ("rollout", PROMPT, GENERATED)
    assert f"predicted rollout speedup over dense (the prompt's dense prefill included): {whole:.3f}x" \
        in r.stderr
    meta = artifact_metadata(out)
    assert float(meta["predicted_speedup"]) == pytest.approx(whole, rel=1e-9)
    assert meta["speedup_scope"] == "rollout"
    assert float(meta["predicted_decode_speedup"]) == pytest.approx(dense / sparse, rel=1e-9)


def test_a_measured_cost_prices_no_prefill_and_says_the_speedup_is_decode_alone(tmp_path):
    """A cost artifact fitted to timed decode steps cannot price a prefill: the headline is labelled a
    decode speedup with the prefill excluded, and it is the ratio of the decode steps alone."""
    profile, _ = _profile(tmp_path / "m.parquet")
    cfg = get_preset(MODEL).config
    truth = analytic(cfg, "h100")
    points = [(b, c, k, float(truth.step_seconds(b, c, k))) for b in (1, 4) for c in (256, 512)
              for k in (0, 64)]
    cost_path = tmp_path / "cost.parquet"
    fitted, _ = write_fitted(cfg, MODEL, points, "cpu", 1, cost_path)
    out = tmp_path / "s.parquet"
    r = _plan("--profile", profile, "--cost", cost_path, "-o", out, "-f", "json")
    doc = json.loads(r.stdout)
    dense, sparse = _decode_seconds(fitted, [b["budget"] for b in doc["schedule"]])
    assert doc["speedup"] == pytest.approx(dense / sparse, rel=1e-9) == doc["decode_speedup"]
    assert (doc["speedup_scope"], doc["prefill_seconds"], doc["cost"]) == ("decode", None, "measured:cpu")
    assert f"predicted decode speedup over dense (prefill excluded): {dense / sparse:.3f}x" in r.stderr
    assert "prefill: not priced" in r.stderr
    assert artifact_metadata(out)["speedup_scope"] == "decode"


def test_the_cost_model_page_puts_the_prefill_on_both_sides_of_the_ratio():
    text = (Path(__file__).resolve().parents[1] / "docs" / "cost-model.md").read_text()
    assert "cancels out" not in text and "(P + D_dense) / (P + D_sparse)" in text


# ---------------------------------------------------------------- -f json: one object


def test_json_is_one_object_with_the_speedup_whatever_the_flags(tmp_path):
    """Plain, --sweep and --speculate: one object with the speedup fields and the bins; the flags add
    keys. The speedup is the one the artifact records; the lengths are the profile's trajectory's."""
    profile, _ = _profile(tmp_path / "m.parquet")
    out = tmp_path / "s.parquet"
    fields = {"speedup", "speedup_scope", "gen_len", "prompt_len", "batch", "cost", "schedule"}
    plain = json.loads(_plan("--profile", profile, "-o", out, "-f", "json").stdout)
    swept = json.loads(_plan("--profile", profile, "--sweep", "0.5,0.9", "-f", "json").stdout)
    drafts = json.loads(_plan("--profile", profile, "--speculate", "-f", "json").stdout)
    for doc in (plain, swept, drafts):
        assert isinstance(doc, dict) and fields <= set(doc)
        assert (doc["gen_len"], doc["prompt_len"], doc["batch"], doc["cost"]) == (GENERATED, PROMPT, 64,
                                                                                   "analytic:h100")
        assert doc["speedup"] == pytest.approx(float(artifact_metadata(out)["predicted_speedup"]))
        assert [b["bin"] for b in doc["schedule"]] == [0, 1]
    assert set(swept) - set(plain) == {"frontier"}
    assert {"speculative", "speculate", "speculative_speedup", "lossy_speedup"} <= set(drafts) - set(plain)
    assert swept["frontier"][0]["speedup"] == pytest.approx(plain["speedup"])  # threshold 0.5: the plan


# ---------------------------------------------------------------- --speculate: stdout is what -o writes


def test_under_speculate_csv_on_stdout_is_the_draft_schedule_that_o_writes(tmp_path):
    profile, _ = _profile(tmp_path / "m.parquet")
    out = tmp_path / "draft.parquet"
    r = _plan("--profile", profile, "--speculate", "-o", out, "-f", "csv")
    rows = list(csv.DictReader(r.stdout.splitlines()))
    written = read_artifact(out, "schedule")
    assert [int(row["draft_budget"]) for row in rows] == written.column("budget").to_pylist()
    assert [int(row["start"]) for row in rows] == written.column("bin_start").to_pylist()
    assert "stdout holds the draft schedule (the one -o writes)" in r.stderr and "dense_ms" in r.stderr
    shown = " ".join(runner.invoke(app, ["plan-schedule", "--help"], env={"COLUMNS": "500"}).stdout.split())
    assert "on stdout is that draft schedule" in shown


# ---------------------------------------------------------------- calibrate-threshold: notes apart


def _run(root: Path, name: str, sparsity: str, budgets: tuple) -> Path:
    """A healthy 16-step run (reward climbing, eval steady) of `sparsity`, with no step-0 sampler reward
    logged, so a sparse run beside its dense reference gets a note and no reason."""
    steps = 16
    step = np.arange(steps)
    trace = {"run_id": ["r"] * steps, "step": step, "reward_mean": 0.05 + 0.8 * step / (steps - 1),
             "grad_norm": np.ones(steps), "mismatch_kl": np.full(steps, 0.001),
             "entropy": np.full(steps, 0.5), "eval_accuracy": [0.6] + [None] * (steps - 2) + [0.6]}
    config = {"model": "smollm2-135m", "lr": 2e-4, "seed": 0, "sparsity": sparsity, "correction": "tis",
              "prompts_sha256": "abc", "steps": steps}
    write_artifact(trace, root / name / "metrics.parquet", "metrics", metadata={"config": json.dumps(config)})
    write_artifact({"bin": [0, 1], "bin_start": [0, 1024], "bin_end": [1024, None], "budget": list(budgets),
                    "tail": [None, None], "predicted_step_seconds": [None, None]},
                   root / name / "schedule.parquet", "schedule")
    return root / name


def test_a_stable_runs_notes_are_a_column_of_their_own_and_kept_in_the_artifact(tmp_path):
    profile, _ = _profile(tmp_path / "m.parquet")
    dense = _run(tmp_path, "dense", "dense", (None, None))
    sparse = _run(tmp_path, "b48", "budget:48", (48, 48))
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(profile), "--bootstrap", "5", "-o",
                            str(out), "-f", "tsv", "--runs", str(dense), str(sparse)])
    assert r.exit_code == 0, r.output
    lines = [line.split("\t") for line in r.stdout.splitlines()]
    rows = {Path(row["run"]).name: row for row in (dict(zip(lines[0], line)) for line in lines[1:])}
    assert lines[0][7:] == ["reasons", "notes", "warnings"]
    assert rows["b48"]["label"] == "stable" and rows["b48"]["reasons"] == ""
    assert rows["b48"]["notes"].startswith("no step-0 sampler reward logged")
    recorded = {Path(x["run"]).name: x for x in json.loads(artifact_metadata(out)["runs"])}
    assert recorded["b48"]["reasons"] == [] and recorded["b48"]["notes"] == [rows["b48"]["notes"]]


# ---------------------------------------------------------------- fit-cost: refused before any timing


@pytest.fixture
def no_timing(monkeypatch):
    import sparrow.stages.cost as cost

    def refuse(*args, **kwargs):
        raise AssertionError("timed although the command line should have been refused")

    monkeypatch.setattr(cost, "time_decode_steps", refuse)
    monkeypatch.setattr(cost, "time_verifications", refuse)


@pytest.mark.parametrize("grid, said", [
    (["--batches", "1,2,1", "--contexts", "256,512", "--budgets", "dense,64"],
     "error: --batches lists 1 more than once; give each batch size once"),
    (["--batches", "1,2", "--contexts", "256,256,512", "--budgets", "dense,64"],
     "error: --contexts lists 256 more than once; give each context once"),
    (["--batches", "1,2", "--contexts", "256,512", "--budgets", "dense,64,Dense,64"],
     "error: --budgets lists dense, 64 more than once; give each budget once"),
])
def test_fit_cost_refuses_a_grid_value_listed_twice(tmp_path, no_timing, grid, said):
    for mode in ([], ["--hardware", "h100"]):
        out = tmp_path / "c.parquet"
        assert _error_line(runner.invoke(app, ["fit-cost", "--model", "tiny-llama", *grid, *mode, "-o",
                                               str(out)])) == said
        assert not out.exists()


def test_fit_cost_refuses_timing_flags_beside_hardware(tmp_path, no_timing):
    out = tmp_path / "c.parquet"
    base = ["fit-cost", "--model", "tiny-llama", "--hardware", "h100", "--batches", "1,2", "-o", str(out)]
    line = _error_line(runner.invoke(app, [*base, "--repeats", "99", "--warmup", "7", "--threads", "1"]))
    assert line == ("error: --repeats, --warmup, --threads apply only when measuring on a device; "
                    "--hardware h100 writes the analytic preset, which times nothing")
    assert _error_line(runner.invoke(app, [*base, "--seed", "3"])).startswith("error: --seed applies only")
    assert not out.exists()
    r = runner.invoke(app, base)  # the defaults of those flags are no refusal
    assert r.exit_code == 0, r.output
    assert set(read_artifact(out, "cost").column("batch").to_pylist()) == {1, 2}


def test_a_profile_from_stdin_is_recorded_as_stdin(tmp_path):
    """`sparrow profile ... -o - | sparrow plan-schedule --profile -`: the schedule records and prints what
    the user gave, `-`, not the private copy of stdin that is gone when the command ends."""
    profile, _ = _profile(tmp_path / "m.parquet")
    out = tmp_path / "s.parquet"
    r = runner.invoke(app, ["plan-schedule", "--model", MODEL, "--threshold", "0.5", "--min-tokens", "1",
                            "--profile", "-", "-o", str(out)], input=profile.read_bytes())
    assert r.exit_code == 0, r.output
    assert artifact_metadata(out)["profile"] == "-"
    assert "profile: -" in r.stderr and "sparrow-input-" not in r.output
