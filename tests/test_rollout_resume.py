"""`sparrow rollout --resume`: a stopped rollout continues from its journal (OUT.partial/) and writes what
an uninterrupted run writes.

The independent expectation is the rollout as the engine gives it without any journal: `run_rollouts`
over the whole prompt set in one call (the path `sparrow rollout` took before it journaled). At one
thread count on a CPU a resumed run must give the same rows bit for bit: tokens, logprobs, budgets,
rewards. The model is a tiny random Llama with SmolLM2's tokenizer, so samples have text and the test
task `vowels` (dist_helper.py) gives them graded rewards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import SCHEMAS, artifact_metadata, read_artifact
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import EngineStats, SamplingParams
from sparrow.stages.model.loading import load_model
from sparrow.stages.rollout import RolloutOptions, run_rollouts
from sparrow.stages.rollout_journal import merged_stats

from cli_checks import error_line

runner = CliRunner()
TESTS = Path(__file__).parent
SAMPLES, NEW_TOKENS, BATCH = 2, 8, 2


@pytest.fixture(autouse=True)
def one_thread():
    """Bit for bit holds at one thread count: every run here (and the subprocess) uses one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, prompts): 6 prompts of the `vowels` task, about 100 tokens each (budget 48 is sparse)."""
    from sparrow.stages.tasks import TASKS

    from dist_helper import make_tiny, register_vowels

    register_vowels()
    yield make_tiny(tmp_path_factory.mktemp("tiny-resume"))
    TASKS.pop("vowels", None)


def _plain(table: pa.Table) -> pa.Table:
    return SCHEMAS["rollouts"].conform(table, "rollouts", fill_missing=True).replace_schema_metadata(None)


@pytest.fixture(scope="module")
def reference(tiny):
    """budget (None: dense) -> the rollouts of `run_rollouts` over every prompt in one engine call."""
    model, prompts = tiny
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(model)
    rows = read_artifact(prompts, "prompts").to_pylist()
    out = {}
    for budget in (None, 48):
        opts = RolloutOptions(sampling=SamplingParams(n=SAMPLES, max_new_tokens=NEW_TOKENS, seed=0),
                              max_batch=BATCH, policy=as_policy(budget))
        out[budget] = _plain(run_rollouts(loaded, rows, opts)[0])
    torch.set_num_threads(before)
    assert all(r is not None for r in out[None].column("reward").to_pylist())  # scored: rewards compared
    return out


def _args(tiny, out: Path, budget: int | None, *extra: str) -> list[str]:
    model, prompts = tiny
    return ["rollout", "--model", model, "--prompts", prompts, "--samples", str(SAMPLES), "--max-new-tokens",
            str(NEW_TOKENS), "--max-num-seqs", str(BATCH), "--threads", "1", "-o", str(out),
            *(["--budget", str(budget)] if budget else []), *extra]


def _partial(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _interrupt_after(monkeypatch, prompts: int) -> None:
    """Ctrl-C from the progress callback once `prompts` prompts have finished (one at a time here: a batch
    of 2 holds one prompt's 2 samples)."""
    from sparrow.cli import rollout as cli

    advance = cli._Bars.advance

    def interrupted(self, finished, new_tokens):
        advance(self, finished, new_tokens)
        if self.done >= prompts * SAMPLES:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli._Bars, "advance", interrupted)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def journal(tiny, tmp_path_factory):
    """The journal a dense run interrupted after 2 of its 6 prompts left, a scored part per prompt (copied by
    the tests that use it)."""
    out = tmp_path_factory.mktemp("interrupted") / "r.parquet"
    with pytest.MonkeyPatch.context() as mp:
        _interrupt_after(mp, 2)
        r = runner.invoke(app, _args(tiny, out, None, "--checkpoint-interval", "0"))
    assert r.exit_code == 130, r.output
    return _partial(out)


def _copy(journal: Path, out: Path) -> Path:
    import shutil

    shutil.copytree(journal, _partial(out))
    return _partial(out)


