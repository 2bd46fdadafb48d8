"""A prompt set read from a file for sampling: our `prompts` artifact, any Parquet with its columns
(DuckDB, pandas) or JSONL, or a user's verl or TRL dataset (`user_data.py`), optionally scored by one
reward for every row (`--reward`, `--reward-fn`: `DataOptions`).

One reader for every stage that samples (rollout, profile, train), so each refuses the same bad
input with the same sentence. The checks that need no weights (the file exists and holds prompts,
token ids fit the vocabulary, the longest prompt plus the generation fits the context) run before any
weights load; prompts that carry only text are tokenized once the model's tokenizer is there and then
checked the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from sparrow.schemas import read_artifact

from .user_data import DataOptions, DatasetError, dataset_metadata, read_dataset

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


def prompt_digest(row: dict) -> str:
    """A prompt's text or chat messages as read from its file (before any chat template), hashed."""
    given = row.get("messages") or row.get("prompt") or ""
    return hashlib.sha256(json.dumps(given, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass
class PromptSet:
    path: Path
    # the COLUMNS the file has (a dataset's rows also `messages`: chat messages, turned into `prompt` by
    # tokenize()); prompt_token_ids may be empty until tokenize()
    rows: list[dict]

    @classmethod
    def read(cls, path: str | os.PathLike, data: DataOptions | None = None) -> PromptSet:
        """The prompts of `path`, each scored by `data`'s reward when it names one."""
        path, data = Path(path), data or DataOptions()
        if not path.exists():
            raise PromptError(f"{path}: no such prompts file")
        try:
            reward = data.reward_task()
            rows = read_dataset(path, data.answer_column)
        except (DatasetError, ValueError) as e:
            raise PromptError(str(e)) from None
        if rows is None:
            if data.answer_column is not None:
                raise PromptError(f"{path} is a prompts file with its own 'answer' column; --answer-column "
                                  "names the answer of a verl or TRL dataset")
            table = read_artifact(path, "prompts")
            rows = table.select([c for c in COLUMNS if c in table.column_names]).to_pylist()
        if not rows:
            raise PromptError(f"{path}: the prompt set is empty")
        for r in rows:
            if not r.get("prompt_token_ids"):
                r["digest"] = prompt_digest(r)
        prompts = cls(path, rows)
        prompts.check_rows()
        if reward is not None:
            prompts.use_reward(reward)
        return prompts

    def digests(self) -> dict[str, str]:
        """The digest of each prompt read as text or chat messages (`prompt_digest`), by prompt id: what
        rollouts record, so that `sparrow reward` can tell a dataset of the same ids from the one sampled."""
        return {r["prompt_id"]: r["digest"] for r in self.rows if r.get("digest")}

    def use_reward(self, task: str) -> None:
        """Score every row by the reward `task` (rewards.py): rows of ours get the datasets' metadata
        layout (their task as data_source, their metadata as extra_info), each row's answer becomes what
        the reward reads (`tasks.rewards.answer_for`) and is checked."""
        from ..tasks import get_task
        from ..tasks.base import row_of
        from ..tasks.rewards import answer_for

        reward = get_task(task)
        for i, r in enumerate(self.rows):
            if r.get("task") not in ("verl", "trl") or not _metadata(r).get("format"):
                columns = {"data_source": r.get("task"), "extra_info": _metadata(r),
                           "answer": r.get("answer")}
                r["metadata"] = dataset_metadata("sparrow", self.path, i, r.get("prompt"), columns)
            r["task"] = task
            if reward.needs_answer and r.get("answer") is None:
                raise PromptError(f"{self.path}: prompt {r['prompt_id']!r}, {row_of(i)}, has no answer, "
                                  "which --reward scores against (for a TRL dataset: name it with "
                                  "--answer-column)")
            try:
                r["answer"] = answer_for(task, r.get("answer"))
                if reward.check_answer is not None:
                    reward.check_answer(r["answer"])
            except ValueError as e:
                raise PromptError(f"{self.path}: prompt {r['prompt_id']!r}, {row_of(i)}, cannot be "
                                  f"scored by the {reward.name} reward: {e}") from None

    def check_rows(self) -> None:
        """Each prompt once (samples, rewards and mismatch are keyed by prompt_id) and none empty; rows are
        named counting from 0, as a dataset's `<file stem>-<row>` ids count them."""
        from ..tasks.base import row_of

        first: dict[str, int] = {}
        for i, r in enumerate(self.rows):
            pid = r["prompt_id"]
            if pid in first:
                raise PromptError(f"{self.path}: prompt_id {pid!r} appears in rows {first[pid]} and {i} "
                                  "(counting from 0); each prompt needs its own id")
            first[pid] = i
            text = (r.get("prompt") or "").strip() or r.get("messages")
            if not r.get("prompt_token_ids") and not text:
                raise PromptError(f"{self.path}: prompt {pid!r}, {row_of(i)}, is empty: it has no token "
                                  "ids and no text")

    def check_rewards(self) -> None:
        """Refuse, before any work, prompts whose reward runs the model's program (code tasks) where no
        sandbox can run it and unsafe execution was not asked for, and prompts whose metadata their task
        will not score (`Task.check_metadata`)."""
        from ..tasks import TaskError, get_task, has_scorer
        from ..tasks.code import default_sandbox
        from ..tasks.sandbox import SandboxUnavailable

        for r in self.rows:
            task = get_task(r["task"]) if has_scorer(r.get("task")) else None
            if task is not None and task.check_metadata is not None:
                try:
                    task.check_metadata(_metadata(r))
                except TaskError as e:
                    raise PromptError(f"{self.path}: prompt {r['prompt_id']!r} of task {task.name} cannot be "
                                      f"scored: {e}") from None
        if any(has_scorer(r.get("task")) and get_task(r["task"]).runs_code for r in self.rows):
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
        """Token ids for the rows that have only text or chat messages (token ids, when present, win).
        Text goes through the model's chat template as one user message, as `sparrow prompts` formats it,
        unless `chat_template` is False or the text is formatted already (it ends with the template's
        generation prompt); chat messages always go through it, as TRL applies it, and `chat_template`
        False (--raw-prompts) says once on stderr that it left them so. The row's text becomes what the
        model sees. Rendered text is tokenized without special tokens (the template writes its own, as
        `apply_chat_template(tokenize=True)` does); raw text with them (a BOS where the tokenizer adds
        one), as TRL's GRPOTrainer and vLLM tokenize a text prompt."""
        pending = [r for r in self.rows if not r.get("prompt_token_ids")]
        if not chat_template and tokenizer is not None and any(r.get("messages") for r in pending):
            print(f"warning: --raw-prompts applies to text prompts only; {self.path}'s chat-message prompts "
                  "go through the model's chat template", file=sys.stderr, flush=True)
        for r in pending:
            if r.get("messages"):
                r["prompt"] = apply_messages(tokenizer, r["messages"], self.path, r["prompt_id"])
            elif tokenizer is None:
                raise PromptError(f"{self.path}: prompt {r['prompt_id']!r} has only text and the model "
                                  "has no tokenizer; write prompts with token ids")
            elif chat_template:
                r["prompt"] = apply_chat_template(tokenizer, r["prompt"])
            raw = not chat_template and not r.get("messages")
            r["prompt_token_ids"] = tokenizer(r["prompt"], add_special_tokens=raw).input_ids

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


def apply_messages(tokenizer, messages: list[dict], path: Path, prompt_id: str) -> str:
    """Chat messages as TRL's GRPOTrainer frames a conversational prompt for generation: the template with
    the generation prompt, whatever the last message's role (a final assistant message is closed and a
    new assistant turn opened, not continued). A model without a tokenizer, or whose tokenizer has no
    chat template, cannot take them."""
    if not getattr(tokenizer, "chat_template", None):
        lacks = "has no tokenizer" if tokenizer is None else "has a tokenizer without a chat template"
        raise PromptError(f"{path}: prompt {prompt_id!r} is a list of chat messages, and a model without a "
                          f"chat template cannot take chat messages (this one {lacks})")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
