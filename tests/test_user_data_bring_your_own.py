"""A verl or TRL user's own data and rewards, read as their trainers read them: verl's `acc: bool` averaged
into the step metrics as numpy averages bools, multimodal datasets refused (Sparrow's models are
text-only), one rule for `prompt_id` in prompts and completions files (pandas' float64 ids), gzip input
named as such, and the reward-function conventions of verl (`compute_score` by default, 0-d tensors) and
TRL (GRPOTrainer's reward keywords). Expectations come from numpy, pandas, the trainers' documented
behaviour and hand-worked values, never from the code under test.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import pickle
import shlex
import subprocess

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact
from sparrow.stages.core.prompt_set import PromptError, PromptSet

from cli_checks import error_line

runner = CliRunner()


def _reward(*args):
    return runner.invoke(app, ["reward", *map(str, args)])


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rewards(path) -> list[tuple[str, float]]:
    return [(r["prompt_id"], r["reward"]) for r in read_artifact(path, "rewards").to_pylist()]


def _verl_gsm8k(path, problems=(("What is 7 + 8?", "15"), ("What is 2 + 3?", "5"))):
    pd.DataFrame([{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}],
                   "ability": "math", "reward_model": {"style": "rule", "ground_truth": a},
                   "extra_info": {"split": "train", "index": i}}
                  for i, (q, a) in enumerate(problems)]).to_parquet(path)
    return path


# ---------------------------------------------------------------- verl's acc: bool in the step metrics


def test_step_means_count_a_reward_dicts_bools_as_0_and_1_as_numpy_does():
    """verl/DAPO's `{"score", "acc": bool, "pred": str}`: acc is the accuracy curve verl logs (np.mean over
    the bools), so the step mean keeps it; text is still left out."""
    from sparrow.stages.train.metrics import reward_extra_means

    accs = [True, False, np.bool_(False), False]
    extras = [{"acc": a, "length": n, "pred": "7"} for a, n in zip(accs, (40, 50, 60, 50))]
    assert reward_extra_means(extras, {}) == {"acc": float(np.mean(accs)), "length": 50.0}
    assert float(np.mean(accs)) == 0.25


# ---------------------------------------------------------------- multimodal datasets


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _geo3k(path, *, images=True, placeholder=True):
    """verl's examples/data_preprocess/geo3k.py layout: `<image>` in the prompt, the image in `images`."""
    question = ("<image>" if placeholder else "") + "What shape is shown?"
    row = {"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": question}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
           "extra_info": {"split": "train", "index": 0}}
    if images:
        row["images"] = [{"bytes": _png(), "path": None}]
    pd.DataFrame([{"data_source": "x", "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
                   "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
                   **({"images": []} if images else {})}, row]).to_parquet(path)
    return path


@pytest.mark.parametrize("form", ["verl images and placeholder", "verl images", "trl image part",
                                  "trl image column"])
def test_a_multimodal_dataset_is_refused_naming_its_row(tmp_path, form):
    """Each multimodal form is refused in one sentence naming the file, the row (1: row 0 is text-only)
    and what it holds; nothing is sampled as text with the images dropped."""
    if form.startswith("verl"):
        path = _geo3k(tmp_path / "geo3k.parquet", images="images" in form, placeholder="placeholder" in form)
        said = "'images'"
    elif form == "trl image part":
        path = _jsonl(tmp_path / "vlm.jsonl", [
            {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "solution": "5"},
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Shape?"}]}],
             "solution": "5"}])
        said = "'image'"
    else:
        path = tmp_path / "vlm.parquet"
        image = {"bytes": _png(), "path": None}
        pd.DataFrame({"prompt": ["What is 2 + 3?", "Shape?"], "image": [None, image],
                      "solution": ["5", "5"]}).to_parquet(path)
        said = "'image'"
    with pytest.raises(PromptError) as e:
        PromptSet.read(path)
    message = str(e.value)
    assert message.startswith(f"{path}: row 1 (counting from 0)") and said in message
    assert "text-only" in message and "\n" not in message


def test_a_placeholder_word_in_a_text_dataset_without_media_is_text(tmp_path):
    """verl puts media only where a row has them; a question about HTML's <video> tag is a text prompt."""
    text = "Write an HTML page that embeds a clip with the <video> tag."
    path = _jsonl(tmp_path / "html.jsonl", [{"prompt": text, "solution": "ok"}])
    assert [r["prompt"] for r in PromptSet.read(path).rows] == [text]
    placeholder_only = _geo3k(tmp_path / "geo3k.parquet", images=False)
    assert len(PromptSet.read(placeholder_only).rows) == 2


def test_a_multimodal_dataset_is_refused_by_rollout_before_the_model_loads(tmp_path):
    from tiny_models import tiny_chat_llama

    model = tiny_chat_llama(tmp_path / "model")
    out = tmp_path / "geo.parquet"
    r = runner.invoke(app, ["rollout", "--model", model, "--prompts", str(_geo3k(tmp_path / "geo3k.parquet")),
                            "--reward", "math", "--samples", "1", "--max-new-tokens", "2", "-o", str(out)])
    line = error_line(r)
    assert "row 1 (counting from 0)" in line and "'images'" in line and "text-only" in line
    assert "loading model" not in r.output and not out.exists()


