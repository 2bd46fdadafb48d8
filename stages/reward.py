"""Rewards of any sampler's completions (`sparrow reward`): each completion scored by its prompt's task.

Design decisions:
- Completions come from anywhere: our `rollouts` artifact, any Parquet file (DuckDB, pandas, vLLM
  scripts), a directory of Parquet parts (`rollout --workers`, read as every artifact directory is) or
  JSONL, read by their columns: `prompt_id` and `text` are needed, `sample` is optional (the row's rank
  within its prompt by default); other columns are ignored. A Sparrow artifact of another kind is
  refused. A file that starts with Parquet's magic bytes is Parquet whatever its suffix; a gzip one is
  refused with the command that decompresses it. `prompt_id` is read by the rule a dataset's ids are
  (`user_data.prompt_id_text`): text, an integer as its text, a whole-number float (7.0, as pandas
  stores an integer column with a missing value) as the integer's; a fraction or a null is refused,
  naming the row.
- JSONL is read line by line with `json`, keeping only those keys (and `completion_ids`, TRL's token
  ids of a completion, for a user's reward function), so a column nothing reads may
  change type from line to line, as other samplers' dumps do; each line is decoded as UTF-8 on its own
  (a bad byte names its line), and a UTF-8 byte order mark at the start of the file is skipped.
- Prompt ids are `<file stem>-<row>` for a verl or TRL dataset without a `prompt_id` column, so two files
  with one stem share them.
  Rollouts record what they were sampled from, so a prompts file that is not it is refused: a prompt's
  token ids where both files have them; else the digest of its text or chat messages, which rollouts
  record for every prompt that had no token ids (`prompt_digests`; for rollouts written before, the
  prompt that the file their metadata names holds under the same id, when that file is still there). A
  file without such records (JSONL, another sampler's Parquet) is matched by the id alone.
- Everything that can be wrong (a column, a missing text, a prompt id the prompts file lacks, a
  prompt without a known task or an answer, a repeated sample, completions of other prompts) is found
  before anything is scored, as one sentence naming the file, the row and the column.
- A rollouts artifact is checked whole a batch of rows at a time (`read_columns`), as every artifact is,
  and then only the columns scoring and its checks read are held (`ROLLOUTS_READ`): not the logprobs and
  budgets of each completion. The token ids are held as Arrow keeps them (4 bytes a token), for a user's
  TRL function, which takes them as completion_ids.
- Scoring is `judge_batch`: code tasks' programs run in a pool of sandboxes. Each row says why it got
  its reward (`status`; for code tasks also the tests passed of the tests run), so a timeout, an output
  kill, a crash, a missing function and a partial pass tell apart.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sparrow.schemas import ArtifactError, ArtifactSpec, Col, artifact_kind, artifact_metadata, read_columns
from sparrow.schemas.artifacts import first_line
from sparrow.schemas.footer import artifact_parts, file_json, kind_version, unreadable
from sparrow.schemas.io import opens_json, utf8_lines
from sparrow.schemas.locations import is_stdio

from .core.prompt_set import PromptSet
from .core.user_data import GZIP_MAGIC, PARQUET_MAGIC, DatasetError, compressed, made_ids, prompt_id_text
from .tasks import get_task, has_scorer, judge_batch, no_scorer, with_completion_ids
from .tasks.base import row_of
from .tasks.extras import extra_json

COMPLETIONS = ArtifactSpec("completions", "completions of any sampler, read by their columns", (
    Col("prompt_id", pa.string()),
    Col("sample", pa.int32(), nullable=True, range="[0, inf)"),
    Col("text", pa.string(), nullable=True),
))
JSON_COLUMNS = {"prompt_id": (str | int | float, "text or an integer", pa.string()),  # then by `_id`
                "sample": (int, "an integer", pa.int64()), "text": (str, "text", pa.string()),
                "completion_ids": (list, "a list of token ids", pa.list_(pa.int64()))}
INT64 = 2**63
REFUSED_KIND = "give rollouts, or any Parquet or JSONL file with columns 'prompt_id' and 'text'"
# what scoring and its checks read
ROLLOUTS_READ = ("prompt_id", "sample", "text", "prompt_token_ids", "token_ids")


@dataclass(frozen=True)
class Completion:
    prompt_id: str
    sample: int
    text: str
    # the prompt's token ids a rollouts artifact recorded, on the prompt's first completion (its samples
    # share them); None for the others and for any other file
    prompt_token_ids: tuple[int, ...] | None = None
    # the completion's token ids: a rollouts artifact's token_ids, or a file's completion_ids (TRL's name)
    token_ids: Any = None  # a numpy array of a file's column, a list of the engine's


def _is_jsonl(path: Path) -> bool:
    """JSON lines by the suffix or the first byte, unless the file starts with Parquet's magic bytes (an
    artifact written under a .jsonl name is Parquet)."""
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == PARQUET_MAGIC:
                return False
    return path.suffix in (".jsonl", ".ndjson", ".json") or opens_json(path)


def _table(path: Path) -> pa.Table:
    if not path.exists():
        raise ArtifactError(f"--completions {path}: no such file")
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(2) == GZIP_MAGIC:
                raise ArtifactError(f"--completions {compressed(path)}")
    if path.is_dir():
        return _parts(path)
    if _is_jsonl(path):
        return _json_lines(path)
    return _parquet(path, f"--completions {path}")


def _parquet(path: Path, shown: str) -> pa.Table:
    """A Parquet file's completion columns: a rollouts artifact's (checked whole), another file's we read."""
    kind = artifact_kind(path)
    if kind == "rollouts":
        return read_columns(path, "rollouts", ROLLOUTS_READ)
    if kind is not None:
        raise ArtifactError(f"{shown} is a '{kind}' artifact; {REFUSED_KIND}")
    try:
        with pa.OSFile(os.fsencode(path)) as f:  # a name that is not UTF-8 reads too
            names = pq.read_schema(f).names
            return pq.read_table(f, columns=[c for c in names if c in (*COMPLETIONS.names, "completion_ids")])
    except (pa.ArrowException, OSError) as e:
        raise unreadable(Path(shown), e) from None