@pytest.mark.parametrize("budget", [None, 48], ids=["dense", "budget48"])
def test_an_interrupted_run_resumed_writes_the_uninterrupted_rows(tiny, reference, tmp_path, monkeypatch,
                                                                  budget):
    """Ctrl-C after 2 prompts: the `finally` journals them unscored (the default interval had written no
    part), the message says how to go on; --resume scores them, samples the other 4 and the artifact is the
    uninterrupted one."""
    out = tmp_path / "r.parquet"
    with monkeypatch.context() as mp:
        _interrupt_after(mp, 2)
        r = runner.invoke(app, _args(tiny, out, budget))
    assert r.exit_code == 130 and not out.exists(), r.output
    assert ("keeps the 2 of 6 prompts that had finished; run the same command with --resume to continue, "
            "which scores the rewards of 2 of them first") in " ".join(r.stderr.split())
    assert _journal_files(out) == ["manifest.json", "unscored-00000.parquet"]
    unscored = _partial(out) / "unscored-00000.parquet"
    assert artifact_metadata(unscored)["prompt_rows"] == [0, 1]
    assert read_artifact(unscored, "rollouts").num_rows == 2 * SAMPLES

    r = runner.invoke(app, _args(tiny, out, budget, "--resume", "--format", "json"))
    assert r.exit_code == 0, r.output
    assert (f"resuming {_partial(out)}/: 2 of 6 prompts done, 4 to go; the rewards of 2 of the done prompts "
            "are scored first" in " ".join(r.stderr.split()))
    assert "(2 prompts from the interrupted run)" in r.stderr
    assert _plain(read_artifact(out, "rollouts")).equals(reference[budget])
    assert not _partial(out).exists()
    summary = artifact_metadata(out)["summary"]
    ref = reference[budget]
    assert summary["samples"] == ref.num_rows and summary["resumed_prompts"] == 2
    assert summary["tokens"] == sum(len(t) for t in ref.column("token_ids").to_pylist())
    assert summary["reward_mean"] == pytest.approx(sum(ref.column("reward").to_pylist()) / ref.num_rows)


_KILLED = """
import sys, time
sys.path.insert(0, sys.argv[1])
from dist_helper import register_vowels
from sparrow.stages import rollout_journal

register_vowels()
flush = rollout_journal.Journal.flush

def flush_then_wait(self, *args, **kwargs):  # the test kills it here, with a part on disk and prompts to go
    flush(self, *args, **kwargs)
    time.sleep(60)

rollout_journal.Journal.flush = flush_then_wait
from sparrow.cli.app import app
app(sys.argv[2:])
"""


def test_a_killed_run_resumed_writes_the_uninterrupted_rows(tiny, reference, tmp_path):
    """SIGKILL (no `finally` runs) once the first part is on disk: --resume keeps it and completes the run."""
    out = tmp_path / "r.parquet"
    args = _args(tiny, out, 48, "--checkpoint-interval", "0")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(TESTS), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            cwd=tmp_path)  # not the repository, whose kernels/ would shadow the package
    first = _partial(out) / "part-00000.parquet"
    deadline = time.monotonic() + 120
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert first.exists(), err.decode()[-2000:]
    assert not out.exists() and not (_partial(out) / "part-00001.parquet").exists()
    done = len(artifact_metadata(first)["prompt_rows"])

    r = runner.invoke(app, _args(tiny, out, 48, "--resume"))
    assert r.exit_code == 0, r.output
    assert f"{done} of 6 prompts done, {6 - done} to go" in r.stderr
    assert _plain(read_artifact(out, "rollouts")).equals(reference[48])
    assert not _partial(out).exists()


OTHER_PROMPTS = "was written with --prompts, --max-prompts or --filter-overlong-prompts 6 prompts (sha256 "


@pytest.mark.parametrize("extra,named", [
    (["--temperature", "0.7"], "was written with --temperature 1.0, this run has 0.7;"),
    (["--budget", "48"], "was written with the sparsity (--budget/--schedule/--kv-compression) dense, this "
                         "run has budget:48;"),
    (["--prompts", "OTHER"], OTHER_PROMPTS),
    (["--max-prompts", "5"], OTHER_PROMPTS),
])
def test_a_journal_of_another_run_is_refused_and_left_as_it_was(tiny, journal, tmp_path, extra, named):
    out = tmp_path / "r.parquet"
    folder = _copy(journal, out)
    before = _snapshot(folder)
    if "OTHER" in extra:
        rows = read_artifact(tiny[1], "prompts").slice(0, 5)
        other = tmp_path / "other.parquet"
        from sparrow.schemas import write_artifact

        write_artifact(rows, other, "prompts")
        tiny, extra = (tiny[0], str(other)), []
    r = runner.invoke(app, [*_args(tiny, out, None, "--resume"), *extra])
    line = error_line(r)
    assert r.exit_code != 0 and line.startswith(f"error: {folder}/ ") and named in line, r.output
    assert "rerun with the same flags, or pass --force to start over" in line
    assert _snapshot(folder) == before and not out.exists()


