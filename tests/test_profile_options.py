"""`sparrow profile`'s options read as `sparrow rollout` reads its own: a schedule sampler (an empty path, a
schedule of another model, a draft schedule), a LoRA that is missing or not peft's, and a learner's LoRA
(`--lora`) merged into both sides. Its summary shows what --draft-alpha and --speculate measured.

References: rollout's own refusals and warnings of the same files, numpy's mean and quantile of the written
artifact, rollout's per-row `accepted`/`drafted` columns, and a checkpoint merged by peft's
`merge_and_unload` (an independent merge of the same LoRA).
"""

from __future__ import annotations

import csv
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.model.adapter import add_lora, save_adapter
from sparrow.stages.model.loading import load_model
from sparrow.stages.model.lora import load_lora
from sparrow.stages.profile import ProfileOptions, profile_shard, run_profile

from cli_checks import error_line

runner = CliRunner()
VOCAB = 300
SAMPLING = ["--samples", "2", "--max-new-tokens", "24", "--temperature", "0.8", "--seed", "3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 4-layer random Llama without a tokenizer: layers 0-1 dense, 2-3 sparse, so a lossy pass writes
    other keys into layer 3 than the dense pass does and a draft's alpha differs from the lossy one."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, max_position_embeddings=512, rope_theta=5000.0,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-options") / "base"
    transformers.AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(path)
    return path


def _adapter(model: Path, folder: Path, seed: int, distilled: bool) -> Path:
    """A rank-2 peft LoRA of `model` whose B matrices are random (peft starts them at zero, a no-op), a
    sparse actor's when `distilled` (sparrow distill's sparrow_distill.json beside it)."""
    loaded = load_model(str(model))
    config = add_lora(loaded.model, 2, 4.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    out = save_adapter(loaded.model, config, folder, str(model))
    if distilled:
        (out / "sparrow_distill.json").write_text("{}")
    return out


@pytest.fixture(scope="module")
def adapters(tiny) -> dict[str, Path]:
    """A learner's LoRA, a sparse actor's, and the base with the learner merged by peft (a checkpoint)."""
    from peft import PeftModel

    root = tiny.parent
    learner = _adapter(tiny, root / "learner", 1, distilled=False)
    actor = _adapter(tiny, root / "actor", 2, distilled=True)
    merged = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tiny), learner)
    merged.merge_and_unload().save_pretrained(root / "merged")
    return {"learner": learner, "actor": actor, "merged": root / "merged"}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    rng = np.random.default_rng(1)
    rows = [{"prompt_id": f"t{i}", "task": "test", "prompt": None, "answer": None, "metadata": None,
             "prompt_token_ids": rng.integers(3, VOCAB, n).tolist()} for i, n in enumerate((70, 130))]
    return write_artifact(rows, tmp_path_factory.mktemp("prompts") / "prompts.parquet", "prompts")


def _schedule(path: Path, budgets: list[int | None], **meta) -> Path:
    """A two-bin schedule artifact (bins of 256 tokens) with these budgets and extra metadata."""
    return write_artifact({"bin": [0, 1], "bin_start": [0, 256], "bin_end": [256, None], "budget": budgets,
                           "tail": [None, None], "predicted_step_seconds": [None, None]}, path, "schedule",
                          metadata={"page_size": 16, **meta})


def _profile(model: Path, prompts: Path, out: Path, *args: str):
    return runner.invoke(app, ["profile", "--model", str(model), "--prompts", str(prompts), *args,
                               "-o", str(out)])


def _rollout(model: Path, prompts: Path, out: Path, *args: str):
    return runner.invoke(app, ["rollout", "--model", str(model), "--prompts", str(prompts), *args,
                               "-o", str(out)])


def _sorted(path: Path):
    table = read_artifact(path, "mismatch").to_pandas()
    return table.sort_values(["prompt_id", "sample", "budget", "position"]).reset_index(drop=True)


# ---------------------------------------------------------------- --sampler schedule:FILE


