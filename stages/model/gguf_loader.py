"""Read a GGUF file (llama, qwen2, qwen3) into a ModelConfig and a Hugging Face style state dict.

llama.cpp's converter permutes the rows of Llama's q/k projections to its interleaved RoPE layout;
we undo that permutation so the weights use the half-rotation layout of Hugging Face (and ours).
RoPE scaling in a GGUF (a `rope.scaling.type` other than none, or Llama-3's precomputed `rope_freqs`
tensor) is refused in one sentence rather than ignored: load such a model from its Hugging Face
checkpoint, whose rope_scaling is supported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig, ModelSpecError

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader, source: str = "the GGUF file") -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, qwen3)")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in names:
        kind = scaling if scaling != "none" else "rope_freqs (Llama-3)"
        raise ModelSpecError(f"{source}: GGUF rope scaling {kind!r} is not supported; load the model from "
                             "its Hugging Face checkpoint directory instead")
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 8192)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved -> half-rotation RoPE layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    cfg = gguf_config(reader, str(path))
    return cfg, gguf_weights(reader, cfg)


def gguf_weights(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The dequantised fp32 weights of a parsed GGUF file, under transformers' names."""
    import gguf

    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(n) for n in reversed(t.shape)])
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, kind, suffix = parts[1], parts[2], parts[3]
            if cfg.arch == "llama" and kind in ("attn_q", "attn_k"):
                w = _unpermute(w, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
            name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
        else:
            name = f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    return state
