"""bench/rollout.py --repeats: each sampler's speedup over dense is the mean of the per-repeat ratios with a
95% t-interval (a hand-worked example), one repeat has no interval, and --repeats 0 is refused before any
model loads. No model runs here."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
rollout = importlib.import_module("rollout")  # bench/ is on sys.path, as when a bench script runs


def no_model(*_args, **_kwargs):
    raise AssertionError("a model was loaded before the arguments were checked")


def test_three_repeats_give_the_mean_ratio_and_its_t_interval():
    # per-repeat ratios 2.0, 2.2, 2.4: mean 2.2, sd 0.2, t(0.975, df 2) = 4.303
    mean, half = rollout.ratio_interval([2.0, 4.4, 4.8], [1.0, 2.0, 2.0])
    assert mean == pytest.approx(2.2)
    assert half == pytest.approx(4.303 * 0.2 / math.sqrt(3))  # 0.4969


def test_the_mean_of_ratios_is_not_the_ratio_of_means():
    # dense 1 s, 6 s over the sampler's 1 s, 2 s: ratios 1 and 3, mean 2 (the means' ratio is 3.5 / 1.5);
    # sd of (1, 3) is sqrt(2), t(0.975, df 1) = 12.706
    mean, half = rollout.ratio_interval([1.0, 6.0], [1.0, 2.0])
    assert mean == pytest.approx(2.0)
    assert half == pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2))


def test_one_repeat_is_the_plain_ratio_without_an_interval():
    assert rollout.ratio_interval([3.0], [1.5]) == (2.0, None)


def test_repeats_are_merged_into_mean_seconds_and_kept_per_repeat():
    runs = [{"engine": "dense", "total_s": 2.0, "prefill_s": 0.5, "decode_s": 1.5, "mean_budget": 0.0,
             "step_times": [0.1, 0.2]},
            {"engine": "dense", "total_s": 4.0, "prefill_s": 1.0, "decode_s": 3.0, "mean_budget": 0.0,
             "step_times": [0.3]}]
    row = rollout.merge_repeats(runs)
    assert (row["total_s"], row["prefill_s"], row["decode_s"]) == (3.0, 0.75, 2.25)
    assert row["step_times"] == [0.1, 0.2, 0.3]
    assert (row["repeats"], row["repeat_total_s"], row["repeat_decode_s"]) == (2, [2.0, 4.0], [1.5, 3.0])


@pytest.mark.parametrize("repeats", ["0", "-2"])
def test_no_repeats_are_refused_before_loading(repeats, monkeypatch, capsys):
    monkeypatch.setattr(rollout, "load_model", no_model)
    monkeypatch.setattr(sys, "argv", ["rollout.py", "--repeats", repeats, "--threads", "1"])
    with pytest.raises(SystemExit) as e:
        rollout.main()
    assert e.value.code == 2
    assert f"--repeats must be at least 1, got {repeats}" in capsys.readouterr().err


def test_repeats_with_own_kv_are_refused_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(rollout, "load_model", no_model)
    monkeypatch.setattr(sys, "argv", ["rollout.py", "--repeats", "3", "--own-kv", "4x1024", "--threads", "1"])
    with pytest.raises(SystemExit) as e:
        rollout.main()
    assert e.value.code == 2
    assert "--repeats applies to the whole rollout, not --own-kv" in capsys.readouterr().err


def test_our_speed_over_a_vllm_peer_pairs_each_repeat_with_the_peer_run_beside_it():
    # whole: vLLM 20 s, 18 s over ours 10 s, 12 s -> ratios 2.0, 1.5 (mean 1.75, sd 0.3536, t(0.975, 1) =
    # 12.706); decode: 16 / 8 and 18 / 9 -> 2.0 both, no spread
    dense = {"engine": "dense", "sampler": "dense", "repeats": 2, "repeat_total_s": [10.0, 12.0],
             "repeat_decode_s": [8.0, 9.0]}
    peer = {"engine": "vllm-bfloat16", "repeats": 2, "repeat_total_s": [20.0, 18.0],
            "repeat_decode_s": [16.0, 18.0]}
    rollout.over_peers([dense, peer])
    assert dense["x_vllm-bfloat16"] == pytest.approx(1.75)
    assert dense["x_vllm-bfloat16_half_width"] == pytest.approx(12.706 * 0.5 / math.sqrt(2) / math.sqrt(2))
    assert dense["x_vllm-bfloat16_decode"] == pytest.approx(2.0)
    assert dense["x_vllm-bfloat16_decode_half_width"] == pytest.approx(0.0)
    assert "x_vllm-bfloat16" not in peer
    assert rollout.interval_words(dense, "x_vllm-bfloat16_decode") == "2.00x ± 0.00"
    assert rollout.interval_kind(dense) == "mean of 2 repeats, 95% t-interval"