def test_a_part_that_does_not_read_is_refused_by_name_and_temporaries_are_ignored(tiny, journal, tmp_path):
    out = tmp_path / "r.parquet"
    folder = _copy(journal, out)
    (folder / ".part-00002.parquet.0123456789ab-999999.tmp").write_bytes(b"PAR1 half")  # a killed write's
    (folder / "part-00002.parquet").write_bytes(b"PAR1 truncated")
    r = runner.invoke(app, _args(tiny, out, None, "--resume"))
    line = error_line(r)
    assert r.exit_code != 0 and str(folder / "part-00002.parquet") in line, r.output
    assert "remove it to resume without its prompts, or pass --force" in line
    (folder / "part-00002.parquet").unlink()
    r = runner.invoke(app, _args(tiny, out, None, "--resume"))
    assert r.exit_code == 0 and "2 of 6 prompts done" in r.stderr, r.output


def test_a_copied_part_is_refused_naming_the_part_that_holds_its_prompts(tiny, journal, tmp_path):
    import shutil

    out = tmp_path / "r.parquet"
    folder = _copy(journal, out)
    shutil.copy(folder / "part-00000.parquet", folder / "part-00009.parquet")
    line = error_line(runner.invoke(app, _args(tiny, out, None, "--resume")))
    assert line == (f"error: {folder / 'part-00009.parquet'} holds prompt row 0 of --prompts, which "
                    "part-00000.parquet holds already (a copied part?); remove one of them to resume, or "
                    "pass --force to start over")


def test_a_journal_without_resume_is_refused_and_force_starts_over(tiny, journal, reference, tmp_path):
    out = tmp_path / "r.parquet"
    folder = _copy(journal, out)
    before = _snapshot(folder)
    r = runner.invoke(app, _args(tiny, out, None))
    assert error_line(r) == (f"error: an interrupted run left 2 of 6 prompts in {folder}/; pass --resume to "
                             "continue it, or --force to start over"), r.output
    assert _snapshot(folder) == before and not out.exists()
    r = runner.invoke(app, _args(tiny, out, None, "--force"))
    assert r.exit_code == 0 and "prompts from the interrupted run" not in r.stderr, r.output
    assert _plain(read_artifact(out, "rollouts")).equals(reference[None])
    assert "resumed_prompts" not in artifact_metadata(out)["summary"] and not folder.exists()


def test_resume_without_a_journal_notes_it_and_runs_everything(tiny, reference, tmp_path):
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, _args(tiny, out, None, "--resume"))
    assert r.exit_code == 0, r.output
    assert "note: --resume:" in r.stderr and "nothing to resume" in r.stderr
    assert _plain(read_artifact(out, "rollouts")).equals(reference[None])


def test_an_uninterrupted_run_writes_what_run_rollouts_gives_and_leaves_no_journal(tiny, reference, tmp_path):
    """The journal changes nothing of the artifact: --checkpoint-interval 0 writes a part per finished
    prompt along the way, and the artifact is the engine's rows without a journal, the folder gone."""
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, _args(tiny, out, 48, "--checkpoint-interval", "0"))
    assert r.exit_code == 0, r.output
    assert _plain(read_artifact(out, "rollouts")).equals(reference[48])
    assert not _partial(out).exists() and sorted(p.name for p in tmp_path.iterdir()) == ["r.parquet"]
    summary = artifact_metadata(out)["summary"]
    assert summary["samples"] == 12 and "resumed_prompts" not in summary


@pytest.mark.parametrize("extra,why", [
    (["--workers", "2"], "--workers runs in Ray workers, which keep no journal"),
    (["--engine", "vllm"], "--engine vllm keeps no journal"),
    (["-o", "-"], "-o - (stdout) has no folder beside it for one"),
])
def test_resume_where_no_journal_is_kept_is_refused(tiny, tmp_path, extra, why):
    r = runner.invoke(app, [*_args(tiny, tmp_path / "out", None, "--resume"), *extra])
    assert error_line(r) == ("error: --resume needs the journal that our engine keeps in this process beside "
                             f"-o (OUT.partial/), and {why}; drop --resume"), r.output
    assert list(tmp_path.iterdir()) == []


