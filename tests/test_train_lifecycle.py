"""A training run's lifecycle around interrupts and its outputs: an interrupt at the last step is finished
by `--resume`; a step the metrics hold reaches the trackers and the log (a resume writes the lines a
tracker lacks); `--full` leaves a Hugging Face model; a killed write's hidden leftovers are cleared (a
checkpoint moved aside is put back); the reward is part of what a resume must agree on; the printed
summary is in the metrics metadata. Tiny random Llama, CPU, fp32."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_train import TIMING, VOWELS, tiny_llama, vowel_token_prompts  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.schemas.io import recover_replaced
from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import TASKS
from sparrow.stages.train import TrainConfig, Trainer, check_run_dir, load_prompts, with_fingerprints
from sparrow.stages.train.config import kv_policy
from sparrow.stages.train.run_dir import clear_run, resume_notes
from sparrow.stages.train.tracking import Trackers
from sparrow.stages.train.update import Learner

from cli_checks import error_line

runner = CliRunner()


def metrics(run) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING}
            for r in read_artifact(run / "metrics.parquet", "metrics").to_pylist()]


def jsonl(run) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def adapter(run) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def same_adapter(a, b) -> bool:
    x, y = adapter(a), adapter(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def summary_of(run) -> dict:
    return json.loads(artifact_metadata(run / "metrics.parquet")["summary"])


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):  # noqa: F811 - the imported fixture
    """Vowel prompts for the tiny model, the CLI arguments of a 2-step run, and that run done straight
    (its printed summary as JSON)."""
    patch = pytest.MonkeyPatch()
    patch.setitem(TASKS, "vowels", VOWELS)
    root = tmp_path_factory.mktemp("lifecycle")
    tok = load_model(tiny_llama[0]).tokenizer
    prompts = write_artifact(vowel_token_prompts(tok, 4, 6), root / "prompts.parquet", "prompts")

    def args(run, *extra: str) -> list[str]:
        return ["train", "--model", tiny_llama[0], "--prompts", str(prompts), "--steps", "2",
                "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens", "6", "--lora-rank", "2",
                "--lr", "0.05", "--budget", "48", "--checkpoint-every", "1", "-o", str(run), *extra]

    straight = root / "straight"
    r = runner.invoke(app, args(straight, "-f", "json"))
    assert r.exit_code == 0, r.output
    yield {"root": root, "prompts": prompts, "args": args, "straight": straight,
           "printed": json.loads(r.stdout.strip().splitlines()[-1]), "model": tiny_llama[0]}
    patch.undo()


def sigint_in_update(monkeypatch, step: int) -> None:
    """A real SIGINT while step `step`'s weights change (the step finishes first)."""
    update = Learner.update

    def update_with_sigint(self, exp):
        if exp.step + 1 == step:
            os.kill(os.getpid(), signal.SIGINT)
        return update(self, exp)

    monkeypatch.setattr(Learner, "update", update_with_sigint)


@pytest.fixture()
def python_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever ran us
    yield
    signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------- an interrupt at the last step

def test_an_interrupt_in_the_last_step_is_finished_by_resume(setup, tmp_path, monkeypatch, python_sigint):
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        sigint_in_update(m, 2)
        r = runner.invoke(app, setup["args"](run))
    assert r.exit_code == 130, r.output
    said = " ".join(r.stderr.split())
    assert (f"interrupted; {run}/checkpoint holds the run's 2 steps, but its adapter and summary are not "
            "written yet; add --resume to the same command to write them") in said
    assert not (run / "adapter").exists() and "summary" not in artifact_metadata(run / "metrics.parquet")
    line = error_line(runner.invoke(app, [*setup["args"](run, "--resume"), "--steps", "1"]))
    assert line == (f"error: --resume: {run} already holds 2 steps, so --steps 1 leaves none to train; give "
                    "--steps 2 to finish it (its adapter and summary are not written yet) or --steps above 2 "
                    "to continue it")
    r = runner.invoke(app, setup["args"](run, "--resume"))  # the command the message gives
    assert r.exit_code == 0, r.output
    assert metrics(run) == metrics(setup["straight"]) and same_adapter(run, setup["straight"])
    assert summary_of(run)["steps"] == 2 and summary_of(run)["adapter"] == str(run / "adapter")
    line = error_line(runner.invoke(app, setup["args"](run, "--resume")))  # finished: nothing left
    assert line.endswith("so --steps 2 leaves none to train; give --steps above 2 to continue it")


