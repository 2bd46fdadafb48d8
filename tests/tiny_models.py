"""Tiny random checkpoints that several test modules build the same way."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def tiny_qwen3(path: Path, max_position_embeddings: int = 512, tie_word_embeddings: bool = True):
    """A 3-layer random Qwen3 (q/k norms, GQA 4/2, head dim 16, vocabulary 300: with the default dense
    layers, 0-1 are dense and 2 is sparse), its norm weights jittered so that they matter, saved as a
    checkpoint at `path` -> the transformers model (fp32, eval mode)."""
    cfg = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                                   rope_theta=5000.0, max_position_embeddings=max_position_embeddings,
                                   rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def tiny_chat_llama(path: Path) -> str:
    """A tiny random Llama (2 layers, GQA 4/2, head dim 8) with SmolLM2's tokenizer and chat template,
    saved at `path`: trainable in seconds, and the chat template applies -> the path as a string."""
    from sparrow.stages.model.loading import embedded_checkpoint

    tok = transformers.AutoTokenizer.from_pretrained(embedded_checkpoint())
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)
