"""`sparrow profile` end to end on SmolLM2, checked against numpy, DuckDB and the invariants; and on a
tiny model, profiling a rollouts artifact (ours, or DuckDB's) against profiling that samples itself."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.model.loading import load_model
from sparrow.stages.profile import ProfileOptions, run_profile, sample_trajectories, summarize

from cli_checks import error_line
from tiny_models import tiny_qwen3

runner = CliRunner()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, smollm2):
    tok = smollm2.tokenizer
    rows = []
    for i, n in enumerate((40, 70)):
        text = " ".join(f"item {j}: the {['red', 'blue', 'green'][j % 3]} box" for j in range(n))
        ids = tok(tok.apply_chat_template([{"role": "user", "content": text + " Which box is item 5?"}],
                                          add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False).input_ids
        rows.append({"prompt_id": f"p{i}", "task": "test", "prompt": None, "prompt_token_ids": ids,
                     "answer": "red", "metadata": None})
    path = tmp_path_factory.mktemp("profile") / "prompts.parquet"
    write_artifact(rows, path, "prompts")
    return path


@pytest.fixture(scope="module")
def profiled(prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile-out") / "mismatch.parquet"
    r = runner.invoke(app, ["profile", "--prompts", str(prompts_file), "--budgets", "64,128,4096",
                            "--samples", "2", "--max-new-tokens", "24", "--bin-width", "256",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out, read_artifact(out, "mismatch")


def test_rows_and_invariants(profiled):
    _, t = profiled
    d = t.to_pandas()
    assert set(d.budget) == {64, 128, 4096}
    per_budget = d.groupby("budget").size()
    assert per_budget.nunique() == 1 and per_budget.iloc[0] == len(d[d.budget == 64])
    full = d[d.budget == 4096]  # covers every sequence: sparse must equal dense
    assert np.all(np.abs(full.alpha - 1) <= 1e-5)
    assert np.abs(full.logp_sparse - full.logp_dense).max() <= 1e-5
    small = d[d.budget == 64]
    assert small.alpha.min() < 0.999
    assert (d.bin == d.position // 256).all()
    r = d.logp_dense - d.logp_sparse
    assert np.allclose(d.log_ratio, r, atol=1e-6)
    assert np.allclose(d.k3, np.exp(r) - 1 - r, atol=1e-5)
    assert np.allclose(d.k2, r**2 / 2, atol=1e-6)
    # the first generated token comes from the dense prefill: alpha is exactly 1 there
    first = d.groupby(["prompt_id", "sample", "budget"]).position.transform("min") == d.position
    assert np.all(np.abs(d[first].alpha - 1) <= 1e-6)


def test_tail_matches_numpy_and_sql(profiled):
    path, t = profiled
    summary = summarize(t, 0.05).to_pandas().set_index(["bin", "budget"])
    d = t.to_pandas()
    for (b, budget), g in d.groupby(["bin", "budget"]):
        assert summary.loc[(b, budget), "tail_alpha"] == pytest.approx(
            np.percentile(g.alpha.to_numpy(np.float64), 5), abs=1e-9)
    r = runner.invoke(app, ["sql", "SELECT bin, budget, quantile_cont(alpha, 0.05) AS p5 FROM mismatch "
                            "GROUP BY ALL ORDER BY ALL", "--run", str(path.parent), "--format", "csv"])
    assert r.exit_code == 0, r.output
    lines = [line.split(",") for line in r.stdout.strip().splitlines()[1:]]
    for b, budget, p5 in lines:
        assert float(p5) == pytest.approx(summary.loc[(int(b), int(budget)), "tail_alpha"], abs=1e-6)


def test_metadata(profiled):
    _, t = profiled
    meta = artifact_metadata(t)
    assert int(meta["bin_width"]) == 256 and meta["model"] == "smollm2-135m"


@pytest.mark.parametrize("args,expected", [
    (["--model", "nope"], "unknown model"),
    (["--budgets", "100"], "not a multiple of the page size"),
    (["--budgets", "32"], "below three pages"),
    (["--sampler", "budget:40"], "not a multiple"),
    (["--sampler", "sparse"], "--sampler must be"),
])
def test_bad_input(prompts_file, tmp_path, args, expected):
    out = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--prompts", str(prompts_file), "-o", str(out), *args])
    assert r.exit_code != 0
    assert expected in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_wrong_kind_and_empty_prompts(profiled, tmp_path):
    mismatch, _ = profiled
    r = runner.invoke(app, ["profile", "--prompts", str(mismatch), "-o", str(tmp_path / "m.parquet")])
    assert r.exit_code != 0 and "mismatch" in r.output and "prompts" in r.output
    empty = tmp_path / "empty.parquet"
    write_artifact({"prompt_id": [], "task": [], "prompt": [], "prompt_token_ids": [], "answer": [],
                    "metadata": []}, empty, "prompts")
    r = runner.invoke(app, ["profile", "--prompts", str(empty), "-o", str(tmp_path / "m.parquet")])
    assert r.exit_code != 0 and "empty" in r.output


# ------------------------------------------- one sampler: the engine; profiling given rollouts (issue 11.3)

TINY_ROLLOUT = ["--samples", "2", "--max-new-tokens", "32", "--temperature", "0.8", "--seed", "3"]
TINY_OPTS = dict(samples=2, max_new_tokens=32, temperature=0.8, seed=3, sampler="budget:48")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-layer Qwen3 checkpoint without a tokenizer: layer 2 is sparse beside the dense layers 0-1."""
    path = tmp_path_factory.mktemp("tiny-profile")
    tiny_qwen3(path)
    return path


