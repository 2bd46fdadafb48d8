"""`train --top-k/--top-p`: the rollouts are sampled from the truncated distribution, as TRL's and verl's
top_k/top_p sample them."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import torch
import transformers
from typer.testing import CliRunner

from sparrow.cli.app import app

from tiny_models import tiny_chat_llama

runner = CliRunner()
REWARD = "def reward(prompts, completions, **kwargs):\n    return [0.5] * len(completions)\n"


def test_train_top_k_1_samples_each_group_greedily(tmp_path):
    """--top-k 1 at temperature 1 keeps only the most likely token: step 1's samples (the adapter starts
    as the base model) are, in every group, transformers' greedy continuation of the chat-formatted prompt."""
    model = tiny_chat_llama(tmp_path / "model")
    fn = tmp_path / "reward.py"
    fn.write_text(REWARD)
    questions = ["What is 2 + 2?", "Name a colour."]
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "--model", model, "--prompts", str(data), "--reward-fn", f"{fn}:reward",
                            "--steps", "1", "--prompts-per-step", "2", "--samples", "3",
                            "--max-new-tokens", "5", "--ignore-eos", "--top-k", "1", "-o", str(run)])
    assert r.exit_code == 0, r.output
    assert json.loads((run / "checkpoint" / "config.json").read_text())["top_k"] == 1
    rows = pq.read_table(next((run / "mismatch").glob("step=*.parquet"))).to_pylist()
    sampled: dict[tuple[str, int], list[int]] = {}
    for row in sorted(rows, key=lambda x: (x["prompt_id"], x["sample"], x["position"])):
        sampled.setdefault((row["prompt_id"], row["sample"]), []).append(row["token_id"])
    tok = transformers.AutoTokenizer.from_pretrained(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    greedy = []
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
        out = hf.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
        greedy.append(out[0, ids.shape[1]:].tolist())
    groups = {}
    for (pid, _), tokens in sampled.items():
        groups.setdefault(pid, []).append(tokens)
    assert len(groups) == 2 and all(len(g) == 3 for g in groups.values())
    assert sorted(g[0] for g in groups.values()) == sorted(greedy)
    assert all(all(t == g[0] for t in g) for g in groups.values())
