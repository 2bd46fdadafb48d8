"""A prompt set read from a file for sampling: our `prompts` artifact, any Parquet with its columns
(DuckDB, pandas) or JSONL, or a user's verl or TRL dataset (`user_data.py`), optionally scored by one
reward for every row (`--reward`, `--reward-fn`: `DataOptions`).

One reader for every stage that samples (rollout, profile, train), so each refuses the same bad
input with the same sentence. The checks that need no weights (the file exists and holds prompts,
token ids fit the vocabulary, the longest prompt plus the generation fits the context) run before any
weights load; prompts that carry only text are tokenized once the model's tokenizer is there and then
checked the same way.

Token ids are the model's input only when the model's tokenizer made them: a prompts artifact records the
model it was tokenized for (its metadata's `model`), and a --model whose tokenizer has another vocabulary
has the prompts re-tokenized from their text, each user message taken out of the other model's chat
template and framed by its own, as `sparrow prompts --model` would write them (a note on stderr names both
models); prompts with only ids are refused. Tokenizers are compared, not names, where the recorded model
still resolves; else the last components of the names are (a checkpoint may have moved). A model without
a tokenizer takes the ids as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sparrow.schemas import artifact_metadata, read_artifact
from sparrow.schemas.footer import file_json
from sparrow.schemas.locations import missing

from .notes import note
from .prompt_length import PromptLength, Truncation
from .user_data import DataOptions, DatasetError, dataset_metadata, missing_answer_advice, read_dataset

COLUMNS = ("prompt_id", "task", "prompt", "prompt_token_ids", "answer", "metadata")


class PromptError(ValueError):
    """A prompt file that cannot be sampled from; the message is one sentence naming the file."""


def _metadata(row: dict) -> dict:
    """A row's metadata as a dict ({} where it is missing or not a JSON object)."""
    try:
        meta = file_json(row.get("metadata") or "{}")
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
    # tokenize()), a `digest` of the text as read, and `from_text` where its ids are made here;
    # prompt_token_ids may be empty until tokenize()
    rows: list[dict]
    meta: dict = field(default_factory=dict)  # a prompts artifact's metadata (task, n, seed, model...)
    matched: bool = False  # match_model has run (a command reads its prompts for one model)
    max_prompts: int | None = None  # the file's first rows only (--max-prompts); None: every row
    length: PromptLength = PromptLength()  # what a prompt too long for the run gets (prompt_length.py)
    left_out: list[str] = field(default_factory=list)  # ids of prompts too long, left out (filter_overlong)
    cut: list[str] = field(default_factory=list)  # ids of prompts cut to length.max_length
    length_notes: list[str] = field(default_factory=list)  # what was left out or cut, said once checked

    @classmethod
    def read(cls, path: str | os.PathLike, data: DataOptions | None = None,
             max_prompts: int | None = None) -> PromptSet:
        """The prompts of `path`, each scored by `data`'s reward when it names one; with `max_prompts`
        its first rows only, their ids, rows and seeds those of the whole file, so that their samples are
        those a run over the whole file gives them. The file's format is checked in every row, the
        prompts in the rows kept."""
        path, data = Path(path), data or DataOptions()
        if not path.exists():
            raise PromptError(f"{path}: no such prompts file" if not path.is_symlink()
                              else f"the prompts file {path} {missing(path)}")
        try:
            reward = data.reward_task()
            rows = read_dataset(path, data.answer_column, data.prompt_column)
        except (DatasetError, ValueError) as e:
            raise PromptError(str(e)) from None
        meta = {}
        if rows is None:
            if data.answer_column is not None:
                raise PromptError(f"{path} is a prompts file with its own 'answer' column; --answer-column "
                                  "names the answer of a verl or TRL dataset")
            table = read_artifact(path, "prompts")
            meta = artifact_metadata(table)  # a damaged record was refused by read_artifact
            rows = table.select([c for c in COLUMNS if c in table.column_names]).to_pylist()
        if not rows:
            raise PromptError(f"{path}: the prompt set is empty")
        rows = rows if max_prompts is None else rows[:max_prompts]
        for i, r in enumerate(rows):
            r["digest"] = prompt_digest(r)
            r["from_text"] = not r.get("prompt_token_ids")
            r["row"] = i
        prompts = cls(path, rows, meta, max_prompts=max_prompts, length=data.prompt_length)
        prompts.check_rows()
        if reward is not None:
            prompts.use_reward(reward)
        return prompts

    def digests(self) -> dict[str, str]:
        """The digest of each prompt tokenized here from its text or chat messages (`prompt_digest`), by
        prompt id: what rollouts record, so that `sparrow reward` can tell a dataset of the same ids from
        the one sampled (and prompts re-tokenized for the model from the ids the file holds)."""
        return {r["prompt_id"]: r["digest"] for r in self.rows
                if (r.get("from_text") or r["prompt_id"] in self.cut) and r.get("digest")}

    def length_metadata(self) -> dict:
        """What an artifact records of the prompts' lengths: the flags given (verl's names), and how many
        prompts were left out or cut."""
        counts = {"filtered_prompts": len(self.left_out), "truncated_prompts": len(self.cut)}
        return self.length.metadata() | {k: n for k, n in counts.items() if n}

    @property
    def made_for(self) -> str | None:
        """The --model the file's token ids were made for, as its metadata records it (None: unknown)."""
        model = self.meta.get("model")
        return model if isinstance(model, str) and model else None

    def needs_tokenizer_for(self, model: str) -> bool:
        """Whether reading the prompts for `model` needs its tokenizer: rows with only text, or token ids
        recorded as made for another model, whose tokenizer `match_model` compares."""
        made_for = self.made_for
        return self.needs_tokenizer or (made_for is not None and not self.matched
                                        and not _same_spec(made_for, model)
                                        and any(r.get("prompt_token_ids") for r in self.rows))

    def match_model(self, model: str | None, tokenizer, chat_template: bool = True) -> None:
        """Token ids made by another tokenizer than `tokenizer` (--model's) dropped, to be remade from the
        text by tokenize() (module docstring); with `chat_template` each row's user message is first taken
        out of the recorded model's template. Prompts with only ids are refused; `model` None (a caller
        that knows only the tokenizer) compares tokenizers alone and keeps the ids where it cannot."""
        made_for = self.made_for
        stale = [r for r in self.rows if r.get("prompt_token_ids")]
        if made_for is None or not stale or tokenizer is None or self.matched or (
                model is not None and _same_spec(made_for, model)):
            return
        self.matched = True
        recorded = _tokenizer_of(made_for)
        if recorded is not None:
            if _same_vocabulary(recorded, tokenizer):
                return
        elif model is None or _base_name(made_for) == _base_name(model):
            return
        given = f"--model {model}" if model is not None else f"the model ({tokenizer.name_or_path})"
        bare = next((r for r in stale if not (r.get("prompt") or "").strip()), None)
        if bare is not None:
            raise PromptError(f"{self.path} holds token ids made for {made_for} (its metadata), and prompt "
                              f"{bare['prompt_id']!r} has no text to tokenize again, while {given} has "
                              f"another tokenizer; remake the prompts for it: {self._remake(model)}")
        for r in stale:
            if chat_template and recorded is not None:
                r["prompt"] = user_message(recorded, r["prompt"]) or r["prompt"]
            r["prompt_token_ids"], r["from_text"] = None, True
        note(f"{self.path} was tokenized for {made_for} (its metadata), and {given} has another tokenizer, "
              "so its prompts are tokenized again from their text")

    def _remake(self, model: str | None) -> str:
        """The `sparrow prompts` command that writes these prompts for `model`."""
        task, n, seed = (self.meta.get(k) for k in ("task", "n", "seed"))
        recipe = f"--task {task} --n {n} --seed {seed} " if task and n and seed is not None else ""
        if recipe:
            recipe += "".join(f"--{k.replace('_', '-')} {self.meta[k]} " for k in ("context_tokens", "split")
                              if self.meta.get(k) is not None)
        return f"sparrow prompts {recipe}--model {model or 'MODEL'} -o NEW.parquet"

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
                                  f"which --reward scores against ({missing_answer_advice(_metadata(r))})")
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

    def tokenize(self, tokenizer, chat_template: bool = True, model: str | None = None) -> None:
        """Token ids for the rows that have only text or chat messages (token ids, when present, win).
        Text goes through the model's chat template as one user message, as `sparrow prompts` formats it,
        unless `chat_template` is False or the text is formatted already (it ends with the template's
        generation prompt); chat messages always go through it, as TRL applies it, and `chat_template`
        False (--raw-prompts) says once on stderr that it left them so. A tokenizer without a chat template
        takes text as --raw-prompts sends it, and a note (naming `model`) says so once. The row's text
        becomes what the model sees. Rendered text is tokenized without special tokens (the template
        writes its own, as `apply_chat_template(tokenize=True)` does); raw text with them (a BOS where the
        tokenizer adds one), as TRL's GRPOTrainer and vLLM tokenize a text prompt."""
        pending = [r for r in self.rows if not r.get("prompt_token_ids")]
        if not chat_template and tokenizer is not None and any(r.get("messages") for r in pending):
            print(f"warning: --raw-prompts applies to text prompts only; {self.path}'s chat-message prompts "
                  "go through the model's chat template", file=sys.stderr, flush=True)
        templated = chat_template and bool(getattr(tokenizer, "chat_template", None))
        if chat_template and tokenizer is not None and not templated and any(not r.get("messages")
                                                                             for r in pending):
            name = f"--model {model}" if model is not None else "the model"
            note(f"{name} has no chat template, so the text prompts of {self.path} go in as plain text, as "
                  "--raw-prompts sends them")
        for r in pending:
            if r.get("messages"):
                r["prompt"] = apply_messages(tokenizer, r["messages"], self.path, r["prompt_id"])
            elif tokenizer is None:
                raise PromptError(f"{self.path}: prompt {r['prompt_id']!r} has only text and the model "
                                  "has no tokenizer; write prompts with token ids")
            elif templated:
                r["prompt"] = apply_chat_template(tokenizer, r["prompt"])
            raw = not templated and not r.get("messages")
            r["prompt_token_ids"] = tokenizer(r["prompt"], add_special_tokens=raw).input_ids

    def check_fits(self, vocab_size: int, context: int, max_new_tokens: int) -> None:
        """Ids from another tokenizer and prompts too long for the context, among the tokenized rows; the
        prompts too long for the run are cut or left out as `length` says, said in a note once every row
        fits."""
        rows = [r for r in self.rows if r.get("prompt_token_ids")]
        for r in rows:
            top = max(r["prompt_token_ids"])
            if top >= vocab_size:
                made = (f"the file was tokenized for {self.made_for}, its metadata says" if self.made_for
                        else "were the ids made with another tokenizer?")
                raise PromptError(f"{self.path}: prompt {r['prompt_id']!r} has token id {top} in column "
                                  f"'prompt_token_ids', but the model's vocabulary has {vocab_size} tokens "
                                  f"({made})")
        if not rows:
            return
        if max_new_tokens >= context:  # no prompt fits, however it is cut or left out
            raise PromptError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
                              f"context of {context} tokens; give at most {context - 1}")
        self._fit_lengths(rows, context, max_new_tokens)
        rows = [r for r in self.rows if r.get("prompt_token_ids")]
        longest = max(rows, key=lambda r: len(r["prompt_token_ids"]))
        if len(longest["prompt_token_ids"]) + max_new_tokens > context:
            raise PromptError(
                f"{self.path}: prompt {longest['prompt_id']!r} has {len(longest['prompt_token_ids'])} "
                f"tokens, which with --max-new-tokens {max_new_tokens} exceeds the model's context "
                f"of {context}; --filter-overlong-prompts leaves such prompts out, --max-prompt-length with "
                "--truncation left|right|middle cuts them")
        for line in self.length_notes:
            note(line)

    def _fit_lengths(self, rows: list[dict], context: int, max_new_tokens: int) -> None:
        """Rows (of those with token ids) longer than the length's limit left out or cut, as `self.length`
        says (prompt_length.py); refused when it says neither and a --max-prompt-length was given."""
        length = self.length
        limit = length.limit(context, max_new_tokens)
        long = [r for r in rows if len(r["prompt_token_ids"]) > limit]
        if not long:
            return
        first = f"{long[0]['prompt_id']!r} ({len(long[0]['prompt_token_ids'])} tokens)"
        why = (f"--max-prompt-length {limit}" if length.max_length is not None else
               f"the model's context of {context} less --max-new-tokens {max_new_tokens}")
        if length.filter_overlong:
            dropped = {id(r) for r in long}
            self.rows = [r for r in self.rows if id(r) not in dropped]
            self.left_out += [r["prompt_id"] for r in long]
            if not self.rows:
                raise PromptError(f"{self.path}: every prompt is longer than {limit} tokens ({why}), so "
                                  "--filter-overlong-prompts leaves none to sample")
            self.length_notes.append(f"{self.path}: {len(long)} prompt(s) longer than {limit} tokens ({why}) "
                                     f"left out by --filter-overlong-prompts, the first {first}; "
                                     f"{len(self.rows)} remain")
            return
        if length.max_length is None:
            return  # the context check refuses the longest
        if length.truncation == Truncation.ERROR:
            raise PromptError(f"{self.path}: prompt {first} is longer than --max-prompt-length {limit}; "
                              "--truncation left|right|middle cuts such prompts, --filter-overlong-prompts "
                              "leaves them out")
        for r in long:
            r["prompt_token_ids"] = length.cut(list(r["prompt_token_ids"]))
            self.cut.append(r["prompt_id"])
        self.length_notes.append(f"{self.path}: {len(long)} prompt(s) longer than --max-prompt-length "
                                 f"{limit} cut to it (--truncation {length.truncation.value}), the first "
                                 f"{first}")


