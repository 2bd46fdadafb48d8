"""`sparrow models`: list the built-in model presets."""

from __future__ import annotations

from sparrow.stages.model.presets import PRESETS

from .errors import friendly_errors
from .output import emit, format_option, resolve_format

COLUMNS = ("preset", "arch", "layers", "hidden", "q_heads", "kv_heads", "head_dim", "ffn", "vocab", "tied",
           "params", "kv_kib_per_token_bf16", "weights")


def _count(n: object) -> str:
    """A parameter count as people write it: 134.5M, 4.02B."""
    return f"{n / 1e9:.2f}B" if n > 1e9 else f"{n / 1e6:.1f}M"


@friendly_errors
def models(format: str = format_option(artifact=False)) -> None:
    """Print the built-in model presets (shapes; where weights and tokenizer come from)."""
    fmt = resolve_format(format)
    rows = []
    for p in PRESETS.values():
        c = p.config
        rows.append([p.name, c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                     c.intermediate_size, c.vocab_size, c.tie_word_embeddings, c.num_parameters,
                     c.kv_bytes_per_token() / 1024, p.weights])
    emit(COLUMNS, rows, fmt, title="model presets", left=("preset", "arch", "weights"),
         render={"params": _count, "kv_kib_per_token_bf16": lambda v: f"{v:g}"})
