"""`sparrow models`: list the built-in model presets."""

from __future__ import annotations

from rich.table import Table

from sparrow.stages.model.presets import PRESETS

from .common import out


def models() -> None:
    """Print the built-in model presets (shapes; where weights and tokenizer come from)."""
    t = Table(title="model presets")
    for col in ("preset", "arch", "layers", "hidden", "q/kv heads", "head dim", "ffn", "vocab",
                "tied", "params", "KV KiB/token (bf16)", "weights"):
        t.add_column(col, justify="right" if col not in ("preset", "arch", "weights") else "left")
    for p in PRESETS.values():
        c = p.config
        t.add_row(p.name, c.arch, str(c.num_layers), str(c.hidden_size),
                  f"{c.num_heads}/{c.num_kv_heads}", str(c.head_dim), str(c.intermediate_size),
                  str(c.vocab_size), "yes" if c.tie_word_embeddings else "no",
                  f"{c.num_parameters / 1e9:.2f}B" if c.num_parameters > 1e9 else
                  f"{c.num_parameters / 1e6:.1f}M",
                  f"{c.kv_bytes_per_token() / 1024:g}", p.weights)
    out.print(t)
