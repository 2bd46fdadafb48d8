"""The two kinds of adapter and what each command does with them, and when distillation is worth it.

A learner's LoRA (`sparrow train`'s RUN/adapter) is the policy itself; a sparse actor's (`sparrow distill`'s,
with sparrow_distill.json) adapts the sparse sampler only, the dense policy being the base alone. So
`profile --adapter` takes only a sparse actor's, and `rollout` refuses a sparse actor's for a dense rollout.
`distill` refuses trajectories that its budgets cover whole (the actor is then the dense policy), warns when
the adapter makes the actor worse, and with `--objective k3` takes only the samples of the actor it distills.

References: block top-k's own page rule (`kept_page_mask`), numpy's quantile and mean of the written
before/after mismatch files, and the rollouts' recorded sampler as `sparrow rollout` wrote it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.attention.block_topk import kept_page_mask
from sparrow.stages.core.schedule import Schedule
from sparrow.stages.distill import WORSE_BY, reads_sparsely, regression_warning, tail_comparison
from sparrow.stages.model.adapter import add_lora, save_adapter
from sparrow.stages.model.loading import load_model

from cli_checks import error_line, passed_the_checks

runner = CliRunner()
VOCAB = 300
PAGE = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint (3 layers: 0-1 dense, 2 sparse) without a tokenizer."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, max_position_embeddings=512, rope_theta=5000.0,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-adapters")
    transformers.AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(path)
    return str(path)


def adapter(model: str, folder: Path, distilled: bool, seed: int = 0) -> Path:
    """A rank-2, alpha-4 peft adapter of `model` (its A matrices drawn from `seed`), a sparse actor's when
    `distilled` (with the sparrow_distill.json that sparrow distill writes beside it)."""
    torch.manual_seed(seed)
    loaded = load_model(model)
    config = add_lora(loaded.model, 2, 4.0)
    out = save_adapter(loaded.model, config, folder, model)
    if distilled:
        (out / "sparrow_distill.json").write_text("{}")
    return out


def prompts(path: Path, lengths: list[int], seed: int = 1) -> Path:
    g = np.random.default_rng(seed)
    rows = [{"prompt_id": f"q{i}", "task": "verl", "prompt": None,
             "prompt_token_ids": g.integers(3, VOCAB, n).tolist(), "answer": None, "metadata": None}
            for i, n in enumerate(lengths)]
    return write_artifact(rows, path, "prompts")


def foreign_rollouts(path: Path, lengths: list[tuple[int, int]]) -> Path:
    """Trajectories as another sampler's Parquet: (prompt, completion) lengths."""
    pq.write_table(pa.table({"prompt_id": [f"q{i}" for i in range(len(lengths))],
                             "prompt_token_ids": [[5] * n for n, _ in lengths],
                             "token_ids": [[7] * t for _, t in lengths]}), path)
    return path


# ---------------------------------------------------------------- profile and rollout: which adapter


def test_profile_refuses_a_learner_adapter(tiny, tmp_path, no_work):
    """A trained learner's LoRA would be scored on the sparse side only, against the untrained dense base:
    refused before any weights load, naming the adapter and what to do; a sparse actor's is taken."""
    learner = adapter(tiny, tmp_path / "adapter", distilled=False)
    source = prompts(tmp_path / "p.parquet", [60])
    out = tmp_path / "m.parquet"
    args = ["profile", "--model", tiny, "--prompts", str(source), "--budgets", "48", "-o", str(out)]
    line = error_line(runner.invoke(app, [*args, "--adapter", str(learner)]))
    assert f"--adapter {learner} is not a sparse actor's adapter (it has no sparrow_distill.json" in line
    assert f"give it as --lora {learner}" in line and not out.exists()
    actor = adapter(tiny, tmp_path / "actor", distilled=True)
    assert passed_the_checks(runner.invoke(app, [*args, "--adapter", str(actor)]))


@pytest.mark.parametrize("flags", [["--dense"], []], ids=["dense", "default"])
def test_rollout_refuses_a_sparse_actor_for_a_dense_rollout(tiny, tmp_path, no_work, flags):
    """The dense policy is the base alone, so a sparse actor's adapter has no place in a dense rollout; the
    same adapter with --budget, or a learner's LoRA densely, is taken."""
    actor = adapter(tiny, tmp_path / "actor", distilled=True)
    learner = adapter(tiny, tmp_path / "learner", distilled=False)
    source, out = prompts(tmp_path / "p.parquet", [60]), tmp_path / "r.parquet"
    args = ["rollout", "--model", tiny, "--prompts", str(source), "--max-new-tokens", "2", "-o", str(out)]
    line = error_line(runner.invoke(app, [*args, *flags, "--adapter", str(actor)]))
    assert f"--adapter {actor} is a sparse actor" in line and "whose policy is the base alone" in line
    assert "give --budget or --schedule" in line and not out.exists()
    assert passed_the_checks(runner.invoke(app, [*args, "--budget", "48", "--adapter", str(actor)]))
    assert passed_the_checks(runner.invoke(app, [*args, *flags, "--adapter", str(learner)]))