def test_merged_stats_add_sums_and_take_the_largest_peak():
    """Two kept parts and this run's engine: counts and seconds add, peaks are the largest of the three,
    and the mean KV tokens come from the summed sums over the summed decode steps."""
    parts = [{"decode_steps": 10, "kv_tokens_sum": 1000, "kv_tokens_peak": 150, "prefill_s": 0.5,
              "decode_s": 2.0, "preemptions": 1},
             {"decode_steps": 5, "kv_tokens_sum": 900, "kv_tokens_peak": 250, "prefill_s": 0.25,
              "decode_s": 1.0, "preemptions": 0}]
    this_run = EngineStats(decode_steps=5, kv_tokens_sum=100, kv_tokens_peak=30, prefill_s=0.25, decode_s=1.0,
                           preemptions=2)
    merged = merged_stats(parts, this_run)
    assert (merged.decode_steps, merged.kv_tokens_sum, merged.kv_tokens_peak, merged.preemptions) == (
        20, 2000, 250, 3)
    assert merged.seconds == pytest.approx(5.0)
    assert merged.kv_tokens_sum / merged.decode_steps == 100.0


def test_an_interrupt_while_the_last_prompts_are_scored_keeps_them_all(tiny, reference, tmp_path,
                                                                         monkeypatch):
    """Every prompt had finished and the last ones were being scored (a slow reward): an interrupt then
    keeps all 6, unscored (the last part is written before the artifact), and the resume samples nothing
    and scores them."""
    import sparrow.stages.rollout as stage

    out, scored, interrupts = tmp_path / "r.parquet", stage.score_rewards, []

    def interrupted_when_all_done(out_columns, items, on_scored=None):
        # the one part of a run with the default interval holds every prompt: one Ctrl-C in its scoring
        if len(out_columns["prompt_id"]) == 6 * SAMPLES and not interrupts:
            interrupts.append(1)
            raise KeyboardInterrupt
        return scored(out_columns, items, on_scored)

    with monkeypatch.context() as mp:
        mp.setattr(stage, "score_rewards", interrupted_when_all_done)
        first = runner.invoke(app, _args(tiny, out, None))
    assert first.exit_code == 130 and not out.exists(), first.output
    # the interrupt's way out writes them unscored: nothing is lost
    assert "keeps the 6 of 6 prompts" in first.stderr
    assert _journal_files(out) == ["manifest.json", "unscored-00000.parquet"]
    assert artifact_metadata(_partial(out) / "unscored-00000.parquet")["prompt_rows"] == list(range(6))
    r = runner.invoke(app, _args(tiny, out, None, "--resume"))
    assert r.exit_code == 0, r.output
    assert "6 of 6 prompts done, 0 to go; the rewards of 6 of the done prompts are scored first" in r.output
    assert _plain(read_artifact(out, "rollouts")).equals(reference[None])


def test_resume_after_the_run_ended_samples_nothing(tiny, tmp_path):
    """A retry with --resume after the artifact was written (no journal left): one line, exit 0, the
    artifact untouched; with another flag it is refused naming it, the artifact untouched (replacing it is
    a run without --resume); with no artifact either it is a fresh run."""
    out = tmp_path / "r.parquet"
    assert runner.invoke(app, _args(tiny, out, None)).exit_code == 0
    before = (out.stat().st_mtime_ns, out.read_bytes())
    r = runner.invoke(app, _args(tiny, out, None, "--resume"))
    assert r.exit_code == 0, r.output
    assert "is the finished artifact of a run with these flags, so there is nothing to resume" in r.output
    assert (out.stat().st_mtime_ns, out.read_bytes()) == before
    assert not _partial(out).exists()
    r = runner.invoke(app, _args(tiny, out, None, "--resume", "--seed", "1"))
    assert error_line(r) == (f"error: --resume: {out} is the finished artifact of a run with --seed 0, and "
                             "this run has 1, so there is no interrupted run to resume; drop --resume to "
                             "sample it again with these flags, or give another -o")
    assert (out.stat().st_mtime_ns, out.read_bytes()) == before
    other = tmp_path / "other.parquet"
    r = runner.invoke(app, _args(tiny, other, None, "--resume", "--seed", "1"))
    assert r.exit_code == 0 and "nothing to resume: the run starts from the first prompt" in r.stderr


