"""Trajectories to profile: prompts and their generated tokens, from a rollouts file of any sampler.

Design decisions:
- A `sparrow rollout` artifact is read and validated whole (`read_artifact(path, "rollouts")`); its
  metadata gives the sampling temperature and how the tokens were sampled.
- A Parquet file from another tool (DuckDB, pandas, polars: no Sparrow metadata) is read by its
  columns against the rollouts schema with only what scoring needs required: `prompt_id`,
  `token_ids` and, per row, `prompt_token_ids` or the prompt's text in a `prompt` column (encoded by
  the model's tokenizer, as prompts files are; it must be the text the sampler encoded). `sample`
  defaults to the row's rank within its prompt; `logprobs`, `budgets`, `finish_reason`, `text` and
  `reward` are checked when present and not needed. Other columns are dropped.
- Everything that can be wrong with the file (a column, a repeated sample, a prompt without token ids
  and no tokenizer, a token id outside the vocabulary, a sequence longer than the model's context) is
  found before any scoring, as one sentence (`ArtifactError`) that names the file and the column.
- Rows without generated tokens have nothing to score and are skipped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa

from sparrow.schemas import (
    SCHEMAS,
    ArtifactError,
    ArtifactSpec,
    Col,
    artifact_kind,
    artifact_metadata,
    read_artifact,
)
from sparrow.schemas.footer import read_parquet

NEEDED = ("prompt_id", "token_ids")
FOREIGN_ROLLOUTS = ArtifactSpec(
    "rollouts",
    "a rollouts file from another sampler, read by its columns",
    (
        Col("prompt", pa.string(), nullable=True),
        *(replace(c, nullable=c.name not in NEEDED) for c in SCHEMAS["rollouts"].columns),
    ),
)


@dataclass(frozen=True)
class Trajectory:
    prompt_id: str
    sample: int
    prompt: list[int]
    completion: list[int]  # the generated token ids


@dataclass
class RolloutsFile:
    path: Path
    rows: list[dict]  # prompt_id, sample, prompt (text), prompt_token_ids (None: text only), token_ids
    temperature: float | None  # the sampling temperature its metadata records
    sampler: str | None  # how it was sampled, as its metadata says, in --sampler's words
    speculate: int | None = None  # drafts per cycle of exact speculative sampling (the drafts' sampler above)
    truncated: str | None = None  # "top_p 0.9", "top_k 20": drawn from a cut of the softmax; None: all of it

    @property
    def needs_tokenizer(self) -> bool:
        return any(r["prompt_token_ids"] is None for r in self.rows)

    def trajectories(self, tokenizer, vocab_size: int, context: int) -> list[Trajectory]:
        """The rows as trajectories, text prompts encoded by `tokenizer`, checked against the model."""
        out = []
        for r in self.rows:
            prompt = r["prompt_token_ids"]
            if prompt is None:
                if tokenizer is None:
                    raise ArtifactError(
                        f"{self.path}: {_which(r)} has no 'prompt_token_ids', only the prompt's text in "
                        "column 'prompt', and the model has no tokenizer; write the prompt token ids"
                    )
                prompt = tokenizer(r["prompt"], add_special_tokens=False).input_ids
            t = Trajectory(r["prompt_id"], r["sample"], list(prompt), list(r["token_ids"]))
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
        if len(t.prompt) + len(t.completion) > context:
            raise ArtifactError(
                f"{self.path}: {_which(vars(t))} has {len(t.prompt)} prompt and {len(t.completion)} "
                f"generated tokens (columns 'prompt_token_ids' and 'token_ids'), more than the model's "
                f"context of {context}"
            )


def read_rollouts(path: str | os.PathLike) -> RolloutsFile:
    """Read and validate a rollouts file (see the module docstring) before any model is loaded."""
    path = Path(path)
    if artifact_kind(path) is not None:
        table = read_artifact(path, "rollouts")
        meta = artifact_metadata(table)
        temperature = meta.get("temperature")
        sampler, speculate = sampler_words(meta.get("sparsity"))
        return RolloutsFile(path, _rows(table, path), None if temperature is None else float(temperature),
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


def _read_foreign(path: Path) -> pa.Table:
    table = read_parquet(path)
    subject = f"{path} (read as 'rollouts' by its columns)"
    table = table.select([c for c in table.column_names if c in FOREIGN_ROLLOUTS.names])
    if "prompt_token_ids" not in table.column_names and "prompt" not in table.column_names:
        raise ArtifactError(
            f"{subject} lacks column 'prompt_token_ids' (or 'prompt' with the prompt's "
            "text), which profiling needs"
        )
    return FOREIGN_ROLLOUTS.conform(table, subject, fill_missing=True)


def _rows(table: pa.Table, path: Path) -> list[dict]:
    """Rows with generated tokens; samples numbered where the file has none; repeats refused."""
    cols = [
        c
        for c in ("prompt_id", "sample", "prompt", "prompt_token_ids", "token_ids")
        if c in table.column_names
    ]
    rows, seen, rank = [], set(), {}
    for i, r in enumerate(table.select(cols).to_pylist()):
        r.setdefault("prompt", None)
        if not r["prompt_token_ids"]:
            if not r["prompt"]:
                raise ArtifactError(
                    f"{path}: row {i} (prompt {r['prompt_id']!r}) has neither "
                    "'prompt_token_ids' nor the prompt's text in column 'prompt'"
                )
            r["prompt_token_ids"] = None
        if r["sample"] is None:
            r["sample"] = rank.get(r["prompt_id"], 0)
        rank[r["prompt_id"]] = max(rank.get(r["prompt_id"], 0), r["sample"] + 1)
        key = (r["prompt_id"], r["sample"])
        if key in seen:
            raise ArtifactError(f"{path}: row {i} repeats {_which(r)} (columns 'prompt_id' and 'sample')")
        seen.add(key)
        if r["token_ids"]:
            rows.append(r)
    if not rows:
        raise ArtifactError(
            f"{path} has no generated tokens in column 'token_ids', so there is nothing to profile"
        )
    return rows


def _which(row: dict) -> str:
    return f"prompt {row['prompt_id']!r} sample {row['sample']}"
