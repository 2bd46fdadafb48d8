"""`sparrow reward` and `profile`/`distill --rollouts` read of a rollouts file only the columns they use, and
refuse a row longer than the model's context from the first bounded batch that holds it.

Expectations are written by hand or read back with pyarrow alone; which columns and batches are read is
recorded by wrapping the readers, not timed.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import sparrow.schemas.footer as footer
import sparrow.schemas.io as io
import sparrow.stages.core.trajectories as trajectories
from sparrow.cli.app import app
from sparrow.schemas import ArtifactError, read_artifact, write_artifact
from sparrow.stages.core.trajectories import Trajectory, read_rollouts

from cli_checks import error_line

runner = CliRunner()
PROMPT = {"a": [5, 6, 7], "b": [8, 9]}


def _rollouts(path, samples: list[tuple[str, list[int]]], texts: list[str] | None = None):
    """A rollouts artifact of `samples` (prompt id, generated ids), numbered within their prompts."""
    seen: dict[str, int] = {}
    rows = []
    for i, (pid, ids) in enumerate(samples):
        seen[pid] = seen.get(pid, -1) + 1
        rows.append({"prompt_id": pid, "sample": seen[pid], "prompt_token_ids": PROMPT[pid], "token_ids": ids,
                     "text": texts[i] if texts else None, "logprobs": [-0.5] * len(ids),
                     "budgets": [64] * len(ids), "finish_reason": "length", "reward": None,
                     "kv_lens": list(range(1, len(ids) + 1))})
    return write_artifact(rows, path, "rollouts", {"temperature": 0.7})


@pytest.fixture
def reads(monkeypatch):
    """The file and columns of every whole read (`read_parquet`), and the number of bounded batches read."""
    seen = {"whole": [], "batches": 0}
    whole, batches = footer.read_parquet, footer.parquet_batches

    def read_parquet(path, columns=None):
        seen["whole"].append((path.name, None if columns is None else list(columns)))
        return whole(path, columns)

    def parquet_batches(path, columns=None):
        for batch in batches(path, columns):
            seen["batches"] += 1
            yield batch

    for module in (io, trajectories):
        monkeypatch.setattr(module, "read_parquet", read_parquet, raising=False)
        monkeypatch.setattr(module, "parquet_batches", parquet_batches, raising=False)
    return seen


# ------------------------------------------------------------------------------------------ reward


def _prompts(path):
    rows = [{"prompt_id": pid, "task": "kv_lookup", "prompt": None, "prompt_token_ids": ids, "answer": "4417",
             "metadata": None} for pid, ids in PROMPT.items()]
    return write_artifact(rows, path, "prompts")


def test_reward_reads_only_the_columns_it_scores_and_writes_the_same_rewards(tmp_path, reads):
    texts = ["The answer is 4417.", "The answer is 12.", "4417", "I do not know."]
    rollouts = _rollouts(tmp_path / "r.parquet", [("a", [1] * 40), ("a", [2] * 30), ("b", [3] * 50),
                                                   ("b", [4] * 20)], texts)
    out = tmp_path / "rewards.parquet"
    result = runner.invoke(app, ["reward", "--prompts", str(_prompts(tmp_path / "p.parquet")),
                                 "--completions", str(rollouts), "-o", str(out), "-f", "csv"])
    assert result.exit_code == 0, result.output
    got = read_artifact(out, "rewards").select(["prompt_id", "sample", "task", "reward"]).to_pylist()
    assert got == [{"prompt_id": "a", "sample": 0, "task": "kv_lookup", "reward": 1.0},
                   {"prompt_id": "a", "sample": 1, "task": "kv_lookup", "reward": 0.0},
                   {"prompt_id": "b", "sample": 0, "task": "kv_lookup", "reward": 1.0},
                   {"prompt_id": "b", "sample": 1, "task": "kv_lookup", "reward": 0.0}]
    read = [c for name, columns in reads["whole"] if name == "r.parquet" for c in (columns or ["all"])]
    # the token ids too, a user's TRL function's completion_ids; never the logprobs, budgets or kv_lens
    assert sorted(read) == ["prompt_id", "prompt_token_ids", "sample", "text", "token_ids"], reads["whole"]


def test_reward_still_refuses_completions_of_other_prompt_ids(tmp_path, reads):
    rollouts = tmp_path / "r.parquet"
    table = read_artifact(_rollouts(rollouts, [("a", [1, 2]), ("b", [3])], ["4417", "4417"]))
    ids = pa.array([[5, 6, 7], [8, 0]], pa.list_(pa.int32()))
    write_artifact(table.set_column(table.column_names.index("prompt_token_ids"), "prompt_token_ids", ids),
                   rollouts, "rollouts")
    prompts = _prompts(tmp_path / "p.parquet")
    result = runner.invoke(app, ["reward", "--prompts", str(prompts), "--completions", str(rollouts),
                                 "-o", str(tmp_path / "w.parquet")])
    assert error_line(result) == (
        f"error: --completions {rollouts}: prompt 'b', row 1 (counting from 0), was sampled from other token "
        f"ids (column 'prompt_token_ids') than --prompts {prompts} has for it, so the completions answer "
        "other prompts")
    assert not (tmp_path / "w.parquet").exists()


# ------------------------------------------------------------------------- profile/distill --rollouts


def _long_first(tmp_path, n: int = 12):
    """Row 0 of prompt 'a' holds 3 + 20 ids; every other row 3 + 2."""
    return _rollouts(tmp_path / "long.parquet", [("a", [1] * 20)] + [("a", [1, 2])] * (n - 1))


def test_a_row_longer_than_the_context_is_refused_from_the_first_batch(tmp_path, reads, monkeypatch):
    path = _long_first(tmp_path)
    monkeypatch.setattr(footer, "BATCH_BYTES", 1)  # a batch of one row
    with pytest.raises(ArtifactError) as refused:
        read_rollouts(path, context=16)
    assert str(refused.value) == (
        f"{path}: prompt 'a' sample 0 has 3 prompt and 20 generated tokens (columns 'prompt_token_ids' and "
        "'token_ids'), more than the model's context of 16")
    assert reads["batches"] == 1 and reads["whole"] == []


def test_the_refusal_names_a_later_row_by_its_rank_within_its_prompt(tmp_path, reads, monkeypatch):
    """Another tool's file without samples: the 3rd row of prompt 'a' (file row 3) is sample 2."""
    path = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"prompt_id": ["a", "a", "b", "a", "b"],
                             "prompt_token_ids": [[5, 6, 7], [5, 6, 7], [8, 9], [5, 6, 7], [8, 9]],
                             "token_ids": [[1], [2], [3], [4] * 14, [5] * 30]}), path)
    monkeypatch.setattr(footer, "BATCH_BYTES", 1)
    with pytest.raises(ArtifactError, match="prompt 'a' sample 2 has 3 prompt and 14 generated tokens"):
        read_rollouts(path, context=16)
    assert reads["batches"] == 4  # rows 0-3, one a batch: row 4 (also too long) is never read