def test_resume_with_another_batch_says_the_rows_may_round_otherwise(tiny, journal, tmp_path):
    """--max-num-seqs is not part of what a run is: a resume with another one runs, with a note."""
    out = tmp_path / "r.parquet"
    _copy(journal, out)
    args = _args(tiny, out, None, "--resume")
    args[args.index("--max-num-seqs") + 1] = "3"
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    note = " ".join(r.stderr.split())
    assert "was written with --max-num-seqs 2 and this run has --max-num-seqs 3" in note
    assert "not bit for bit those of an uninterrupted run" in note


def test_generate_hands_each_prompt_over_once_and_keeps_it_no_longer(tiny):
    """Engine.generate's on_prompt: once per prompt, all its samples in sample order, as generate without
    it returns them; the engine then keeps none (the lists it returns are empty for those prompts)."""
    from sparrow.stages.engine import Engine

    model, prompts = tiny
    loaded = load_model(model)
    ids = [r["prompt_token_ids"] for r in read_artifact(prompts, "prompts").to_pylist()]
    params = SamplingParams(n=SAMPLES, max_new_tokens=NEW_TOKENS, seed=0)
    with Engine(loaded.model, as_policy(None)) as engine:
        plain = engine.generate(ids, params)
    handed: dict[int, list] = {}
    with Engine(loaded.model, as_policy(None)) as engine:
        kept = engine.generate(ids, params, on_prompt=lambda rid, cs: handed.setdefault(rid, []).extend(cs))
    assert kept == [[] for _ in ids]
    assert sorted(handed) == list(range(len(ids)))
    for i, completions in enumerate(plain):
        assert [c.sample for c in handed[i]] == list(range(SAMPLES))
        assert [c.token_ids for c in handed[i]] == [c.token_ids for c in completions]


def test_sql_reads_an_unfinished_rollouts_journal_and_skips_a_finished_ones(tiny, journal, tmp_path):
    """A long rollout can be queried while it runs: `sparrow sql` reads the journal's parts as rollouts
    (with a warning that says so); once OUT is written, the journal beside it is skipped, as OUT holds its
    rows."""
    import shutil

    out = tmp_path / "r.parquet"
    folder = _copy(journal, out)
    kept = sum(len(artifact_metadata(p)["prompt_rows"]) for p in folder.glob("part-*.parquet"))
    shutil.copy(folder / "part-00000.parquet", folder / "unscored-00002.parquet")  # not a part: not read
    r = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM rollouts", "--run", str(tmp_path), "-f", "csv"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[-1] == str(kept * SAMPLES)
    assert "is the journal of an unfinished rollout" in " ".join(r.stderr.split())
    assert ("; 1 file of finished prompts that an interrupt left unscored (unscored-*.parquet) are read once "
            "`sparrow rollout --resume` scores them") in " ".join(r.stderr.split())
    read_artifact(folder / "part-00000.parquet", "rollouts")  # a part is a whole artifact
    shutil.copy(folder / "part-00000.parquet", out)  # stands for the finished artifact
    r = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM rollouts", "--run", str(tmp_path), "-f", "csv"])
    assert r.exit_code == 0, r.output
    first = read_artifact(out, "rollouts").num_rows
    assert r.stdout.splitlines()[-1] == str(first)
    assert "whose rows that file holds; skipped it" in " ".join(r.stderr.split())


# a reward as slow as a code reward in a sandbox when SLOW_REWARD_SECONDS says so; else the `vowels` scorer's
SLOW_REWARD = """
import os
import time


def compute_score(data_source, solution_str, ground_truth, extra_info):
    time.sleep(float(os.environ.get("SLOW_REWARD_SECONDS") or 0))
    letters = [ch for ch in solution_str.lower() if ch.isalpha()]
    return sum(ch in "aeiou" for ch in letters) / max(len(letters), 1)
"""


@pytest.fixture
def slow_reward(tmp_path) -> str:
    path = tmp_path / "slow_reward.py"
    path.write_text(SLOW_REWARD)
    return str(path)


def _signal_after(monkeypatch, prompts: int, signum: int) -> list[float]:
    """A real signal to this process (the CLI runs in its main thread) from the progress callback once
    `prompts` prompts have finished; the list receives when it was sent."""
    from sparrow.cli import rollout as cli

    advance, sent = cli._Bars.advance, []

    def signalled(self, finished, new_tokens):
        advance(self, finished, new_tokens)
        if self.done >= prompts * SAMPLES and not sent:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(cli._Bars, "advance", signalled)
    return sent