# ---------------------------------------------------------------- every logged step reaches the trackers

def test_a_step_an_interrupt_waited_for_reaches_the_jsonl_and_the_log(setup, tmp_path, monkeypatch,
                                                                      python_sigint):
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        sigint_in_update(m, 1)
        r = runner.invoke(app, setup["args"](run))
    assert r.exit_code == 130, r.output
    assert "train step 1/2: reward" in r.stderr
    assert [row["step"] for row in jsonl(run)] == [row["step"] for row in metrics(run)] == [1]
    assert runner.invoke(app, setup["args"](run, "--resume")).exit_code == 0
    assert jsonl(run) == jsonl(setup["straight"]) and len(jsonl(run)) == 2


def test_a_resume_writes_the_jsonl_lines_it_lacks(setup, tmp_path):
    run = tmp_path / "run"
    assert runner.invoke(app, [*setup["args"](run, "--report-to", "none"), "--steps", "1"]).exit_code == 0
    assert not (run / "metrics.jsonl").exists()
    r = runner.invoke(app, setup["args"](run, "--resume"))  # jsonl, the default
    assert r.exit_code == 0, r.output
    assert jsonl(run) == jsonl(setup["straight"]) and len(jsonl(run)) == 2


def test_tensorboard_on_resume_purges_and_rewrites_every_step(tmp_path, monkeypatch):
    """Which steps earlier event files hold is unknown, so a resume purges from step 0 and writes the config
    and the checkpoint's steps again before the new ones (a stand-in SummaryWriter records the calls)."""
    calls = []

    class Writer:
        def __init__(self, log_dir, purge_step=None):
            calls.append(("open", purge_step))

        def add_scalar(self, key, value, global_step):
            calls.append((key, value, global_step))

        def add_text(self, *a):
            calls.append(("text",))

        def flush(self):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    history = [{"step": 1, "reward_mean": 0.5, "collapse": None}, {"step": 2, "reward_mean": 0.25}]
    trackers = Trackers(("tensorboard",), tmp_path, start_step=2, history=history)
    trackers.log({"step": 3, "reward_mean": 1.0})
    assert calls == [("open", 0), ("text",), ("reward_mean", 0.5, 1), ("reward_mean", 0.25, 2),
                     ("reward_mean", 1.0, 3)]


# ---------------------------------------------------------------- --full leaves a model

def test_full_fine_tuning_writes_a_hugging_face_model(setup, tmp_path):
    path = setup["model"]
    loaded = load_model(path)
    rows = load_prompts(setup["prompts"], loaded.tokenizer)
    cfg = TrainConfig(model=path, steps=1, prompts_per_step=2, samples=2, max_new_tokens=6, lora_rank=0,
                      lr=0.05, sparsity="budget:48")
    run = tmp_path / "run"
    trainer = Trainer(cfg, loaded, rows, run)
    summary = trainer.run()
    folder = run / "model"
    assert summary["model"] == str(folder) and summary["adapter"] is None
    assert summary_of(run)["model"] == str(folder)
    x = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = trainer.model(x)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
        base = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
        assert (hf(x).logits - trained).abs().max() < 1e-5
        assert (base(x).logits - trained).abs().max() > 1e-3  # the trained weights, not the base's
        assert (load_model(str(folder)).model(x) - trained).abs().max() < 1e-5  # --model RUN/model
    text = "Write the number 37."
    assert (transformers.AutoTokenizer.from_pretrained(folder)(text).input_ids
            == transformers.AutoTokenizer.from_pretrained(path)(text).input_ids)


def test_a_folder_named_model_is_replaced_only_when_a_full_run_wrote_it(setup, tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "weights.bin").write_text("mine")
    full = TrainConfig(model=setup["model"], lora_rank=0)
    with pytest.raises(ValueError, match=f"{run / 'model'} exists and is not a training run's model"):
        check_run_dir(run, full, resume=False, force=True)
    check_run_dir(run, replace(full, lora_rank=4), resume=False, force=True)  # a LoRA run leaves it
    clear_run(run)
    assert (run / "model" / "weights.bin").read_text() == "mine"


# ---------------------------------------------------------------- what a killed write leaves

