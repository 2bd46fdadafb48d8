"""Users' own datasets read as prompt sets: verl's layout and TRL's (Hugging Face datasets), in Parquet,
JSONL or a `save_to_disk` folder.

Design decisions:
- The format is read from the file, never from a flag. A Sparrow artifact (its Parquet footer says so)
  stays ours (`prompt_set.py`). So does a file without the footer (DuckDB's, pandas', JSON lines) that
  only ours can be, unless it is verl's (`prompt` and `reward_model`): one with `prompt_token_ids`, or
  without `prompt` but with `prompt_id` or `task` (the prompts reader names what it lacks), or one of
  text prompts with `prompt_id` and `task` where every task is one Sparrow scores. A user's multi-task
  mix that has those two column names (with tasks of its own, chat prompts or a `reward_model`) is a
  dataset, whose every column reaches the reward as its trainer passes them. A file taken for ours that
  has columns our reader drops names them on stderr, with the rename that has it read as a dataset, and
  --answer-column on it is refused with that rename. A file with `prompt` and `reward_model` is verl's
  (examples/data_preprocess/*.py): the ground truth is `reward_model.ground_truth`. A file with `prompt`
  otherwise is TRL's: the answer is the `--answer-column`, else the first of ANSWER_COLUMNS it has, else
  none (a reward function may need none). `--prompt-column` (verl's data.prompt_key) names another
  column as the prompt: the file is then a dataset (verl's with `reward_model`, else TRL's) whose other
  columns stay columns. Anything else is refused in one sentence listing the columns found and what is
  expected (with the --prompt-column to pass where a column is named like a prompt).
- The answer is the value as stored (a number, a list, a struct as a dict), since verl passes
  `reward_model.ground_truth` to a reward function as stored; `tasks.rewards.answer_for` gives each
  built-in reward what it reads (math-verify: text, a number as its text, anything else refused before
  any work; code: the tests as JSON text). A dotted `--answer-column` whose field no row's struct has is
  a typo, refused with the struct's fields.
- Files are Parquet (known by its magic bytes, whatever the file's suffix), JSON lines (UTF-8, one
  object per line), a `save_to_disk` folder or a folder of Parquet files: a Sparrow artifact's parts, or
  a dataset's shards as the Hugging Face Hub keeps them (`train-00000-of-00002.parquet`...), read in
  name order as one dataset; a folder mixing the shards of several splits is refused with the splits.
  Other files (CSV, one JSON array, a lone Arrow file) are refused with the formats read and a one-line
  conversion that needs only pyarrow or the standard library; a gzip-compressed file (`.jsonl.gz`, which
  `datasets` decompresses on the fly) with the `gunzip` command that gives a file read here.
- `prompt` is text or a list of chat messages ({"role", "content"}); messages become text through the
  model's chat template when the prompts are tokenized, as TRL's GRPOTrainer applies it
  (`prompt_set.apply_messages`).
- A row keeps the dataset's other columns in its metadata, as JSON: {"format", "file", "row", "prompt",
  "columns", and "answer_column" when --answer-column names it}, which is what the rewards
  (`tasks/rewards.py`, `reward_function.py`) pass to a user's function, check the ground truth by and use to
  name a row; values JSON has no type for (datetime, Decimal, bytes) travel tagged and reach the function as
  those Python values (`tasks.extras.column_json`). Prompt ids are the file's `prompt_id` column where some
  row has one, else `<file stem>-<row>`. One rule reads the column here and in completions files
  (`prompt_id_text`): text as it is, an integer as its digits, a float that is a whole number as the integer's
  (pandas stores an integer column with a missing value as float64, so 7.0 is '7'); a fraction, a null in a
  column of ids, or any other value is refused naming the file, the column and the row, never given a made-up
  id. Rows count from 0, in the ids and in every message (`tasks.base.row_of`), as pyarrow and pandas count
  them.
- Sparrow's models are text-only, so a multimodal dataset is refused before any weights load, whatever
  form it takes (`_check_text_only`): TRL's (message content as a list of typed parts, or an `image` or
  `images` column GRPOTrainer hands the processor) and verl's (an `images`, `videos` or
  `multi_modal_data` column, whose media its processor puts where the prompt says `<image>` or
  `<video>`). Sampling the text alone would answer a question about a picture nobody sees. Those words
  in a prompt without media are text (a question about HTML's `<video>` tag), as verl reads them.
- A `save_to_disk` folder is read with pyarrow from its Arrow files (state.json lists them), so the
  `datasets` package is not needed; a DatasetDict folder is refused with the split folders to name.
"""

