"""Our decoder against Hugging Face transformers' own implementations (the independent reference)."""

import json

import pytest
import torch
import transformers

from sparrow.stages.engine import SamplingParams
from sparrow.stages.model.config import ModelConfig
from sparrow.stages.model.llama import KVCache
from sparrow.stages.model.loading import ModelSpecError, load_model, resolve_config
from sparrow.stages.scoring.generate import generate

TINY = {
    "llama-gqa2-tied": (transformers.LlamaConfig, dict(head_dim=16, num_attention_heads=4,
                                                       num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mha-untied-hd32": (transformers.LlamaConfig, dict(head_dim=32, num_attention_heads=2,
                                                             num_key_value_heads=2,
                                                             tie_word_embeddings=False)),
    "qwen2-gqa4-bias": (transformers.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=1,
                                                       tie_word_embeddings=False)),
    "qwen3-gqa2-hd32-tied": (transformers.Qwen3Config, dict(head_dim=32, num_attention_heads=4,
                                                            num_key_value_heads=2,
                                                            tie_word_embeddings=True)),
    "qwen3-gqa8-hd8": (transformers.Qwen3Config, dict(head_dim=8, num_attention_heads=8,
                                                      num_key_value_heads=1, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request, tmp_path_factory):
    cls, extra = TINY[request.param]
    cfg = cls(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              rope_theta=5000.0, max_position_embeddings=512, rms_norm_eps=1e-6, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # non-trivial norms and biases so that a missed one shows
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(str(path)), request.param


def test_tiny_logits_match_transformers(tiny):
    hf, ours, name = tiny
    tokens = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours.model(tokens)
    assert (got - expected).abs().max().item() <= 1e-4, name


def test_packed_stacked_projections_match_transformers_and_follow_the_weights(tiny):
    """The CPU decode step's linears (oneDNN-packed; q/k/v and gate/up each one product over stacked
    weights) give transformers' logits; an in-place weight change is picked up at the next `active()`."""
    from sparrow.stages.engine.cpu.packed_linears import PackedLinears, packing_available

    hf, ours, name = tiny
    if not packing_available(ours.model):
        pytest.skip("this torch has no oneDNN packed linear")
    packed = PackedLinears(ours.model, batch_hint=3)
    assert len(packed.groups) == 2 * ours.config.num_layers, name
    tokens = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with packed.active():
            got = ours.model(tokens)
        assert (got - hf(tokens).logits).abs().max().item() <= 1e-4, name
        ours.model.layers[1].attn.v_proj.weight.mul_(-1.5)
        ours.model.layers[0].mlp.up_proj.weight.mul_(0.5)
        with packed.active():
            got = ours.model(tokens)
        assert (got - ours.model(tokens)).abs().max().item() <= 1e-4, name
        ours.model.layers[1].attn.v_proj.weight.div_(-1.5)
        ours.model.layers[0].mlp.up_proj.weight.div_(0.5)
    assert "qkv" not in ours.model.layers[0].attn.__dict__  # the modules are their plain selves outside


def test_tiny_greedy_matches_transformers(tiny):
    hf, ours, _ = tiny
    prompt = [5, 17, 42, 99, 3, 250, 7]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                               min_new_tokens=64, pad_token_id=0)[0, len(prompt):].tolist()
    greedy = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    got = generate(ours.model, [prompt], greedy)[0].tokens
    assert got == expected


def test_incremental_decoding_equals_full_forward(tiny):
    """Ragged batch through prefill + one-token steps gives the full-sequence logits."""
    _, ours, _ = tiny
    model = ours.model
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in (9, 23, 20)]
    prefix = [5, 11, 16]
    cache = KVCache.allocate(model.cfg, 3, 32)
    padded = torch.zeros(3, max(prefix), dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, prefix)):
        padded[i, :n] = s[:n]
    with torch.no_grad():
        model(padded, cache)
        cache.lengths = torch.tensor(prefix)
        for _ in range(4):
            step = torch.stack([s[int(n)] for s, n in zip(seqs, cache.lengths)])[:, None]
            logits = model(step, cache)[:, 0]
            for i, s in enumerate(seqs):
                n = int(cache.lengths[i])
                full = model(s[None, : n + 1])[0, -1]
                assert (logits[i] - full).abs().max() <= 1e-4
            cache.lengths = cache.lengths + 1


