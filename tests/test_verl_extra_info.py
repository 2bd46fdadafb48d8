"""A verl `compute_score` gets the `extra_info` verl's reward manager passes: a copy of the row's extra_info
as a dict, `{}` where the column is missing or null (verl's RLHFDataset), with the `num_turns` and
`rollout_reward_scores` keys verl's NaiveRewardManager adds; what one call changes in it reaches no other.

Reference: verl's naive reward manager, written out here:
    extra_info = dict(non_tensor_batch.get("extra_info") or {})
    extra_info["num_turns"] = non_tensor_batch.get("__num_turns__")  # 2 from the single-turn agent loop
    extra_info["rollout_reward_scores"] = non_tensor_batch.get("reward_scores", {})
"""

from __future__ import annotations

import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact

runner = CliRunner()

RECORDING = '''\
import pickle
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    calls = pickle.load(open(OUT, "rb")) if OUT.exists() else []
    calls.append(dict(extra_info))
    pickle.dump(calls, open(OUT, "wb"))
    extra_info["scribbled"] = True  # must not reach the next sample of the same row
    return {"score": float(ground_truth in solution_str), "split": extra_info.get("split")}
'''


def verl_manager_extra_info(stored):
    """What verl's naive reward manager passes for a row whose extra_info is `stored`."""
    extra = dict(stored or {})
    extra["num_turns"] = 2
    extra["rollout_reward_scores"] = {}
    return extra


def run_reward(tmp_path, rows):
    """`sparrow reward` of two samples per row with the recording compute_score -> (calls, rewards)."""
    data = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    calls = tmp_path / "calls.pkl"
    fn = tmp_path / "vr.py"
    fn.write_text(f"from pathlib import Path\nOUT = Path({str(calls)!r})\n" + RECORDING)
    completions = tmp_path / "c.jsonl"
    samples = [{"prompt_id": f"gsm8k-{i}", "sample": s, "text": "#### 5"}
               for i in range(len(rows)) for s in (0, 1)]
    completions.write_text("".join(json.dumps(c) + "\n" for c in samples))
    out = tmp_path / "rw.parquet"
    result = runner.invoke(app, ["reward", "--prompts", str(data), "--completions", str(completions),
                                 "--reward-fn", str(fn), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return pickle.loads(calls.read_bytes()), read_artifact(out, "rewards").to_pylist()


def row(extra_info=..., truth="5"):
    r = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth}}
    if extra_info is not ...:
        r["extra_info"] = extra_info
    return r


def test_no_extra_info_column_gives_verls_dict(tmp_path):
    calls, rewards = run_reward(tmp_path, [row()])
    assert calls == [verl_manager_extra_info(None)] * 2
    assert [r["reward"] for r in rewards] == [1.0, 1.0]


def test_a_null_extra_info_gives_verls_dict_and_a_struct_is_copied(tmp_path):
    stored = {"split": "train", "index": 0}
    calls, rewards = run_reward(tmp_path, [row(stored), row(None)])
    assert calls == [verl_manager_extra_info(stored)] * 2 + [verl_manager_extra_info(None)] * 2
    assert [json.loads(r["reward_extra"])["split"] for r in rewards] == ["train", "train", None, None]
