"""peft adapter configs that scale the delta otherwise than alpha / r (rsLoRA, alpha_pattern, rank_pattern)
are merged as peft applies them, and a config that changes the delta in a way Sparrow does not merge is
refused in one sentence before any model loads.

References: peft itself (the log-probabilities of a `PeftModel` around the same transformers model, and
peft's own `get_pattern_key`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.model.loading import load_model
from sparrow.stages.model.lora import load_lora, lora_merged, pattern_key

from cli_checks import error_line

peft = pytest.importorskip("peft")
runner = CliRunner()
VOCAB = 300
TOKENS = [[5, 17, 250, 3, 99, 42, 7, 128, 64, 11, 200, 33]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, tied embeddings) without a tokenizer."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-adapter-configs") / "base"
    transformers.AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(path)
    return path


def peft_adapter(base: Path, folder: Path, **config) -> tuple[Path, torch.Tensor]:
    """A peft LoRA of `base` with random A and B (peft starts B at zero, a no-op), saved to `folder`, and
    the log-probabilities peft's model gives TOKENS."""
    from peft import LoraConfig, get_peft_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = get_peft_model(hf, LoraConfig(task_type="CAUSAL_LM", **config))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        logp = torch.log_softmax(model(torch.tensor(TOKENS)).logits.float(), -1)
    model.save_pretrained(folder)
    return folder, logp


def sparrow_logp(base: Path, adapter: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparrow's log-probabilities of TOKENS with the adapter merged, and without it."""
    model = load_model(str(base)).model
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        plain = torch.log_softmax(model(tokens).float(), -1)
        with lora_merged(model, load_lora(adapter)):
            merged = torch.log_softmax(model(tokens).float(), -1)
    return merged, plain


@pytest.mark.parametrize("config", [
    dict(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    dict(r=4, lora_alpha=4, alpha_pattern={"q_proj": 32, r"layers\.1\.mlp\.down_proj": 2},
         target_modules=["q_proj", "v_proj", "down_proj"]),
    dict(r=4, lora_alpha=8, rank_pattern={"v_proj": 2, r"layers\.0\.self_attn\.q_proj": 6},
         target_modules=["q_proj", "v_proj", "up_proj"]),
    dict(r=4, lora_alpha=8, use_rslora=True, rank_pattern={"v_proj": 8}, alpha_pattern={"q_proj": 2},
         target_modules=["q_proj", "v_proj"]),
    dict(r=2, lora_alpha=8, layers_to_transform=[1], target_modules=["q_proj", "o_proj"]),
], ids=["rslora", "alpha_pattern", "rank_pattern", "rslora_with_patterns", "layers_to_transform"])
def test_scaled_adapters_merge_as_peft_applies_them(tiny, tmp_path, config):
    adapter, reference = peft_adapter(tiny, tmp_path / "adapter", **config)
    merged, plain = sparrow_logp(tiny, adapter)
    assert (plain - reference).abs().max() > 1e-2  # the adapter matters
    assert (merged - reference).abs().max() < 1e-4


@pytest.mark.parametrize("module", ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
                                    "model.layers.1.mlp.down_proj", "model.layers.10.self_attn.v_proj",
                                    "model.layers.0.self_attn.k_proj"])
def test_pattern_keys_follow_peft(module):
    from peft.utils.other import get_pattern_key

    patterns = {r"layers\.1\..*": 1, "q_proj": 2, "proj": 3, "v_proj": 4, "0.self_attn.k_proj": 5}
    assert pattern_key(patterns, module) == get_pattern_key(list(patterns), module)


def edited(adapter: Path, folder: Path, **changes) -> Path:
    """A copy of `adapter` whose adapter_config.json has `changes`."""
    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.fixture(scope="module")
def plain_adapter(tiny, tmp_path_factory) -> Path:
    return peft_adapter(tiny, tmp_path_factory.mktemp("plain") / "adapter", r=2, lora_alpha=4,
                        target_modules=["q_proj", "v_proj"])[0]


@pytest.mark.parametrize("changes, sentence", [
    (dict(use_dora=True), "DoRA adapters are not supported"),
    (dict(modules_to_save=["lm_head"]), "an adapter with modules_to_save (lm_head) is not supported"),
    (dict(lora_bias=True), "an adapter with lora_bias (a bias on lora_B) is not supported"),
    (dict(fan_in_fan_out=True), "an adapter with fan_in_fan_out (transposed weights) is not supported"),
    (dict(bias="all"), "an adapter that trains the layers' biases (adapter_config.json's bias 'all')"),
    (dict(init_lora_weights="pissa_niter_4"), "an adapter initialised with pissa_niter_4 is not supported"),
    (dict(trainable_token_indices=[3, 4]), "an adapter with trainable_token_indices"),
    (dict(layer_replication=[[0, 2], [1, 2]]), "an adapter with layer_replication"),
    (dict(use_qalora=True), "QA-LoRA adapters are not supported"),
    (dict(alora_invocation_tokens=[5]), "aLoRA adapters are not supported"),
    (dict(peft_type="IA3"), "a IA3 adapter is not supported"),
])
def test_delta_changing_settings_are_refused(plain_adapter, tmp_path, changes, sentence):
    with pytest.raises(ValueError) as e:
        load_lora(edited(plain_adapter, tmp_path / "edited", **changes))
    assert str(e.value).startswith(sentence)


def test_peft_dora_and_modules_to_save_adapters_are_refused_before_the_model_loads(tiny, tmp_path, no_work):
    dora = peft_adapter(tiny, tmp_path / "dora", r=2, lora_alpha=4, use_dora=True,
                        target_modules=["q_proj"])[0]
    saved = peft_adapter(tiny, tmp_path / "saved", r=2, lora_alpha=4, target_modules=["q_proj"],
                         modules_to_save=["lm_head"])[0]
    prompts = write_artifact([{"prompt_id": "p0", "task": "test", "prompt": None, "answer": None,
                               "metadata": None, "prompt_token_ids": TOKENS[0]}],
                             tmp_path / "prompts.parquet", "prompts")
    for folder, sentence in ((dora, "DoRA adapters are not supported"),
                             (saved, "an adapter with modules_to_save (lm_head) is not supported")):
        result = runner.invoke(app, ["rollout", "--model", str(tiny), "--prompts", str(prompts),
                                     "--lora", str(folder), "--max-new-tokens", "2", "-o",
                                     str(tmp_path / "r.parquet")])
        assert result.exit_code != 0
        assert sentence in error_line(result), error_line(result)
    assert not (tmp_path / "r.parquet").exists()