def test_smollm2_logits_and_greedy_match_transformers(smollm2):
    from sparrow.stages.model.loading import embedded_checkpoint

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        embedded_checkpoint(), dtype=torch.float32).eval()
    tok = smollm2.tokenizer
    msg = {"role": "user", "content": "Write a story about a sparrow who learns to fly."}
    text = tok.apply_chat_template([msg], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        x = torch.tensor([prompt])
        assert (smollm2.model(x) - hf(x).logits).abs().max() <= 1e-4
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                               eos_token_id=2, pad_token_id=2)[0, len(prompt):].tolist()
    greedy = SamplingParams(max_new_tokens=64, temperature=0.0)
    got = generate(smollm2.model, [prompt], greedy, eos_ids=[2])[0].tokens
    assert len(got) == 64
    assert got == expected
    assert any(c.isalpha() for c in tok.decode(got))


def test_gguf_conversion_matches_transformers_gguf_loader(smollm2):
    """Dequantisation and the q/k un-permutation checked against transformers' GGUF reader."""
    from sparrow.stages.model.llama import ours_to_hf
    from sparrow.stages.model.loading import embedded_gguf

    path = embedded_gguf()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32)
    theirs = hf.state_dict()
    for name, w in smollm2.model.state_dict().items():
        if name.startswith("rope_"):
            continue
        assert torch.equal(w, theirs[ours_to_hf(name)]), name


def test_gguf_file_loads_directly(smollm2):
    from sparrow.stages.model.loading import embedded_gguf

    direct = load_model(str(embedded_gguf()))
    assert direct.config == smollm2.config
    tokens = torch.tensor([[1, 2, 3, 400, 5000]])
    with torch.no_grad():
        assert torch.equal(direct.model(tokens), smollm2.model(tokens))


def test_a_gguf_suffix_in_capitals_is_a_gguf_file(tmp_path, smollm2):
    from sparrow.stages.model.loading import embedded_gguf, resolve_config

    upper = tmp_path / "SmolLM2.GGUF"
    upper.symlink_to(embedded_gguf())
    assert resolve_config(str(upper)) == smollm2.config


@pytest.mark.slow  # a real 538 MB conversion; test_model_cache_home builds caches of a tiny model
def test_corrupt_cache_is_rebuilt(tmp_path, monkeypatch, smollm2):
    from sparrow.stages.model import loading

    monkeypatch.setenv("SPARROW_HOME", str(tmp_path))
    folder = loading.embedded_checkpoint()
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 10_000])
    assert not loading._cache_ok(folder)
    rebuilt = load_model("smollm2-135m")
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(rebuilt.model(tokens), smollm2.model(tokens))
    assert not [p for p in tmp_path.joinpath("models").iterdir() if p.name.startswith(".smollm2")
                and p.is_dir()]


REFERENCE_SHAPES = {  # ../shared/reference/README.md, "Model shapes"
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072, 151936, True),
    "qwen3-1.7b": (28, 2048, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b": (36, 2560, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": (36, 4096, 32, 8, 128, 12288, 151936, False),
    "qwen3-14b": (40, 5120, 40, 8, 128, 17408, 151936, False),
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, True),
}


@pytest.mark.parametrize("name", list(REFERENCE_SHAPES))
def test_presets_match_reference_shapes(name):
    c = resolve_config(name)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == REFERENCE_SHAPES[name]


def test_preset_derived_numbers():
    assert resolve_config("qwen3-1.7b").kv_bytes_per_token() == 112 * 1024
    assert resolve_config("qwen3-4b").kv_bytes_per_token() == 144 * 1024
    assert 4.0e9 < resolve_config("qwen3-4b").num_parameters < 4.1e9
    assert 134e6 < resolve_config("smollm2-135m").num_parameters < 136e6


def test_hf_config_round_trip():
    for name in REFERENCE_SHAPES:
        c = resolve_config(name)
        assert ModelConfig.from_hf(json.loads(json.dumps(c.to_hf()))) == c


def test_bad_model_specs(tmp_path):
    with pytest.raises(ModelSpecError, match="unknown model 'nope'"):
        load_model("nope")
    with pytest.raises(ModelSpecError, match="shapes only"):
        load_model("qwen3-4b")
    with pytest.raises(ModelSpecError, match="no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(resolve_config("tiny-llama").to_hf()))
    with pytest.raises(ModelSpecError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_random_weight_preset_runs():
    m = load_model("tiny-qwen3")
    with torch.no_grad():
        assert m.model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 512)