def _parts(path: Path) -> pa.Table:
    """A directory of Parquet parts (`rollout --workers`): a rollouts artifact checked and read as every
    artifact directory is (`read_columns`), else each part's completion columns, concatenated in name
    order."""
    try:
        parts = artifact_parts(path)
    except ArtifactError:
        raise ArtifactError(f"--completions {path} is a directory without Parquet parts; give a Parquet "
                            "or JSONL file, or a directory of Parquet parts (rollout --workers writes one)"
                            ) from None
    kind = artifact_kind(parts[0])
    if kind == "rollouts":
        return read_columns(path, "rollouts", ROLLOUTS_READ)
    if kind is not None:
        raise ArtifactError(f"--completions {path} is a directory of '{kind}' parts; {REFUSED_KIND}")
    tables = [_parquet(p, f"--completions {path}: part {p.name}") for p in parts]
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as e:
        raise ArtifactError(f"--completions {path}: its parts do not form one table "
                            f"({first_line(e)})") from None


def _json_lines(path: Path) -> pa.Table:
    """The completion columns of a JSON lines file, read line by line (module docstring)."""
    columns: dict[str, list] = {name: [] for name in JSON_COLUMNS}
    present: set[str] = set()
    line_numbers = []  # the line of each object read
    try:
        lines = list(utf8_lines(path))
    except ArtifactError as e:
        raise ArtifactError(f"--completions {e}") from None
    for n, line in lines:
        record = _json_line(line, path, n)
        if record is None:
            continue
        line_numbers.append(n)
        present.update(name for name in JSON_COLUMNS if name in record)
        for name, (kind, what, _) in JSON_COLUMNS.items():
            value = record.get(name)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise ArtifactError(f"--completions {path} line {n}: '{name}' is {_json_kind(value)}, "
                                    f"expected {what}")
            if name == "completion_ids" and value is not None:
                _check_token_ids(value, f"--completions {path} line {n}")
            if name == "sample" and value is not None and not -INT64 <= value < INT64:
                raise ArtifactError(f"--completions {path} line {n}: 'sample' is {value}, expected a sample "
                                    "index from 0")
            columns[name].append(value)
    if not line_numbers:
        raise ArtifactError(f"--completions {path} holds no completions (no JSON lines)")
    if "prompt_id" in present:
        columns["prompt_id"] = [_id(v, f"--completions {path} line {n}") for v, n in
                                zip(columns["prompt_id"], line_numbers)]
    try:
        return pa.table({k: pa.array(v, JSON_COLUMNS[k][2]) for k, v in columns.items() if k in present})
    except (pa.ArrowException, UnicodeError) as e:
        raise ArtifactError(f"--completions {path}: its lines do not form one table "
                            f"({first_line(e)})") from None


def _check_token_ids(ids: list, where: str) -> None:
    for v in ids:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < INT64:
            raise ArtifactError(f"{where}: 'completion_ids' holds {json.dumps(v)}, expected token ids "
                                "(integers from 0)")


