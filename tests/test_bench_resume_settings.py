"""The resumable benches reuse a stage only under the settings that made it (bench/common.py), write their
result tables atomically, and say in one sentence what a small profile cannot give; the speculation
table shows "-" where a column does not apply, and distill.py prices its schedule at the mean generated
tokens per trajectory. No model runs here."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common  # noqa: E402  (bench/ is on sys.path, as when a bench script runs)

SETTINGS = {"--model": "smollm2-135m", "--contexts": "192,400", "--train-prompts": 4, "--budgets": "48,64"}


def made(tmp_path: Path, settings: dict = SETTINGS) -> Path:
    """An output made as a stage makes it: its settings recorded first, then the file."""
    out = tmp_path / "prompts.parquet"
    assert common.reuse_or_refuse(out, settings) is False  # nothing there yet: make it
    common.record_settings(out, settings)
    out.write_bytes(b"the stage's output")
    return out


def test_an_output_made_with_the_same_settings_is_reused(tmp_path, capsys):
    out = made(tmp_path)
    assert common.reuse_or_refuse(out, dict(SETTINGS)) is True
    assert capsys.readouterr().out == f"reused {out} (same settings)\n"
    assert json.loads((tmp_path / "prompts.parquet.settings.json").read_text()) == SETTINGS


def test_paths_and_tuples_compare_as_recorded(tmp_path):
    settings = {"--out": tmp_path / "x", "budgets": (48, 64), "--schedule": None, "--distill": True}
    out = made(tmp_path, settings)
    assert common.reuse_or_refuse(out, settings, quiet=True) is True


def test_a_changed_setting_is_refused_naming_it_and_both_values(tmp_path):
    out = made(tmp_path)
    with pytest.raises(SystemExit) as refused:
        common.reuse_or_refuse(out, {**SETTINGS, "--train-prompts": 12, "--budgets": "48,64,96"})
    assert str(refused.value) == (f"{out} was made with --train-prompts 4, not 12; use another --out, or "
                                  f"delete {out}")
    assert out.read_bytes() == b"the stage's output"


def test_a_setting_the_record_lacks_or_a_dropped_one_is_refused(tmp_path):
    out = made(tmp_path)
    with pytest.raises(SystemExit, match="was made with --lr unset, not 0.01;"):
        common.reuse_or_refuse(out, {**SETTINGS, "--lr": 0.01})
    fewer = {k: v for k, v in SETTINGS.items() if k != "--budgets"}
    with pytest.raises(SystemExit, match="was made with --budgets 48,64, not unset;"):
        common.reuse_or_refuse(out, fewer)


def test_an_output_without_a_record_is_refused(tmp_path):
    out = tmp_path / "mismatch.parquet"
    out.write_bytes(b"an older bench's profile")
    with pytest.raises(SystemExit) as refused:
        common.reuse_or_refuse(out, SETTINGS)
    assert str(refused.value) == (f"{out} has no record of the settings that made it (mismatch.parquet."
                                  "settings.json: an older bench wrote it, or the record was deleted); use "
                                  f"another --out, or delete {out}")


def test_a_run_folder_has_its_record_beside_it(tmp_path):
    run = tmp_path / "runs" / "dense-none-seed0"
    common.record_settings(run, SETTINGS)
    run.mkdir()
    assert (tmp_path / "runs" / "dense-none-seed0.settings.json").exists()
    with pytest.raises(SystemExit, match=r"dense-none-seed0 was made with --model smollm2-135m, not other;"):
        common.reuse_or_refuse(run, {**SETTINGS, "--model": "other"})


def stop_in_the_middle(monkeypatch, where: str) -> None:
    """A Ctrl-C during the write, after part of the bytes went out."""
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    if where == "parquet":
        def partial(table, sink, **_kwargs):
            if isinstance(sink, (str, Path)):
                sink = open(sink, "wb")  # noqa: SIM115  (an in-place write, as before the fix)
            sink.write(b"PAR1 half a file")
            sink.flush()
            raise KeyboardInterrupt

        monkeypatch.setattr(pq, "write_table", partial)
    else:
        import sparrow.schemas.io as io

        monkeypatch.setattr(io, "_keep_access", interrupted)  # after the bytes are written and synced


def test_a_stop_while_recording_settings_keeps_the_old_record(tmp_path, monkeypatch):
    out = made(tmp_path)
    stop_in_the_middle(monkeypatch, "record")
    with pytest.raises(KeyboardInterrupt):
        common.record_settings(out, {**SETTINGS, "--train-prompts": 12})
    monkeypatch.undo()
    assert json.loads((tmp_path / "prompts.parquet.settings.json").read_text()) == SETTINGS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.parquet", "prompts.parquet.settings.json"]


def test_a_stop_while_writing_results_keeps_the_old_table(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    common.write_results([{"run": "a", "tok_s": 1.5}], "rollout")
    stop_in_the_middle(monkeypatch, "parquet")
    with pytest.raises(KeyboardInterrupt):
        common.write_results([{"run": "b", "tok_s": 2.5}], "rollout")
    monkeypatch.undo()
    assert pq.read_table(tmp_path / "rollout.parquet").to_pylist() == [{"run": "a", "tok_s": 1.5}]
    assert [p.name for p in tmp_path.iterdir()] == ["rollout.parquet"]


def test_choose_refuses_in_one_sentence_when_no_two_means_are_close():
    import tail_test

    # means 0.50, 0.60, 0.70: no pair within 0.02 of each other
    designs = [tail_test.Design((48, 48), 0.10, 0.50, 0.2), tail_test.Design((48, 64), 0.10, 0.60, 0.3),
               tail_test.Design((64, 64), 0.20, 0.70, 0.4)]
    with pytest.raises(SystemExit) as refused:
        tail_test.choose(designs, 48)
    assert str(refused.value) == ("no two schedules of the profiled budgets have mean alpha within 0.02, so "
                                  "none pulls the tail apart at a similar mean; profile more budgets "
                                  "(--budgets)")


def test_choose_picks_the_most_different_tails_at_close_means():
    import tail_test

    a, b, c = (tail_test.Design((48, 48), 0.10, 0.500, 0.2), tail_test.Design((48, 64), 0.30, 0.510, 0.3),
               tail_test.Design((64, 64), 0.12, 0.515, 0.4))
    # tails at means within 0.02: a-b differ by 0.20, a-c by 0.02, b-c by 0.18 -> a, b; means at tails
    # within 0.03: only a-c (tails 0.02 apart) -> c joins; the uniform 48 is a, already chosen
    assert tail_test.choose([a, b, c], 48) == [a, b, c]


def test_the_speculation_table_shows_a_dash_where_nothing_applies():
    import speculation

    dense = {"sampler": "dense", "speculate": 0, "total_s": 10.0, "decode_s": 8.0, "tokens_per_s": 100.0,
             "speedup": 1.0, "acceptance": None}
    line = speculation.table_line(dense)
    assert line.split()[1:] == ["10.0", "8.0", "100.0", "1.00x", "-", "-", "-", "-", "-", "-", "-"]
    assert len(line) == len(speculation.TABLE_HEADER)
    spec = {**dense, "sampler": "speculative K=2", "speculate": 2, "speedup": 1.25, "acceptance": 0.8,
            "alpha_mean": 0.0, "draft_alpha_mean": 0.9, "tokens_per_cycle": 2.5,
            "tokens_per_cycle_half_width": 0.25, "predicted_tokens_per_cycle": 1.0,
            "draft_predicted_tokens_per_cycle": 2.71, "floor_speedup": 2.1}
    line = speculation.table_line(spec)
    assert line.split()[2:] == ["10.0", "8.0", "100.0", "1.25x", "0.800", "0.000", "0.900", "2.50", "+-",
                                "0.25", "1.00", "2.71", "2.10x"]
    assert len(line) == len(speculation.TABLE_HEADER)


def mismatch(prompt_lens: list[int], generated: int, samples: int = 2) -> pa.Table:
    """A profile of one budget: every trajectory `generated` tokens after its prompt, alpha 0.9."""
    rows = [{"prompt_id": f"p{i}", "sample": s, "position": p + t, "budget": 64, "alpha": 0.9}
            for i, p in enumerate(prompt_lens) for s in range(samples) for t in range(generated)]
    return pa.Table.from_pylist(rows)


def test_distill_prices_the_mean_generated_tokens_per_trajectory_not_the_spread_of_prompts():
    import distill

    from sparrow.stages.model.presets import get_preset

    args = Namespace(quantile=0.05, bin_width=256, threshold=0.86, hardware="h100", batch=64)
    cfg = get_preset("smollm2-135m").config
    planned = distill.predicted_speedup(mismatch([100, 300], 8), args, cfg)
    # 4 trajectories of 8 generated tokens after prompts of 100, 100, 300, 300 (not 208 = 307 - 100 + 1)
    assert (planned.gen_len, planned.prompt_len, planned.trajectories) == (8, 200, 4)
    assert planned.speedup is None  # 16 tokens a bin: too few to plan from (20)
    text = planned.describe(args, "before")
    assert text.startswith("schedule planned from the before profile at 0.86: no schedule (")
    assert "nan" not in text
    one_token = distill.predicted_speedup(mismatch([100], 1, samples=30), args, cfg)
    assert one_token.speedup is None and "no decode step" in one_token.describe(args, "after")
