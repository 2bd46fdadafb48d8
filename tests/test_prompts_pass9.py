"""Prompts and the model they are read for: token ids made by another model's tokenizer are made again from
the text (or refused when there is none), text for a model without a chat template goes in as
--raw-prompts sends it (BOS included), and the artifacts' metadata names the prompts by absolute path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.core.prompt_set import PromptSet
from sparrow.stages.model.loading import embedded_checkpoint
from sparrow.stages.tasks import make_prompts
from sparrow.stages.train.data import load_prompts

from cli_checks import error_line
from tiny_models import tiny_chat_llama

runner = CliRunner()
QUICK = ["--max-new-tokens", "2", "--threads", "1"]


def _save_tiny_llama(path: Path, tok) -> str:
    """A tiny random Llama that uses `tok` (any tokenizer), saved at `path`."""
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen_tokenized(tmp_path_factory) -> str:
    """A tiny model with the Qwen3 tokenizer: another vocabulary than SmolLM2's, the same chat format."""
    from sparrow.stages.model.qwen_tokenizer import qwen3_tokenizer

    return _save_tiny_llama(tmp_path_factory.mktemp("qwen-tok") / "qwen_tok", qwen3_tokenizer())


@pytest.fixture(scope="module")
def smol_tok():
    return transformers.AutoTokenizer.from_pretrained(embedded_checkpoint())


@pytest.fixture(scope="module")
def smol_prompts(tmp_path_factory, smol_tok) -> Path:
    """Two prompts as `sparrow prompts` writes them with its default model (text, token ids, metadata)."""
    path = tmp_path_factory.mktemp("smol-prompts") / "pr_smol.parquet"
    rows = make_prompts("basic_arithmetic", 2, 0, smol_tok)
    return write_artifact(rows, path, "prompts", {"task": "basic_arithmetic", "n": 2, "seed": 0,
                                                  "model": "smollm2-135m"})


def _expected_ids(model: str) -> list[list[int]]:
    """What `sparrow prompts --model model` writes for the same task, count and seed."""
    tok = transformers.AutoTokenizer.from_pretrained(model)
    return [r["prompt_token_ids"] for r in make_prompts("basic_arithmetic", 2, 0, tok)]


# ---------------------------------------------------------------- prompts tokenized for another model

def test_prompts_of_another_tokenizer_are_tokenized_again_for_the_model(smol_prompts, qwen_tokenized,
                                                                         tmp_path):
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", qwen_tokenized, "--prompts", str(smol_prompts), *QUICK,
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    sampled = [row["prompt_token_ids"] for row in read_artifact(out, "rollouts").to_pylist()]
    assert sampled == _expected_ids(qwen_tokenized)
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:") and "tokenized for" in line]
    assert len(notes) == 1 and "smollm2-135m" in notes[0] and qwen_tokenized in notes[0], r.stderr


def test_profile_and_train_read_them_for_the_model_too(smol_prompts, qwen_tokenized, tmp_path):
    out, copy = tmp_path / "m.parquet", tmp_path / "copy.parquet"  # a note is said once per file
    copy.write_bytes(smol_prompts.read_bytes())
    r = runner.invoke(app, ["profile", "--model", qwen_tokenized, "--prompts", str(copy),
                            "--budgets", "48", "--samples", "1", *QUICK, "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "smollm2-135m" in r.stderr and "tokenized again" in r.stderr
    expected = _expected_ids(qwen_tokenized)
    tok = transformers.AutoTokenizer.from_pretrained(qwen_tokenized)
    rows = load_prompts(smol_prompts, tok, model=qwen_tokenized)
    assert [row.token_ids for row in rows] == expected
    prompts = read_artifact(out, "mismatch").column("prompt_id").unique().to_pylist()
    assert sorted(prompts) == sorted(r.prompt_id for r in rows)


def test_prompts_with_only_token_ids_for_another_tokenizer_are_refused(smol_prompts, qwen_tokenized,
                                                                      tmp_path):
    ids_only = [{**row, "prompt": None} for row in read_artifact(smol_prompts, "prompts").to_pylist()]
    path = write_artifact(ids_only, tmp_path / "ids.parquet", "prompts", artifact_metadata(smol_prompts))
    out = tmp_path / "r.parquet"
    line = error_line(runner.invoke(app, ["rollout", "--model", qwen_tokenized, "--prompts", str(path),
                                          *QUICK, "-o", str(out)]))
    assert str(path) in line and "smollm2-135m" in line and qwen_tokenized in line
    assert f"sparrow prompts --task basic_arithmetic --n 2 --seed 0 --model {qwen_tokenized}" in line
    assert not out.exists()


def test_the_same_tokenizer_under_another_model_name_keeps_the_ids(smol_prompts, tmp_path, capsys):
    model = tiny_chat_llama(tmp_path / "llama")  # SmolLM2's tokenizer
    prompts = PromptSet.read(smol_prompts)
    before = prompts.tokens
    prompts.match_model(model, transformers.AutoTokenizer.from_pretrained(model))
    assert prompts.tokens == before and "note:" not in capsys.readouterr().err


def test_a_recorded_model_that_no_longer_resolves_is_told_apart_by_name(smol_prompts, tmp_path, smol_tok):
    rows = read_artifact(smol_prompts, "prompts").to_pylist()
    moved = write_artifact(rows, tmp_path / "moved.parquet", "prompts", {"model": "/gone/checkpoints/ckpt"})
    same_name = PromptSet.read(moved)
    same_name.match_model("/elsewhere/ckpt", smol_tok)  # the same checkpoint, moved: ids kept
    assert same_name.tokens == [r["prompt_token_ids"] for r in rows]
    other = PromptSet.read(moved)
    other.match_model("/elsewhere/other", smol_tok)
    assert other.needs_tokenizer  # to be made again from the text


# ---------------------------------------------------------------- a model without a chat template

@pytest.fixture(scope="module")
def bos_no_template(tmp_path_factory) -> str:
    """A tiny model whose tokenizer adds BOS (as Llama-2's, Mistral's and Gemma's do) and has no chat
    template."""
    from tokenizers.processors import TemplateProcessing

    tok = transformers.AutoTokenizer.from_pretrained(embedded_checkpoint())
    tok.chat_template = None
    tok._tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.bos_token} $A", pair=f"{tok.bos_token} $A $B", special_tokens=[(tok.bos_token,
                                                                                      tok.bos_token_id)])
    path = _save_tiny_llama(tmp_path_factory.mktemp("bos") / "bos_nochat", tok)
    for template in Path(path).glob("chat_template.*"):
        template.unlink()
    return path


