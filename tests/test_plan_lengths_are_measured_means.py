"""plan-schedule prices the lengths a measured profile's trajectories really have: their means rounded half
up (a mean of 18.5 tokens is 19, not round()'s 18), and a profile whose trajectories average one generated
token, which the dense prefill produces, is refused (no decode step to price) rather than priced as two. A
schedule planned from a reference profile records it by name, `reference:M`, not as a path; a closed bin in
a note is named by its positions as the table gives them."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, write_artifact
from sparrow.stages.core.schedule import TailProfile, plan

from cli_checks import error_line

runner = CliRunner()


def _profile(path, trajectories: list[tuple[int, int]], budgets=(64, 128)):
    """One sample per (prompt length, generated tokens) trajectory, alpha 0.9 everywhere."""
    rows = [{"prompt_id": f"p{i}", "sample": 0, "position": prompt + k, "bin": (prompt + k) // 128,
             "budget": b, "token_id": 1, "alpha": 0.9, "logp_dense": -1.0, "logp_sparse": -1.0,
             "log_ratio": 0.0, "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0}
            for i, (prompt, generated) in enumerate(trajectories) for k in range(generated) for b in budgets]
    return write_artifact(rows, path, "mismatch", metadata={"model": "smollm2-135m", "bin_width": 128})


def _plan(*args):
    return runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--threshold", "0.5",
                               "--min-tokens", "1", *map(str, args)])


def test_one_generated_token_per_trajectory_has_no_decode_step_to_price(tmp_path):
    profile, out = _profile(tmp_path / "m.parquet", [(510, 1)] * 20), tmp_path / "s.parquet"
    line = error_line(_plan("--profile", profile, "-o", out))
    assert "20 trajectories average 1 generated token each" in line and "give --gen-len" in line
    assert not out.exists()
    r = _plan("--profile", profile, "--gen-len", 2, "-o", out, "-f", "json")  # the length, given
    assert r.exit_code == 0, r.output
    assert artifact_metadata(out)["gen_len"] == 2


def test_mean_lengths_round_half_up(tmp_path):
    """Prompts of 100 and 101 tokens (mean 100.5), 18 and 19 generated tokens (mean 18.5): 101 and 19."""
    assert (np.mean([100, 101]), np.mean([18, 19])) == (100.5, 18.5)
    profile, out = _profile(tmp_path / "m.parquet", [(100, 18), (101, 19)]), tmp_path / "s.parquet"
    r = _plan("--profile", profile, "-o", out)
    assert r.exit_code == 0, r.output
    meta = artifact_metadata(out)
    assert (meta["prompt_len"], meta["gen_len"]) == (101, 19)
    assert "19 generated tokens after a 101-token prompt" in " ".join(r.stderr.split())


def test_a_reference_plan_records_its_profile_by_name_wherever_it_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "-o", "s.parquet"])
    assert r.exit_code == 0, r.output
    assert artifact_metadata(tmp_path / "s.parquet")["profile"] == "reference:qwen3-4b"
    assert "profile: reference:qwen3-4b" in r.stderr
    profile = _profile(tmp_path / "m.parquet", [(100, 40)] * 2)
    r = _plan("--profile", "m.parquet", "-o", "measured.parquet")
    assert r.exit_code == 0, r.output
    assert artifact_metadata(tmp_path / "measured.parquet")["profile"] == str(profile.absolute())


def test_a_thin_bin_is_named_by_its_positions_and_only_the_last_bin_is_open():
    n = 3
    profile = TailProfile(np.arange(n) * 128, 128, np.array([64, 128]), np.full((n, 2), 0.9), 0.05,
                          "synthetic", thin=np.array([True, False, True]), tokens=np.array([3, 100, 3]),
                          min_tokens=50)
    notes = plan(profile, 0.5).notes
    assert any(note.startswith("bin 0 (0-128): fewer tokens") for note in notes), notes
    assert any(note.startswith("bin 2 (256+): fewer tokens") for note in notes), notes