from __future__ import annotations

import json
import numbers
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from sparrow.schemas.artifacts import ArtifactError
from sparrow.schemas.footer import file_json, read_parquet, read_schema

from .prompt_length import PromptLength

OUR_COLUMNS = ("prompt_id", "task", "prompt", "prompt_token_ids", "answer", "metadata")  # what ours keep
PARQUET_MAGIC = b"PAR1"
_SHARD = re.compile(r"(?P<split>.+)-\d+-of-\d+\.parquet")  # the Hub's shard names
FORMATS = "Parquet, JSON lines (one object per line) or a `datasets` save_to_disk folder"
MEDIA_COLUMNS = ("image", "images", "videos", "multi_modal_data")  # TRL's and verl's multimodal inputs
GZIP_MAGIC = b"\x1f\x8b"
EXPECTED = ("a Sparrow prompts file (prompt_id, task, and prompt or prompt_token_ids), a verl dataset "
            "(prompt as chat messages, reward_model with ground_truth, data_source...) or a TRL / Hugging "
            "Face dataset (prompt as text or chat messages, and an answer column)")


class DatasetError(ValueError):
    """A dataset that cannot be read as prompts; the message is one sentence naming the file."""


@dataclass(frozen=True)
class DataOptions:
    """How a command reads users' datasets and scores them: `reward` is "math" or "code" (in any case),
    `reward_fn` a user's function as path.py:function, or a file alone for its compute_score (at most one
    of them), called with `reward_kwargs` besides what its trainer passes."""

    answer_column: str | None = None
    reward: str | None = None
    reward_fn: str | None = None
    reward_kwargs: dict[str, Any] | None = None
    prompt_length: PromptLength = PromptLength()  # a prompt too long: refused, cut or left out
    prompt_column: str | None = None  # the dataset's prompt column (verl's data.prompt_key); None: `prompt`

    def reward_task(self) -> str | None:
        """The task name every row is scored by (None: each row's own task)."""
        from ..tasks import reward_function, rewards

        if self.reward is not None and self.reward_fn is not None:
            raise DatasetError("--reward and --reward-fn are two ways to score; give one of them")
        if self.reward_kwargs and self.reward_fn is None:
            raise DatasetError("--reward-kwargs passes keywords to a function of yours; name it with "
                               "--reward-fn")
        if self.reward is not None:
            task = rewards.reward_choice(self.reward)
            if task is None:
                raise DatasetError(f"--reward must be one of {', '.join(rewards.CHOICES)}, got "
                                   f"{self.reward!r}")
            return task
        if self.reward_fn is not None:
            return reward_function.register_function(self.reward_fn, self.reward_kwargs)
        return None


@dataclass(frozen=True)
class Source:
    """A user's file as read: its columns, and its records (of the columns named, else all) when asked."""

    columns: list[str]
    read: Callable[[list[str] | None], list[dict]]

    def records(self, columns: list[str] | None = None) -> list[dict]:
        return self.read(columns)

    @classmethod
    def of_records(cls, records: list[dict]) -> Source:
        return cls(list(dict.fromkeys(k for r in records for k in r)), lambda columns: records)

    @classmethod
    def of_table(cls, table: pa.Table) -> Source:
        return cls(table.column_names, lambda names: table.select(names or table.column_names).to_pylist())


def dataset_metadata(fmt: str, path: Path, row: int, prompt: Any, columns: dict[str, Any],
                     answer_column: str | None = None, prompt_column: str | None = None) -> str:
    """A row's metadata (module docstring); `answer_column` is the --answer-column its ground truth was
    read from (kept only when given: else it follows from the format, `rewards.answer_column_of`), and
    `prompt_column` the --prompt-column its prompt was (kept only when given)."""
    from ..tasks.extras import column_json

    meta = {"format": fmt, "file": path.name, "row": row, "prompt": column_json(prompt),
            "columns": column_json(columns)}
    if answer_column is not None:
        meta["answer_column"] = answer_column
    if prompt_column is not None:
        meta["prompt_column"] = prompt_column
    return json.dumps(meta, sort_keys=True)