def _journal_files(out: Path) -> list[str]:
    return sorted(p.name for p in _partial(out).iterdir() if not p.name.startswith("."))


def test_sigterm_with_a_slow_reward_journals_the_finished_prompts_unscored_at_once(tiny, reference, tmp_path,
                                                                                  monkeypatch, slow_reward):
    """A scheduler's SIGTERM with a reward of a second a sample: the 2 finished prompts are journaled at once,
    unscored (scoring their 4 samples would take 4 s, past what a grace period allows), exit 143; --resume
    scores them without sampling them again and writes the uninterrupted rows."""
    out = tmp_path / "r.parquet"
    args = _args(tiny, out, None, "--reward-fn", slow_reward)
    monkeypatch.setenv("SLOW_REWARD_SECONDS", "1")
    with monkeypatch.context() as mp:
        sent = _signal_after(mp, 2, signal.SIGTERM)
        r = runner.invoke(app, args)
    took = time.monotonic() - sent[0]
    assert r.exit_code == 143 and not out.exists(), r.output
    assert took < 1.0, f"the interrupt took {took:.1f} s to exit"
    assert "keeps the 2 of 6 prompts that had finished; run the same command with --resume" in r.stderr
    assert _journal_files(out) == ["manifest.json", "unscored-00000.parquet"]
    unscored = _partial(out) / "unscored-00000.parquet"
    assert artifact_metadata(unscored)["prompt_rows"] == [0, 1]
    assert read_artifact(unscored, "rollouts").column("reward").to_pylist() == [None] * (2 * SAMPLES)

    r = runner.invoke(app, args)
    assert error_line(r) == (f"error: an interrupted run left 2 of 6 prompts in {_partial(out)}/; pass "
                             "--resume to continue it, or --force to start over"), r.output

    monkeypatch.setenv("SLOW_REWARD_SECONDS", "0")
    r = runner.invoke(app, [*args, "--resume"])
    assert r.exit_code == 0, r.output
    said = " ".join(r.stderr.split())
    assert "2 of 6 prompts done, 4 to go; the rewards of 2 of the done prompts are scored first" in said
    assert _plain(read_artifact(out, "rollouts")).equals(reference[None])
    assert artifact_metadata(out)["summary"]["resumed_prompts"] == 2 and not _partial(out).exists()


def test_a_second_interrupt_exits_at_once_and_leaves_a_journal_that_resumes(tiny, reference, tmp_path,
                                                                            monkeypatch, slow_reward):
    """Ctrl-C while a resume scores the unscored prompts stops it there, the journal as it was; Ctrl-C again
    while an interrupt writes its unscored prompts stops that write, the scored part kept; the last resume
    writes the uninterrupted rows."""
    from sparrow.cli import rollout as cli
    from sparrow.stages import rollout_journal

    out = tmp_path / "r.parquet"
    args = _args(tiny, out, None, "--reward-fn", slow_reward)
    monkeypatch.setenv("SLOW_REWARD_SECONDS", "0.5")
    with monkeypatch.context() as mp:
        _signal_after(mp, 2, signal.SIGINT)
        assert runner.invoke(app, args).exit_code == 130
    before = _snapshot(_partial(out))
    assert sorted(before) == ["manifest.json", "unscored-00000.parquet"]

    scored, sent = cli._Bars.scored, []

    def interrupted_while_scoring(self, done, total):  # after the first prompt's samples, of 2 prompts
        scored(self, done, total)
        if done and not sent:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

    with monkeypatch.context() as mp:
        mp.setattr(cli._Bars, "scored", interrupted_while_scoring)
        r = runner.invoke(app, [*args, "--resume"])
    assert r.exit_code == 130 and time.monotonic() - sent[0] < 1.0, r.output
    assert "keeps the 2 of 6 prompts that had finished" in r.stderr
    assert _snapshot(_partial(out)) == before

    monkeypatch.setenv("SLOW_REWARD_SECONDS", "0")
    write, again = rollout_journal.write_artifact, []

    def interrupted_again(table, path, *a, **k):  # the interrupt's write of prompt 2, unscored
        if Path(path).name.startswith("unscored-"):
            again.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)
        return write(table, path, *a, **k)

    with monkeypatch.context() as mp:
        _signal_after(mp, 3, signal.SIGINT)
        mp.setattr(rollout_journal, "write_artifact", interrupted_again)
        r = runner.invoke(app, [*args, "--resume"])
    assert r.exit_code == 130 and again and time.monotonic() - again[0] < 1.0, r.output
    assert "Traceback" not in r.output
    assert _journal_files(out) == ["manifest.json", "part-00000.parquet"]
    assert artifact_metadata(_partial(out) / "part-00000.parquet")["prompt_rows"] == [0, 1]

    r = runner.invoke(app, [*args, "--resume"])
    assert r.exit_code == 0 and "2 of 6 prompts done, 4 to go" in r.stderr, r.output
    assert _plain(read_artifact(out, "rollouts")).equals(reference[None])