KILLED = """
import os, sys
from pathlib import Path
from sparrow.schemas import io
where, at = Path(sys.argv[1]), sys.argv[2]
real = os.replace
calls = []
def replace(a, b):
    calls.append(a)
    if at == "between" and len(calls) == 2:
        os._exit(9)
    real(a, b)
io.os.replace = replace
def fill(tmp):
    (tmp / "state.pt").write_bytes(b"new")
    if at == "fill":
        os._exit(9)
io.replace_dir(where, fill)
"""


def killed_replace(folder, at: str) -> None:
    """Replace `folder` by io.replace_dir in a process killed (os._exit) while it fills the new one, or
    between moving the old one aside and putting the new one in place."""
    subprocess.run([sys.executable, "-c", KILLED, str(folder), at], check=False)


def hidden(folder) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*"))


@pytest.mark.parametrize("at", ["fill", "between"])
def test_recover_replaced_puts_back_the_version_a_killed_replace_moved_aside(tmp_path, at):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "state.pt").write_bytes(b"old")
    killed_replace(folder, at)
    assert hidden(tmp_path) and (folder.exists() == (at == "fill"))
    assert recover_replaced(folder) == (at == "between")
    assert (folder / "state.pt").read_bytes() == b"old" and hidden(tmp_path) == []


def test_resume_and_force_clear_what_a_killed_checkpoint_write_left(setup, tmp_path):
    run = tmp_path / "run"
    assert runner.invoke(app, [*setup["args"](run), "--steps", "1"]).exit_code == 0
    killed_replace(run / "checkpoint", "between")  # checkpoint/ moved aside, the new one half in place
    (run / "mismatch" / ".step=00002.parquet.0123456789ab.tmp").write_bytes(b"half")
    assert not (run / "checkpoint").exists() and len(hidden(run)) == 3
    r = runner.invoke(app, setup["args"](run, "--resume"))
    assert r.exit_code == 0, r.output
    assert hidden(run) == [] and metrics(run) == metrics(setup["straight"])
    assert same_adapter(run, setup["straight"])
    killed_replace(run / "checkpoint", "fill")
    killed_replace(run / "adapter", "fill")
    assert len(hidden(run)) == 2
    assert runner.invoke(app, [*setup["args"](run, "--force"), "--steps", "1"]).exit_code == 0
    assert hidden(run) == []


# ---------------------------------------------------------------- the reward is part of the run