def test_without_the_context_only_the_columns_profiling_uses_are_held(tmp_path, reads, monkeypatch):
    path = _long_first(tmp_path)
    monkeypatch.setattr(footer, "BATCH_BYTES", 1)
    given = read_rollouts(path)
    assert reads["whole"] == [] and len(given.rows) == 12 and given.temperature == 0.7
    with pytest.raises(ArtifactError, match="prompt 'a' sample 0 has 3 prompt and 20 generated tokens"):
        given.trajectories(None, 100, 16)


class Words:
    """A tokenizer of one id per word (the word's length)."""

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [len(w) for w in text.split()]})()


def test_trajectories_are_the_files_rows_across_batches(tmp_path, monkeypatch):
    """Another tool's file read a row a batch: samples ranked across batches, rows without generated
    tokens skipped, a text prompt encoded; the same trajectories as its rows read with pyarrow."""
    path = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({
        "prompt_id": ["a", "b", "a", "c", "a"],
        "sample": pa.array([None, 4, None, None, 7], pa.int64()),
        "prompt": [None, None, None, "one three", None],
        "prompt_token_ids": [[5, 6, 7], [8, 9], [5, 6, 7], None, [5, 6, 7]],
        "token_ids": [[1, 2], [3], [], [4, 4, 4], [9]],
        "logprobs": [[-0.1, -0.2], [-0.3], [], [-1.0] * 3, [-0.5]],
    }), path)
    monkeypatch.setattr(footer, "BATCH_BYTES", 1)
    given = read_rollouts(path, context=16)
    assert given.needs_tokenizer
    assert given.trajectories(Words(), 10, 16) == [
        Trajectory("a", 0, [5, 6, 7], [1, 2]),
        Trajectory("b", 4, [8, 9], [3]),
        Trajectory("c", 0, [3, 5], [4, 4, 4]),
        Trajectory("a", 7, [5, 6, 7], [9]),
    ]  # row 2, prompt 'a' sample 1, has no generated tokens
    with pytest.raises(ArtifactError, match="prompt 'b' sample 4 has token id 9 in column "
                                            "'prompt_token_ids', but the model's vocabulary has 9 tokens"):
        given.trajectories(Words(), 9, 16)


def test_a_hole_in_another_tools_prompt_ids_is_refused(tmp_path):
    """A text prompt may stand in for a row's prompt ids (a null list), but a null inside the ids is a hole:
    one sentence naming the file, the column and the row, never float ids."""
    path = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"prompt_id": ["a", "b", "c"],
                             "prompt_token_ids": pa.array([[4, 5], None, [1, None, 3]], pa.list_(pa.int32())),
                             "prompt": [None, "hi", None],
                             "token_ids": pa.array([[7], [8], [9]], pa.list_(pa.int32()))}), path)
    with pytest.raises(ArtifactError) as e:
        read_rollouts(path).trajectories(None, vocab_size=50, context=100)
    assert str(e.value) == (f"{path} (read as 'rollouts' by its columns) has 1 null element inside the lists "
                            "of column 'prompt_token_ids' (first: in row 2)")