def missing_answer_advice(metadata: dict[str, Any]) -> str:
    """Where a row that has no answer should have one, by the format its metadata names: the
    --answer-column it was read from, a verl dataset's reward_model.ground_truth, a TRL dataset's answer
    column (named with --answer-column), our prompts' 'answer' column."""
    if metadata.get("answer_column"):
        return f"its --answer-column {metadata['answer_column']!r} is null there"
    if metadata.get("format") == "verl":
        return _verl_ground_truth_advice(metadata)
    if metadata.get("format") == "trl":
        return "for a TRL dataset: name the answer column with --answer-column"
    return "its column 'answer' is null"


def _verl_ground_truth_advice(metadata: dict[str, Any]) -> str:
    """Why a verl row has no ground truth: its reward_model is not the struct verl writes, lacks the field,
    or holds a null there."""
    columns = metadata.get("columns")
    reward_model = columns.get("reward_model") if isinstance(columns, dict) else None
    if isinstance(reward_model, str):
        return ("its reward_model is text; verl's is a struct with a field ground_truth, as {'style': "
                "'rule', 'ground_truth': '42'}")
    if isinstance(reward_model, dict) and "ground_truth" not in reward_model:
        fields = ", ".join(reward_model) or "none"
        return f"its reward_model's fields are {fields}; none is ground_truth"
    return "a verl dataset's ground truth is reward_model.ground_truth, which is null in this row"


def read_dataset(path: Path, answer_column: str | None = None,
                 prompt_column: str | None = None) -> list[dict] | None:
    """The rows (prompt_set.COLUMNS plus `messages`) of a verl or TRL dataset, the prompt in its column
    `prompt` or `prompt_column` (--prompt-column, verl's data.prompt_key); None for a file of ours."""
    from ..tasks.rewards import ANSWER_COLUMNS

    source = _load(path)
    if source is None:
        if prompt_column is not None:
            raise DatasetError(f"{path} is a Sparrow prompts file, whose prompt is its column 'prompt'; "
                               "--prompt-column names the prompt of a verl or TRL dataset")
        return None
    columns = source.columns
    if prompt_column is not None and prompt_column not in columns:
        raise DatasetError(f"{path} has no column {prompt_column!r} (--prompt-column); its columns: "
                           f"{', '.join(columns)}")
    if prompt_column is None and _ours(columns, source):
        _taken_for_ours(path, columns, answer_column)
        return None  # ours (missing something, its reader names what)
    key = prompt_column or "prompt"
    if key not in columns:
        raise DatasetError(f"{path} has columns {', '.join(columns) or 'none'}, which fit none of the "
                           f"formats Sparrow reads: {EXPECTED}{_rename_hint(path, columns)}")
    fmt = "verl" if "reward_model" in columns else "trl"
    if answer_column is not None and answer_column.split(".")[0] not in columns:
        raise DatasetError(f"{path} has no column {answer_column!r} (--answer-column); its columns: "
                           f"{', '.join(columns)}")
    records = source.records()
    if not records:
        raise DatasetError(f"{path}: the dataset is empty")
    if answer_column is not None:
        _check_fields(records, answer_column, path)
    _check_text_only(records, columns, path, key)
    ids = _prompt_ids(records, path)
    answer_at = answer_column or ("reward_model.ground_truth" if fmt == "verl"
                                  else next((c for c in ANSWER_COLUMNS if c in columns), None))
    rows = []
    for i, record in enumerate(records):
        prompt = record.get(key)
        text, messages = _prompt(prompt, path, i, key)
        others = {k: v for k, v in record.items() if k != key}
        rows.append({"prompt_id": ids[i], "task": fmt, "prompt": text, "messages": messages,
                     "prompt_token_ids": None, "answer": _answer(record, answer_at),
                     "metadata": dataset_metadata(fmt, path, i, prompt, others, answer_column,
                                                  prompt_column)})
    _warn_messages_as_text(path, [r["prompt"] for r in rows])
    return rows


def _warn_messages_as_text(path: Path, prompts: list[str | None]) -> None:
    """A warning where prompts are text holding chat messages as JSON (a dataset written with json.dumps of
    its messages): they reach the model as that text, brackets and all, which is rarely what was meant."""
    held = [i for i, p in enumerate(prompts) if _json_messages(p)]
    if not held:
        return
    from ..tasks.base import row_of

    query = ("SELECT prompt::JSON::STRUCT(role VARCHAR, content VARCHAR)[] AS prompt, * EXCLUDE (prompt) "
             f"FROM {_view_name(path)}")
    fix = (f", for instance with sparrow sql \"{query}\" --run {path.parent} -o prompts.parquet"
           if len(held) == len(prompts) else "")
    print(f"warning: {path}: the prompt of {len(held)} of {len(prompts)} rows (first: {row_of(held[0])}) is "
          "text that holds chat messages as JSON, so the model reads that JSON text; store the messages as a "
          f"list of structs, as verl does{fix}", file=sys.stderr, flush=True)