@pytest.fixture(scope="module")
def tiny_prompts(tmp_path_factory):
    rng = np.random.default_rng(1)
    rows = [{"prompt_id": f"t{i}", "task": "test", "prompt": None, "answer": None, "metadata": None,
             "prompt_token_ids": rng.integers(3, 300, n).tolist()} for i, n in enumerate((70, 130))]
    return write_artifact(rows, tmp_path_factory.mktemp("tiny-prompts") / "prompts.parquet", "prompts")


@pytest.fixture(scope="module")
def engine_rollouts(tiny, tiny_prompts, tmp_path_factory):
    """`sparrow rollout` at budget 48, then `sparrow profile --rollouts` over its artifact."""
    folder = tmp_path_factory.mktemp("tiny-rollouts")
    rollouts, mismatch = folder / "rollouts.parquet", folder / "mismatch.parquet"
    r = runner.invoke(app, ["rollout", "--model", str(tiny), "--prompts", str(tiny_prompts), "--budget", "48",
                            *TINY_ROLLOUT, "--max-batch", "3", "-o", str(rollouts)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["profile", "--model", str(tiny), "--rollouts", str(rollouts),
                            "--budgets", "48,64", "-o", str(mismatch)])
    assert r.exit_code == 0, r.output
    return rollouts, mismatch


def _tiny_prompt_tokens(tiny_prompts):
    rows = read_artifact(tiny_prompts, "prompts").to_pylist()
    return [r["prompt_id"] for r in rows], [r["prompt_token_ids"] for r in rows]


def _sorted(table):
    return table.to_pandas().sort_values(["prompt_id", "sample", "budget", "position"]).reset_index(drop=True)


def test_profile_of_engine_rollouts_equals_profile_sampling_itself(tiny, tiny_prompts, engine_rollouts):
    rollouts, mismatch = engine_rollouts
    given = _sorted(read_artifact(mismatch, "mismatch"))
    ids, tokens = _tiny_prompt_tokens(tiny_prompts)
    opts = ProfileOptions(budgets=[48, 64], batch_size=2, **TINY_OPTS)
    sampled = _sorted(run_profile(load_model(str(tiny)), ids, tokens, opts))
    keys = ["prompt_id", "sample", "budget", "position", "token_id"]
    assert given[keys].equals(sampled[keys])
    for col in ("alpha", "logp_dense", "logp_sparse", "entropy_dense"):
        assert np.abs(given[col] - sampled[col]).max() <= 1e-5, col
    assert given.alpha.min() < 0.999  # layer 2's sparsity changed something
    # the rollout's own logprobs are the teacher-forced ones under its budget
    rows = read_artifact(rollouts, "rollouts").to_pylist()
    logp = np.concatenate([r["logprobs"] for r in sorted(rows, key=lambda r: (r["prompt_id"], r["sample"]))])
    assert np.abs(given[given.budget == 48].logp_sparse.to_numpy() - logp).max() <= 1e-4
    meta = artifact_metadata(mismatch)
    assert meta["temperature"] == 0.8 and meta["sampler"] == "budget:48" and meta["rollouts"] == str(rollouts)
    assert "seed" not in meta and "samples" not in meta  # sampling options did not apply


def test_trajectories_do_not_depend_on_batch_size(tiny, tiny_prompts):
    loaded = load_model(str(tiny))
    ids, tokens = _tiny_prompt_tokens(tiny_prompts)
    opts = TINY_OPTS | {"max_new_tokens": 16}
    runs = [sample_trajectories(loaded, ids, tokens, ProfileOptions(budgets=[48], batch_size=b, **opts))
            for b in (1, 3)]
    assert runs[0] == runs[1]
    assert [(t.prompt_id, t.sample) for t in runs[0]] == [("t0", 0), ("t0", 1), ("t1", 0), ("t1", 1)]
    other = sample_trajectories(loaded, ids, tokens, ProfileOptions(budgets=[48], **(opts | {"seed": 4})))
    assert [t.completion for t in other] != [t.completion for t in runs[0]]


def test_duckdb_written_rollouts_are_profiled(tiny, engine_rollouts, tmp_path):
    """Only the needed columns, BIGINT ids, no `sample` (numbered per prompt) and a column of its own."""
    import duckdb

    rollouts, mismatch = engine_rollouts
    duck = tmp_path / "duck.parquet"
    duckdb.sql(f"COPY (SELECT prompt_id, prompt_token_ids::BIGINT[] AS prompt_token_ids, "
               f"token_ids::BIGINT[] AS token_ids, 'vllm' AS engine FROM read_parquet('{rollouts}') "
               f"ORDER BY prompt_id, sample) TO '{duck}' (FORMAT parquet)")
    out = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--model", str(tiny), "--rollouts", str(duck), "--budgets", "48,64",
                            "--temperature", "0.8", "-o", str(out)])
    assert r.exit_code == 0, r.output
    ours, theirs = _sorted(read_artifact(mismatch, "mismatch")), _sorted(read_artifact(out, "mismatch"))
    assert ours.drop(columns="alpha").equals(theirs.drop(columns="alpha"))
    assert np.abs(ours.alpha - theirs.alpha).max() <= 1e-6
    assert "sampler" not in artifact_metadata(out)