def test_an_unscored_file_beside_the_part_of_its_number_is_ignored(tiny, journal, reference, tmp_path):
    """A resume stopped after it wrote an unscored file's prompts as the part of its number, before it
    removed the file, leaves both: the part is read, the file removed, and the prompts counted once."""
    import shutil

    out = tmp_path / "r.parquet"
    folder = _copy(journal, out)
    shutil.copy(folder / "part-00001.parquet", folder / "unscored-00001.parquet")
    r = runner.invoke(app, _args(tiny, out, None, "--resume"))
    assert r.exit_code == 0 and "2 of 6 prompts done, 4 to go" in r.stderr, r.output
    assert "scored first" not in r.stderr
    assert _plain(read_artifact(out, "rollouts")).equals(reference[None]) and not folder.exists()


def test_a_final_write_that_fails_keeps_the_journal_and_says_resume(tiny, reference, tmp_path, monkeypatch):
    """A full disk when the artifact is written after the sampling: one sentence that the journal keeps
    every prompt, and --resume writes the uninterrupted rows without sampling again."""
    import sparrow.schemas as schemas
    from sparrow.schemas import ArtifactError

    out = tmp_path / "r.parquet"
    write = schemas.write_artifact

    def full_at_out(data, path, *a, **k):
        if Path(path) == out:
            raise ArtifactError(f"cannot write {path} (No space left on device)")
        return write(data, path, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(schemas, "write_artifact", full_at_out)
        r = runner.invoke(app, _args(tiny, out, None))
    assert r.exit_code == 2, r.output
    line = r.stderr.splitlines()[-1]
    assert line == (f"error: cannot write {out} (No space left on device); the journal {_partial(out)}/ "
                    "keeps all 6 prompts, so once it can be written, run the same command with --resume")
    assert not out.exists() and _partial(out).is_dir()
    r = runner.invoke(app, _args(tiny, out, None, "--resume"))
    assert r.exit_code == 0, r.output
    assert "6 of 6 prompts done, 0 to go" in " ".join(r.stderr.split())
    assert _plain(read_artifact(out, "rollouts")).equals(reference[None])


FAILING_REWARD = """
calls = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls.append(1)
    if len(calls) == 7:
        raise ValueError("bug")
    return 1.0
"""


def test_a_reward_that_raises_keeps_the_journal_and_a_resume_scores_it_again_with_the_fixed_one(
        tiny, reference, tmp_path):
    """The reward raising on prompt 4: prompts 1-3 were journaled scored (by the broken reward), prompt 4
    unscored; the message says so. The reward fixed, --resume scores all of them with it (a note says the
    journal's parts were scored otherwise) and samples the rest: the uninterrupted rows, rewards of the
    fixed reward."""
    reward = tmp_path / "reward.py"
    reward.write_text(FAILING_REWARD)
    out = tmp_path / "r.parquet"
    args = _args(tiny, out, None, "--reward-fn", str(reward), "--checkpoint-interval", "0")
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and not out.exists()
    assert r.stderr.strip().splitlines()[-1].endswith(
        f"{_partial(out)}/ keeps the 4 of 6 prompts that had finished, so once the reward is fixed, run the "
        "same command with --resume: it scores them with the fixed reward and samples the rest")
    assert _journal_files(out) == ["manifest.json", "part-00000.parquet", "part-00001.parquet",
                                   "part-00002.parquet", "unscored-00003.parquet"]
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 0.5\n")
    r = runner.invoke(app, [*args, "--resume"])
    assert r.exit_code == 0, r.output
    said = " ".join(r.stderr.split())
    assert "--resume: 3 of the journal's prompts were scored with --reward-fn" in said
    table = _plain(read_artifact(out, "rollouts"))
    assert table.column("reward").to_pylist() == [0.5] * 12
    drop = ["reward", "reward_extra"]
    assert table.drop_columns(drop).equals(reference[None].drop_columns(drop))
    assert not _partial(out).exists()


def test_a_resume_may_score_with_a_fixed_reward_in_another_file(tiny, reference, tmp_path):
    """resume.md: --reward-fn may change on --resume. The broken reward in reward.py, the fixed one written
    as fixed.py: the resume scores the journal with fixed.py (a note names both) and samples the rest, the
    uninterrupted rows; the prompts are the same, whatever reward's name stands in their task."""
    reward, fixed = tmp_path / "reward.py", tmp_path / "fixed.py"
    reward.write_text(FAILING_REWARD)
    fixed.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    return 0.5\n")
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, _args(tiny, out, None, "--reward-fn", str(reward), "--checkpoint-interval", "0"))
    assert r.exit_code == 2 and not out.exists()
    r = runner.invoke(app, [*_args(tiny, out, None, "--reward-fn", str(fixed), "--checkpoint-interval", "0"),
                            "--resume"])
    assert r.exit_code == 0, r.output
    said = "".join(r.stderr.split())  # a long path may be wrapped anywhere
    assert f"3ofthejournal'spromptswerescoredwith--reward-fn{reward}:compute_score(sha256" in said
    assert f"thisrunscoresthemagain,first,with--reward-fn{fixed}:compute_score(sha256" in said
    table = _plain(read_artifact(out, "rollouts"))
    assert table.column("reward").to_pylist() == [0.5] * 12
    drop = ["reward", "reward_extra"]
    assert table.drop_columns(drop).equals(reference[None].drop_columns(drop))


