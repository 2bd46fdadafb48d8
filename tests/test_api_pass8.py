"""The library entry points and the TRL path held to what TRL and the docs say: --raw-prompts text keeps
the BOS TRL's GRPOTrainer adds, a chat prompt ending with an assistant turn is framed as GRPOTrainer
frames it (by the CLI's reader and by SparseRollout alike), the TRL example refuses bad flags and a
missing extra in one line before the model loads, train names the file, flag and prompt that is too
long, an empty schedule: path is refused by the library as by the CLI, a threshold read from stdin is
recorded as `-`, and the engine's documented example runs while its wrong inputs are one sentence each."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, write_artifact
from sparrow.stages.core.prompt_set import PromptSet

from cli_checks import error_line
from tiny_models import tiny_chat_llama

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trl_grpo_sparse.py"
runner = CliRunner()

PREFILL = [{"role": "user", "content": "What is 7 + 8?"}, {"role": "assistant", "content": "The answer is"}]
TEXTS = ["What is 7 + 8?", "What is 9 - 4?"]


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from sparrow.stages.model.loading import embedded_checkpoint

    return AutoTokenizer.from_pretrained(embedded_checkpoint())


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer made to add a BOS (<|endoftext|>, id 0) to text, as Llama 3's adds one."""
    from transformers import AutoTokenizer

    from sparrow.stages.model.loading import embedded_checkpoint

    folder = tmp_path_factory.mktemp("bos")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (embedded_checkpoint() / name).exists():
            shutil.copy(embedded_checkpoint() / name, folder / name)
    spec = json.loads((folder / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return AutoTokenizer.from_pretrained(folder)


def _trl_tokenized(tokenizer, prompts: list) -> list[list[int]]:
    """TRL's GRPOTrainer._tokenize_prompts itself, on a stand-in for the trainer's state."""
    trl = pytest.importorskip("trl")
    state = SimpleNamespace(processing_class=tokenizer, _is_vlm=False, environment_factories=None, tools=None,
                            chat_template=None, chat_template_kwargs={})
    return [list(ids) for ids in trl.GRPOTrainer._tokenize_prompts(state, prompts)[0]]


def _text_prompts(tmp_path: Path) -> PromptSet:
    path = tmp_path / "std.parquet"
    pq.write_table(pa.table({"prompt": TEXTS, "solution": ["15", "5"]}), path)
    return PromptSet.read(path)


# ---------------------------------------------------------------------------------- prompt tokenization

def test_raw_prompts_keep_the_bos_the_tokenizer_adds(bos_tokenizer, tmp_path):
    raw = _text_prompts(tmp_path)
    raw.tokenize(bos_tokenizer, chat_template=False)
    want = [[0, *bos_tokenizer(t, add_special_tokens=False).input_ids] for t in TEXTS]
    assert raw.tokens == want and want[0][1:] == [1780, 314, 216, 39, 1232, 216, 40, 47]
    assert [r["prompt"] for r in raw.rows] == TEXTS  # the text is what the model was sent
    framed = _text_prompts(tmp_path)  # through the chat template: the template writes its own tokens
    framed.tokenize(bos_tokenizer)
    chat = bos_tokenizer.apply_chat_template([{"role": "user", "content": TEXTS[0]}],
                                             add_generation_prompt=True, tokenize=False)
    assert framed.tokens[0] == bos_tokenizer(chat, add_special_tokens=False).input_ids
    assert framed.tokens[0][0] != 0


def test_raw_prompts_are_what_trls_grpo_trainer_sends(bos_tokenizer, tmp_path):
    raw = _text_prompts(tmp_path)
    raw.tokenize(bos_tokenizer, chat_template=False)
    assert raw.tokens == _trl_tokenized(bos_tokenizer, TEXTS)


def _prefill_set(tmp_path: Path) -> PromptSet:
    path = tmp_path / "prefill.jsonl"
    path.write_text(json.dumps({"prompt": PREFILL, "answer": "15"}) + "\n")
    return PromptSet.read(path)


def test_a_final_assistant_turn_is_closed_and_a_new_one_opened(smol_tokenizer, tmp_path):
    prompts = _prefill_set(tmp_path)
    prompts.tokenize(smol_tokenizer)
    text = prompts.rows[0]["prompt"]
    assert text.endswith("<|im_start|>user\nWhat is 7 + 8?<|im_end|>\n<|im_start|>assistant\nThe answer is"
                         "<|im_end|>\n<|im_start|>assistant\n")
    assert smol_tokenizer.decode(prompts.tokens[0]) == text


def test_cli_and_sparse_rollout_frame_an_assistant_prefix_as_trl_does(smol_tokenizer, tmp_path):
    pytest.importorskip("trl")
    from sparrow.stages.integrations.trl import tokenize_prompts

    prompts = _prefill_set(tmp_path)
    prompts.tokenize(smol_tokenizer)
    trl_ids = _trl_tokenized(smol_tokenizer, [PREFILL])
    ours = tokenize_prompts([PREFILL], SimpleNamespace(processing_class=smol_tokenizer))
    assert prompts.tokens == trl_ids == [list(ids) for ids in ours]


# ---------------------------------------------------------------------------------- the TRL example

def _run_example(monkeypatch, capsys, *args: str, extra: bool = False) -> tuple[int, str, str]:
    """The example run in this process with `args`; without the extra (trl and datasets unimportable)
    unless `extra` -> (exit status, stdout, stderr)."""
    if not extra:
        monkeypatch.setitem(sys.modules, "trl", None)
        monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(sys, "argv", [EXAMPLE.name, *args])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr()
    return stopped.value.code, out.out, out.err


def test_trl_example_help_works_and_a_missing_extra_is_one_line(monkeypatch, capsys):
    code, out, err = _run_example(monkeypatch, capsys, "--help")
    assert code == 0 and out.startswith("usage: trl_grpo_sparse.py") and "--max-new-tokens" in out
    code, out, err = _run_example(monkeypatch, capsys, "--steps", "1", "--context", "160")
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == [
        "trl_grpo_sparse.py: error: this example needs trl and datasets (the bench extra), which are not "
        "installed; install them with: .venv/bin/uv pip install --python .venv/bin/python trl datasets"]
    install = ".venv/bin/uv pip install --python .venv/bin/python trl datasets"
    assert install in (ROOT / "docs" / "trl.md").read_text()  # the setup the docs give


def test_trl_example_refuses_flags_its_run_would_fail_on_before_the_model_loads(monkeypatch, capsys,
                                                                                smol_tokenizer):
    from sparrow.stages.tasks import TaskError, get_task

    measure = lambda user: len(smol_tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                                                  add_generation_prompt=True, tokenize=True,
                                                                  return_dict=True)["input_ids"])
    with pytest.raises(TaskError):  # 160 is the shortest passkey document
        list(get_task("passkey").generate(1, 0, measure, context_tokens=159))
    lengths = [measure(r.user) for r in get_task("passkey").generate(3, 0, measure, context_tokens=160)]
    window = 8192  # SmolLM2-135M's context
    cases = [
        (["--context", "100"], "--context must be at least 160, got 100"),
        (["--max-new-tokens", "9000"], f"--context 400 with --max-new-tokens 9000 exceeds smollm2-135m's "
                                       f"context of {window} tokens"),
        (["--prompts-per-step", "3", "--context", "160", "--max-new-tokens", str(window - 160 + 1)],
         f"--context 160 with --max-new-tokens {window - 160 + 1} exceeds smollm2-135m's context of "
         f"{window} tokens"),
        (["--schedule", ""], "--schedule is an empty path; give a schedule file"),
    ]
    assert max(lengths) <= 160  # the prompts made are at most --context tokens
    for args, message in cases:
        code, _, err = _run_example(monkeypatch, capsys, "--steps", "1", *args, extra=True)
        assert code == 2 and err.splitlines()[-1] == f"trl_grpo_sparse.py: error: {message}", err
        assert "Traceback" not in err


# ------------------------------------------------------------------------ train, sparsity, thresholds

def test_train_names_the_flag_file_and_prompt_that_is_too_long(tmp_path, smol_tokenizer):
    model = tiny_chat_llama(tmp_path / "tiny")  # a context of 512 tokens
    short, long_ = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    short.write_text(json.dumps({"prompt": "What is 1+1?", "answer": "2"}) + "\n")
    text = "word " * 600 + "What is 1+1?"
    long_.write_text("".join(json.dumps({"prompt": p, "answer": "2"}) + "\n" for p in ("What is 2+2?", text)))
    n = len(smol_tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
    base = ["train", "--model", model, "--reward", "math", "--steps", "1", "--prompts-per-step", "1",
            "--samples", "2", "--max-new-tokens", "8"]
    for flag, given in (("--eval-prompts", ["--prompts", str(short), "--eval-prompts", str(long_)]),
                        ("--prompts", ["--prompts", str(long_)])):
        out = tmp_path / f"run{flag}"
        line = error_line(runner.invoke(app, [*base, *given, "-o", str(out)]))
        assert line == (f"error: {flag} {long_}: prompt 'held-1' has {n} tokens, which with "
                        "--max-new-tokens 8 exceeds the model's context of 512; --filter-overlong-prompts "
                        "leaves such prompts out, --max-prompt-length with --truncation left|right|middle "
                        "cuts them")
        assert not out.exists()


def test_an_empty_schedule_path_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch):
    from sparrow.stages.core.sparsity import as_policy
    from sparrow.stages.integrations.trl import SparseRollout

    monkeypatch.chdir(tmp_path)
    for spec in ("schedule:", "schedule:   "):
        want = re.escape(f"sparsity {spec!r} is an empty path; give a schedule file, as in "
                         "schedule:run/schedule.parquet")
        with pytest.raises(ValueError, match=f"^{want}$"):
            as_policy(spec)
        with pytest.raises(ValueError, match=f"^{want}$"):
            SparseRollout(spec, bin_width=512)


def test_a_threshold_file_from_stdin_is_recorded_as_stdin(tmp_path):
    threshold = tmp_path / "th.parquet"
    write_artifact({"threshold": [0.5], "lower": [0.4], "upper": [0.6], "quantile": [0.05],
                    "source": ["calibrated"], "n_runs": [6], "n_collapsed": [2], "note": ["sweep"]},
                   threshold, "threshold", metadata={"model": "qwen3-4b"})
    for given, recorded in (("-", "calibrated, -"), (str(threshold), f"calibrated, {threshold}")):
        out = tmp_path / f"s{len(given)}.parquet"
        r = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--threshold-file", given,
                                "-o", str(out)], input=threshold.read_bytes() if given == "-" else None)
        assert r.exit_code == 0, r.output
        assert artifact_metadata(out)["threshold_source"] == recorded
        assert "sparrow-input-" not in r.output