def _json_messages(prompt: str | None) -> bool:
    if not prompt or not prompt.lstrip().startswith("[{"):
        return False
    try:
        value = json.loads(prompt)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value)


PROMPT_LIKE = ("question", "problem", "query", "instruction", "input")  # what raw datasets call a prompt


def _view_name(path: Path) -> str:
    """The view `sparrow sql --run FOLDER` gives a file of the folder, by its stem (the rule of
    sql.views.identifier, which a part may not import)."""
    if not path.is_file():
        return "<the file's name>"
    name = re.sub(r"[^A-Za-z0-9_]+", "_", path.stem).strip("_") or "file"
    return f"_{name}" if name[0].isdigit() else name


def _rename_hint(path: Path, columns: list[str]) -> str:
    """How to make a near miss readable: a column that is the prompt by another name (--prompt-column), or
    a `messages` column of whole conversations (SFT data), whose prompt is every turn but the last and whose
    answer is the last, as a `sparrow sql` query over the file's folder (each file a view named by its
    stem)."""
    view = _view_name(path)
    rename = next((c for c in columns if c.lower() == "prompt"), None) or next(
        (c for c in columns if c.lower() in PROMPT_LIKE), None)
    if rename is not None:
        return f"; if its column {rename!r} is the prompt, pass --prompt-column {rename}"
    if "messages" in columns:
        query = (f"SELECT messages[:-2] AS prompt, messages[-1].content AS answer, * EXCLUDE (messages) "
                 f"FROM {view}")
        return (f"; its 'messages' column holds whole conversations: the prompt is every turn but the last, "
                f"the answer the last one's content: sparrow sql \"{query}\" --run {path.parent} -o "
                "prompts.parquet")
    return ""


def prompt_id_text(value: Any, where: str) -> str:
    """A `prompt_id` value as the id it is read as, in a prompts file and a completions file alike (module
    docstring); DatasetError naming `where` (the file and the row) for a value that is no id."""
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    raise DatasetError(f"{where}: column 'prompt_id' holds {_id_kind(value)}, and an id is text or an "
                       "integer (a whole number stored as a float, 7.0, reads as '7'), one in every row")


def _id_kind(value: Any) -> str:
    if value is None:
        return "no value (null)"
    if isinstance(value, bool):
        return f"the boolean {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    kinds = {list: "a list", dict: "a struct", bytes: "bytes"}
    return next((what for kind, what in kinds.items() if isinstance(value, kind)), type(value).__name__)


def _prompt_ids(records: list[dict], path: Path) -> list[str]:
    """Each row's prompt id: the `prompt_id` column where some row has one (`prompt_id_text`), else
    `<file stem>-<row>`."""
    from ..tasks.base import row_of

    given = [r.get("prompt_id") for r in records]
    if all(v is None for v in given):
        return [f"{path.stem}-{i}" for i in range(len(records))]
    return [prompt_id_text(v, f"{path}, {row_of(i)}") for i, v in enumerate(given)]


def made_ids(row: dict) -> bool:
    """Whether a prompt's id was made from its file's name and row (a dataset without `prompt_id`)."""
    try:
        meta = file_json(row.get("metadata") or "{}")
    except ValueError:
        return False
    return (isinstance(meta, dict) and meta.get("format") in ("verl", "trl")
            and isinstance(meta.get("columns"), dict) and meta["columns"].get("prompt_id") is None)


def _check_text_only(records: list[dict], columns: list[str], path: Path, key: str = "prompt") -> None:
    """The first row with images or videos, in any of TRL's and verl's forms (module docstring), refused
    in one sentence that names it and the form; the prompt is column `key`."""
    from ..tasks.base import row_of

    media = [c for c in MEDIA_COLUMNS if c in columns]
    for i, record in enumerate(records):
        prompt = record.get(key)
        held = next((c for c in media if record.get(c) not in (None, [], {})), None)
        part = _media_part(prompt)
        if held is not None:
            what = f"has media in column {held!r} (a multimodal dataset's images or videos)"
        elif part is not None:
            what = (f"has a {key!r} whose message content holds a part of type {part!r} (TRL's multimodal "
                    "layout)")
        else:
            continue
        raise DatasetError(f"{path}: {row_of(i)} {what}; Sparrow's models are text-only, so they cannot see "
                           "images or videos (give a text-only dataset)")


