"""Small points of what commands leave and say: an adapter's weights follow the umask as a plain file
does, fit-cost names the flags and the largest context that fits, and slow prompt generation shows its
progress in a log as the other commands do."""

from __future__ import annotations

import os
import stat

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.stages.model.loading import load_model
from sparrow.stages.model.presets import PRESETS

from cli_checks import error_line

runner = CliRunner()


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_an_adapters_files_all_follow_the_umask(tmp_path, umask_022):
    from sparrow.stages.model.adapter import add_lora, lora_state, save_adapter

    plain = tmp_path / "plain"
    with open(plain, "w"):
        pass
    expected = stat.S_IMODE(plain.stat().st_mode)  # what open() gives under this umask: 0644
    model = load_model("tiny-llama").model
    config = add_lora(model, 2, 4.0)
    folder = save_adapter(model, config, tmp_path / "adapter", "tiny-llama")
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()}
    assert modes == {"adapter_config.json": expected, "adapter_model.safetensors": expected}
    saved = load_file(folder / "adapter_model.safetensors")
    assert saved.keys() == lora_state(model).keys()
    assert all((saved[k] == v).all() for k, v in lora_state(model).items())


def test_fit_cost_names_the_flags_and_the_largest_context(tmp_path, monkeypatch):
    import sparrow.stages.model.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    n = PRESETS["smollm2-135m"].config.max_position_embeddings
    out = tmp_path / "c.parquet"
    line = error_line(runner.invoke(app, ["fit-cost", "--model", "smollm2-135m", "--contexts", f"1024,{n}",
                                          "-o", str(out)]))
    generated = 2 + 5 + 1  # --warmup 2, --repeats 5 (the defaults) and the prefill's token
    assert line.startswith(f"error: --contexts {n} plus the {generated} tokens each timed point generates "
                           "(--warmup 2 and --repeats 5 "), line
    assert f"is beyond the model's context of {n}; give contexts of at most {n - generated}" in line
    fewer = ["--contexts", f"1024,{n - 4}", "--repeats", "1", "--warmup", "3", "-o", str(out)]
    line = error_line(runner.invoke(app, ["fit-cost", "--model", "smollm2-135m", *fewer]))
    assert f"give contexts of at most {n - 5}" in line
    assert not out.exists()


def test_slow_prompt_generation_shows_progress_lines_in_a_log(monkeypatch):
    """stderr not a terminal: whole lines once generation has run past the delay, none before."""
    from sparrow.cli import prompts as cli_prompts

    lines: list[str] = []
    monkeypatch.setattr(cli_prompts, "LogProgress", _recording(lines))
    quick = cli_prompts._LazyProgress(3, "kv_lookup prompts", delay=60)
    for done in (1, 2, 3):
        quick(done)
    assert lines == []
    slow = cli_prompts._LazyProgress(3, "kv_lookup prompts", delay=0)
    for done in (1, 2, 3):
        slow(done)
    slow.close()
    assert slow.bar is None and lines[0] == "kv_lookup prompts: 1/3" and lines[-1] == "kv_lookup prompts: 3/3"


def _recording(lines: list[str]):
    class Recording:
        def __init__(self, what: str) -> None:
            self.what, self.start = what, 0.0

        def __call__(self, done: int, total: int, info: str = "") -> None:
            lines.append(f"{self.what}: {done}/{total}")

    return Recording


def test_the_prompts_bar_on_a_terminal_shows_its_label_not_markup(monkeypatch):
    import io

    from sparrow.cli import prompts as cli_prompts
    from sparrow.cli.console import MessageConsole, console

    monkeypatch.setattr(console, "_force_terminal", True)
    monkeypatch.setattr(console, "_file", io.StringIO())  # the private slot: `file` would pin stderr
    bar = cli_prompts._LazyProgress(3, "kv_lookup prompts", delay=0)
    bar(1)
    shown = MessageConsole(file=io.StringIO(), width=120)  # the CLI's console rule for bracketed text
    shown.print(bar.bar.get_renderable())
    bar.close()
    text = shown.file.getvalue()
    assert "kv_lookup prompts" in text and "[progress.description]" not in text, text


def test_a_log_line_past_a_few_seconds_says_how_long_the_rest_takes_at_the_rate_so_far(monkeypatch):
    """Linear in the work left: 100 of 400 in 20 s leaves 60 s; 10 of 400 in 60 s leaves 39 min."""
    from sparrow.cli import progress

    lines: list[str] = []
    monkeypatch.setattr(progress, "log_line", lines.append)
    clock = iter([0.0, 1.0, 20.0, 40.0, 40.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    log = progress.LogProgress("prompts", every=0)
    for done in (1, 100, 400):
        log(done, 400)
    log(400, 400)
    assert lines[:3] == ["prompts: 1/400 (1 s)", "prompts: 100/400 (20 s, about 60 s left)",
                         "prompts: 400/400 (40 s)"]
    assert progress._left(60.0, 10, 400) == ", about 39 min left"


def test_a_log_line_whose_caller_says_the_time_left_says_it_once(monkeypatch):
    """A rollout's line bounds the time left by its tokens; the line adds no second estimate."""
    from sparrow.cli import progress

    lines: list[str] = []
    monkeypatch.setattr(progress, "log_line", lines.append)
    clock = iter([0.0, 20.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    log = progress.LogProgress("rollouts (samples)", every=0, eta=False)
    log(1, 8, "45 tokens, 3.0 tok/s, at most 0:00:27 left")
    assert lines == ["rollouts (samples): 1/8, 45 tokens, 3.0 tok/s, at most 0:00:27 left (20 s)"]


def test_a_resumed_rollouts_progress_says_which_samples_came_from_the_journal(monkeypatch):
    """Its count includes the journal's samples, its tokens are this run's: the line says so."""
    from rich.progress import Progress

    from sparrow.cli import progress
    from sparrow.cli.rollout import _Bars

    lines: list[str] = []
    monkeypatch.setattr(progress, "log_line", lines.append)
    bars = _Bars(Progress(disable=True), "rollouts (samples)", 16, rate=True)
    bars.skip(6)
    bars.advance(0, 2)
    assert lines == ["rollouts (samples): 6/16, 6 from the journal, 2 tokens (0 s)"]
