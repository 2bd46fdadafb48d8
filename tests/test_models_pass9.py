"""Checkpoints a first-time user brings: what runs exactly as transformers runs it, what is refused in one
sentence before any work (another activation, a sliding window, biases the decoder has not, weights that
do not fit their config.json), which weight files are read, where generation stops, how artifacts name
the model, and how --model and --dtype spellings are answered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, write_artifact
from sparrow.stages.model.config import ModelConfig, ModelSpecError
from sparrow.stages.model.loading import canonical_dtype, load_model, resolve_config, resolve_dtype
from sparrow.stages.model.names import model_name, short_name

from cli_checks import error_line
from tiny_models import tiny_chat_llama, tiny_qwen3

runner = CliRunner()
SHAPES = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def config_dir(path: Path, config_cls, **fields) -> Path:
    """A checkpoint directory holding only the config.json that transformers writes for `fields`."""
    config_cls(**SHAPES, **fields).save_pretrained(path)
    return path


def token_prompts(path: Path) -> Path:
    rows = [{"prompt_id": "p0", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": list(range(5, 15)), "answer": "3", "metadata": None}]
    return write_artifact(rows, path, "prompts")


def hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def our_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return load_model(str(folder)).model(torch.tensor([ids]))[0]


# ---------------------------------------------------------------- 1. activation and sliding window


@pytest.mark.parametrize("config_cls,fields,words", [
    (transformers.LlamaConfig, {"hidden_act": "gelu"}, ["hidden_act 'gelu'", "silu"]),
    (transformers.Qwen2Config, {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
     ["sliding_window", "4 tokens", "full causal attention"]),
    (transformers.Qwen3Config, {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8,
                                "use_sliding_window": True}, ["layer_types", "1 layer(s)", "8 tokens"]),
])
def test_other_math_is_refused_naming_the_config(tmp_path, config_cls, fields, words):
    """transformers computes these with another activation or a windowed attention mask: refused by
    name, before any weight is read."""
    folder = config_dir(tmp_path / "m", config_cls, **fields)
    with pytest.raises(ModelSpecError) as e:
        resolve_config(str(folder))
    assert str(e.value).startswith(f"{folder / 'config.json'}: ")
    assert all(w in str(e.value) for w in words), e.value


@pytest.mark.parametrize("config_cls,fields", [
    (transformers.Qwen2Config, {}),  # transformers writes use_sliding_window false, layer_types all full
    (transformers.Qwen2Config, {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
    (transformers.Qwen3Config, {"use_sliding_window": True, "sliding_window": 1024,  # wider than the context
                                "max_window_layers": 0}),
])
def test_full_attention_configs_still_load(tmp_path, config_cls, fields):
    """No layer slides (transformers' own layer_types say so), or the window covers the whole context."""
    folder = config_dir(tmp_path / "m", config_cls, **fields)
    hf = config_cls.from_pretrained(folder)
    window = hf.sliding_window or SHAPES["max_position_embeddings"]
    assert "sliding_attention" not in hf.layer_types or window >= SHAPES["max_position_embeddings"]
    assert resolve_config(str(folder)).vocab_size == SHAPES["vocab_size"]


def test_written_config_keeps_the_activation_read(tmp_path):
    folder = config_dir(tmp_path / "m", transformers.Qwen3Config)
    cfg = resolve_config(str(folder))
    assert cfg.to_hf()["hidden_act"] == transformers.Qwen3Config.from_pretrained(folder).hidden_act
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelConfig(**{**cfg.to_dict(), "hidden_act": "gelu", "eos_token_ids": ()})


def test_cli_refuses_a_gelu_checkpoint_before_loading(tmp_path, monkeypatch):
    import sparrow.stages.model.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    folder = config_dir(tmp_path / "m", transformers.LlamaConfig, hidden_act="gelu_new")
    out = tmp_path / "r.parquet"
    prompts = token_prompts(tmp_path / "p.parquet")
    r = runner.invoke(app, ["rollout", "--model", str(folder), "--prompts", str(prompts), "-o", str(out)])
    assert r.exit_code == 2 and "hidden_act 'gelu_new'" in error_line(r) and not out.exists()


# ---------------------------------------------------------------- 2. weights that do not fit


@pytest.mark.parametrize("config_cls,fields,field", [
    (transformers.LlamaConfig, {"mlp_bias": True}, "mlp_bias"),
    (transformers.Qwen3Config, {"attention_bias": True}, "attention_bias"),
    (transformers.LlamaConfig, {"attention_bias": True}, "attention_bias"),
])
def test_biases_the_decoder_has_not_are_refused_up_front(tmp_path, config_cls, fields, field):
    folder = config_dir(tmp_path / "m", config_cls, **fields)
    with pytest.raises(ModelSpecError, match=f"^{folder / 'config.json'}: {field} true is not supported"):
        resolve_config(str(folder))


@pytest.fixture()
def untied(tmp_path) -> Path:
    tiny_qwen3(tmp_path / "m", tie_word_embeddings=False)
    return tmp_path / "m"


def _edit_weights(folder: Path, edit) -> None:
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def test_weights_that_do_not_fit_name_the_folder_and_tensor(untied):
    cfg = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**cfg, "vocab_size": 310}))
    with pytest.raises(ModelSpecError, match=rf"^{untied}: tensor model.embed_tokens.weight has shape "
                                             r"\[300, 64\], but its config.json \(vocab_size 310\) gives "
                                             r"\[310, 64\]"):
        load_model(str(untied))
    (untied / "config.json").write_text(json.dumps(cfg))
    _edit_weights(untied, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ModelSpecError, match=rf"^{untied} has no tensor lm_head.weight"):
        load_model(str(untied))


