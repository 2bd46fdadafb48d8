"""A prompt set read from a file for sampling: our `prompts` artifact, any Parquet with its columns
(DuckDB, pandas) or JSONL.

One reader for every stage that samples (rollout, profile, train), so each refuses the same bad
input with the same sentence. The checks that need no weights (the file exists and holds prompts,
token ids fit the vocabulary, the longest prompt plus the generation fits the context) run before any
weights load; prompts that carry only text are tokenized once the model's tokenizer is there and then
checked the same way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from sparrow.schemas import read_artifact

COLUMNS = ("prompt_id", "task", "prompt", "prompt_token_ids", "answer", "metadata")


class PromptError(ValueError):
    """A prompt file that cannot be sampled from; the message is one sentence naming the file."""


def _metadata(row: dict) -> dict:
    """A row's metadata as a dict ({} where it is missing or not a JSON object)."""
    try:
        meta = json.loads(row.get("metadata") or "{}")
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


@dataclass
class PromptSet:
    path: Path
    rows: list[dict]  # the COLUMNS the file has; prompt_token_ids may be empty until tokenize()

    @classmethod
    def read(cls, path: str | os.PathLike) -> PromptSet:
        path = Path(path)
        if not path.exists():
            raise PromptError(f"{path}: no such prompts file")
        table = read_artifact(path, "prompts")
        if table.num_rows == 0:
            raise PromptError(f"{path}: the prompt set is empty")
        prompts = cls(path, table.select([c for c in COLUMNS if c in table.column_names]).to_pylist())
        prompts.check_rows()
        return prompts

    def check_rows(self) -> None:
        """Each prompt once (samples, rewards and mismatch are keyed by prompt_id) and none empty."""
        first: dict[str, int] = {}
        for i, r in enumerate(self.rows, 1):
            pid = r["prompt_id"]
            if pid in first:
                raise PromptError(f"{self.path}: prompt_id {pid!r} appears in rows {first[pid]} and {i}; "
                                  "each prompt needs its own id")
            first[pid] = i
            if not r.get("prompt_token_ids") and not (r.get("prompt") or "").strip():
                raise PromptError(f"{self.path}: row {i} (prompt {pid!r}) is empty: it has no token ids and "
                                  "no text")

    def check_rewards(self) -> None:
        """Refuse, before any work, prompts whose reward runs the model's program (code tasks) where no
        sandbox can run it and unsafe execution was not asked for, and prompts whose metadata their task
        will not score (`Task.check_metadata`)."""
        from ..tasks import TASKS, TaskError
        from ..tasks.code import default_sandbox
        from ..tasks.sandbox import SandboxUnavailable

        for r in self.rows:
            task = TASKS.get(r.get("task"))
            if task is not None and task.check_metadata is not None:
                try:
                    task.check_metadata(_metadata(r))
                except TaskError as e:
                    raise PromptError(f"{self.path}: prompt {r['prompt_id']!r} of task {task.name} cannot be "
                                      f"scored: {e}") from None
        if any(r.get("task") in TASKS and TASKS[r["task"]].runs_code for r in self.rows):
            try:
                default_sandbox()
            except SandboxUnavailable as e:
                raise PromptError(f"{self.path}: {e}") from None

    @property
    def needs_tokenizer(self) -> bool:
        return not all(r.get("prompt_token_ids") for r in self.rows)

    @property
    def ids(self) -> list[str]:
        return [r["prompt_id"] for r in self.rows]

    @property
    def tokens(self) -> list[list[int]]:
        return [list(r["prompt_token_ids"]) for r in self.rows]

    def tokenize(self, tokenizer, chat_template: bool = True) -> None:
        """Token ids for the rows that have only text (token ids, when present, win). Text goes through
        the model's chat template as one user message, as `sparrow prompts` formats it, unless
        `chat_template` is False or the text is formatted already (it ends with the template's
        generation prompt); the row's text becomes what the model sees."""
        for r in self.rows:
            if not r.get("prompt_token_ids"):
                if tokenizer is None:
                    raise PromptError(f"{self.path}: prompt {r['prompt_id']!r} has only text and the model "
                                      "has no tokenizer; write prompts with token ids")
                if chat_template:
                    r["prompt"] = apply_chat_template(tokenizer, r["prompt"])
                r["prompt_token_ids"] = tokenizer(r["prompt"], add_special_tokens=False).input_ids

    def check_fits(self, vocab_size: int, context: int, max_new_tokens: int) -> None:
        """Ids from another tokenizer and prompts too long for the context, among the tokenized rows."""
        rows = [r for r in self.rows if r.get("prompt_token_ids")]
        for r in rows:
            top = max(r["prompt_token_ids"])
            if top >= vocab_size:
                raise PromptError(f"{self.path}: prompt {r['prompt_id']!r} has token id {top} in column "
                                  f"'prompt_token_ids', but the model's vocabulary has {vocab_size} tokens "
                                  "(were the ids made with another tokenizer?)")
        if not rows:
            return
        longest = max(rows, key=lambda r: len(r["prompt_token_ids"]))
        if len(longest["prompt_token_ids"]) + max_new_tokens > context:
            raise PromptError(
                f"{self.path}: prompt {longest['prompt_id']!r} has {len(longest['prompt_token_ids'])} "
                f"tokens, which with --max-new-tokens {max_new_tokens} exceeds the model's context "
                f"of {context}")


def apply_chat_template(tokenizer, text: str) -> str:
    """`text` as the model's chat template frames one user message for generation; unchanged when the
    tokenizer has no template or `text` already ends with the template's generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    marker = "\x00"
    framed = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                           tokenize=False)
    generation_prompt = framed.split(marker)[-1].strip()
    if generation_prompt and text.rstrip().endswith(generation_prompt):
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
