"""Trajectories to profile: prompts and their generated tokens, from a rollouts file of any sampler.

Design decisions:
- A `sparrow rollout` artifact is checked whole a bounded batch of rows at a time (`check_artifact`);
  its metadata gives the sampling temperature and how the tokens were sampled.
- A Parquet file from another tool (DuckDB, pandas, polars: no Sparrow metadata) is read by its
  columns against the rollouts schema with only what scoring needs required: `prompt_id`,
  `token_ids` and, per row, `prompt_token_ids` or the prompt's text in a `prompt` column (encoded by
  the model's tokenizer, as prompts files are; it must be the text the sampler encoded). `sample`
  defaults to the row's rank within its prompt; `logprobs`, `budgets`, `finish_reason`, `text` and
  `reward` are checked when present and not needed. Other columns are dropped.
- Only the columns profiling reads are then held (`READ`), a batch at a time: ids and samples as Python
  values, the token ids as Arrow lists (4 bytes a token) that become Python lists only as trajectories.
  The logprobs, budgets and KV lengths of a rollout, most of its file, are never held.
- Everything that can be wrong with the file (a column, a repeated sample, a prompt without token ids
  and no tokenizer, a token id outside the vocabulary, a sequence longer than the model's context) is
  found before any scoring, as one sentence (`ArtifactError`) that names the file and the column.
  A sequence longer than the context is found first, from the lengths of the two id lists: given the
  context (`read_rollouts(path, context)`), a bounded batch at a time before the file is checked, so
  that a file of GBs whose first rows are too long is refused at once.
- Rows without generated tokens have nothing to score and are skipped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from sparrow.schemas import (
    SCHEMAS,
    ArtifactError,
    ArtifactSpec,
    Col,
    artifact_kind,
    artifact_metadata,
    artifact_parts,
    check_artifact,
)
from sparrow.schemas.artifacts import no_null_elements
from sparrow.schemas.footer import parquet_batches, read_schema
from sparrow.schemas.io import column_reader

NEEDED = ("prompt_id", "token_ids")
IDS = ("prompt_token_ids", "token_ids")
READ = ("prompt_id", "sample", "prompt", *IDS)  # what profiling reads; an artifact has no 'prompt'
FOREIGN_ROLLOUTS = ArtifactSpec(
    "rollouts",
    "a rollouts file from another sampler, read by its columns",
    (
        Col("prompt", pa.string(), nullable=True),
        *(replace(c, nullable=c.name not in NEEDED) for c in SCHEMAS["rollouts"].columns),
    ),
    rules=(no_null_elements("prompt_token_ids"),),  # a text prompt may stand in for the ids, not a hole
)
Batch = pa.Table | pa.RecordBatch


@dataclass(frozen=True)
class Trajectory:
    prompt_id: str
    sample: int
    prompt: list[int]
    completion: list[int]  # the generated token ids


@dataclass
class RolloutsFile:
    path: Path
    # prompt_id, sample, prompt (text), prompt_token_ids (None: text only) and token_ids, the ids as Arrow
    # lists (`pa.ListScalar`)
    rows: list[dict]
    temperature: float | None  # the sampling temperature its metadata records
    sampler: str | None  # how it was sampled, as its metadata says, in --sampler's words
    speculate: int | None = None  # drafts per cycle of exact speculative sampling (the drafts' sampler above)
    truncated: str | None = None  # "top_p 0.9", "top_k 20": drawn from a cut of the softmax; None: all of it

    @property
    def needs_tokenizer(self) -> bool:
        return any(r["prompt_token_ids"] is None for r in self.rows)

    def trajectories(self, tokenizer, vocab_size: int, context: int) -> list[Trajectory]:
        """The rows as trajectories, text prompts encoded by `tokenizer`, checked against the model: the
        lengths of rows with prompt ids first, before any list is made or text encoded."""
        for r in self.rows:
            if r["prompt_token_ids"] is not None:
                _check_length(self.path, r, len(r["prompt_token_ids"]), len(r["token_ids"]), context)
        out = []
        for r in self.rows:
            prompt = r["prompt_token_ids"]
            if prompt is None:
                if tokenizer is None:
                    raise ArtifactError(
                        f"{self.path}: {_which(r)} has no 'prompt_token_ids', only the prompt's text in "
                        "column 'prompt', and the model has no tokenizer; write the prompt token ids"
                    )
                ids = list(tokenizer(r["prompt"], add_special_tokens=False).input_ids)
            else:
                ids = _ints(prompt)
            t = Trajectory(r["prompt_id"], r["sample"], ids, _ints(r["token_ids"]))
            self._check(t, vocab_size, context)
            out.append(t)
        return out

    def _check(self, t: Trajectory, vocab_size: int, context: int) -> None:
        for column, ids in (("prompt_token_ids", t.prompt), ("token_ids", t.completion)):
            top = max(ids, default=0)
            if top >= vocab_size:
                raise ArtifactError(
                    f"{self.path}: {_which(vars(t))} has token id {top} in column '{column}', but the "
                    f"model's vocabulary has {vocab_size} tokens (were the ids made with another "
                    "tokenizer?)"
                )
        _check_length(self.path, vars(t), len(t.prompt), len(t.completion), context)


def _check_length(path: Path, row: dict, prompt: int, generated: int, context: int) -> None:
    if prompt + generated > context:
        raise ArtifactError(
            f"{path}: {_which(row)} has {prompt} prompt and {generated} "
            f"generated tokens (columns 'prompt_token_ids' and 'token_ids'), more than the model's "
            f"context of {context}"
        )


def read_rollouts(path: str | os.PathLike, context: int | None = None) -> RolloutsFile:
    """Read and validate a rollouts file (see the module docstring) before any model is loaded; given the
    model's `context`, a row longer than it is refused before the file is checked."""
    path = Path(path)
    kind = artifact_kind(path)
    if context is not None and kind in (None, "rollouts"):
        _refuse_longer(path, context)
    if kind is not None:
        check_artifact(path, "rollouts")
        meta = artifact_metadata(path)
        temperature = meta.get("temperature")
        sampler, speculate = sampler_words(meta.get("sparsity"))
        batches = column_reader(path, "rollouts", [c for c in READ if c != "prompt"])
        return RolloutsFile(path, _rows(batches, path), None if temperature is None else float(temperature),
                            sampler, speculate, _truncation(meta))
    return RolloutsFile(path, _rows(_read_foreign(path), path), None, None)