def test_a_stray_tensor_is_named(untied):
    _edit_weights(untied, lambda s: s.update({"model.layers.0.mlp.gate_proj.bias": torch.zeros(96)}))
    with pytest.raises(ModelSpecError, match=rf"^{untied}: tensor model.layers.0.mlp.gate_proj.bias is not "
                                             "part of a qwen3 model as its config.json describes it$"):
        load_model(str(untied))


def test_cli_refuses_a_vocab_mismatch_before_loading(untied, tmp_path, monkeypatch):
    """The headers are checked with the config, so the refusal comes before the weights are read."""
    import sparrow.stages.model.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    cfg = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**cfg, "vocab_size": 310}))
    prompts = token_prompts(tmp_path / "p.parquet")
    r = runner.invoke(app, ["rollout", "--model", str(untied), "--prompts", str(prompts),
                            "--max-new-tokens", "2", "-o", str(tmp_path / "r.parquet")])
    last = r.stderr.strip().splitlines()[-1]  # after the warning that the folder has no tokenizer
    assert r.exit_code == 2, r.stderr
    assert last.startswith(f"error: {untied}: tensor model.embed_tokens.weight")


def test_only_the_files_transformers_loads_are_read(tmp_path):
    """An adapter saved beside the model and a shard that the index does not list are not weights of the
    model (transformers ignores both): the logits are transformers' own."""
    ids = [3, 17, 42, 5, 99]
    single = tmp_path / "single"
    tiny_qwen3(single, tie_word_embeddings=False)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64)},
              single / "adapter_model.safetensors")
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="100KB")
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    save_file({"lm_head.weight": torch.zeros(300, 64)}, sharded / "zz-stale.safetensors")
    for folder in (single, sharded):
        torch.testing.assert_close(our_logits(folder, ids), hf_logits(folder, ids), atol=1e-5, rtol=1e-5)