# ---------------------------------------------------------------- distill: nothing to distill


def _page_rule_reads_sparsely(n: int, t: int, budget_at) -> bool:
    """Block top-k's own rule: whether some generated token j >= 1 (query at position n + j - 1, budget
    budget_at(n + j)) drops a page, with random queries and page centroids."""
    g = torch.Generator().manual_seed(n * 1000 + t)
    for j in range(1, t):
        position = n + j - 1
        pages = position // PAGE + 1
        q, centroids = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 1, pages, 8, generator=g)
        kept = kept_page_mask(q, centroids, torch.tensor([[position]]), torch.tensor([[budget_at(n + j)]]))
        if not bool(kept[..., :pages].all()):
            return True
    return False


@pytest.mark.parametrize("budget_at", [lambda _: 48, lambda _: 64, Schedule((0, 40), (0, 48)).budget_at],
                         ids=["budget48", "budget64", "schedule"])
def test_reads_sparsely_is_the_page_rule(budget_at):
    for n in (1, 20, 31, 40, 47, 48, 49, 60, 63, 64, 65):
        for t in (1, 2, 3, 9, 18):
            assert reads_sparsely([(n, t)], [budget_at]) == _page_rule_reads_sparsely(n, t, budget_at), (n, t)


def test_distill_refuses_trajectories_the_budget_covers(tiny, tmp_path, no_work):
    """Trajectories that fit in the budget leave the actor equal to the dense policy (a zero objective):
    refused before any weights load; one token more of context, and the same command trains."""
    out = tmp_path / "act"
    args = ["distill", "--model", tiny, "--budget", "48", "--steps", "1", "-o", str(out)]
    covered = foreign_rollouts(tmp_path / "covered.parquet", [(30, 8), (41, 8)])  # contexts up to 48
    line = error_line(runner.invoke(app, [*args, "--rollouts", str(covered)]))
    assert f"every trajectory of --rollouts {covered} fits within the budget" in line
    assert "reaches at most 48 tokens of context" in line and "nothing to distill" in line
    assert not out.exists()
    longer = foreign_rollouts(tmp_path / "longer.parquet", [(30, 8), (42, 8)])
    assert passed_the_checks(runner.invoke(app, [*args, "--rollouts", str(longer)]))
    # sampled from prompts: the longest a trajectory may be, the prompt with --max-new-tokens
    source = prompts(tmp_path / "p.parquet", [30, 40])
    sample = ["--prompts", str(source), "--samples", "2"]
    line = error_line(runner.invoke(app, [*args, *sample, "--max-new-tokens", "9"]))
    assert f"every prompt of --prompts {source} with --max-new-tokens 9 fits" in line
    assert "longer trajectories" in line
    assert passed_the_checks(runner.invoke(app, [*args, *sample, "--max-new-tokens", "10"]))
    # several taught budgets: refused only when every one covers them
    line = error_line(runner.invoke(app, [*args, "--rollouts", str(covered), "--train-budgets", "48,64"]))
    assert "(48,64)" in line
    assert passed_the_checks(runner.invoke(app, [*args, "--rollouts", str(longer), "--train-budgets",
                                                 "48,64"]))


# ---------------------------------------------------------------- distill: an adapter that makes it worse


def _mismatch(cells: dict[tuple[int, int], list[float]]) -> pa.Table:
    rows = [(b, g, a) for (b, g), alphas in cells.items() for a in alphas]
    return pa.table(dict(zip(("bin", "budget", "alpha"), map(list, zip(*rows)))))


def _worse(before: list[float], after: list[float], q: float = 0.05) -> bool:
    x, y = np.array(before), np.array(after)
    return bool(np.quantile(y, q) < np.quantile(x, q) - WORSE_BY or y.mean() < x.mean() - WORSE_BY)