# ---------------------------------------------------------------------------------- the engine's Python API

def test_the_engine_example_in_the_docs_runs_as_written():
    """The block as written, at fewer samples and tokens (as the README walk shrinks its commands)."""
    block = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "engine.md").read_text(), re.S).group(1)
    small = block.replace("n=8", "n=2").replace("max_new_tokens=64", "max_new_tokens=4")
    assert small.count("n=2") == 1 and small.count("max_new_tokens=4") == 1
    scope: dict = {}
    exec(compile(small, "docs/engine.md", "exec"), scope)
    results, loaded = scope["results"], scope["loaded"]
    assert len(results) == 1 and [c.sample for c in results[0]] == [0, 1]
    assert all(1 <= len(c.token_ids) <= 4 for c in results[0])
    assert results[0][0].prompt_token_ids == loaded.tokenizer("The capital of France is").input_ids


@pytest.fixture(scope="module")
def tiny():
    from sparrow.stages.model.loading import load_model

    return load_model("tiny-llama", random_weights=True)


def test_engine_wrong_inputs_are_one_sentence_each(tiny):
    from sparrow.stages.core.sparsity import as_policy
    from sparrow.stages.engine import Engine, EngineConfig, SamplingParams

    vocab = tiny.config.vocab_size
    with pytest.raises(TypeError, match=r"got LoadedModel; pass its decoder, the LoadedModel's \.model$"):
        Engine(tiny, as_policy(None))
    with pytest.raises(TypeError, match=r"policy must be a KVPolicy or None \(dense\), got 64"):
        Engine(tiny.model, 64)
    params = SamplingParams(n=2, max_new_tokens=3, temperature=0.0)
    engine = Engine(tiny.model, as_policy(None), EngineConfig(max_batch=4))
    wrong = [
        (["hello"], TypeError, r"^prompt 0 is text \('hello'\); the engine takes token ids"),
        ("hello", TypeError, r"^generate takes a list of prompts, each a list of token ids, not text"),
        ([1, 2], TypeError, r"^prompt 0 is not a sequence of token ids \(got int 1\)"),
        ([[1, 2], [1.5, 2.0]], TypeError, r"^prompt 1 holds something other than whole token ids"),
        ([[1, 2], [vocab]], ValueError, rf"^prompt 1 has token id {vocab}, but the model's vocabulary has "
                                        rf"{vocab} tokens"),
        ([[-5, 3]], ValueError, rf"^prompt 0 has token id -5, but the model's vocabulary has {vocab} tokens"),
        ([[]], ValueError, r"^prompt 0 is empty"),
    ]
    for prompts, kind, message in wrong:
        with pytest.raises(kind, match=message):
            engine.generate(prompts, params)
        assert not engine.has_work()  # nothing of the good prompts before it was queued
    with pytest.raises(ValueError, match="^generate got 1 SamplingParams for 2 prompts"):
        engine.generate([[1, 2], [3]], [params])
    good = engine.generate([np.array([1, 2, 3]), (4, 5)], params)
    fresh = Engine(tiny.model, as_policy(None), EngineConfig(max_batch=4)).generate([[1, 2, 3], [4, 5]],
                                                                                   params)
    assert [[c.token_ids for c in g] for g in good] == [[c.token_ids for c in g] for g in fresh]


