"""Values of options that several commands take: --device, --raw-prompts, comma-separated integers.

--device is cpu or cuda in any case: the engine runs on the current CUDA device, so cuda:N other than 0 is
refused with how to pick that GPU (CUDA_VISIBLE_DEVICES). A bad value is one sentence before any work."""

from __future__ import annotations

import typer

from .errors import UsageError
from .messages import fail, warn

DEVICE_HELP = ("cpu or cuda (cuda:0 is cuda; for another GPU, select it with CUDA_VISIBLE_DEVICES, e.g. "
               "CUDA_VISIBLE_DEVICES=1 with --device cuda).")


def parse_device(value: str) -> str:
    """typer parser of every --device: cpu or cuda in any case, cuda:0 as cuda. The engine runs on the
    current CUDA device (its kernels and CUDA graphs launch there), so another index is refused in one
    sentence that says how to pick that GPU instead."""
    device = value.strip().lower()
    kind, colon, index = device.partition(":")
    if kind == "cuda" and colon and index.isdigit():
        if int(index) == 0:
            return "cuda"
        fail(f"--device {value}: Sparrow runs on the first visible GPU only; select GPU {int(index)} with "
             f"CUDA_VISIBLE_DEVICES={int(index)} and pass --device cuda")
    if device not in ("cpu", "cuda"):
        fail(f"--device must be cpu or cuda (or cuda:0), got {value!r}")
    return device


def check_device(device: str, remote: bool = False) -> None:
    """--device (already `parse_device`'s cpu or cuda) with CUDA present here, unless the work runs on a
    Ray cluster (`remote`); one sentence otherwise, before any work. Shared by every command with
    --device."""
    import torch

    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda (or cuda:0), got {device!r}")
    if device == "cuda" and not remote and not torch.cuda.is_available():
        raise UsageError(f"--device {device} was given but no CUDA device is available")


def on_a_cluster(workers: int, ray_address: str | None) -> bool:
    """Whether --workers run on a Ray cluster elsewhere (--ray-address, or RAY_ADDRESS as Ray reads it), so
    that --device names its devices, not this machine's; `local` is this machine."""
    from sparrow.stages.backends.ray_pool import cluster_address

    return workers > 0 and not cluster_address(ray_address).local


RAW_PROMPTS_HELP = ("Tokenize text prompts (a prompt file with text but no token ids, e.g. from DuckDB or "
                    "JSONL) as they are; by default they go through the model's chat template as one user "
                    "message, as `sparrow prompts` formats them.")


MAX_PROMPTS_HELP = ("Sample the first N prompts of --prompts only (vLLM bench's --num-prompts): each keeps "
                    "the prompt id, row and seeds it has in the whole file, so its samples are those a run "
                    "over the whole file gives it. Default: every prompt.")


def max_prompts_option():
    return typer.Option(None, "--max-prompts", "--num-prompts", help=MAX_PROMPTS_HELP)


def check_max_prompts(max_prompts: int | None) -> None:
    if max_prompts is not None and max_prompts < 1:
        raise UsageError(f"--max-prompts must be at least 1, got {max_prompts}")


def raw_prompts_option():
    return typer.Option(False, "--raw-prompts/--no-raw-prompts", help=RAW_PROMPTS_HELP)


def warn_first_token_stops(lengths: list[int], max_new_tokens: int, raw_prompts: bool) -> None:
    """Most samples ending at their first token (an immediate EOS, where more were allowed) usually means
    prompts the model does not read as a question: say so on stderr."""
    short = sum(n <= 1 for n in lengths)
    if max_new_tokens > 1 and lengths and short > len(lengths) / 2:
        hint = ("they were tokenized without the chat template (--raw-prompts)" if raw_prompts else
                "check that the prompts are what the model expects (text prompts go through its chat "
                "template)")
        warn(f"{short} of {len(lengths)} samples ended at their first token; {hint}")


def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated integers, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag} is empty; it takes comma-separated integers (for example 64,128)")
    return values