def _write_bad_rollouts(rollouts, change: str, path) -> None:
    """Token ids that do not fit the model in a Sparrow artifact; missing columns in a foreign file."""
    t = read_artifact(rollouts, "rollouts")
    if change in ("outside vocabulary", "longer than context"):
        write_artifact(_changed_ids(t, change), path, "rollouts")
    else:
        pq.write_table(_foreign(t, change), path)


def _foreign(t: pa.Table, change: str) -> pa.Table:
    t = t.replace_schema_metadata(None)
    if change == "no token_ids":
        return t.drop_columns(["token_ids"])
    if change == "no prompt":
        return t.select(["prompt_id", "token_ids"])
    if change == "text, no tokenizer":
        return pa.table({"prompt_id": ["a"], "prompt": ["What is 2 + 3?"], "token_ids": [[5, 6]]})
    raise ValueError(change)


def _changed_ids(t: pa.Table, change: str) -> pa.Table:
    if change == "outside vocabulary":
        ids = t["token_ids"].to_pylist()
        ids[1][-1] = 999
        return t.set_column(t.column_names.index("token_ids"), "token_ids", pa.array(ids))
    prompts = t["prompt_token_ids"].to_pylist()
    prompts[2] = prompts[2] * 4
    return t.set_column(t.column_names.index("prompt_token_ids"), "prompt_token_ids", pa.array(prompts))