def test_an_empty_media_column_is_no_obstacle(tmp_path):
    path = tmp_path / "text.parquet"
    pd.DataFrame({"prompt": ["What is 2 + 3?"], "images": [[]], "solution": ["5"]}).to_parquet(path)
    assert [r["prompt"] for r in PromptSet.read(path).rows] == ["What is 2 + 3?"]


# ---------------------------------------------------------------- prompt ids


def test_pandas_float_ids_are_read_as_integers_on_both_sides(tmp_path):
    """A whole-number float id (pandas' float64 id column) is the integer's text in the prompts and in
    completions, JSON or Parquet, float or int: every pairing matches and is scored by math-verify."""
    data = tmp_path / "ids.parquet"
    pd.DataFrame({"prompt": ["What is 7 + 8?", "What is 9 - 4?"], "solution": ["15", "5"],
                  "prompt_id": [7.0, 9.0]}).to_parquet(data)
    assert pq.read_schema(data).field("prompt_id").type == "double"
    assert [r["prompt_id"] for r in PromptSet.read(data).rows] == [str(int(7.0)), str(int(9.0))]
    given = [(7, "\\boxed{15}"), (9.0, "\\boxed{4}")]
    json_ids = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": p, "text": t} for p, t in given])
    parquet_ids = tmp_path / "c.parquet"
    pd.DataFrame({"prompt_id": [7.0, 9.0], "text": [t for _, t in given]}).to_parquet(parquet_ids)
    for completions in (json_ids, parquet_ids):
        out = tmp_path / f"rw-{completions.suffix[1:]}.parquet"
        r = _reward("--prompts", data, "--completions", completions, "--reward", "math", "-o", out)
        assert r.exit_code == 0, r.output
        assert _rewards(out) == [("7", 1.0), ("9", 0.0)]


def test_a_null_id_in_a_column_of_ids_is_refused_naming_file_column_and_row(tmp_path):
    """pandas makes [7, None, 9] a float64 column with a null in row 1: refused, not given a made-up id."""
    data = tmp_path / "ids.parquet"
    pd.DataFrame({"prompt": ["What is 7 + 8?", "What is 9 - 4?", "What is 3 * 3?"],
                  "solution": ["15", "5", "9"], "prompt_id": [7, None, 9]}).to_parquet(data)
    with pytest.raises(PromptError) as e:
        PromptSet.read(data)
    message = str(e.value)
    assert str(data) in message and "row 1 (counting from 0)" in message and "'prompt_id'" in message
    assert "null" in message


@pytest.mark.parametrize("where", ["prompts", "completions jsonl", "completions parquet"])
def test_a_fractional_id_is_refused_on_either_side(tmp_path, where):
    good = pd.DataFrame({"prompt": ["What is 7 + 8?", "What is 9 - 4?"], "solution": ["15", "5"],
                         "prompt_id": ["7", "9"]})
    data = tmp_path / "ids.parquet"
    (good.assign(prompt_id=[7.0, 9.5]) if where == "prompts" else good).to_parquet(data)
    if where == "completions parquet":
        completions = tmp_path / "c.parquet"
        pd.DataFrame({"prompt_id": [7.0, 9.5], "text": ["15", "5"]}).to_parquet(completions)
    else:
        completions = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": 7, "text": "15"},
                                                    {"prompt_id": 9.5, "text": "5"}])
    out = tmp_path / "rw.parquet"
    line = error_line(_reward("--prompts", data, "--completions", completions, "--reward", "math", "-o", out))
    shown = {"prompts": f"{data}, row 1 (counting from 0)",
             "completions jsonl": f"{completions} line 2",
             "completions parquet": f"{completions}, row 1 (counting from 0)"}[where]
    assert shown in line and "'prompt_id'" in line and "9.5" in line and not out.exists()


def test_a_missing_id_names_where_the_ids_came_from(tmp_path):
    """A verl dataset has no prompt_id: the refusal says its ids were made from the file and row, and does
    not name a column it lacks."""
    data = _verl_gsm8k(tmp_path / "gsm8k.parquet")
    completions = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": 7, "text": "15"}])
    line = error_line(_reward("--prompts", data, "--completions", completions, "--reward", "math",
                              "-o", tmp_path / "rw.parquet"))
    assert "column 'prompt_id'" not in line and "file's name and row" in line and "'gsm8k-0'" in line


# ---------------------------------------------------------------- gzip