def test_tail_comparison_marks_the_worse_bins_and_the_warning_names_them():
    before = {(0, 48): [0.5, 0.9, 1.0], (1, 48): [0.4, 0.6, 0.8], (1, 64): [0.7, 0.8, 0.9]}
    after = {(0, 48): [0.6, 0.9, 1.0], (1, 48): [0.2, 0.6, 0.8],
             (1, 64): [a - WORSE_BY / 2 for a in before[(1, 64)]]}  # within rounding: not worse
    rows = tail_comparison(_mismatch(before), _mismatch(after), 0.05, 0.86)
    want = {key: _worse(before[key], after[key]) for key in before}
    assert {(r["bin"], r["budget"]): r["worse_after"] for r in rows} == want == {
        (0, 48): False, (1, 48): True, (1, 64): False}
    warning = regression_warning(rows, Path("act"))
    assert warning.startswith("the distilled actor is worse than the plain one in 1 of 3 bins and budgets")
    assert "bin 1 budget 48: tail 0.42 -> 0.24" in warning and "--adapter act" in warning
    assert "bin 0" not in warning and "budget 64" not in warning
    assert regression_warning([r | {"worse_after": False} for r in rows], Path("act")) is None


def test_cli_distill_warns_when_the_adapter_makes_the_actor_worse(tiny, tmp_path):
    """A learning rate far too large wrecks the adapter: the warning is on stderr, in sparrow_distill.json
    and in the after file's metadata, and the table's worse_after agrees with numpy on the written files."""
    source, out = prompts(tmp_path / "p.parquet", [70, 90]), tmp_path / "act"
    r = runner.invoke(app, ["distill", "--model", tiny, "--prompts", str(source), "--budget", "48",
                            "--samples", "2", "--max-new-tokens", "8", "--steps", "2", "--lora-rank", "2",
                            "--lr", "0.5", "--format", "json", "-o", str(out)])
    assert r.exit_code == 0, r.output
    before, after = (read_artifact(out / "mismatch" / f"{n}.parquet", "mismatch").to_pandas()
                     for n in ("before", "after"))
    cells = lambda t: {(int(b), int(g)): a.to_list() for (b, g), a in t.groupby(["bin", "budget"]).alpha}
    plain, distilled = cells(before), cells(after)
    want = {key: _worse(plain[key], distilled[key]) for key in plain}
    assert any(want.values())  # the case this test is about
    table = json.loads(r.stdout)
    assert {(row["bin"], row["budget"]): row["worse_after"] for row in table} == want
    stderr = " ".join(r.stderr.split())
    assert "warning: the distilled actor is worse than the plain one" in stderr
    record = json.loads((out / "sparrow_distill.json").read_text())
    assert len(record["warnings"]) == 1 and record["warnings"][0] in stderr
    assert artifact_metadata(out / "mismatch" / "after.parquet")["warnings"] == record["warnings"][0]


# ---------------------------------------------------------------- distill --objective k3: whose samples


@pytest.fixture(scope="module")
def sampled(tiny, tmp_path_factory) -> dict:
    """Rollouts of a sparse actor (budget 48 + adapter A), of the plain actor at budget 48 and of a
    schedule, as sparrow rollout writes them; two adapters of the same shape, A and B."""
    tmp = tmp_path_factory.mktemp("k3")
    a, b = (adapter(tiny, tmp / name, distilled=True, seed=s) for name, s in (("a", 0), ("b", 1)))
    source = prompts(tmp / "p.parquet", [100, 90])
    write_artifact({"bin": [0, 1], "bin_start": [0, 96], "bin_end": [96, None], "budget": [48, 64],
                    "tail": [None, None], "predicted_step_seconds": [None, None]}, tmp / "s.parquet",
                   "schedule", metadata={"page_size": PAGE})
    files = {"A": str(a), "B": str(b), "PROMPTS": str(source), "SCHEDULE": str(tmp / "s.parquet")}
    for name, flags in (("ACTOR", ["--budget", "48", "--adapter", str(a)]), ("PLAIN", ["--budget", "48"]),
                        ("SCHEDULED", ["--schedule", str(tmp / "s.parquet")]),
                        ("CUT", ["--budget", "48", "--top-p", "0.9"])):
        files[name] = str(tmp / f"{name.lower()}.parquet")
        r = runner.invoke(app, ["rollout", "--model", tiny, "--prompts", str(source), "--samples", "2",
                                "--max-new-tokens", "3", *flags, "-o", files[name]])
        assert r.exit_code == 0, r.output
    shutil.copy(tmp / "s.parquet", tmp / "same.parquet")  # the same schedule under another name
    files["SAME"] = str(tmp / "same.parquet")
    return files