def _json_line(line: str, path: Path, n: int) -> dict[str, Any] | None:
    """Line `n`'s JSON object; None for a blank line."""
    if not line.strip():
        return None
    try:
        record = file_json(line)
    except json.JSONDecodeError as e:
        raise ArtifactError(f"--completions {path} line {n} is not JSON ({e.msg} at column "
                            f"{e.colno})") from None
    except ValueError as e:
        raise ArtifactError(f"--completions {path} line {n} cannot be read: {e}") from None
    if isinstance(record, list):
        raise ArtifactError(f"--completions {path} line {n} is a JSON array; completions are JSON lines, one "
                            "object per line with 'prompt_id' and 'text'")
    if not isinstance(record, dict):
        raise ArtifactError(f"--completions {path} line {n} is {_json_kind(record)}, not a JSON object")
    return record


def _json_kind(value: Any) -> str:
    kinds = ((bool, "true or false"), (str, "text"), (int, "an integer"), (float, "a number"),
             (list, "a list"), (dict, "an object"))
    return next((what for kind, what in kinds if isinstance(value, kind)), "null")


def read_completions(path: str | os.PathLike) -> list[Completion]:
    """The completions of a file (module docstring), validated; samples numbered where the file has none."""
    path = Path(path)
    table = _ids_as_text(_table(path), path)
    subject = f"--completions {path} (read by its columns)"
    if "text" not in table.column_names:
        raise ArtifactError(f"{subject} lacks column 'text' (the completion's text, which is scored)")
    tokens = _first_prompt_tokens(table) if kind_version(table.schema)[0] == "rollouts" else {}
    ids = _completion_ids(table, path)
    numbered = "sample" in table.column_names  # else each row's rank within its prompt numbers it
    table = COMPLETIONS.conform(table.select([c for c in table.column_names if c in COMPLETIONS.names]),
                                subject, fill_missing=True)
    out, seen, rank = [], set(), {}
    for i, r in enumerate(table.to_pylist()):
        if r["text"] is None:
            raise ArtifactError(f"--completions {path}: {row_of(i)}, prompt {r['prompt_id']!r}, has no text "
                                "in column 'text'")
        if numbered and r["sample"] is None:
            raise ArtifactError(f"--completions {path}: {row_of(i)}, prompt {r['prompt_id']!r}, has no "
                                "sample in column 'sample' (give every row one, or drop the column to number "
                                "each prompt's rows in order)")
        sample = rank.get(r["prompt_id"], 0) if r["sample"] is None else r["sample"]
        rank[r["prompt_id"]] = max(rank.get(r["prompt_id"], 0), sample + 1)
        if (r["prompt_id"], sample) in seen:
            raise ArtifactError(f"--completions {path}: {row_of(i)} repeats prompt {r['prompt_id']!r} sample "
                                f"{sample} (columns 'prompt_id' and 'sample')")
        seen.add((r["prompt_id"], sample))
        out.append(Completion(r["prompt_id"], sample, r["text"], tokens.get(i), ids[i] if ids else None))
    if not out:
        raise ArtifactError(f"--completions {path} holds no completions")
    return out


def _completion_ids(table: pa.Table, path: Path) -> list | None:
    """Each completion's token ids (a rollouts artifact's token_ids, else a completion_ids column), for a
    user's TRL function; None where the file has neither. A column that is not lists of integers is
    refused."""
    name = ("token_ids" if kind_version(table.schema)[0] == "rollouts" else
            "completion_ids" if "completion_ids" in table.column_names else None)
    if name is None:
        return None
    column = table.column(name)
    kind = column.type
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    if not listed or not pa.types.is_integer(kind.value_type):
        raise ArtifactError(f"--completions {path} has column {name!r} of type {kind}, expected lists of "
                            "token ids (integers)")
    out: list = []
    for chunk in column.chunks:  # numpy views, not Python ints: a long completion is 4 bytes a token
        values = chunk.values.to_numpy(zero_copy_only=False)
        offsets = chunk.offsets.to_numpy()
        valid = chunk.is_valid().to_numpy(zero_copy_only=False)
        out += [values[a:b] if ok else None for a, b, ok in zip(offsets[:-1], offsets[1:], valid)]
    return out


