"""A trained adapter's adapter_config.json names a base model that peft can load by itself
(AutoPeftModelForCausalLM reads `base_model_name_or_path`): a checkpoint directory's absolute path, and
for the embedded preset its converted checkpoint's, not the preset's name."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_train import VOWELS, tiny_llama, vowel_token_prompts  # noqa: F401 - tiny_llama is a fixture
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.model.adapter import adapter_base
from sparrow.stages.model.loading import load_model
from sparrow.stages.tasks import TASKS


def test_the_embedded_preset_is_named_by_its_converted_checkpoint():
    base = Path(adapter_base("smollm2-135m"))
    assert base.is_absolute() and (base / "config.json").is_file() and (base / "model.safetensors").is_file()
    assert adapter_base("smollm2-135m", random_weights=True) == "smollm2-135m"  # no checkpoint holds those


def test_auto_peft_loads_a_trained_adapter_with_its_base(tiny_llama, tmp_path, monkeypatch):  # noqa: F811
    from peft import AutoPeftModelForCausalLM

    monkeypatch.setitem(TASKS, "vowels", VOWELS)
    tok = load_model(tiny_llama[0]).tokenizer
    prompts = write_artifact(vowel_token_prompts(tok, 2, 2), tmp_path / "p.parquet", "prompts")
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "--model", tiny_llama[0], "--prompts", str(prompts), "--steps", "1",
                                 "--prompts-per-step", "2", "--samples", "2", "--max-new-tokens", "4",
                                 "--lora-rank", "2", "--lr", "0.05", "--threads", "1", "-o", str(run)])
    assert r.exit_code == 0, r.output
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(tiny_llama[0]).resolve())
    model = AutoPeftModelForCausalLM.from_pretrained(str(run / "adapter"))  # the base found by itself
    lora = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert lora and any(bool(v.abs().sum() > 0) for v in lora.values())  # the trained B, not peft's zeros
    base = tiny_llama[1].state_dict()
    embed = next(k for k in model.state_dict() if k.endswith("embed_tokens.weight"))
    assert torch.equal(model.state_dict()[embed], base["model.embed_tokens.weight"])


def test_a_distilled_adapter_names_its_base_as_a_trained_one(tiny_llama, tmp_path, monkeypatch):  # noqa: F811
    """`sparrow distill` with --model given relative to the working directory: the adapter names the
    checkpoint by its absolute path (what AutoPeftModelForCausalLM resolves from anywhere), not as typed."""
    from peft import AutoPeftModelForCausalLM

    checkpoint = Path(tiny_llama[0])
    tok = load_model(str(checkpoint)).tokenizer
    prompts = write_artifact(vowel_token_prompts(tok, 2, 12), tmp_path / "p.parquet", "prompts")
    monkeypatch.chdir(checkpoint.parent)
    out = tmp_path / "distilled"
    r = CliRunner().invoke(app, ["distill", "--model", checkpoint.name, "--prompts", str(prompts),
                                 "--budget", "48", "--samples", "1", "--max-new-tokens", "4", "--steps", "1",
                                 "--lora-rank", "2", "--threads", "1", "-o", str(out)])
    assert r.exit_code == 0, r.output
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(checkpoint.resolve())
    monkeypatch.chdir(tmp_path)  # the adapter's base found from another directory
    model = AutoPeftModelForCausalLM.from_pretrained(str(out))
    embed = next(k for k in model.state_dict() if k.endswith("embed_tokens.weight"))
    assert torch.equal(model.state_dict()[embed], tiny_llama[1].state_dict()["model.embed_tokens.weight"])
