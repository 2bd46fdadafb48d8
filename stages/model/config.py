"""Model shapes: one dataclass for every Llama-family decoder we run or plan for.

The same `ModelConfig` drives the decoder, the cost model and the planner, so a preset without
weights (qwen3-14b on a laptop) is still a complete description of the shapes that matter.

A checkpoint's `rope_scaling` (or transformers 5's `rope_parameters`) is read, never ignored: the types
whose frequencies are a fixed function of the position, which Qwen3 (yarn) and Llama-3 (llama3)
checkpoints use, plus linear, become a `RopeScaling` that the decoder's rotary tables apply exactly as
transformers does; any other type (dynamic NTK, whose frequencies change with the current sequence
length, longrope, ...) is refused with one sentence naming the checkpoint and the type.

What the decoder computes is fixed: SiLU-gated MLPs without bias, full causal attention in every layer,
q/k/v bias for Qwen2 only. A config.json that asks for anything else (another `hidden_act`, a sliding
window that is shorter than the context, `mlp_bias`, Llama's or Qwen3's `attention_bias`) is refused
before any weight is read, in one sentence naming the file and the field, rather than run with other math
than transformers and vLLM run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ACTIVATION = "silu"  # the MLP's activation, the only one the decoder has
HF_ARCHITECTURE_NAMES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class ModelSpecError(ValueError):
    """A --model argument that names nothing we can load."""


ROPE_TYPES = ("linear", "llama3", "yarn")
ROPE_KEYS = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ()}  # yarn: factor or original_max_position_embeddings, checked below


@dataclass(frozen=True)
class RopeScaling:
    """A supported rope_scaling of a checkpoint, in transformers' names (None where not given)."""

    rope_type: str  # linear | llama3 | yarn
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn (default 32)
    beta_slow: float | None = None  # yarn (default 1)
    attention_factor: float | None = None  # yarn (default from factor, mscale, mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn

    @classmethod
    def from_hf(cls, hf: dict, source: str) -> RopeScaling | None:
        """From a config.json's `rope_scaling` (or `rope_parameters`); None for plain RoPE."""
        params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        kind = params.get("rope_type") or params.get("type") or "default"
        partial = params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0
        if partial != 1.0:
            raise ModelSpecError(f"{source}: partial_rotary_factor {partial} is not supported (the decoder "
                                 "rotates the whole head)")
        if kind == "default":
            return None
        if kind not in ROPE_TYPES:
            raise ModelSpecError(f"{source}: rope_scaling type {kind!r} is not supported (supported: "
                                 f"{', '.join(ROPE_TYPES)}), so this checkpoint cannot be run correctly")
        given = {f: params[f] for f in cls.__dataclass_fields__
                 if f != "rope_type" and params.get(f) is not None}
        if kind in ("llama3", "yarn"):  # as transformers: a top-level value wins, then the context
            given["original_max_position_embeddings"] = int(
                hf.get("original_max_position_embeddings") or given.get("original_max_position_embeddings")
                or hf.get("max_position_embeddings", 8192))
        if kind == "yarn" and "factor" not in given:  # transformers: the ratio of the two context lengths
            given["factor"] = (hf.get("max_position_embeddings", 8192)
                               / given["original_max_position_embeddings"])
        missing = [k for k in ROPE_KEYS[kind] if k not in given]
        if missing:
            raise ModelSpecError(f"{source}: rope_scaling of type {kind!r} has no {missing[0]}")
        return cls(rope_type=kind, **given)

    def to_hf(self) -> dict:
        return {"rope_type": self.rope_type, **{k: v for k, v in asdict(self).items()
                                                if k != "rope_type" and v is not None}}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # llama | qwen2 (qkv bias) | qwen3 (per-head q/k RMSNorm)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    rope_scaling: RopeScaling | None = None
    hidden_act: str = ACTIVATION

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.arch!r}; Sparrow runs {supported_types()}")
        if self.hidden_act != ACTIVATION:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; Sparrow runs {ACTIVATION} "
                             "MLPs only")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def attention_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V cached per token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json",
                generation: dict | None = None) -> ModelConfig:
        """From a Hugging Face config.json dictionary (`source` names it in errors) and, when the
        checkpoint has one, its generation_config.json: the EOS ids are the union of both files'."""
        check_supported(hf, source)
        check_field_types(hf, source)
        model_type = hf.get("model_type", "llama")
        eos = _ids(hf.get("eos_token_id")) + _ids((generation or {}).get("eos_token_id"))
        eos_ids = tuple(dict.fromkeys(eos))  # the union, config.json's first
        num_heads = hf["num_attention_heads"]
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            arch=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_scaling=RopeScaling.from_hf(hf, source),
            hidden_act=_activation(hf),
        )

    def to_hf(self) -> dict:
        """A config.json that `transformers` loads into its own implementation of this model."""
        hf = {
            "architectures": [HF_ARCHITECTURE_NAMES[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "torch_dtype": "float32",
        }
        if self.arch == "llama":
            hf["attention_bias"] = False
            hf["mlp_bias"] = False
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            hf["eos_token_id"] = (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            )
        if self.rope_scaling is not None:
            hf["rope_scaling"] = self.rope_scaling.to_hf()
        return hf


REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
POSITIVE_INTS = (*REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings")
POSITIVE_NUMBERS = ("rope_theta", "rms_norm_eps")


def check_field_types(hf: dict, source: str) -> None:
    """The config fields Sparrow reads, each of its JSON type, in one sentence naming the field (a string,
    float or null where a count belongs would otherwise fail deep in the model's construction)."""
    def refuse(key: str, what: str) -> None:
        raise ModelSpecError(f"{source}: {key} must be {what}, got {json.dumps(hf[key])[:40]}")

    for key in POSITIVE_INTS:
        given = key in REQUIRED and key in hf or hf.get(key) is not None  # an optional null is its default
        if given and not (type(hf[key]) is int and hf[key] > 0):
            refuse(key, "a positive whole number")
    for key in POSITIVE_NUMBERS:
        if hf.get(key) is not None and not (type(hf[key]) in (int, float) and hf[key] > 0):
            refuse(key, "a positive number")
    if hf.get("rope_scaling") is not None and not isinstance(hf["rope_scaling"], dict):
        refuse("rope_scaling", "an object (or null)")
    for key, what in (("bos_token_id", "a token id"), ("eos_token_id", "a token id or a list of them")):
        value = hf.get(key)
        ids = value if isinstance(value, list) and key == "eos_token_id" else [value]
        if value is not None and not all(type(i) is int and i >= 0 for i in ids):
            refuse(key, what)


def supported_types(conjunction: str = "and") -> str:
    """The model types that run, in words: "llama, qwen2 and qwen3"."""
    return f"{', '.join(ARCHITECTURES[:-1])} {conjunction} {ARCHITECTURES[-1]}"


def check_supported(hf: dict, source: str) -> None:
    """Refuse, in one sentence naming `source` and the field, a config.json whose model the decoder would
    compute differently from transformers: another model type, activation, bias layout or attention span."""
    model_type = hf.get("model_type", "llama")
    if model_type not in ARCHITECTURES:
        raise ModelSpecError(f"{source}: model_type {model_type!r} is not supported; Sparrow runs "
                             f"{supported_types()} checkpoints")
    act = _activation(hf)
    if act != ACTIVATION:
        key = "hidden_act" if hf.get("hidden_act") else "hidden_activation"
        raise ModelSpecError(f"{source}: {key} {act!r} is not supported; Sparrow runs {ACTIVATION} MLPs only")
    if model_type in ("llama", "qwen3") and hf.get("attention_bias"):
        raise ModelSpecError(f"{source}: attention_bias true is not supported for {model_type}; Sparrow runs "
                             "attention projections without bias (q/k/v bias for qwen2 only)")
    if model_type == "llama" and hf.get("mlp_bias"):
        raise ModelSpecError(f"{source}: mlp_bias true is not supported; Sparrow runs MLPs without bias")
    _check_sliding_window(hf, source)


def _activation(hf: dict) -> str:
    """The MLP activation a config.json names (transformers' default for these models: silu)."""
    return str(hf.get("hidden_act") or hf.get("hidden_activation") or ACTIVATION)


def _check_sliding_window(hf: dict, source: str) -> None:
    """A sliding window shorter than the context, on any layer, is refused. The layers that slide are
    found as transformers finds them: `layer_types` when given, else (Qwen2/Qwen3) every layer from
    `max_window_layers` on when `use_sliding_window` is true."""
    window, context = hf.get("sliding_window"), hf.get("max_position_embeddings", 8192)
    types = hf.get("layer_types")
    if isinstance(types, list):
        sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
        field_ = "layer_types"
    else:
        first = hf.get("max_window_layers")
        first = 28 if first is None else int(first)  # transformers' default
        sliding = (list(range(first, int(hf.get("num_hidden_layers") or 0)))
                   if hf.get("use_sliding_window") else [])
        field_ = "use_sliding_window"
    if sliding and window is not None and window < context:
        raise ModelSpecError(f"{source}: {field_} makes {len(sliding)} layer(s) attend over a sliding window "
                             f"of {window} tokens (sliding_window), shorter than the context of {context}; "
                             "Sparrow runs full causal attention in every layer")


SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "tie_word_embeddings")  # what a cost model or schedule is fitted to


def shape_of(cfg: ModelConfig) -> dict:
    return {k: getattr(cfg, k) for k in SHAPE_KEYS}


def _ids(value) -> tuple[int, ...]:
    """An eos_token_id field (an int, a list of ints or absent) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