def test_an_empty_schedule_sampler_is_refused_as_an_empty_path(tiny, prompts, tmp_path, monkeypatch, no_work):
    """`schedule:` (an unset $SCHED) names no file: refused as rollout refuses --schedule "", rather than
    read as the working directory, even where that directory holds a schedule."""
    _schedule(tmp_path / "schedule.parquet", [48, 48])
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "m.parquet"
    line = error_line(_profile(tiny, prompts, out, "--budgets", "48", "--sampler", "schedule:"))
    assert line.startswith("error: --sampler schedule: is an empty path; give a schedule file")
    rollout = error_line(_rollout(tiny, prompts, out, "--schedule", ""))
    assert rollout.startswith("error: --schedule is an empty path; give")  # the same refusal, in its flag
    assert not out.exists()


def test_a_schedule_of_another_model_is_refused_as_rollout_refuses_it(tiny, prompts, tmp_path, no_work):
    other = tmp_path / "q4b.parquet"
    assert runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "-o", str(other)]).exit_code == 0
    out = tmp_path / "m.parquet"
    expected = error_line(_rollout(tiny, prompts, out, "--schedule", str(other)))
    assert "the schedule was planned for qwen3-4b, whose shape differs" in expected
    for speculate in ([], ["--speculate", "2"]):
        line = error_line(_profile(tiny, prompts, out, "--budgets", "48", "--sampler", f"schedule:{other}",
                                   *speculate))
        assert line == expected
    assert not out.exists()


def test_a_draft_schedule_is_warned_about_in_rollouts_sentence(tiny, prompts, tmp_path, no_work):
    """plan-schedule --speculate's drafts used as a lossy sampler: the warning rollout gives, in profile's
    flag; under --speculate a schedule dense in every bin is refused as rollout refuses it."""
    drafts = _schedule(tmp_path / "drafts.parquet", [48, 64], speculate=3)
    out = tmp_path / "m.parquet"
    said = " ".join(_rollout(tiny, prompts, out, "--schedule", str(drafts)).stderr.split())
    sentence = said[said.index("holds draft budgets"):said.index("--speculate", said.index("add --")) + 11]
    r = _profile(tiny, prompts, out, "--budgets", "48", "--sampler", f"schedule:{drafts}")
    assert f"warning: --sampler schedule:{drafts} {sentence}" in " ".join(r.stderr.split())
    dense = _schedule(tmp_path / "dense.parquet", [None, None])
    line = error_line(_profile(tiny, prompts, out, "--budgets", "48", "--sampler", f"schedule:{dense}",
                               "--speculate", "2"))
    assert line == (f"error: --sampler schedule:{dense} is dense in every bin, so --speculate would draft "
                    "with the dense model itself; give a sparse schedule or --sampler budget:B, or drop "
                    "--speculate")
    assert not out.exists()


# ---------------------------------------------------------------- the summary: drafts and speculation


def test_the_summary_shows_the_draft_alphas_mean_and_tail(tiny, prompts, tmp_path):
    out = tmp_path / "m.parquet"
    r = _profile(tiny, prompts, out, "--budgets", "48,64", "--bin-width", "64", "--draft-alpha", *SAMPLING,
                 "-f", "csv")
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert list(rows[0]) == ["bin", "budget", "tokens", "mean_alpha", "tail_alpha", "mean_alpha_draft",
                             "tail_alpha_draft", "above"]
    d = _sorted(out)
    assert (d.alpha_draft - d.alpha).abs().max() > 1e-3  # the two alphas differ in this model
    for row in rows:
        cell = d[(d.bin == int(row["bin"])) & (d.budget == int(row["budget"]))]
        for column, values in (("alpha", cell.alpha), ("alpha_draft", cell.alpha_draft)):
            x = values.to_numpy(np.float64)
            assert float(row[f"mean_{column}"]) == pytest.approx(x.mean(), abs=1e-6)
            assert float(row[f"tail_{column}"]) == pytest.approx(np.percentile(x, 5), abs=1e-6)
    plain = _profile(tiny, prompts, tmp_path / "p.parquet", "--budgets", "48", *SAMPLING, "-f", "csv")
    assert plain.stdout.splitlines()[0] == "bin,budget,tokens,mean_alpha,tail_alpha,above"