def test_the_reward_is_recorded_and_a_resume_names_its_change(setup, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rf").mkdir()
    source = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n"
    (tmp_path / "rf" / "r.py").write_text(source)
    spec = "rf/r.py:compute_score"
    path = setup["model"]
    loaded = load_model(path)
    rows = load_prompts(setup["prompts"], loaded.tokenizer)
    cfg = TrainConfig(model=path, steps=1, prompts_per_step=2, samples=2, max_new_tokens=4, lora_rank=2,
                      reward_fn=spec)
    run = tmp_path / "run"
    Trainer(cfg, loaded, rows, run).run()
    saved = json.loads((run / "checkpoint" / "config.json").read_text())
    assert saved["reward_fn"] == spec and saved["reward"] is None
    assert saved["reward_fn_sha256"] == hashlib.sha256(source.encode()).hexdigest()
    policy = kv_policy(cfg.sparsity, loaded.config)

    def resume(**change) -> None:
        now = with_fingerprints(replace(cfg, steps=2, **change), rows, None, policy)
        check_run_dir(run, now, resume=True)

    with pytest.raises(ValueError) as e:
        resume(reward="math", reward_fn=None)
    assert str(e.value) == (f"--resume: {run} was trained with --reward-fn {spec}, not --reward math; only "
                            "--steps, --checkpoint-every and --eval-every may change on resume")
    (tmp_path / "copy.py").write_text(source)
    resume(reward_fn="copy.py:compute_score")  # the same function at another path: the same run
    (tmp_path / "copy.py").write_text(source.replace("0.5", "0.25"))
    with pytest.raises(ValueError) as e:  # another file of other code
        resume(reward_fn="copy.py:compute_score")
    assert str(e.value) == (f"--resume: {run} was trained with --reward-fn {spec}, whose file held other "
                            "code than copy.py holds now (their content differs); only --steps, "
                            "--checkpoint-every and --eval-every may change on resume")
    assert resume_notes(run, replace(cfg, steps=2, reward_fn_sha256="")) == []  # as the CLI asks: no digest
    (tmp_path / "rf" / "r.py").write_text(source.replace("0.5", "0.25"))  # the run's file, fixed in place
    resume()
    now = with_fingerprints(replace(cfg, steps=2), rows, None, policy)
    edited = [f"--resume: rf/r.py holds other code than when {run} was checkpointed; the steps after step 1 "
              "score with its code as it is now"]
    assert resume_notes(run, now) == edited
    assert resume_notes(run, replace(cfg, steps=2, reward_fn_sha256="")) == edited
    for key in ("reward", "reward_fn", "reward_fn_sha256"):  # a checkpoint that names none: not compared
        del saved[key]
    (run / "checkpoint" / "config.json").write_text(json.dumps(saved))
    resume()


# ---------------------------------------------------------------- the summary stays with the run

def test_the_printed_summary_is_in_the_metrics_metadata(setup):
    printed, stored = setup["printed"], summary_of(setup["straight"])
    for key, value in printed.items():
        want = "; ".join(stored[key]) if key in ("reasons", "warnings") else stored[key]
        assert value == pytest.approx(want) if isinstance(value, float) else value == want, key
    rows = read_artifact(setup["straight"] / "metrics.parquet", "metrics").to_pylist()
    assert stored["reward_first"] == rows[0]["reward_mean"] and stored["steps"] == len(rows) == 2
    assert stored["mean_mismatch_kl"] == pytest.approx(sum(r["mismatch_kl"] for r in rows) / 2)


def test_a_forced_run_over_a_killed_one_starts_clean(setup, tmp_path):
    """--force on a directory whose checkpoint was moved aside by a killed write: no stale copy stays."""
    run = tmp_path / "run"
    shutil.copytree(setup["straight"], run)
    killed_replace(run / "checkpoint", "between")
    assert runner.invoke(app, [*setup["args"](run, "--force"), "--steps", "1"]).exit_code == 0
    assert hidden(run) == [] and json.loads((run / "checkpoint" / "progress.json").read_text())["step"] == 1


def test_an_exported_qwen3_loads_in_transformers_with_the_same_logits(tmp_path):
    """The Qwen3 layout (q/k norms, GQA, untied head) under Hugging Face names, in the weights' dtype."""
    from sparrow.stages.model.export import export_model

    from tiny_models import tiny_qwen3

    hf = tiny_qwen3(tmp_path / "qwen3", tie_word_embeddings=False)
    ours = load_model(str(tmp_path / "qwen3")).model
    export_model(ours.to(torch.bfloat16), None, tmp_path / "model", {"base_model": "qwen3"})
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    x = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for param in hf.parameters():  # the same bf16 rounding of the weights (not of the rotary buffers)
            param.copy_(param.to(torch.bfloat16).float())
        assert (back.eval()(x).logits - hf(x).logits).abs().max() < 1e-5


# ---------------------------------------------------------------- the completions each step sampled

def test_each_steps_completions_are_logged_with_their_reward_and_advantage(setup):
    """RUN/completions/step=N.parquet: every sampled completion of the step. Checked against the task's
    scorer on the logged text and GRPO's group-relative advantage computed here from those rewards, and
    against the step's mean reward in the metrics."""
    run = setup["straight"]
    files = sorted(p.name for p in (run / "completions").iterdir())
    assert files == ["step=00001.parquet", "step=00002.parquet"]
    rows = read_artifact(run / "completions", "train_completions").to_pylist()
    metrics = {m["step"]: m for m in read_artifact(run / "metrics.parquet", "metrics").to_pylist()}
    for step in (1, 2):
        mine = [r for r in rows if r["step"] == step]
        assert len(mine) == 2 * 2  # prompts per step x samples
        for r in mine:
            assert r["reward"] == pytest.approx(VOWELS.score(r["text"], "", None), abs=1e-12)
            assert 1 <= r["tokens"] <= 6 and r["finish_reason"] in ("stop", "length")
        for pid in {r["prompt_id"] for r in mine}:
            group = [r for r in mine if r["prompt_id"] == pid]
            rewards = torch.tensor([r["reward"] for r in group], dtype=torch.float64)
            expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            assert [r["advantage"] for r in group] == pytest.approx(expected.tolist(), abs=1e-5)
        assert sum(r["reward"] for r in mine) / len(mine) == pytest.approx(metrics[step]["reward_mean"])
    r = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM train_completions", "--run", str(run), "-f",
                            "csv"])
    assert r.exit_code == 0 and r.stdout.split() == ["n", "8"], r.output