def _truncation(meta: dict) -> str | None:
    """How a rollouts artifact's sampling cut the softmax (top-p below 1, top-k above 0); None: it did not."""
    top_p, top_k = meta.get("top_p"), meta.get("top_k")
    cut = ([f"top_p {float(top_p):g}"] if top_p is not None and float(top_p) < 1 else []) + \
        ([f"top_k {int(top_k)}"] if top_k is not None and int(top_k) > 0 else [])
    return ", ".join(cut) or None


def sampler_words(sparsity: str | None) -> tuple[str | None, int | None]:
    """A rollouts artifact's `sparsity` ("budget 48", "schedule FILE", "speculative, budget 48 drafts 2 a
    cycle") -> (its sampler in --sampler's words, the drafts per cycle when it speculated)."""
    if sparsity is None:
        return None, None
    text, speculate = str(sparsity), None
    match = re.fullmatch(r"speculative, (.+) drafts (\d+) a cycle", text)
    if match:
        text, speculate = match.group(1), int(match.group(2))
    return text.replace(" ", ":", 1), speculate  # "budget 48" -> "budget:48"


def _read_foreign(path: Path) -> Iterator[pa.Table]:
    """Another tool's file checked by its columns a batch at a time, then its `READ` columns a batch at a
    time, of the schema's types."""
    schema = read_schema(path)
    subject = f"{path} (read as 'rollouts' by its columns)"
    known = pa.schema([f for f in schema if f.name in FOREIGN_ROLLOUTS.names])
    if "prompt_token_ids" not in known.names and "prompt" not in known.names:
        raise ArtifactError(
            f"{subject} lacks column 'prompt_token_ids' (or 'prompt' with the prompt's "
            "text), which profiling needs"
        )
    FOREIGN_ROLLOUTS.check_batches(known, parquet_batches(path, known.names), subject)
    read = [c for c in READ if c in known.names]
    for batch in parquet_batches(path, read):
        yield FOREIGN_ROLLOUTS.conform(batch, subject, fill_missing=True).select(read)


