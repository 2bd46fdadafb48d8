"""Outputs under real filesystem conditions: one writer per run directory, a dangling symlink among an
output's folders, what a killed write leaves, a newer metrics schema under --resume, the access of a
replaced file, a file output named as a folder or as a text format."""

from __future__ import annotations

import grp
import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_train import VOWELS, tiny_llama, vowel_token_prompts  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import ArtifactError, check_output, check_output_dir, read_artifact, write_artifact
from sparrow.schemas.io import replace_dir, write_table
from sparrow.schemas.locations import check_file_path
from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import TASKS

from cli_checks import error_line

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):  # noqa: F811 - the imported fixture
    """Vowel prompts for the tiny model and the CLI arguments of a short LoRA run."""
    patch = pytest.MonkeyPatch()
    patch.setitem(TASKS, "vowels", VOWELS)
    root = tmp_path_factory.mktemp("fs8")
    tok = load_model(tiny_llama[0]).tokenizer
    prompts = write_artifact(vowel_token_prompts(tok, 4, 4), root / "prompts.parquet", "prompts")

    def args(run, steps: int, *extra: str) -> list[str]:
        return ["train", "--model", tiny_llama[0], "--prompts", str(prompts), "--steps", str(steps),
                "--prompts-per-step", "1", "--samples", "2", "--max-new-tokens", "4", "--lora-rank", "2",
                "-o", str(run), *extra]

    yield {"root": root, "args": args, "model": tiny_llama[0], "prompts": prompts}
    patch.undo()


def train(args: list[str]) -> None:
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output + r.stderr


def no_model_load(monkeypatch) -> None:
    import sparrow.stages.model.loading as loading

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(loading, "load_model", refuse)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*")) if p.is_file()}


HOLD = """
import sys, time
from pathlib import Path
from sparrow.stages.train.run_dir import lock_run
lock_run(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""

TRY = """
import sys
from sparrow.schemas.locations import hold_folder
try:
    hold_folder(sys.argv[1], "sparrow train", "another run directory (-o)")
    print("took it")
except ValueError as e:
    print(e)
"""


def holder(run: Path) -> subprocess.Popen:
    """Another process that holds `run` as a training run's writer until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ---------------------------------------------------------------- one writer per run directory