def _media_part(prompt: Any) -> str | None:
    """The type of the first non-text part of a message's content given as typed parts (TRL's multimodal
    layout, `[{"type": "image"}, {"type": "text", "text": ...}]`); None for none."""
    messages = prompt if isinstance(prompt, list) else []
    parts = [p for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
             for p in m["content"] if isinstance(p, dict)]
    return next((str(p.get("type")) for p in parts if p.get("type") not in (None, "text")), None)


def _ours(columns: list[str], source: Source) -> bool:
    """Whether a file without Sparrow's footer is a prompts file of ours by its content (module
    docstring): not verl's, and with `prompt_token_ids`, or without `prompt` but with a column of ours,
    or with text prompts, `prompt_id` and `task` whose every task Sparrow scores."""
    from ..tasks import has_scorer

    names = set(columns)
    if "reward_model" in names and "prompt" in names:
        return False
    if "prompt_token_ids" in names or "prompt" not in names:
        return bool(names & {"prompt_id", "task", "prompt_token_ids"})
    if not {"prompt_id", "task"} <= names:
        return False
    return all(isinstance(r.get("task"), str) and has_scorer(r["task"])
               and not isinstance(r.get("prompt"), list) for r in source.records(["task", "prompt"]))


def _taken_for_ours(path: Path, columns: list[str], answer_column: str | None) -> None:
    """A file read as ours by its columns: --answer-column refused, and columns our reader drops named,
    each with the rename that has the file read as a dataset instead."""
    if "prompt" not in columns:
        return
    why = "has columns 'prompt_id' and 'task', and every task is one of Sparrow's"
    rename = "rename its column 'task' to have it read as a TRL dataset, which passes every column"
    if answer_column is not None:
        raise DatasetError(f"{path} is read as a Sparrow prompts file (it {why}), whose answer is its column "
                           f"'answer'; --answer-column names the answer of a verl or TRL dataset: {rename}")
    index = pandas_index(path, columns)
    dropped = [c for c in columns if c not in OUR_COLUMNS and c not in index]
    if dropped:
        print(f"warning: {path} is read as a Sparrow prompts file (it {why}), so its columns "
              f"{', '.join(map(repr, dropped))} do not reach the reward; {rename}", file=sys.stderr,
              flush=True)


def pandas_index(path: Path, columns: list[str]) -> set[str]:
    """Those of `columns` that hold pandas' index (`__index_level_0__`, or a named index that the footer's
    `pandas` record of a Parquet file lists): pandas' row labels, not data, so our reader drops them
    without a word."""
    named: set[str] = set()
    if _starts_with(path, PARQUET_MAGIC):
        try:
            recorded = (read_schema(path).pandas_metadata or {}).get("index_columns", [])
        except (ArtifactError, ValueError):  # a damaged `pandas` record: no index to drop
            recorded = []
        named = {c for c in recorded if isinstance(c, str)}
    return {c for c in columns if c in named or re.fullmatch(r"__index_level_\d+__", c)}


def _prompt(prompt: Any, path: Path, row: int, key: str = "prompt") -> tuple[str | None, list[dict] | None]:
    """A prompt as text, or as chat messages whose content is text or a list of text parts (TRL's typed
    layout, `[{"type": "text", "text": ...}]`, joined; other parts are refused before, `_check_text_only`)."""
    if prompt is None or isinstance(prompt, str):
        return prompt, None
    ok = isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and _text_content(m.get("content")) is not None
        for m in prompt)
    if not ok:
        from ..tasks.base import row_of

        raise DatasetError(f"{path}: {row_of(row)} has a {key!r} that is neither text nor a list of chat "
                           "messages with text 'role' and 'content' (text, or a list of text parts)")
    return None, [{"role": m["role"], "content": _text_content(m["content"])} for m in prompt]


def _text_content(content: Any) -> str | None:
    """A message's content as text: text as it is, typed text parts joined; None for anything else."""
    if isinstance(content, str):
        return content
    texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"] \
        if isinstance(content, list) else []
    if texts and len(texts) == len(content) and all(isinstance(t, str) for t in texts):
        return "".join(texts)
    return None