def test_as_policy_refuses_a_budget_that_is_not_a_whole_number():
    from sparrow.stages.core.sparsity import as_policy

    for value in (64.5, True, [64]):
        want = f"^sparsity {re.escape(repr(value))} is not a whole number of tokens"
        with pytest.raises(TypeError, match=want):
            as_policy(value)
    assert as_policy(np.int64(64)).spec() == as_policy(64).spec() == "budget:64"


def test_budget_0_is_refused_alike_as_an_int_a_spec_and_a_flag():
    """Dense is None or 'dense'; 0 is not a budget in any of the three forms (schedules' 0 is dense)."""
    from sparrow.stages.core.sparsity import as_policy, sparsity_from_flags

    for value in (0, np.int64(0)):
        with pytest.raises(ValueError, match="^budget 0 is dense attention, not a block top-k budget; "
                                             "dense is None or 'dense'$"):
            as_policy(value)
    with pytest.raises(ValueError, match="^sparsity 'budget:0' is dense attention, not a block top-k budget; "
                                         "say 'dense'$"):
        as_policy("budget:0")
    with pytest.raises(ValueError, match="^--budget: budget 0 is dense attention, not a block top-k budget$"):
        sparsity_from_flags(None, 0, False)
    assert as_policy(None).spec() == as_policy("dense").spec() == "dense"


@pytest.mark.parametrize("field, value, named", [
    ("n", 0, "n must be at least 1 (samples per prompt), got 0"),
    ("top_k", -1, "top_k must be >= 0 (0: off), got -1"),
    ("logprobs", -2, "logprobs must be >= 0, got -2"),
    ("max_new_tokens", 0, "max_new_tokens must be at least 1, got 0"),
])
def test_sampling_params_name_the_field_that_is_wrong(field, value, named):
    from sparrow.stages.engine.sequence import SamplingParams

    with pytest.raises(ValueError) as raised:
        SamplingParams(**{field: value})
    assert str(raised.value) == named
