"""Rewards of any sampler's completions (`sparrow reward`): each completion scored by its prompt's task.

Design decisions:
- Completions come from anywhere: our `rollouts` artifact, any Parquet file (DuckDB, pandas, vLLM
  scripts) or JSONL, read by their columns: `prompt_id` and `text` are needed, `sample` is optional (the
  row's rank within its prompt by default); other columns are ignored. A Sparrow artifact of another
  kind is refused.
- Everything that can be wrong (a column, a missing text, a prompt id the prompts file lacks, a
  prompt without a known task or an answer, a repeated sample) is found before anything is scored,
  as one sentence naming the file, the row and the column.
- Scoring is `judge_batch`: code tasks' programs run in a pool of sandboxes. Each row says why it got
  its reward (`status`; for code tasks also the tests passed of the tests run), so a timeout, an output
  kill, a crash, a missing function and a partial pass tell apart.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq

from sparrow.schemas import ArtifactError, ArtifactSpec, Col, artifact_kind, read_artifact
from sparrow.schemas.artifacts import first_line

from . import TASKS, get_task, has_scorer, judge_batch
from .base import row_of

COMPLETIONS = ArtifactSpec("completions", "completions of any sampler, read by their columns", (
    Col("prompt_id", pa.string()),
    Col("sample", pa.int32(), nullable=True, range="[0, inf)"),
    Col("text", pa.string(), nullable=True),
))


@dataclass(frozen=True)
class Completion:
    prompt_id: str
    sample: int
    text: str


def _is_jsonl(path: Path) -> bool:
    if path.suffix in (".jsonl", ".ndjson", ".json"):
        return True
    with open(path, "rb") as f:
        return f.read(1) in (b"{", b"[")


def _table(path: Path) -> pa.Table:
    if not path.exists():
        raise ArtifactError(f"--completions {path}: no such file")
    if path.is_dir():
        raise ArtifactError(f"--completions {path} is a directory; give a Parquet or JSONL file")
    if _is_jsonl(path):
        try:
            return pj.read_json(path)
        except (pa.ArrowException, OSError) as e:
            raise ArtifactError(f"--completions {path} is not JSON lines ({first_line(e)})") from None
    kind = artifact_kind(path)
    if kind == "rollouts":
        return read_artifact(path, "rollouts")
    if kind is not None:
        raise ArtifactError(f"--completions {path} is a '{kind}' artifact; give rollouts, or any Parquet "
                            "or JSONL file with columns 'prompt_id' and 'text'")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ArtifactError(f"--completions {path} is a corrupt Parquet file ({first_line(e)})") from None


def read_completions(path: str | os.PathLike) -> list[Completion]:
    """The completions of a file (module docstring), validated; samples numbered where the file has none."""
    path = Path(path)
    table = _table(path)
    subject = f"--completions {path} (read by its columns)"
    if "text" not in table.column_names:
        raise ArtifactError(f"{subject} lacks column 'text' (the completion's text, which is scored)")
    table = COMPLETIONS.conform(table.select([c for c in table.column_names if c in COMPLETIONS.names]),
                                subject, fill_missing=True)
    out, seen, rank = [], set(), {}
    for i, r in enumerate(table.to_pylist()):
        if r["text"] is None:
            raise ArtifactError(f"--completions {path}: {row_of(i)}, prompt {r['prompt_id']!r}, has no text "
                                "in column 'text'")
        sample = rank.get(r["prompt_id"], 0) if r["sample"] is None else r["sample"]
        rank[r["prompt_id"]] = max(rank.get(r["prompt_id"], 0), sample + 1)
        if (r["prompt_id"], sample) in seen:
            raise ArtifactError(f"--completions {path}: {row_of(i)} repeats prompt {r['prompt_id']!r} sample "
                                f"{sample} (columns 'prompt_id' and 'sample')")
        seen.add((r["prompt_id"], sample))
        out.append(Completion(r["prompt_id"], sample, r["text"]))
    if not out:
        raise ArtifactError(f"--completions {path} holds no completions")
    return out


def check_prompts(prompts: dict[str, dict], completions: list[Completion], prompts_path: Path,
                  completions_path: Path) -> None:
    """Every completion's prompt is in the prompts file with a known task and an answer."""
    for i, c in enumerate(completions):
        row = prompts.get(c.prompt_id)
        if row is None:
            raise ArtifactError(f"--completions {completions_path}: prompt {c.prompt_id!r}, {row_of(i)}, is "
                                f"not in --prompts {prompts_path} (column 'prompt_id')")
        if not has_scorer(row.get("task")):
            raise ArtifactError(f"--prompts {prompts_path}: prompt {c.prompt_id!r} has task "
                                f"{row.get('task')!r}, which has no scorer (known: {', '.join(TASKS)}; a "
                                "verl or TRL dataset is scored by --reward or --reward-fn)")
        if row.get("answer") is None and get_task(row["task"]).needs_answer:
            raise ArtifactError(f"--prompts {prompts_path}: prompt {c.prompt_id!r} has no answer (column "
                                "'answer'), so its completions cannot be scored")
        _check_metadata(row, prompts_path)


def _check_metadata(row: dict, path: Path) -> None:
    """The metadata keys the prompt's task scorer reads are there (a JSON object in column 'metadata')."""
    keys = get_task(row["task"]).metadata_keys
    if not keys:
        return
    try:
        meta = json.loads(row.get("metadata") or "{}")
    except ValueError:
        meta = None
    missing = [k for k in keys if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ArtifactError(f"--prompts {path}: prompt {row['prompt_id']!r} of task {row['task']} lacks "
                            f"{', '.join(map(repr, missing))} in column 'metadata' (a JSON object), which "
                            "its scorer reads")


def score_completions(prompts: dict[str, dict], completions: list[Completion],
                      workers: int | None = None) -> list[dict]:
    """Rows of the `rewards` artifact, in the completions' order."""
    items = [(prompts[c.prompt_id]["task"], c.text, prompts[c.prompt_id]["answer"],
              prompts[c.prompt_id].get("metadata")) for c in completions]
    judged = judge_batch(items, workers)
    return [{"prompt_id": c.prompt_id, "sample": c.sample, "task": item[0], "reward": j.reward,
             "status": j.status, "tests_passed": j.tests_passed, "tests_total": j.tests_total,
             "reward_extra": json.dumps(j.extra, default=str, sort_keys=True) if j.extra else None}
            for c, item, j in zip(completions, items, judged)]