def seed_rows(rows: Sequence[dict], indices: Sequence[int] | None = None) -> list[int]:
    """Each row's index in its file, which seeds its samples (prompt_length.py), where the prompt reader
    recorded one, else its index in the prompt set (`indices`, default 0, 1, ...)."""
    return [r.get("row", i) for r, i in zip(rows, range(len(rows)) if indices is None else indices)]


def _frame(tokenizer) -> tuple[str, str]:
    """What the model's chat template writes before and after one user message, generation prompt
    included."""
    marker = "\x00"
    framed = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                           tokenize=False)
    head, _, tail = framed.partition(marker)
    return head, tail


def apply_chat_template(tokenizer, text: str) -> str:
    """`text` as the model's chat template frames one user message for generation; unchanged when the
    tokenizer has no template or `text` already ends with the template's generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    generation_prompt = _frame(tokenizer)[1].strip()
    if generation_prompt and text.rstrip().endswith(generation_prompt):
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


def user_message(tokenizer, text: str) -> str | None:
    """The user message of `text` when it is one user message framed by `tokenizer`'s chat template for
    generation, as `sparrow prompts` writes it; None for any other text."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    head, tail = _frame(tokenizer)
    if len(text) < len(head) + len(tail) or not (text.startswith(head) and text.endswith(tail)):
        return None
    return text[len(head):len(text) - len(tail)]


def _tokenizer_of(spec: str):
    """The tokenizer of a recorded --model, or None where it no longer resolves (a relative path read
    from another folder, a moved checkpoint) or has none."""
    from ..model.loading import spec_tokenizer

    try:
        return spec_tokenizer(spec)
    except (ValueError, OSError, KeyError, ImportError):
        return None


def _same_vocabulary(a, b) -> bool:
    """Two tokenizers whose ids mean the same tokens."""
    return a is b or (len(a) == len(b) and a.get_vocab() == b.get_vocab())


def _same_spec(a: str, b: str) -> bool:
    """Two --model arguments that name the same preset (in any case), directory or file as written (no
    files read)."""
    from ..model.names import model_name

    return model_name(a) == model_name(b)


def _base_name(spec: str) -> str:
    """A --model's last path component (a preset's name), what tells models apart when a recorded one no
    longer resolves: the same checkpoint may have moved since."""
    from ..model.names import short_name

    return short_name(spec).lower()


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