def test_a_second_train_into_a_run_being_written_is_refused_at_once(setup, tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(setup["args"](run, 1))
    (run / ".metrics.parquet.0123456789ab-999999.tmp").write_bytes(b"its write in flight")
    proc = holder(run)
    before = tree(run)
    try:
        with monkeypatch.context() as m:
            no_model_load(m)
            for extra in ([], ["--resume"], ["--force"]):
                steps = 2 if extra == ["--resume"] else 1
                line = error_line(runner.invoke(app, setup["args"](run, steps, *extra)))
                assert f"{run} is being written by another sparrow train (pid {proc.pid})" in line, line
                assert "choose another run directory (-o)" in line
        assert tree(run) == before  # a resume's recovery did not touch the other writer's files
    finally:
        proc.kill()
        proc.wait()
    # the killed writer's lock blocks nothing: the run resumes, and leaves no lock behind
    assert (run / ".sparrow.lock").exists()
    r = runner.invoke(app, setup["args"](run, 2, "--resume"))
    assert r.exit_code == 0, r.output
    assert len(read_artifact(run / "metrics.parquet", "metrics")) == 2
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []


def test_a_trainer_holds_a_fresh_run_directory_from_its_start_to_its_end(setup, tmp_path):
    from sparrow.stages.train import TrainConfig, Trainer, load_prompts

    loaded = load_model(setup["model"])
    rows = load_prompts(setup["prompts"], loaded.tokenizer)
    cfg = TrainConfig(model=setup["model"], steps=1, prompts_per_step=1, samples=2, max_new_tokens=4,
                      lora_rank=2)
    run = tmp_path / "fresh"
    trainer = Trainer(cfg, loaded, rows, run)  # the directory did not exist when it was checked

    def other() -> str:
        return subprocess.run([sys.executable, "-c", TRY, str(run)], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert f"{run} is being written by another sparrow train (pid {os.getpid()})" in other()
    trainer.run()
    assert other() == "took it"


# ---------------------------------------------------------------- a dangling symlink on the way

def test_a_dangling_symlink_among_the_folders_of_an_output_is_refused_up_front(setup, tmp_path, monkeypatch):
    link = tmp_path / "dl"
    link.symlink_to(tmp_path / "nowhere")
    for refuse in (lambda: check_output(link / "r.parquet", "rollouts"),
                   lambda: check_output(link / "deeper" / "r.parquet", None),
                   lambda: check_output_dir(link / "rep", "a report folder", ours=lambda d: True)):
        with pytest.raises(ArtifactError, match=f"{link} is a symlink to {tmp_path / 'nowhere'}, which "
                                                "does not exist"):
            refuse()
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ArtifactError, match="loops back on itself"):
        check_output(loop / "r.parquet", "rollouts")
    no_model_load(monkeypatch)
    line = error_line(runner.invoke(app, setup["args"](link / "run", 1)))
    assert f"{link} is a symlink to {tmp_path / 'nowhere'}, which does not exist" in line
    assert not (tmp_path / "nowhere").exists() and not os.path.exists(link)


# ---------------------------------------------------------------- what a killed write leaves

KILLED_WRITE = """
import os, sys
from pathlib import Path
import pyarrow as pa
from sparrow.schemas.io import _write
def write(f):
    f.write(b"PAR1" + b"x" * 100000)
    f.flush()
    os._exit(9)
_write(Path(sys.argv[1]), write)
"""


def test_a_later_write_removes_what_a_killed_writer_left_and_nothing_else(tmp_path):
    out = tmp_path / "big.parquet"
    write_table(pa.table({"a": [1]}), out)
    subprocess.run([sys.executable, "-c", KILLED_WRITE, str(out)], check=False)
    (dead,) = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert dead.name.startswith(".big.parquet.") and dead.stat().st_size >= 100000
    alive = tmp_path / f".big.parquet.0123456789ab-{os.getpid()}.tmp"  # a live writer's
    older = tmp_path / ".big.parquet.0123456789ab.tmp"  # an older Sparrow's: nothing tells whose
    other = tmp_path / f".other.parquet.0123456789ab-{dead.name.split('-')[-1].split('.')[0]}.tmp"
    for f in (alive, older, other):
        f.write_bytes(b"x")
    write_table(pa.table({"a": [2]}), out)
    assert pq.read_table(out).column("a").to_pylist() == [2]
    kept = [out.name, alive.name, older.name, other.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


KILLED_REPLACE = """
import os, sys
from pathlib import Path
from sparrow.schemas.io import replace_dir
def fill(tmp):
    (tmp / "part-00000.parquet").write_bytes(b"half")
    os._exit(9)
replace_dir(Path(sys.argv[1]), fill)
"""


def test_a_later_replacement_removes_a_killed_replacements_folder(tmp_path):
    parts = tmp_path / "parts"
    replace_dir(parts, lambda d: (d / "part-00000.parquet").write_bytes(b"one"))
    subprocess.run([sys.executable, "-c", KILLED_REPLACE, str(parts)], check=False)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".")]) == 1
    replace_dir(parts, lambda d: (d / "part-00000.parquet").write_bytes(b"two"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parts"]
    assert (parts / "part-00000.parquet").read_bytes() == b"two"


# ---------------------------------------------------------------- a resume reads metrics.parquet first

def test_resume_refuses_a_metrics_file_of_a_newer_schema_before_the_model_loads(setup, tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(setup["args"](run, 1))
    path = run / "metrics.parquet"
    t = pq.read_table(path)
    meta = {**t.schema.metadata, b"sparrow.version": b"2"}
    newer = t.append_column("new_metric", pa.array([1.5] * len(t))).replace_schema_metadata(meta)
    pq.write_table(newer, path)
    before = tree(run)
    no_model_load(monkeypatch)
    line = error_line(runner.invoke(app, setup["args"](run, 2, "--resume")))
    assert f"--resume: {path} has version 2 of the 'metrics' schema" in line
    assert "upgrade Sparrow" in line
    assert tree(run) == before
    assert pq.read_table(path).column("new_metric").to_pylist() == [1.5]


# ---------------------------------------------------------------- a replaced file keeps its access

def other_group() -> int:
    """A group other than this process's, to give a file (root may give any)."""
    mine = os.getgid()
    return next(g.gr_gid for g in grp.getgrall() if g.gr_gid != mine)


def test_a_replaced_artifact_keeps_its_mode_and_group_through_a_symlink(tmp_path):
    rows = [{"a": 1}]
    out = tmp_path / "q.parquet"
    write_table(pa.table({"a": [0]}), out)
    os.chmod(out, 0o600)
    write_table(pa.Table.from_pylist(rows), out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    target = tmp_path / "real.parquet"
    write_table(pa.table({"a": [0]}), target)
    os.chmod(target, 0o640)
    link = tmp_path / "link.parquet"
    link.symlink_to(target)
    group = other_group() if os.geteuid() == 0 else target.stat().st_gid
    os.chown(target, -1, group)
    write_table(pa.Table.from_pylist(rows), link)
    assert link.is_symlink() and pq.read_table(target).to_pylist() == rows
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 and target.stat().st_gid == group
    fresh = tmp_path / "fresh.parquet"  # nothing replaced: the umask's mode
    write_table(pa.Table.from_pylist(rows), fresh)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask


def test_a_run_keeps_the_access_of_its_metrics_and_checkpoint_at_every_step(setup, tmp_path):
    run = tmp_path / "run"
    train(setup["args"](run, 1, "--checkpoint-every", "1"))
    os.chmod(run / "metrics.parquet", 0o600)
    os.chmod(run / "checkpoint", 0o700)
    os.chmod(run / "checkpoint" / "state.pt", 0o600)
    r = runner.invoke(app, setup["args"](run, 3, "--resume", "--checkpoint-every", "1"))
    assert r.exit_code == 0, r.output
    assert len(read_artifact(run / "metrics.parquet", "metrics")) == 3
    assert stat.S_IMODE((run / "metrics.parquet").stat().st_mode) == 0o600
    assert stat.S_IMODE((run / "checkpoint").stat().st_mode) == 0o700
    assert stat.S_IMODE((run / "checkpoint" / "state.pt").stat().st_mode) == 0o600


# ---------------------------------------------------------------- a file output's name

@pytest.mark.parametrize("text", ["x/", "runs/x/", "x/.", "."])
def test_a_file_output_ending_in_a_slash_names_a_directory(text):
    with pytest.raises(ArtifactError, match=r"names a directory; give a file path such as .*out\.parquet"):
        check_file_path(text)


@pytest.mark.parametrize("text", ["x", "x/out.parquet", "-", "./x.parquet"])
def test_a_file_output_path_is_taken(text):
    check_file_path(text)


@pytest.mark.parametrize("name", ["pp.jsonl", "rr.json", "out.CSV", "t.tsv", "n.ndjson"])
def test_a_parquet_output_named_as_a_text_format_is_refused(tmp_path, name):
    with pytest.raises(ArtifactError, match=rf"would hold Parquet under a .* name, so give a path ending in "
                                            rf"\.parquet \(not {name}\)"):
        check_output(tmp_path / name, "prompts")
    with pytest.raises(ArtifactError, match="ending in .parquet"):
        check_output(tmp_path / name, None)
    assert not (tmp_path / name).exists()


def test_other_output_names_are_taken(tmp_path):
    for name in ("r", "r.parquet", "r.pq", "run.v2", "notes.txt"):
        check_output(tmp_path / name, "rollouts")
    check_output(tmp_path / "parts.jsonl", "rollouts", parts=True)  # a directory of parts: not a file


def test_prompts_refuses_a_jsonl_output_before_any_work(tmp_path):
    out = tmp_path / "pp.jsonl"
    args = ["prompts", "--task", "basic_arithmetic", "--n", "1", "-o", str(out)]
    line = error_line(runner.invoke(app, args))
    assert "would hold Parquet under a JSON lines name" in line and not out.exists()


@pytest.mark.parametrize("command", [["prompts", "--task", "chain_sum", "--n", "1"],
                                     ["sql", "SELECT 1 AS x", "--run", "."]])
def test_a_file_output_typed_as_a_folder_is_refused_before_work(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, [*command, "-o", "out/"])
    assert r.exit_code == 2
    assert error_line(r) == "error: -o out/ names a directory; give a file path such as out/out.parquet"
    assert list(tmp_path.iterdir()) == []


def test_a_folder_output_may_end_in_a_slash(tmp_path):
    """report -o names a folder: out/ is that folder, not a refused file name."""
    r = CliRunner().invoke(app, ["report", str(tmp_path), "-o", f"{tmp_path}/page/"])
    assert "names a directory" not in r.output


def test_a_prompts_artifact_renamed_to_jsonl_is_read_as_the_parquet_it_is(tmp_path):
    out = tmp_path / "p.parquet"
    r = CliRunner().invoke(app, ["prompts", "--task", "chain_sum", "--n", "2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    renamed = (tmp_path / "p.parquet").rename(tmp_path / "p.jsonl")
    expected = pq.read_table(renamed).column("prompt").to_pylist()
    assert read_artifact(renamed, "prompts").column("prompt").to_pylist() == expected


def test_a_footer_whose_column_name_is_not_utf8_is_one_sentence(tmp_path):
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"qzqzqz": [1, 2]}), path)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"qzqzqz", b"\xff\xfe\xfd\xfc\xfb\xfa"))
    with pytest.raises(ArtifactError, match="is a corrupt Parquet file"):
        read_artifact(path, "mismatch")


def test_a_replaced_adapter_keeps_its_access_and_leaves_no_temporary_folder(tmp_path):
    from sparrow.stages.model.adapter import add_lora, save_adapter

    model = load_model("tiny-llama").model
    config = add_lora(model, 2, 4.0)
    folder = save_adapter(model, config, tmp_path / "adapter", "tiny-llama")
    os.chmod(folder, 0o700)
    os.chmod(folder / "adapter_model.safetensors", 0o600)
    save_adapter(model, config, folder, "tiny-llama")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "adapter_model.safetensors").stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_a_run_directory_the_run_made_and_left_empty_is_removed_when_let_go(tmp_path):
    """A run stopped while its model loaded leaves no empty folder (a --resume there would find no run);
    one it wrote into, or one that was there before, stays."""
    from sparrow.stages.train.run_dir import lock_run, release_run

    made, written, there = tmp_path / "made", tmp_path / "written", tmp_path / "there"
    there.mkdir()
    for run in (made, written, there):
        lock_run(run)
    (written / "metrics.parquet").write_bytes(b"x")
    for run in (made, written, there):
        release_run(run)
    assert not made.exists() and written.exists() and there.exists()
    assert os.listdir(written) == ["metrics.parquet"] and os.listdir(there) == []