def test_an_interrupt_right_after_a_part_is_in_place_counts_that_part(tiny, tmp_path, monkeypatch):
    """Ctrl-C as the first part's rename returns: the part is whole and in the journal, and the message
    says it is kept (not "nothing was kept", which would send a user to --force)."""
    from sparrow.stages import rollout_journal

    write, calls = rollout_journal.write_artifact, []

    def interrupted_after_the_write(*args, **kwargs):
        write(*args, **kwargs)
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(rollout_journal, "write_artifact", interrupted_after_the_write)
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, _args(tiny, out, None, "--checkpoint-interval", "0"))
    assert r.exit_code == 130 and calls == [1], r.output
    assert _journal_files(out) == ["manifest.json", "part-00000.parquet"]
    assert f"{_partial(out)}/ keeps the 1 of 6 prompts that had finished" in " ".join(r.stderr.split())


def test_a_journal_a_killed_process_was_removing_is_removed_by_the_next_run(tiny, tmp_path):
    """The hidden sibling a journal is moved to before it is deleted: a process killed meanwhile leaves it,
    and the next run with that -o removes it (one of a live process is left alone)."""
    out = tmp_path / "r.parquet"
    dead, live = (tmp_path / f".r.parquet.partial.removed-{pid}" for pid in (2**22 + 12345, os.getpid()))
    for folder in (dead, live):
        folder.mkdir()
        (folder / "part-00000.parquet").write_bytes(b"x" * 100)
    r = runner.invoke(app, _args(tiny, out, None))
    assert r.exit_code == 0, r.output
    assert not dead.exists() and live.exists()


def test_rewards_scored_while_sampling_show_their_progress_over_the_run(tiny, slow_reward, tmp_path):
    """With --checkpoint-interval 0 each finished prompt is scored (and journaled) while the engine samples
    the rest: a log hears of that scoring, counted over the run's 12 samples up to 12/12 (it heard of
    the last part's alone, 2/2)."""
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, _args(tiny, out, None, "--reward-fn", slow_reward, "--checkpoint-interval", "0"))
    assert r.exit_code == 0, r.output
    counts = [line.split(": ", 1)[1].split(" ", 1)[0] for line in r.stderr.splitlines()
              if line.startswith("scoring rewards (samples): ")]
    totals = {c.split("/")[1] for c in counts}
    assert totals == {str(6 * SAMPLES)} and counts[-1] == f"{6 * SAMPLES}/{6 * SAMPLES}", r.stderr
    done = [int(c.split("/")[0]) for c in counts]
    assert done == sorted(done)  # a log's lines are 10 s apart: the first and the last here
