"""Shared CLI plumbing: one-sentence errors, consoles, option parsing helpers."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import NoReturn

import typer
from rich.console import Console

console = Console(stderr=True, soft_wrap=True)  # messages and progress; stdout holds only data
# (soft_wrap: a message is never broken inside a path, so logs stay greppable)
out = Console()


class UsageError(ValueError):
    """Bad input found before any work starts."""


def fail(message: str, code: int = 2) -> NoReturn:
    from rich.markup import escape

    # escaped: a message may quote brackets (a path, an extra such as '.[vllm]') that rich would eat
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def friendly_errors(fn: Callable) -> Callable:
    """Turn the project's input errors into one clear line and a non-zero exit."""
    from sparrow.schemas import ArtifactError
    from sparrow.stages.model.config import ModelSpecError
    from sparrow.stages.prompt_set import PromptError
    from sparrow.stages.rollout.memory import PoolTooSmall

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UsageError, ArtifactError, ModelSpecError, PromptError, PoolTooSmall, KeyError) as e:
            fail(str(e.args[0]) if e.args else str(e))
        except KeyboardInterrupt:
            console.print("[yellow]interrupted; nothing half-written was left behind[/]")
            sys.exit(130)

    return wrapper


def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated integers, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag} is empty")
    return values