def _refuse_longer(path: Path, context: int) -> None:
    """The first row whose prompt and generated ids are more than `context` tokens, refused from the two
    lists' lengths a bounded batch at a time; a file whose columns are not those of rollouts is left to
    its check."""
    rank: dict[str, int] = {}
    for part in artifact_parts(path) if path.is_dir() else [path]:
        schema = read_schema(part)
        if not _lengths_readable(schema):
            return
        for batch in parquet_batches(part, [c for c in ("prompt_id", "sample", *IDS) if c in schema.names]):
            prompt, generated = (pc.list_value_length(batch.column(c)) for c in IDS)
            over = pc.and_(pc.greater(pc.add(prompt, generated), context),
                           pc.and_(pc.greater(prompt, 0), pc.greater(generated, 0)))
            first = pc.index(over, True).as_py()
            end = batch.num_rows if first < 0 else first + 1
            ids = batch.column("prompt_id").slice(0, end).to_pylist()
            given = batch.column("sample").slice(0, end).to_pylist() if "sample" in schema.names \
                else [None] * end
            samples = [_ranked(rank, prompt_id, sample) for prompt_id, sample in zip(ids, given)]
            if first >= 0:
                row = {"prompt_id": ids[first], "sample": samples[first]}
                _check_length(path, row, prompt[first].as_py(), generated[first].as_py(), context)


def _lengths_readable(schema: pa.Schema) -> bool:
    """Whether `schema` has the columns `_refuse_longer` reads, of types it reads."""
    types = {f.name: f.type for f in schema}
    ids = types.get("prompt_id", pa.null())
    return (all(pa.types.is_list(types.get(c, pa.null())) for c in IDS)
            and (pa.types.is_string(ids) or pa.types.is_large_string(ids))
            and pa.types.is_integer(types.get("sample", pa.int32())))


def _ranked(rank: dict[str, int], prompt_id: str, sample: int | None) -> int:
    """The row's sample: its own, else its rank within its prompt (`rank`, updated)."""
    if sample is None:
        sample = rank.get(prompt_id, 0)
    rank[prompt_id] = max(rank.get(prompt_id, 0), sample + 1)
    return sample


def _rows(batches: Iterable[Batch], path: Path) -> list[dict]:
    """Rows with generated tokens; samples numbered where the file has none; repeats refused."""
    rows, seen, rank, i = [], set(), {}, 0
    for batch in batches:
        values = {c: batch.column(c).to_pylist() if c in batch.column_names else [None] * batch.num_rows
                  for c in ("prompt_id", "sample", "prompt")}
        prompt_lengths, lengths = (pc.list_value_length(batch.column(c)).to_pylist() if c in
                                   batch.column_names else [None] * batch.num_rows for c in IDS)
        for j in range(batch.num_rows):
            r = {c: values[c][j] for c in values}
            if not prompt_lengths[j] and not r["prompt"]:
                raise ArtifactError(
                    f"{path}: row {i} (prompt {r['prompt_id']!r}) has neither "
                    "'prompt_token_ids' nor the prompt's text in column 'prompt'"
                )
            r["sample"] = _ranked(rank, r["prompt_id"], r["sample"])
            key = (r["prompt_id"], r["sample"])
            if key in seen:
                raise ArtifactError(f"{path}: row {i} repeats {_which(r)} (columns 'prompt_id' and 'sample')")
            seen.add(key)
            if lengths[j]:
                r["prompt_token_ids"] = batch.column("prompt_token_ids")[j] if prompt_lengths[j] else None
                r["token_ids"] = batch.column("token_ids")[j]
                rows.append(r)
            i += 1
    if not rows:
        raise ArtifactError(
            f"{path} has no generated tokens in column 'token_ids', so there is nothing to profile"
        )
    return rows


def _ints(ids: pa.ListScalar) -> list[int]:
    return ids.values.to_numpy(zero_copy_only=False).tolist()


def _which(row: dict) -> str:
    return f"prompt {row['prompt_id']!r} sample {row['sample']}"