@pytest.mark.parametrize("change,expected", [
    ("no token_ids", "lacks column 'token_ids'"),
    ("no prompt", "lacks column 'prompt_token_ids' (or 'prompt' with the prompt's text)"),
    ("outside vocabulary", "has token id 999 in column 'token_ids', but the model's vocabulary has 300"),
    ("longer than context", "(columns 'prompt_token_ids' and 'token_ids'), more than the model's context "
                            "of 512"),
    ("text, no tokenizer", "has no 'prompt_token_ids', only the prompt's text in column 'prompt', and the "
                           "model has no tokenizer"),
])
def test_bad_rollouts_are_one_sentence_before_any_scoring(tiny, engine_rollouts, tmp_path, change, expected):
    path, out = tmp_path / "bad.parquet", tmp_path / "m.parquet"
    _write_bad_rollouts(engine_rollouts[0], change, path)
    r = runner.invoke(app, ["profile", "--model", str(tiny), "--rollouts", str(path), "-o", str(out)])
    line = error_line(r)
    assert str(path) in line and expected in line
    assert not out.exists()


@pytest.mark.parametrize("args,expected", [
    (["--prompts", "{prompts}"], "not both"),
    ([], "give one of --prompts"),
    (["--samples", "8"], "--samples applies only when sampling from --prompts"),
    (["--speculate", "2"], "--speculate applies only when sampling from --prompts"),
    (["--temperature", "1.0"], "sampled at temperature 0.8 (its metadata), but --temperature 1 was given"),
])
def test_rollouts_flags(tiny, tiny_prompts, engine_rollouts, tmp_path, args, expected):
    source = ["--rollouts", str(engine_rollouts[0])] if args else []
    args = [a.format(prompts=tiny_prompts) for a in args]
    out = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--model", str(tiny), *source, *args, "-o", str(out)])
    assert r.exit_code != 0 and expected in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_a_prompts_file_is_not_rollouts(tiny, tiny_prompts, tmp_path):
    r = runner.invoke(app, ["profile", "--model", str(tiny), "--rollouts", str(tiny_prompts),
                            "-o", str(tmp_path / "m.parquet")])
    assert r.exit_code != 0 and "is a 'prompts' artifact, expected 'rollouts'" in r.output