def test_a_shard_missing_from_the_folder_is_named(tmp_path):
    folder = tmp_path / "m"
    hf = tiny_qwen3(tmp_path / "src")
    hf.save_pretrained(folder, max_shard_size="100KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelSpecError, match=f"lists the shard {shard.name}, which is not in {folder}"):
        resolve_config(str(folder))


# ---------------------------------------------------------------- 4. the tokenizer's EOS


def test_generation_stops_at_the_tokenizers_eos(tmp_path):
    """config.json names no EOS and there is no generation_config.json: the tokenizer's eos_token_id
    stops generation, as in vLLM."""
    from sparrow.stages.engine import Engine, EngineConfig, SamplingParams

    folder = Path(tiny_chat_llama(tmp_path / "m"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("eos_token_id", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").unlink(missing_ok=True)
    prompt = [5, 6, 7, 8]
    first = int(hf_logits(folder, prompt)[-1].argmax())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.eos_token = tok.convert_ids_to_tokens(first)
    tok.save_pretrained(folder)
    assert transformers.AutoTokenizer.from_pretrained(folder).eos_token_id == first
    loaded = load_model(str(folder))
    assert first in loaded.config.eos_token_ids
    out = Engine(loaded.model, None, EngineConfig(max_batch=1)).generate(
        [prompt], SamplingParams(max_new_tokens=5, temperature=0.0))
    assert out[0][0].token_ids == [first] and out[0][0].finish_reason == "stop"


# ---------------------------------------------------------------- 6. a model's identity


def test_checkpoints_in_folders_of_the_same_name_stay_apart(tmp_path, monkeypatch):
    """Two `.../actor/huggingface` checkpoints: the rollouts record each by its absolute path, and a
    profile of one does not plan the other."""
    from sparrow.stages.plan import ScheduleError, check_profile_model

    a, b = tmp_path / "step_50" / "huggingface", tmp_path / "step_100" / "huggingface"
    tiny_qwen3(a)
    tiny_qwen3(b)
    monkeypatch.chdir(tmp_path)
    prompts = token_prompts(tmp_path / "p.parquet")
    out = tmp_path / "a.parquet"
    r = runner.invoke(app, ["rollout", "--model", "step_50/huggingface/", "--prompts", str(prompts),
                            "--max-new-tokens", "2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    measured = artifact_metadata(out)["model"]
    assert measured == str(Path.cwd() / "step_50" / "huggingface")
    assert model_name("step_100/huggingface") == str(Path.cwd() / "step_100" / "huggingface")
    assert short_name(str(b)) == "huggingface"
    check_profile_model(out, "./step_50/huggingface")
    with pytest.raises(ScheduleError, match=f"plan with --model {measured}, "):
        check_profile_model(out, "step_100/huggingface")
    assert model_name("Tiny-Qwen3") == "tiny-qwen3"


# ---------------------------------------------------------------- 7. --model that names nothing


def test_model_errors_say_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config_dir(tmp_path / "q", transformers.Qwen3Config)
    cases = {"./qwen3x": "no such directory: ./qwen3x",
             "~/no/such/folder": "no such directory: ~/no/such/folder",
             "q/config.json": "model q/config.json is a config.json; pass the checkpoint directory",
             "nope": "unknown model 'nope': expected a preset",
             "q/x.gguf": "no such GGUF file: q/x.gguf",  # in a local folder: not a Hub id
             "q/other": "no such directory: q/other"}
    (tmp_path / "q" / "gone.gguf").symlink_to(tmp_path / "nowhere.gguf")
    cases["q/gone.gguf"] = f"model q/gone.gguf is a link to {tmp_path / 'nowhere.gguf'}, which does not exist"
    for spec, expected in cases.items():
        with pytest.raises(ModelSpecError) as e:
            resolve_config(spec)
        assert str(e.value).startswith(expected), e.value
    with pytest.raises(ModelSpecError) as e:
        resolve_config("Qwen/Qwen3-0.6B")
    assert "Hub ids" in str(e.value)
    assert "hf download Qwen/Qwen3-0.6B --local-dir DIR" in str(e.value)
    assert "qwen3-0.6b" in str(e.value)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "config.json").write_text(json.dumps({**SHAPES, "model_type": "gpt2"}))
    with pytest.raises(ModelSpecError, match=r"Sparrow runs llama, qwen2 and qwen3 checkpoints$"):
        resolve_config("g")


def test_cli_names_a_missing_directory(tmp_path):
    r = runner.invoke(app, ["rollout", "--model", str(tmp_path / "nothere"), "--prompts",
                            str(token_prompts(tmp_path / "p.parquet")), "-o", str(tmp_path / "r.parquet")])
    assert r.exit_code == 2 and error_line(r) == f"error: no such directory: {tmp_path / 'nothere'}"


# ---------------------------------------------------------------- 9. --dtype spellings


@pytest.mark.parametrize("text,want", [("float", "float32"), ("FLOAT32", "float32"), ("bf16", "bfloat16"),
                                       ("BFloat16", "bfloat16"), ("Auto", "auto")])
def test_vllm_dtype_spellings(text, want):
    assert canonical_dtype(text) == want
    on_cpu = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[want]
    assert resolve_dtype(text, "cpu") == on_cpu


@pytest.mark.parametrize("text", ["half", "float16", "FP16"])
def test_float16_is_refused_by_name(text):
    with pytest.raises(ValueError, match=f"^--dtype {text}: float16 is not supported; use bfloat16"):
        canonical_dtype(text)


def test_unknown_dtype_lists_the_choices():
    with pytest.raises(ValueError, match=r"^--dtype must be one of auto, float32 \(float\), bfloat16 "):
        canonical_dtype("fp8")