def test_gzip_input_is_named_and_the_command_given_gives_a_file_that_is_read(tmp_path):
    """`.jsonl.gz`, which `datasets` reads transparently: refused as gzip with a gunzip command, on either
    side; running the command gives files that score as the uncompressed ones do."""
    plain = _jsonl(tmp_path / "trl.jsonl", [{"prompt": "What is 7 + 8?", "solution": "15"}])
    data = tmp_path / "trl.jsonl.gz"
    data.write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    comps_plain = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": "trl-0", "text": "\\boxed{15}"}])
    completions = tmp_path / "c.jsonl.gz"
    completions.write_bytes(gzip.compress(comps_plain.read_bytes()))
    comps_plain.unlink()
    out = tmp_path / "rw.parquet"
    for args in (["--prompts", data, "--completions", completions],
                 ["--prompts", tmp_path / "trl.jsonl", "--completions", completions]):
        line = error_line(_reward(*args, "--reward", "math", "-o", out))
        assert "gzip-compressed" in line and "gunzip -c" in line and not out.exists()
        command = line[line.index("(gunzip -c") + 1:line.index(") and give")]
        subprocess.run(command, shell=True, check=True, cwd=tmp_path)
    assert shlex.split(command)[-1] == str(tmp_path / "c.jsonl")
    r = _reward("--prompts", tmp_path / "trl.jsonl", "--completions", tmp_path / "c.jsonl",
                "--reward", "math", "-o", out)
    assert r.exit_code == 0, r.output
    assert _rewards(out) == [("trl-0", 1.0)]


# ---------------------------------------------------------------- reward functions and --reward


def test_a_reward_file_alone_means_its_compute_score_and_0d_scores_are_read_by_item(tmp_path):
    """verl's custom_reward_function.name defaults to compute_score; verl's reward manager takes a 0-d
    tensor or array score by .item(): 0.75 and 0.25, as torch and numpy hold them."""
    fn = tmp_path / "my_reward.py"
    fn.write_text("import numpy as np\nimport torch\n\n"
                  "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    if extra_info['index'] == 0:\n"
                  "        return torch.tensor(0.75)\n"
                  "    return {'score': np.array(0.25), 'acc': False}\n")
    data = _verl_gsm8k(tmp_path / "gsm8k.parquet")
    completions = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": f"gsm8k-{i}", "text": "x"} for i in range(2)])
    out = tmp_path / "rw.parquet"
    r = _reward("--prompts", data, "--completions", completions, "--reward-fn", fn, "-o", out)
    assert r.exit_code == 0, r.output
    assert _rewards(out) == [("gsm8k-0", 0.75), ("gsm8k-1", 0.25)]
    meta = artifact_metadata(out)
    assert meta["reward_fn"] == f"{fn}:compute_score"
    assert meta["reward_fn_sha256"] == hashlib.sha256(fn.read_bytes()).hexdigest()


def test_a_module_path_is_answered_with_what_reward_fn_takes(tmp_path):
    data = _verl_gsm8k(tmp_path / "gsm8k.parquet")
    completions = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": "gsm8k-0", "text": "x"}])
    line = error_line(_reward("--prompts", data, "--completions", completions,
                              "--reward-fn", "myrewards.gsm:compute_score", "-o", tmp_path / "rw.parquet"))
    assert "no such file myrewards.gsm" in line and "dotted import path" in line


def test_trl_functions_are_not_given_the_completion_columns_grpo_trainer_leaves_out(tmp_path):
    """GRPOTrainer passes `key for key in inputs[0] if key not in ["prompt", "completion",
    "completion_ids"]`: a dataset's own `completion` column does not replace or join the sampled ones,
    and a function naming only the columns it reads is not refused for them."""
    record = tmp_path / "calls.pkl"
    fn = tmp_path / "trl_reward.py"
    fn.write_text("import pickle\n\n"
                  "def named(prompts, completions, solution, log_metric=None, log_extra=None):\n"
                  "    return [float(c == s) for c, s in zip(completions, solution)]\n\n"
                  "def kw(prompts, completions, **kwargs):\n"
                  f"    pickle.dump((completions, sorted(k for k in kwargs if not k.startswith('log_'))), "
                  f"open({str(record)!r}, 'wb'))\n"
                  "    return [0.0] * len(completions)\n")
    data = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "What is 7 + 8?", "completion": "15", "solution": "15",
                                            "completion_ids": [1, 2]}])
    completions = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": "sft-0", "text": "15"}])
    out = tmp_path / "rw.parquet"
    r = _reward("--prompts", data, "--completions", completions, "--reward-fn", f"{fn}:named", "-o", out)
    assert r.exit_code == 0, r.output
    assert _rewards(out) == [("sft-0", 1.0)]
    r = _reward("--prompts", data, "--completions", completions, "--reward-fn", f"{fn}:kw", "-o", out,
                "--force")
    assert r.exit_code == 0, r.output
    assert pickle.loads(record.read_bytes()) == (["15"], ["solution"])


def test_reward_names_take_any_case(tmp_path):
    data = _verl_gsm8k(tmp_path / "gsm8k.parquet")
    completions = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": "gsm8k-0", "text": "\\boxed{15}"},
                                                {"prompt_id": "gsm8k-1", "text": "\\boxed{4}"}])
    got = []
    for name in ("math", "MATH", "Math"):
        out = tmp_path / f"rw-{name}.parquet"
        r = _reward("--prompts", data, "--completions", completions, "--reward", name, "-o", out)
        assert r.exit_code == 0, r.output
        got.append(_rewards(out))
    assert got == [[("gsm8k-0", 1.0), ("gsm8k-1", 0.0)]] * 3