def test_speculative_profile_samples_the_dense_models_trajectories(tiny, tiny_prompts, tmp_path):
    """--speculate: budget 48 only drafts, so greedy trajectories are the dense sampler's; sampled ones are
    `sparrow rollout --speculate`'s of the same seed, and the artifact records K."""
    loaded = load_model(str(tiny))
    ids, tokens = _tiny_prompt_tokens(tiny_prompts)
    greedy = TINY_OPTS | {"temperature": 0.0, "samples": 1}
    dense = sample_trajectories(loaded, ids, tokens,
                                ProfileOptions(budgets=[48], **(greedy | {"sampler": "dense"})))
    drafted = ProfileOptions(budgets=[48], speculate=3, **greedy)
    assert sample_trajectories(loaded, ids, tokens, drafted) == dense
    rollouts, out = tmp_path / "r.parquet", tmp_path / "m.parquet"
    source = ["--model", str(tiny), "--prompts", str(tiny_prompts), "--speculate", "2", *TINY_ROLLOUT]
    r = runner.invoke(app, ["rollout", *source, "--budget", "48", "-o", str(rollouts)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["profile", *source, "--budgets", "48", "--sampler", "budget:48", "-o", str(out)])
    assert r.exit_code == 0, r.output
    rows = read_artifact(rollouts, "rollouts").to_pylist()
    rows.sort(key=lambda x: (x["prompt_id"], x["sample"]))
    assert any(not all(r["accepted"][1:]) for r in rows)  # some drafts were rejected
    profiled = _sorted(read_artifact(out, "mismatch"))
    assert profiled.token_id.tolist() == [t for r in rows for t in r["token_ids"]]
    meta = artifact_metadata(out)
    assert int(meta["speculate"]) == 2 and meta["sampler"] == "budget:48"


def test_draft_alpha_is_scored_beside_the_lossy_alpha(tiny, tiny_prompts, tmp_path):
    """--draft-alpha adds each token's alpha for a speculative draft (queries over the dense KV); without
    the flag the column is null and the rest of the artifact is the same. In the tiny model the one sparse
    layer comes after the dense ones, so the keys the lossy pass writes there are the dense ones and the
    two alphas agree (tests/test_mismatch.py holds a draft's alpha to its definition where they differ)."""
    source = ["profile", "--model", str(tiny), "--prompts", str(tiny_prompts), "--budgets", "48",
              *TINY_ROLLOUT]
    plain, drafted = tmp_path / "m.parquet", tmp_path / "d.parquet"
    assert runner.invoke(app, [*source, "-o", str(plain)]).exit_code == 0
    r = runner.invoke(app, [*source, "--draft-alpha", "-o", str(drafted)])
    assert r.exit_code == 0, r.output
    without, withd = _sorted(read_artifact(plain, "mismatch")), _sorted(read_artifact(drafted, "mismatch"))
    assert without.alpha_draft.isna().all() and withd.alpha_draft.notna().all()
    assert withd.alpha.tolist() == without.alpha.tolist()
    assert withd.alpha_draft.tolist() == withd.alpha.tolist() and (withd.alpha < 0.999).any()


@pytest.mark.parametrize("args,expected", [
    (["--speculate", "2"], "--speculate drafts with the block top-k sampler"),
    (["--speculate", "-1", "--sampler", "budget:48"], "--speculate must be >= 0"),
    (["--speculate", "2", "--sampler", "budget:48", "--adapter", "{prompts}"], "drop one of them"),
    (["--draft-alpha", "--adapter", "{prompts}"], "--draft-alpha scores the drafts of exact speculative"),
    (["--draft-alpha", "--kv-compression", "snapkv"], "--draft-alpha scores block top-k drafts"),
])
def test_speculative_profile_refusals(tiny, tiny_prompts, tmp_path, args, expected):
    args = [a.format(prompts=tiny_prompts) for a in args]
    out = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--model", str(tiny), "--prompts", str(tiny_prompts), *args,
                            "-o", str(out)])
    assert r.exit_code != 0 and expected in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_a_rollouts_artifacts_sampler_in_the_words_of_sampler():
    """`sparrow rollout` names its sampler in prose ("budget 48", "speculative, budget 64 drafts 3 a cycle");
    a profile of those rollouts records it as --sampler would, and how many drafts a cycle made."""
    from sparrow.stages.core.trajectories import sampler_words

    assert sampler_words("dense") == ("dense", None)
    assert sampler_words("budget 48") == ("budget:48", None)
    assert sampler_words("schedule /runs/a b.parquet") == ("schedule:/runs/a b.parquet", None)
    assert sampler_words("speculative, budget 64 drafts 3 a cycle") == ("budget:64", 3)
    assert sampler_words("speculative, schedule /x.parquet drafts 12 a cycle") == ("schedule:/x.parquet", 12)
    assert sampler_words(None) == (None, None)