def _ids_as_text(table: pa.Table, path: Path) -> pa.Table:
    """The `prompt_id` column as text, read as a dataset's ids are (module docstring): `101` and `101.0`
    are "101"; a fraction, a null or another value refused with its row."""
    if "prompt_id" not in table.column_names:
        return table
    i = table.column_names.index("prompt_id")
    column = table.column(i)
    if column.null_count == 0 and (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return table
    if column.null_count == 0 and pa.types.is_integer(column.type):
        return table.set_column(i, "prompt_id", column.cast(pa.string()))
    ids = [_id(v, f"--completions {path}, {row_of(n)}") for n, v in enumerate(column.to_pylist())]
    return table.set_column(i, "prompt_id", pa.array(ids, pa.string()))


def _id(value: Any, where: str) -> str:
    """A completion's prompt id, by the rule a dataset's ids are read (`user_data.prompt_id_text`)."""
    try:
        return prompt_id_text(value, where)
    except DatasetError as e:
        raise ArtifactError(str(e)) from None


def _first_prompt_tokens(table: pa.Table) -> dict[int, tuple[int, ...]]:
    """Row -> prompt token ids, for each prompt's first row of a rollouts table (only those are read)."""
    first: dict[str, int] = {}
    for i, pid in enumerate(table.column("prompt_id").to_pylist()):
        first.setdefault(pid, i)
    rows = list(first.values())
    ids = table.column("prompt_token_ids").take(rows).to_pylist()
    return {i: tuple(v) for i, v in zip(rows, ids) if v is not None}


def check_prompts(prompts: dict[str, dict], completions: list[Completion], prompts_path: Path,
                  completions_path: Path) -> None:
    """Every completion's prompt is in the prompts file, is the prompt it was sampled from where that
    was recorded, and has a known task and an answer."""
    for i, c in enumerate(completions):
        if c.prompt_id not in prompts:
            raise ArtifactError(f"--completions {completions_path}: prompt {c.prompt_id!r}, {row_of(i)}, is "
                                f"not in --prompts {prompts_path} ({_ids_from(prompts)}; "
                                f"{_some_ids(prompts)})")
    check_sampled_from(prompts, completions, prompts_path, completions_path)
    for prompt_id in dict.fromkeys(c.prompt_id for c in completions):  # each prompt once
        row = prompts[prompt_id]
        if not has_scorer(row.get("task")):
            raise ArtifactError(f"--prompts {prompts_path}: prompt {prompt_id!r} "
                                f"{no_scorer(row.get('task'))}")
        if row.get("answer") is None and get_task(row["task"]).needs_answer:
            raise ArtifactError(f"--prompts {prompts_path}: prompt {prompt_id!r} has no answer (column "
                                "'answer'), so its completions cannot be scored")
        _check_metadata(row, prompts_path)


def _ids_from(prompts: dict[str, dict]) -> str:
    """Where a prompts file's ids come from: its column, or its name and rows (a dataset without one)."""
    if prompts and all(map(made_ids, prompts.values())):
        return "it has no 'prompt_id' values, so its ids were made from the file's name and row"
    return "column 'prompt_id'"


def _some_ids(prompts: dict[str, dict]) -> str:
    ids = list(prompts)
    shown = ", ".join(map(repr, ids[:3]))
    return f"its ids: {shown}" + (f", ... ({len(ids)} in all)" if len(ids) > 3 else "")


def check_sampled_from(prompts: dict[str, dict], completions: list[Completion], prompts_path: Path,
                       completions_path: Path) -> None:
    """Rollouts' completions answer the prompts of `prompts_path` (module docstring): by the prompt token
    ids where that file has them and the rollouts sampled those ids, else by the digest of each prompt's
    text or messages the rollouts record (ids remade for another model's tokenizer), else by the prompt
    the file the rollouts' metadata names holds."""
    unchecked = []
    digests = _recorded_digests(completions_path)
    for i, c in enumerate(completions):
        if c.prompt_token_ids is None:
            continue
        mine = prompts[c.prompt_id].get("prompt_token_ids")
        if not mine or (tuple(mine) != c.prompt_token_ids and c.prompt_id in (digests or {})):
            unchecked.append(c.prompt_id)  # no ids here, or ids remade from the text for their model
        elif tuple(mine) != c.prompt_token_ids:
            raise ArtifactError(f"--completions {completions_path}: prompt {c.prompt_id!r}, {row_of(i)}, was "
                                "sampled from other token ids (column 'prompt_token_ids') than --prompts "
                                f"{prompts_path} has for it, so the completions answer other prompts"
                                f"{_sampled_from(completions_path)}")
    if not unchecked:
        return
    if digests is not None:
        for pid in unchecked:
            if pid in digests and digests[pid] != prompts[pid].get("digest"):
                raise ArtifactError(f"--completions {completions_path}: prompt {pid!r} was sampled from "
                                    f"another prompt than --prompts {prompts_path} has under that id (the "
                                    "rollouts record a digest of each prompt's text or messages), so the "
                                    f"completions answer other prompts{_sampled_from(completions_path)}")
        return
    recorded = _recorded_prompts(completions_path)
    theirs = _prompt_rows(recorded, prompts_path)
    for pid in unchecked:
        if pid in theirs and not _same_prompt(theirs[pid], prompts[pid]):
            raise ArtifactError(f"--completions {completions_path}: prompt {pid!r} was sampled from "
                                f"{recorded} (the rollouts' metadata records it), whose prompt of that id is "
                                f"not the one --prompts {prompts_path} has, so the completions answer other "
                                f"prompts; give --prompts {recorded}")


def _recorded_digests(path: Path) -> dict[str, str] | None:
    """The prompt digests a rollouts artifact records (`PromptSet.digests`); None for one written before
    they were recorded, or from prompts that all had token ids."""
    try:
        digests = artifact_metadata(path).get("prompt_digests")
    except (ArtifactError, OSError, ValueError):
        return None
    return digests if isinstance(digests, dict) else None


def _recorded_prompts(path: Path) -> str | None:
    """The prompts file a rollouts artifact records it was sampled from."""
    try:
        recorded = artifact_metadata(path).get("prompts")
    except (ArtifactError, OSError, ValueError):
        return None
    return recorded if isinstance(recorded, str) and recorded and not is_stdio(recorded) else None


def _sampled_from(path: Path) -> str:
    recorded = _recorded_prompts(path)
    return f" (the rollouts record {recorded} as their prompts)" if recorded else ""


def _prompt_rows(recorded: str | None, prompts_path: Path) -> dict[str, dict]:
    """The rows of the prompts file a rollouts artifact names, by prompt id; none where it is not there
    (it was named relative to another folder, moved, or read from a pipe), cannot be read, or is the
    prompts file itself."""
    if recorded is None:
        return {}
    path = Path(recorded)
    try:
        if not (path.is_file() or path.is_dir()) or path.samefile(prompts_path):
            return {}
        return {r["prompt_id"]: r for r in PromptSet.read(path).rows}
    except (ValueError, OSError, pa.ArrowException):
        return {}


def _same_prompt(a: dict, b: dict) -> bool:
    """Two prompt rows hold the same prompt: their token ids where both have them, else their chat
    messages, else their text; rows that share none of these are not told apart."""
    for key in ("prompt_token_ids", "messages", "prompt"):
        x, y = a.get(key), b.get(key)
        if x and y:
            return list(x) == list(y) if key == "prompt_token_ids" else x == y
    return True


def _check_metadata(row: dict, path: Path) -> None:
    """The prompt's metadata is a JSON object (column 'metadata'; the scorers are handed it) that holds the
    keys its task's scorer reads."""
    try:
        meta = file_json(row.get("metadata") or "{}")
    except ValueError as e:
        raise ArtifactError(f"--prompts {path}: prompt {row['prompt_id']!r} has a column 'metadata' that "
                            f"cannot be read ({e}); expected a JSON object") from None
    if not isinstance(meta, dict):
        raise ArtifactError(f"--prompts {path}: prompt {row['prompt_id']!r} has a column 'metadata' that is "
                            "not a JSON object")
    keys = get_task(row["task"]).metadata_keys
    missing = [k for k in keys if k not in meta]
    if missing:
        raise ArtifactError(f"--prompts {path}: prompt {row['prompt_id']!r} of task {row['task']} lacks "
                            f"{', '.join(map(repr, missing))} in column 'metadata' (a JSON object), which "
                            "its scorer reads")


def data_source(metadata: str | dict | None) -> str | None:
    """A dataset row's data_source column (verl's), as text; None where it has none."""
    try:
        meta = file_json(metadata) if isinstance(metadata, str) else metadata
        value = (meta.get("columns") or {}).get("data_source")
    except (ValueError, AttributeError):
        return None
    return None if value is None else str(value)


def score_completions(prompts: dict[str, dict], completions: list[Completion],
                      workers: int | None = None) -> list[dict]:
    """Rows of the `rewards` artifact, in the completions' order."""
    items = [(prompts[c.prompt_id]["task"], c.text, prompts[c.prompt_id]["answer"],
              with_completion_ids(prompts[c.prompt_id].get("metadata"), c.token_ids)) for c in completions]
    judged = judge_batch(items, workers)
    return [{"prompt_id": c.prompt_id, "sample": c.sample, "task": item[0], "reward": j.reward,
             "status": j.status, "tests_passed": j.tests_passed, "tests_total": j.tests_total,
             "reward_extra": extra_json(j.extra, item[0], c.prompt_id, item[3])}
            for c, item, j in zip(completions, items, judged)]
