"""Users' own datasets read as prompt sets: verl's layout and TRL's (Hugging Face datasets), in Parquet,
JSONL or a `save_to_disk` folder.

Design decisions:
- The format is read from the columns, never from a flag. A Sparrow prompts artifact, and any file with
  our columns (`prompt_id` and `task`, or `prompt_token_ids`), stays ours
  (`prompt_set.py`). A file with `prompt` and `reward_model` is verl's (examples/data_preprocess/*.py):
  the ground truth is `reward_model.ground_truth`. A file with `prompt` otherwise is TRL's: the answer is
  the `--answer-column`, else the first of ANSWER_COLUMNS it has, else none (a reward function may need
  none). Anything else is refused in one sentence listing the columns found and what is expected.
- `prompt` is text or a list of chat messages ({"role", "content"}); messages become text through the
  model's chat template when the prompts are tokenized, as TRL applies it (add_generation_prompt, or
  continue_final_message when the last turn is the assistant's).
- A row keeps the dataset's other columns in its metadata, as JSON: {"format", "file", "row", "prompt",
  "columns"}, which is what the rewards (`tasks/rewards.py`) pass to a user's function and use to name a
  row. Prompt ids are the file's `prompt_id` column, else `<file stem>-<row>`. Rows count from 0, in
  the ids and in every message (`tasks.base.row_of`), as pyarrow and pandas count them.
- A `save_to_disk` folder is read with pyarrow from its Arrow files (state.json lists them), so the
  `datasets` package is not needed; a DatasetDict folder is refused with the split folders to name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ANSWER_COLUMNS = ("answer", "solution", "ground_truth", "target")
EXPECTED = ("a Sparrow prompts file (prompt_id, task, and prompt or prompt_token_ids), a verl dataset "
            "(prompt as chat messages, reward_model with ground_truth, data_source...) or a TRL / Hugging "
            "Face dataset (prompt as text or chat messages, and an answer column)")


class DatasetError(ValueError):
    """A dataset that cannot be read as prompts; the message is one sentence naming the file."""


@dataclass(frozen=True)
class DataOptions:
    """How a command reads users' datasets and scores them: `reward` is "math" or "code", `reward_fn` a
    user's function as path.py:function (at most one of them)."""

    answer_column: str | None = None
    reward: str | None = None
    reward_fn: str | None = None

    def reward_task(self) -> str | None:
        """The task name every row is scored by (None: each row's own task)."""
        from ..tasks import rewards

        if self.reward is not None and self.reward_fn is not None:
            raise DatasetError("--reward and --reward-fn are two ways to score; give one of them")
        if self.reward is not None:
            if self.reward not in rewards.CHOICES:
                raise DatasetError(f"--reward must be one of {', '.join(rewards.CHOICES)}, got "
                                   f"{self.reward!r}")
            return rewards.CHOICES[self.reward]
        if self.reward_fn is not None:
            return rewards.register_function(self.reward_fn)
        return None


def dataset_metadata(fmt: str, path: Path, row: int, prompt: Any, columns: dict[str, Any]) -> str:
    return json.dumps({"format": fmt, "file": path.name, "row": row, "prompt": prompt, "columns": columns},
                      default=str, sort_keys=True)


def read_dataset(path: Path, answer_column: str | None = None) -> list[dict] | None:
    """The rows (prompt_set.COLUMNS plus `messages`) of a verl or TRL dataset; None for a file of ours."""
    columns, records = _load(path)
    if columns is None:
        return None
    if {"prompt_id", "task"} <= set(columns) or "prompt_token_ids" in columns:
        return None  # ours (missing something, its reader names what)
    if "prompt" not in columns:
        raise DatasetError(f"{path} has columns {', '.join(columns) or 'none'}, which fit none of the "
                           f"formats Sparrow reads: {EXPECTED}")
    fmt = "verl" if "reward_model" in columns else "trl"
    if answer_column is not None and answer_column.split(".")[0] not in columns:
        raise DatasetError(f"{path} has no column {answer_column!r} (--answer-column); its columns: "
                           f"{', '.join(columns)}")
    answer_at = answer_column or ("reward_model.ground_truth" if fmt == "verl"
                                  else next((c for c in ANSWER_COLUMNS if c in columns), None))
    rows = []
    for i, record in enumerate(records()):
        prompt = record.get("prompt")
        text, messages = _prompt(prompt, path, i)
        others = {k: v for k, v in record.items() if k != "prompt"}
        rows.append({"prompt_id": str(record["prompt_id"]) if record.get("prompt_id") is not None
                     else f"{path.stem}-{i}",
                     "task": fmt, "prompt": text, "messages": messages, "prompt_token_ids": None,
                     "answer": _answer(record, answer_at),
                     "metadata": dataset_metadata(fmt, path, i, prompt, others)})
    if not rows:
        raise DatasetError(f"{path}: the dataset is empty")
    return rows


def _prompt(prompt: Any, path: Path, row: int) -> tuple[str | None, list[dict] | None]:
    if prompt is None or isinstance(prompt, str):
        return prompt, None
    ok = isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt)
    if not ok:
        from ..tasks.base import row_of

        raise DatasetError(f"{path}: {row_of(row)} has a 'prompt' that is neither text nor a list of chat "
                           "messages with text 'role' and 'content'")
    return None, [{"role": m["role"], "content": m["content"]} for m in prompt]


def _answer(record: dict, at: str | None) -> str | None:
    if at is None:
        return None
    value: Any = record
    for key in at.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)


def _load(path: Path):
    """(columns, a function giving the records) of a user's dataset, or (None, None) for a file of ours."""
    from sparrow.schemas import artifact_kind
    from sparrow.schemas.footer import json_text

    if path.is_dir():
        if (path / "dataset_dict.json").exists():
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").exists())
            raise DatasetError(f"{path} is a Hugging Face DatasetDict; give one split's folder "
                               f"({', '.join(str(path / s) for s in splits) or 'none found'})")
        if not (path / "state.json").exists():
            return None, None  # a directory of Parquet parts: ours
        table = _arrow_dataset(path)
        return table.column_names, table.to_pylist
    if path.suffix in (".jsonl", ".ndjson") or json_text(path):
        records = _json_lines(path)
        if records is None:
            return None, None
        return list(dict.fromkeys(k for r in records for k in r)), lambda: records
    if artifact_kind(path) is not None:
        return None, None
    names = pq.read_schema(path).names
    return names, lambda: pq.read_table(path).to_pylist()


def _json_lines(path: Path) -> list[dict] | None:
    """The objects of a JSON lines file; None when a line is not an object (the prompts reader names it)."""
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            return None
        if not isinstance(record, dict):
            return None
        records.append(record)
    return records or None


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
