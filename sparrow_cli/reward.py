"""`sparrow reward`: score any sampler's completions with their tasks' scorers, to a rewards artifact.

Everything is checked before anything is scored (the output location, both files, every completion's
prompt, and for code tasks that a sandbox can run here); code tasks' programs run in a pool of sandboxes
(`--workers`). Each row of the rewards artifact says why it got its reward (`status`; for code tasks also
`tests_passed` of `tests_total`). The summary (one row per task: completions, mean reward, accuracy) is
printed as a table.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from .console import console
from .data_options import (
    answer_column_option,
    data_options,
    prompt_column_option,
    reward_fn_option,
    reward_kwargs_option,
    reward_option,
)
from .errors import UsageError, friendly_errors
from .options import code_rewards, given_path, output_path, unsafe_code_option
from .output import emit, format_option, resolve_format
from .paths import check_output, force_option, input_path, output_help
from .progress import working


@friendly_errors
def reward(
    ctx: typer.Context,
    prompts: Path = typer.Option(..., "--prompts", callback=input_path,
                                 help="The prompts the completions answer (- = stdin): a prompts artifact, "
                                 "any Parquet or JSONL file with its columns (prompt_id, task, answer, "
                                 "metadata), or a verl or TRL dataset scored by --reward or --reward-fn.",
                                 parser=given_path("--prompts")),
    completions: Path = typer.Option(..., "--completions", callback=input_path,
                                     help="A rollouts artifact (- = stdin, for one of the two inputs), or "
                                     "any Parquet or JSONL file with columns prompt_id and text (and "
                                     "optionally sample), from any sampler.",
                                     parser=given_path("--completions")),
    output: Path = typer.Option(..., "-o", "--output", help=output_help("the rewards artifact"),
                                parser=output_path()),
    prompt_column: str = prompt_column_option(),
    answer_column: str = answer_column_option(),
    reward_name: str = reward_option(),
    reward_fn: str = reward_fn_option(),
    reward_kwargs: str = reward_kwargs_option(),
    workers: int = typer.Option(None, "--workers", help="Programs run at once for code tasks (default: "
                                "$SPARROW_REWARD_WORKERS, else the CPU count): the sandbox pool's size, "
                                "not Ray workers as rollout's, profile's and train's --workers are."),
    unsafe_code_execution: bool = unsafe_code_option(),
    fmt: str = format_option(),
    force: bool = force_option(),
) -> None:
    """Score completions (of any sampler) with their prompts' task scorers, or with one reward for all
    (--reward, --reward-fn)."""
    from sparrow.schemas import input_name, write_artifact
    from sparrow.stages.core.prompt_set import PromptSet
    from sparrow.stages.reward import check_prompts, data_source, read_completions, score_completions
    from sparrow.stages.tasks.reward_function import reward_provenance

    fmt = resolve_format(fmt)
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    check_output(output, "rewards", force, inputs={"--prompts": prompts, "--completions": completions})
    code_rewards(ctx, unsafe_code_execution)
    data = data_options(answer_column, reward_name, reward_fn, reward_kwargs, prompt_column=prompt_column)
    prompt_set = PromptSet.read(prompts, data)
    rows = {r["prompt_id"]: r for r in prompt_set.rows}
    done = read_completions(completions)
    check_prompts(rows, done, prompts, completions)
    PromptSet(prompts, [rows[pid] for pid in dict.fromkeys(c.prompt_id for c in done)]).check_rewards()

    start = time.perf_counter()
    with working(f"scoring {len(done):,} completions"):
        scored = score_completions(rows, done, workers)
    seconds = time.perf_counter() - start
    meta = {"prompts": input_name(prompts), "completions": input_name(completions), "n": len(scored),
            "reward_mean": sum(r["reward"] for r in scored) / len(scored), "seconds": seconds,
            **reward_provenance(reward_name, reward_fn, data.reward_kwargs)}
    path = write_artifact(scored, output, "rewards", meta)

    sources = {pid: data_source(r.get("metadata")) for pid, r in rows.items()}
    by_source = any(v is not None for v in sources.values())  # verl's per-data_source validation metrics
    groups = list(dict.fromkeys((r["task"], sources[r["prompt_id"]]) for r in scored))
    table = []
    for task, source in groups:
        mine = [r["reward"] for r in scored if r["task"] == task and sources[r["prompt_id"]] == source]
        accuracy = sum(x >= 1.0 - 1e-9 for x in mine) / len(mine)
        table.append([task, *([source] if by_source else []), len(mine), sum(mine) / len(mine), accuracy])
    columns = ("task", *(["data_source"] if by_source else []), "completions", "reward_mean", "accuracy")
    emit(columns, table, fmt, title="rewards", left=("task", "data_source"))
    console.print(f"[green]wrote[/] {len(scored)} rewards to [bold]{path}[/] ({seconds:.1f} s)",
                  highlight=False)
