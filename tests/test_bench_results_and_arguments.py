"""The benches' shared options and refusals (bench/common.py and the scripts' argument checks): a result
table goes where --results or $SPARROW_BENCH_RESULTS says, each --help names its table and shows the whole
docstring, a bad argument is one line before any model loads, an interrupted resumable bench ends in one
line with exit status 130, and cpu_step.py's median is the median. No model runs here."""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import common  # noqa: E402  (bench/ is on sys.path, as when a bench script runs)

from sparrow.stages.train import TrainingInterrupted  # noqa: E402

# every bench that writes a result table, and the tables its --help must name
TABLES = {"rollout": ("rollout", "rollout-own-kv"), "speculation": ("speculation",),
          "kernel_times": ("kernels",), "distill": ("distill",), "train_code": ("train_code",),
          "profile_scoring": ("profile_scoring",), "train": ("train",),
          "kv_compression": ("kv_compression-rollout", "kv_compression-accuracy", "kv_compression-train")}


def no_model(*_args, **_kwargs):
    raise AssertionError("a model was loaded before the arguments were checked")


def run_main(monkeypatch, script: str, *argv: str, **patches) -> None:
    """`script`'s main() with these arguments, `patches` set on its module first."""
    module = importlib.import_module(script)
    for name, value in patches.items():
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    module.main()


def test_results_goes_where_the_flag_says(tmp_path, monkeypatch):
    monkeypatch.delenv(common.RESULTS_ENV, raising=False)
    args = common.bench_parser(None, "rollout").parse_args(["--results", str(tmp_path / "mine")])
    out = common.write_results([{"engine": "dense", "tok_s": 3.5}], "rollout", args.results)
    assert out == tmp_path / "mine" / "rollout.parquet"
    assert pq.read_table(out).to_pylist() == [{"engine": "dense", "tok_s": 3.5}]


def test_results_defaults_to_the_environment_then_bench_results(tmp_path, monkeypatch):
    monkeypatch.delenv(common.RESULTS_ENV, raising=False)
    assert common.bench_parser(None, "x").parse_args([]).results == BENCH / "results"
    monkeypatch.setenv(common.RESULTS_ENV, str(tmp_path))
    assert common.bench_parser(None, "x").parse_args([]).results == tmp_path
    assert common.write_results([{"a": 1}], "x") == tmp_path / "x.parquet"


def test_a_bench_without_tables_has_no_results_option():
    with pytest.raises(SystemExit):
        common.bench_parser(None).parse_args(["--results", "/tmp"])


@pytest.mark.parametrize("script", sorted(TABLES))
def test_each_help_names_its_tables_and_its_folder(script, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, script, "--help")
    assert e.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps the flags' help, at hyphens too
    assert "--resultsDIR" in text and "$SPARROW_BENCH_RESULTS" in text
    for table in TABLES[script]:
        assert f"{table}.parquet" in text


def test_help_shows_the_whole_docstring_and_defaults(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run_main(monkeypatch, "rollout", "--help")
    text = capsys.readouterr().out
    assert "vLLM and Hugging Face `generate` as peers where they run." in text  # the line that was cut
    assert "--no-hf --no-vllm --threads 1" in text  # the smoke command
    with pytest.raises(SystemExit):
        run_main(monkeypatch, "cpu_step", "--help")
    assert "(default: 16)" in " ".join(capsys.readouterr().out.split())  # --steps


def test_rollout_refuses_a_budget_off_the_pages_before_loading(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, "rollout", "--budget", "100", "--threads", "1", load_model=no_model)
    assert e.value.code == 2
    assert "--budget: budget 100 is not a multiple of the page size 16" in capsys.readouterr().err


def test_speculation_refuses_a_budget_off_the_pages_before_loading(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, "speculation", "--budget", "100", load_model=no_model)
    assert e.value.code == 2
    assert "--budget: budget 100 is not a multiple of the page size 16" in capsys.readouterr().err


def test_speculation_refuses_a_short_prompt_by_its_own_flag_before_loading(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, "speculation", "--prompt-len", "300", "--budget", "128", load_model=no_model)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--prompt-len 300 is too short" in err and "--context-tokens" not in err


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_cpu_step_refuses_no_steps_before_loading(steps, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, "cpu_step", "--steps", steps, load_model=no_model)
    assert e.value.code == 2
    assert f"--steps must be at least 1, got {steps}" in capsys.readouterr().err


class ScriptedEngine:
    """An engine whose steps take no time: the clock below says how long each timed one took."""

    def __init__(self, *_args, **_kwargs):
        pass

    def add_request(self, *_args):
        pass

    def step(self):
        pass


def test_cpu_step_prints_the_median_of_an_even_count(monkeypatch, capsys):
    ticks = iter([0.0, 0.001, 0.0, 0.010, 0.0, 0.002, 0.0, 0.003])  # steps of 1, 10, 2 and 3 ms
    clock = SimpleNamespace(perf_counter=lambda: next(ticks))
    loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=1000), model=None)
    threads = str(torch.get_num_threads())  # the process's own: nothing changes for later tests
    run_main(monkeypatch, "cpu_step", "--steps", "4", "--context", "32", "--samples", "2",
             "--threads", threads,
             load_model=lambda *a, **k: loaded, Engine=ScriptedEngine, time=clock)
    assert "step median 2.5 ms, fastest 1.0 ms" in capsys.readouterr().out  # (2 + 3) / 2


@pytest.mark.parametrize("error", [KeyboardInterrupt(), TrainingInterrupted(
    "/x/checkpoint holds the 0 complete steps of 2; add --resume to the same command to continue")])
def test_an_interrupt_is_one_line_and_status_130(error, capsys):
    def main():
        raise error

    with pytest.raises(SystemExit) as e:
        common.stop_on_interrupt(main, "finished runs kept")
    assert e.value.code == 130
    assert capsys.readouterr().err == "stopped: finished runs kept; the same command continues\n"


@pytest.mark.parametrize("script, argv", [
    ("train_code.py", ["--configs", "dense"]),
    ("threshold_sweep.py", ["--thresholds", "0.5", "--seeds", "0"]),
])
def test_the_resumable_benches_stop_in_one_line(script, argv, tmp_path, monkeypatch, capsys):
    import sparrow.stages.model.loading as loading

    def interrupted(_spec):  # the first work each does: its prompts' tokenizer
        raise TrainingInterrupted("a run stopped; add --resume to the same command to continue")

    monkeypatch.setattr(loading, "spec_tokenizer", interrupted)
    monkeypatch.setattr(sys, "argv", [script, *argv, "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err.startswith("stopped: ") and err.endswith("; the same command continues\n")
    assert err.count("\n") == 1 and "--resume" not in err