def test_text_for_a_model_without_a_chat_template_goes_in_as_raw_prompts_do(bos_no_template, tmp_path):
    prompts = tmp_path / "p.jsonl"
    texts = ["The capital of France is", "1, 2, 3, 4,"]
    prompts.write_text("".join(f'{{"prompt": "{t}"}}\n' for t in texts))
    tok = transformers.AutoTokenizer.from_pretrained(bos_no_template)
    assert not tok.chat_template
    expected = [[tok.bos_token_id, *tok(t, add_special_tokens=False).input_ids] for t in texts]
    got = {}
    for name, extra in (("default", []), ("raw", ["--raw-prompts"])):
        out = tmp_path / f"{name}.parquet"
        r = runner.invoke(app, ["rollout", "--model", bos_no_template, "--prompts", str(prompts), *QUICK,
                                *extra, "-o", str(out)])
        assert r.exit_code == 0, r.output
        got[name] = [row["prompt_token_ids"] for row in read_artifact(out, "rollouts").to_pylist()]
        notes = [line for line in r.stderr.splitlines() if "no chat template" in line]
        assert len(notes) == (1 if name == "default" else 0), r.stderr
    assert got["default"] == got["raw"] == expected


# ---------------------------------------------------------------- absolute paths in the metadata

def test_metadata_names_the_prompts_by_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": list(range(5 + i, 30)), "answer": "3", "metadata": None} for i in range(2)]
    write_artifact(rows, tmp_path / "p.parquet", "prompts")
    r = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", "p.parquet", *QUICK,
                            "-o", "r.parquet"])
    assert r.exit_code == 0, r.output
    assert artifact_metadata(tmp_path / "r.parquet")["prompts"] == str((tmp_path / "p.parquet").resolve())
    r = runner.invoke(app, ["profile", "--model", "tiny-llama", "--prompts", "p.parquet", "--budgets", "48",
                            "--samples", "1", *QUICK, "-o", "m.parquet"])
    assert r.exit_code == 0, r.output
    assert artifact_metadata(tmp_path / "m.parquet")["prompts"] == str((tmp_path / "p.parquet").resolve())
    r = runner.invoke(app, ["profile", "--model", "tiny-llama", "--rollouts", "r.parquet", "--budgets", "48",
                            "-o", "m2.parquet", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert artifact_metadata(tmp_path / "m2.parquet")["rollouts"] == str((tmp_path / "r.parquet").resolve())


# ---------------------------------------------------------------- a damaged footer, refused alike

def _damaged_meta(path: Path) -> Path:
    """`path` rewritten with its `sparrow.meta` footer entry no longer a JSON object."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"sparrow.meta": b"{not json"}),
                   path)
    return path


@pytest.mark.parametrize("kind", ["prompts", "rollouts"])
def test_a_prompts_or_rollouts_artifact_with_damaged_metadata_is_refused(tmp_path, kind):
    """As a profile already was: the record a stage reads from the metadata (the model prompts were made for,
    the prompts rollouts were sampled from) is not silently dropped."""
    prompts = write_artifact([{"prompt_id": "p0", "task": "basic_arithmetic", "prompt": "What is 1 + 1?",
                               "prompt_token_ids": None, "answer": "2", "metadata": None}],
                             tmp_path / "p.parquet", "prompts", metadata={"model": "smollm2-135m"})
    if kind == "prompts":
        bad = _damaged_meta(prompts)
        args = ["rollout", "--prompts", str(bad), "--max-new-tokens", "2", "-o", str(tmp_path / "r.parquet")]
    else:
        rollouts = write_artifact([{"prompt_id": "p0", "sample": 0, "prompt_token_ids": [1, 2],
                                    "token_ids": [3], "text": "2", "logprobs": [-0.5], "budgets": [0],
                                    "finish_reason": "length"}], tmp_path / "r.parquet", "rollouts")
        bad = _damaged_meta(rollouts)
        args = ["reward", "--prompts", str(prompts), "--completions", str(bad), "-o",
                str(tmp_path / "rw.parquet")]
    line = error_line(runner.invoke(app, args))
    assert line == f"error: {bad} has 'sparrow.meta' metadata that is not a JSON object", line
    assert not (tmp_path / "rw.parquet").exists()
    assert kind == "rollouts" or not (tmp_path / "r.parquet").exists()