def _answer(record: dict, at: str | None) -> Any:
    """The value at the dotted path `at`, as stored (module docstring); None where a row lacks it."""
    if at is None:
        return None
    value: Any = record
    for key in at.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    if value is None or isinstance(value, str | int | float):
        return value
    from ..tasks.extras import column_json

    return column_json(value)  # JSON's types, odd leaves (dates, decimals, bytes) tagged


_KINDS = {str: "text", int: "integers", float: "numbers", bool: "booleans", list: "lists"}


def _check_fields(records: list[dict], at: str, path: Path) -> None:
    """Each field a dotted --answer-column names is a field of the struct before it, in some row."""
    keys = at.split(".")
    values = [r.get(keys[0]) for r in records]
    for depth, key in enumerate(keys[1:], 1):
        name = ".".join(keys[:depth])
        structs = [v for v in values if isinstance(v, dict)]
        if not structs:
            held = next((_KINDS.get(type(v), type(v).__name__) for v in values if v is not None), None)
            what = f"is not a struct (it holds {held})" if held else "is null in every row"
            raise DatasetError(f"{path}: column {name!r} {what}, so it has no field {key!r} (--answer-column "
                               f"{at})")
        fields = list(dict.fromkeys(k for v in structs for k in v))
        if key not in fields:
            raise DatasetError(f"{path}: struct column {name!r} has no field {key!r} (--answer-column "
                               f"{at}); its fields: {', '.join(map(str, fields)) or 'none'}")
        values = [v.get(key) for v in structs]


def _load(path: Path) -> Source | None:
    """A user's dataset as read (module docstring), or None for a Sparrow artifact (its footer says so)."""
    from sparrow.schemas import artifact_kind
    from sparrow.schemas.io import opens_json

    if path.is_dir():
        return _folder(path)
    if _starts_with(path, GZIP_MAGIC):
        raise DatasetError(compressed(path))
    if not _starts_with(path, PARQUET_MAGIC) and (path.suffix in (".jsonl", ".ndjson") or opens_json(path)):
        records = _json_lines(path)
        if records is None:
            return None
        return Source.of_records(records)
    _check_parquet(path)
    if artifact_kind(path) is not None:
        return None
    return Source(read_schema(path).names, lambda names: read_parquet(path, columns=names).to_pylist())


def _starts_with(path: Path, magic: bytes) -> bool:
    """A file that starts with a format's magic bytes, whatever its suffix (-o wrote prompts.jsonl)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def _folder(path: Path) -> Source | None:
    """A `save_to_disk` folder, a dataset's Parquet shards, or None for a Sparrow artifact's parts."""
    from sparrow.schemas import artifact_kind

    if (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").exists())
        raise DatasetError(f"{path} is a Hugging Face DatasetDict; give one split's folder "
                           f"({', '.join(str(path / s) for s in splits) or 'none found'})")
    if (path / "state.json").exists():
        return Source.of_table(_arrow_dataset(path))
    parts = sorted(p for p in path.iterdir() if p.suffix == ".parquet" and not p.name.startswith("."))
    if not parts:
        data = path / "data"
        hint = f"; a dataset repository keeps them in {data}, give that folder" if data.is_dir() else ""
        raise DatasetError(f"{path} is a folder without Parquet files and without a save_to_disk state.json, "
                           f"so it holds no prompts{hint}")
    for part in parts:
        _check_parquet(part)
    if artifact_kind(parts[0]) is not None:
        return None
    return Source.of_table(_shards(path, parts))


def _shards(path: Path, parts: list[Path]) -> pa.Table:
    """A dataset's Parquet shards as one table, in name order; shards of several splits are refused."""
    splits = {m["split"] for m in map(_SHARD.fullmatch, (p.name for p in parts)) if m}
    if len(splits) > 1:
        raise DatasetError(f"{path} holds the Parquet shards of splits {', '.join(sorted(splits))}; give a "
                           "folder holding one split's shards (or one shard file)")
    try:
        tables = [read_parquet(p) for p in parts]
    except (pa.ArrowException, OSError, ArtifactError) as e:
        raise DatasetError(f"{path}: its Parquet files do not form one dataset ({e})") from None
    merged = tables[0]
    for i in range(1, len(parts)):
        try:
            merged = pa.concat_tables([merged, tables[i]], promote_options="permissive")
        except pa.ArrowException as e:
            before = parts[0].name if i == 1 else f"the {i} before it ({parts[0].name}, ...)"
            raise DatasetError(f"{path}: its Parquet files do not form one dataset: {parts[i].name} does not "
                               f"merge with {before} ({e})") from None
    return merged