def test_a_speculative_profile_prints_rollouts_drafted_and_kept_counts(tiny, prompts, tmp_path):
    """The same seed samples the same speculative cycles as `sparrow rollout --speculate`, whose rows
    record each sample's drafts and the kept ones."""
    rollouts, out = tmp_path / "r.parquet", tmp_path / "m.parquet"
    assert _rollout(tiny, prompts, rollouts, "--budget", "48", "--speculate", "2", *SAMPLING).exit_code == 0
    rows = read_artifact(rollouts, "rollouts").to_pylist()
    drafted, kept = sum(r["drafted"] for r in rows), sum(sum(r["accepted"]) for r in rows)
    assert 0 < kept <= drafted
    r = _profile(tiny, prompts, out, "--budgets", "48", "--sampler", "budget:48", "--speculate", "2",
                 *SAMPLING)
    assert r.exit_code == 0, r.output
    said = " ".join(r.stderr.split())
    assert f"{drafted} drafts proposed, {kept} drafts kept (dense verification)" in said
    assert f"acceptance (kept / proposed) {kept / drafted:.4g}" in said
    recorded = artifact_metadata(out)["speculation"]
    recorded = json.loads(recorded) if isinstance(recorded, str) else recorded
    summary = artifact_metadata(rollouts)["summary"]
    summary = json.loads(summary) if isinstance(summary, str) else summary
    assert recorded == {k: summary[k] for k in recorded}


# ---------------------------------------------------------------- adapters: missing, invalid, which kind


@pytest.mark.parametrize("command,flag", [("rollout", "--adapter"), ("profile", "--adapter"),
                                          ("profile", "--lora")])