K3_REFUSALS = [
    (["--rollouts", "ACTOR", "--budget", "64"],
     "{ACTOR} was sampled with budget:48 (its metadata), not by the --budget 64 actor; give --budget 48"),
    (["--rollouts", "ACTOR", "--budget", "48"],
     "{ACTOR} was sampled with the adapter {A} (its metadata 'lora') and distill starts from a fresh "
     "adapter; give --init-adapter {A}"),
    (["--rollouts", "ACTOR", "--budget", "48", "--init-adapter", "B"],
     "{ACTOR} was sampled with the adapter {A} (its metadata 'lora') and distill starts from --init-adapter "
     "{B}; give --init-adapter {A}"),
    (["--rollouts", "PLAIN", "--budget", "48", "--init-adapter", "A"],
     "{PLAIN} was sampled with no adapter (its metadata) and distill starts from --init-adapter {A}; drop "
     "--init-adapter"),
    (["--rollouts", "ACTOR", "--budget", "48", "--init-adapter", "A", "--eval-budgets", "48,64"],
     "while the adapter is taught at budgets 48,64 (--train-budgets, which defaults to --eval-budgets); "
     "give --train-budgets 48"),
    (["--rollouts", "SCHEDULED", "--budget", "48"], "{SCHEDULED} was sampled with schedule:{SCHEDULE}"),
    (["--rollouts", "PLAIN", "--schedule", "SCHEDULE"], "not by the --schedule {SCHEDULE} actor"),
    (["--prompts", "PROMPTS", "--budget", "48", "--train-budgets", "48,64"],
     "--prompts are sampled with --budget 48 while the adapter is taught at budgets 48,64"),
]


@pytest.mark.parametrize("args,message", K3_REFUSALS)
def test_k3_refuses_the_samples_of_another_actor(tiny, sampled, tmp_path, no_work, args, message):
    """Samples of another budget, schedule or adapter, or an adapter taught at other budgets: k3 would
    estimate another actor's KL, so the command is refused naming the file's sampler and the flag."""
    out = tmp_path / "act"
    line = error_line(runner.invoke(app, ["distill", "--model", tiny, *[sampled.get(a, a) for a in args],
                                          "--objective", "k3", "--lora-rank", "2", "--lora-alpha", "4",
                                          "-o", str(out)]))
    assert "--objective k3 needs trajectories sampled by" in line and message.format(**sampled) in line
    assert "--objective kl" in line and not out.exists()


def test_k3_refuses_samples_from_a_cut_of_the_actors_softmax(tiny, sampled, tmp_path, no_work):
    """top-p below 1 (or top-k) draws from a truncated distribution, not the actor's: k3 over those tokens
    is biased, so they are refused as another sampler's."""
    out = tmp_path / "act"
    line = error_line(runner.invoke(app, ["distill", "--model", tiny, "--rollouts", sampled["CUT"],
                                          "--budget", "48", "--objective", "k3", "--lora-rank", "2",
                                          "-o", str(out)]))
    assert f"{sampled['CUT']} was sampled with top_p 0.9, which cuts it; use --objective kl" in line
    assert not out.exists()


@pytest.mark.parametrize("args", [
    ["--rollouts", "ACTOR", "--budget", "48", "--init-adapter", "A"],
    ["--rollouts", "ACTOR", "--budget", "48", "--init-adapter", "A", "--eval-budgets", "48,64",
     "--train-budgets", "48"],
    ["--rollouts", "PLAIN", "--budget", "48"],
    ["--rollouts", "SCHEDULED", "--schedule", "SAME"],
    ["--prompts", "PROMPTS", "--budget", "48", "--eval-budgets", "48,64", "--train-budgets", "48"],
], ids=["actor", "actor-eval-budgets", "plain", "same-schedule", "prompts"])
def test_k3_takes_the_samples_of_the_actor_it_distills(tiny, sampled, tmp_path, no_work, args):
    args = [sampled.get(a, a) for a in args]
    r = runner.invoke(app, ["distill", "--model", tiny, *args, "--objective", "k3", "--lora-rank", "2",
                            "--lora-alpha", "4", "-o", str(tmp_path / "act")])
    assert passed_the_checks(r), r.output


def test_replacing_an_adapter_keeps_the_users_files_beside_it(tiny, tmp_path):
    """A second adapter written to a folder replaces the writers' files (peft's, distill's record and
    mismatch) and keeps what else it holds: a user's notes, a `sparrow report` folder."""
    folder = adapter(tiny, tmp_path / "actor", distilled=True)
    (folder / "mismatch").mkdir()
    (folder / "mismatch" / "before.parquet").write_text("stale")
    (folder / "notes.txt").write_text("mine")
    (folder / "report").mkdir()
    (folder / "report" / "index.html").write_text("<html>")
    first = (folder / "adapter_model.safetensors").read_bytes()
    adapter(tiny, folder, distilled=False, seed=1)
    assert (folder / "adapter_model.safetensors").read_bytes() != first
    assert (folder / "notes.txt").read_text() == "mine"
    assert (folder / "report" / "index.html").read_text() == "<html>"
    assert not (folder / "mismatch").exists() and not (folder / "sparrow_distill.json").exists()