def _json_lines(path: Path) -> list[dict] | None:
    """The objects of a JSON lines file (UTF-8, a BOM allowed); None when a line is not an object (the
    prompts reader names it). Lines are split on line breaks only, so U+2028 inside a string stays."""
    from sparrow.schemas import ArtifactError
    from sparrow.schemas.io import utf8_lines

    records = []
    try:
        lines = list(utf8_lines(path))
    except ArtifactError as e:
        raise DatasetError(str(e)) from None
    for _, line in lines:
        if not line.strip():
            continue
        try:
            record = file_json(line)
        except ValueError:
            return None if records else _json_array(path)
        if not isinstance(record, dict):
            return None if records else _json_array(path)
        records.append(record)
    return records or None


def _json_array(path: Path) -> None:
    """Refuses a file that is one JSON array (of the prompts' objects); None for anything else."""
    text = path.read_bytes().decode("utf-8-sig", errors="replace")
    if not text.lstrip().startswith("["):
        return None
    try:
        file_json(text)
    except ValueError:
        return None
    jsonl = _beside(path, ".jsonl")
    raise DatasetError(f"{path} holds one JSON array; Sparrow reads JSON lines (one object per line): "
                       f"convert it with python -c \"import json; [print(json.dumps(r)) for r in "
                       f"json.load(open({str(path)!r}, encoding='utf-8-sig'))]\" > {_shell(jsonl)}")


def _check_parquet(path: Path) -> None:
    """Refuses, naming the formats read and how to convert, a file that is not Parquet (an empty or a
    truncated one is left to the Parquet reader's own sentence)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if not head or head[:4] == b"PAR1":
        return
    parquet = _beside(path, ".parquet")
    if head[:6] == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff":
        if (path.parent / "state.json").exists():
            raise DatasetError(f"{path} is one Arrow file of a `datasets` save_to_disk folder; give the "
                               f"folder, {path.parent}")
        opener = "open_file" if head[:6] == b"ARROW1" else "open_stream"
        how = (f"python -c \"import pyarrow as pa, pyarrow.parquet as pq; pq.write_table(pa.ipc.{opener}("
               f"pa.memory_map({str(path)!r})).read_all(), {str(parquet)!r})\"")
        what = "an Arrow file"
    elif path.suffix.lower() == ".csv":
        how = (f"python -c \"import pyarrow.csv as csv, pyarrow.parquet as pq; "
               f"pq.write_table(csv.read_csv({str(path)!r}), {str(parquet)!r})\"")
        what = "CSV"
    else:
        raise DatasetError(f"{path} is not a Parquet file (it does not start with the Parquet magic bytes); "
                           f"Sparrow reads prompts from {FORMATS}")
    raise DatasetError(f"{path} is {what}, which Sparrow does not read: give {FORMATS} (convert it with "
                       f"{how})")


def compressed(path: Path) -> str:
    """The refusal of a gzip-compressed file (module docstring), with the command that decompresses it."""
    plain = path.with_suffix("") if path.suffix.lower() == ".gz" else path.with_name(f"{path.name}.out")
    return (f"{path} is gzip-compressed, which Sparrow does not read: decompress it first "
            f"(gunzip -c {_shell(path)} > {_shell(plain)}) and give {plain}")


def _beside(path: Path, suffix: str) -> Path:
    """Where a suggested conversion writes: `path` with `suffix`, never `path` itself."""
    out = path.with_suffix(suffix)
    return out if out != path else path.with_name(f"{path.stem}.converted{suffix}")


def _shell(path: Path) -> str:
    import shlex

    return shlex.quote(str(path))


def _arrow_dataset(path: Path) -> pa.Table:
    """A `datasets` save_to_disk folder: the Arrow stream files its state.json lists, in order."""
    try:
        files = [path / f["filename"] for f in json.loads((path / "state.json").read_text())["_data_files"]]
        tables = [pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files]
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
        raise DatasetError(f"{path} is not a readable Hugging Face dataset folder ({e})") from None
    if not tables:
        raise DatasetError(f"{path}: the dataset folder lists no Arrow files")
    return pa.concat_tables(tables)