def test_a_missing_or_invalid_adapter_names_its_flag(tiny, prompts, tmp_path, no_work, command, flag):
    out = tmp_path / "m.parquet"
    args = ["--budgets", "48"] if command == "profile" else []
    run = _profile if command == "profile" else _rollout
    missing = tmp_path / "nothere"
    line = error_line(run(tiny, prompts, out, *args, flag, str(missing)))
    assert line.startswith(f"error: {flag} {missing} does not exist; give a peft LoRA adapter directory")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{\n")
    (bad / "adapter_model.safetensors").write_bytes(b"")
    line = error_line(run(tiny, prompts, out, *args, flag, str(bad)))
    assert line.startswith(f"error: {flag} {bad}: {bad / 'adapter_config.json'} is not valid JSON")
    assert not out.exists()


def test_each_kind_of_adapter_is_pointed_at_its_flag(tiny, prompts, adapters, tmp_path, no_work):
    """A learner's LoRA as --adapter is pointed at --lora; a sparse actor's as --lora at --adapter."""
    out = tmp_path / "m.parquet"
    line = error_line(_profile(tiny, prompts, out, "--budgets", "48", "--adapter", str(adapters["learner"])))
    assert f"to profile a learner, give it as --lora {adapters['learner']}" in line
    line = error_line(_profile(tiny, prompts, out, "--budgets", "48", "--lora", str(adapters["actor"])))
    assert f"--lora {adapters['actor']} is a sparse actor's adapter" in line
    assert line.endswith("give it as --adapter")
    assert not out.exists()


# ---------------------------------------------------------------- --lora: a learner on both sides


@pytest.mark.parametrize("actor", [False, True], ids=["learner", "learner+actor"])
def test_lora_profiles_the_learner_as_its_merged_checkpoint(tiny, prompts, adapters, tmp_path, actor):
    """--lora L on the base samples and scores as the checkpoint peft merged L into; with --adapter the
    sparse side is that actor on top of the learner (train --distill-sparse's pair). The artifact records
    the LoRA as `lora`, which `sparrow sql` shows as source_lora."""
    run = tmp_path / "run"
    run.mkdir()
    extra = ["--adapter", str(adapters["actor"])] if actor else []
    args = ["--budgets", "48,64", "--sampler", "budget:48", *SAMPLING, *extra]
    r = _profile(tiny, prompts, run / "lora.parquet", *args, "--lora", str(adapters["learner"]))
    assert r.exit_code == 0, r.output
    r = _profile(adapters["merged"], prompts, run / "merged.parquet", *args)
    assert r.exit_code == 0, r.output
    r = _profile(tiny, prompts, tmp_path / "base.parquet", *args)
    assert r.exit_code == 0, r.output
    got, want, base = _sorted(run / "lora.parquet"), _sorted(run / "merged.parquet"), _sorted(
        tmp_path / "base.parquet")
    keys = ["prompt_id", "sample", "budget", "position", "token_id"]
    assert got[keys].equals(want[keys])
    for column in ("alpha", "logp_dense", "logp_sparse"):
        assert np.abs(got[column] - want[column]).max() <= 1e-4, column
    assert len(base) != len(got) or not np.allclose(base.logp_dense, got.logp_dense, atol=1e-3)
    assert artifact_metadata(run / "lora.parquet")["lora"] == str(adapters["learner"])
    r = runner.invoke(app, ["sql", "SELECT source_file, source_lora FROM mismatch GROUP BY ALL ORDER BY 1",
                            "--run", str(run), "-f", "csv"])
    assert r.exit_code == 0, r.output
    recorded = dict(line.split(",", 1) for line in r.stdout.splitlines()[1:])
    assert recorded["lora.parquet"] == str(adapters["learner"]) and recorded["merged.parquet"] in ("", "\\N")


def test_a_ray_shard_carries_the_learners_lora(tiny, prompts, adapters):
    """A Ray worker gets the options pickled: its shard samples and scores with the learner merged, as
    this process does."""
    rows = read_artifact(prompts, "prompts").to_pylist()
    ids, tokens = [r["prompt_id"] for r in rows], [r["prompt_token_ids"] for r in rows]
    opts = ProfileOptions(budgets=[48], samples=2, max_new_tokens=16, temperature=0.8, seed=3,
                          sampler="budget:48", lora=load_lora(adapters["learner"]))
    shipped = pickle.loads(pickle.dumps(opts))
    table, speculation = profile_shard(load_model(str(tiny)), list(zip(ids, tokens, [0, 1])), [0, 1], shipped,
                                       True)  # (prompt id, token ids, row in the file)
    merged = run_profile(load_model(str(adapters["merged"])), ids, tokens, ProfileOptions(
        budgets=[48], samples=2, max_new_tokens=16, temperature=0.8, seed=3, sampler="budget:48"))
    assert speculation is None
    assert table.column("token_id").to_pylist() == merged.column("token_id").to_pylist()
    assert np.allclose(table.column("alpha").to_numpy(), merged.column("alpha").to_numpy(), atol=1e-4)


def test_rollouts_of_a_learner_profiled_without_it_are_warned_about(tiny, prompts, adapters, tmp_path):
    """Rollouts sampled with a learner's LoRA are that policy's samples: profiling them on the base model
    says so and names the --lora to give; with that --lora, or for a sparse actor's adapter, nothing."""
    learner, actor = adapters["learner"], adapters["actor"]
    by = {}
    for name, flags in (("learner", ["--lora", str(learner)]), ("actor", ["--adapter", str(actor),
                                                                           "--budget", "48"])):
        by[name] = tmp_path / f"{name}.parquet"
        r = _rollout(tiny, prompts, by[name], "--samples", "1", "--max-new-tokens", "2", *flags)
        assert r.exit_code == 0, r.output

    def profile(rollouts: Path, *extra: str) -> str:
        r = runner.invoke(app, ["profile", "--model", str(tiny), "--rollouts", str(rollouts), "--budgets",
                                "48", *extra, "-o", str(tmp_path / "m.parquet"), "--force"])
        assert r.exit_code == 0, r.output
        return " ".join(r.stderr.split())

    said = profile(by["learner"])
    assert f"were sampled with the learner's LoRA {learner}" in said and f"give --lora {learner}" in said
    assert "learner's LoRA" not in profile(by["learner"], "--lora", str(learner))
    assert "learner's LoRA" not in profile(by["actor"])


def test_rollouts_of_another_model_are_warned_about(tiny, prompts, tmp_path):
    """Their metadata names the model that sampled them; scored on --model, they are its mismatch on
    another policy's tokens. Rollouts of --model (a path to it or its name) draw no warning."""
    rollouts = tmp_path / "r.parquet"
    r = _rollout(tiny, prompts, rollouts, "--samples", "1", "--max-new-tokens", "2")
    assert r.exit_code == 0, r.output
    for model, warned in (("tiny-llama", True), (str(tiny), False)):
        r = runner.invoke(app, ["profile", "--model", model, "--rollouts", str(rollouts), "--budgets", "48",
                                "-o", str(tmp_path / "m.parquet"), "--force"])
        said = " ".join(r.stderr.split())
        assert r.exit_code == 0, r.output
        assert (f"--rollouts {rollouts} were sampled by {tiny} (their metadata), not by --model tiny-llama: "
                "the mismatch is measured on another policy's tokens" in said) == warned, said
