"""`sparrow profile`: per-token sparse-to-dense mismatch of a model on a prompt set."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .common import UsageError, console, friendly_errors, parse_int_list
from .output import emit, format_option, resolve_format
from .rollout import check_vocab


def load_prompt_tokens(path: Path, tokenizer) -> tuple[list[str], list[list[int]]]:
    """Prompt ids and token ids of a prompts artifact (token ids win; text needs a tokenizer)."""
    from sparrow.schemas import read_artifact

    table = read_artifact(path, "prompts")
    if table.num_rows == 0:
        raise UsageError(f"{path}: the prompt set is empty")
    ids, tokens = [], []
    for row in table.select(["prompt_id", "prompt", "prompt_token_ids"]).to_pylist():
        if row["prompt_token_ids"]:
            tokens.append(list(row["prompt_token_ids"]))
        elif tokenizer is None:
            raise UsageError(f"{path}: prompt {row['prompt_id']!r} has only text and the model has "
                             "no tokenizer; write prompts with token ids")
        else:
            tokens.append(tokenizer(row["prompt"], add_special_tokens=False).input_ids)
        ids.append(row["prompt_id"])
    return ids, tokens


def check_context(path: Path, ids: list[str], tokens: list[list[int]], max_new: int,
                  context: int) -> None:
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i]))
    if len(tokens[longest]) + max_new > context:
        raise UsageError(
            f"{path}: prompt {ids[longest]!r} has {len(tokens[longest])} tokens, which with "
            f"--max-new-tokens {max_new} exceeds the model's context of {context}")


@friendly_errors
def profile(
    model: str = typer.Option("smollm2-135m", "--model", help="Preset, checkpoint dir or .gguf."),
    prompts: Path = typer.Option(..., "--prompts", help="A prompts artifact (sparrow prompts), or any "
                                 "Parquet or JSONL file with its columns (token ids or text)."),
    budgets: str = typer.Option("256,512,1024", "--budgets",
                                help="Candidate budgets in tokens, multiples of the page size."),
    samples: int = typer.Option(4, "--samples", help="Trajectories per prompt."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    sampler: str = typer.Option("dense", "--sampler",
                                help="How trajectories are sampled: dense, budget:B or schedule:FILE."),
    bin_width: int = typer.Option(512, "--bin-width", help="Position bin width in tokens "
                                  "(the embedded model's 8K context wants 512; Qwen3 runs use 2000)."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature (0 = greedy); "
                                      "alpha is measured at this temperature (1 when greedy)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int = typer.Option(0, "--seed"),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences sampled together."),
    quantile: float = typer.Option(0.05, "--quantile", help="Tail quantile shown in the summary."),
    threshold: float = typer.Option(0.86, "--threshold", help="Tail threshold shown in the summary."),
    device: str = typer.Option("cpu", "--device"),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the mismatch artifact."),
    format: str = format_option(),
) -> None:
    """Sample K trajectories per prompt, then score every generated token under dense attention
    and under each budget (teacher forced): one row per token per budget."""
    from sparrow.schemas import write_artifact
    from sparrow.stages.model.loading import load_model, resolve_config
    from sparrow.stages.profile import ProfileOptions, run_profile, summarize
    from sparrow.stages.schedule import Schedule

    fmt = resolve_format(format)
    opts = ProfileOptions(budgets=parse_int_list(budgets, "--budgets"), samples=samples,
                          max_new_tokens=max_new_tokens, sampler=sampler, bin_width=bin_width,
                          temperature=temperature, top_p=top_p, seed=seed, batch_size=batch_size)
    try:
        opts.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if sampler.startswith("schedule:"):
        opts.schedule = Schedule.from_artifact(sampler.split(":", 1)[1])
    if not prompts.exists():
        raise UsageError(f"{prompts}: no such prompts file")
    cfg = resolve_config(model)
    loaded = load_model(model, device=device)
    ids, tokens = load_prompt_tokens(prompts, loaded.tokenizer)
    check_vocab(prompts, [{"prompt_id": i, "prompt_token_ids": t} for i, t in zip(ids, tokens)],
                cfg.vocab_size)
    check_context(prompts, ids, tokens, max_new_tokens, cfg.max_position_embeddings)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as bar:
        tasks = {"sampling": bar.add_task("sampling (decode steps)", total=None),
                 "scoring": bar.add_task("scoring (sequences)", total=None)}
        table = run_profile(loaded, ids, tokens, opts,
                            lambda phase, done, total: bar.update(tasks[phase], completed=done,
                                                                  total=total))
    meta = opts.metadata() | {"model": loaded.name, "prompts": str(prompts)}
    write_artifact(table, output, "mismatch", metadata=meta)
    console.print(f"wrote {table.num_rows} rows ({table.num_rows // len(opts.budgets)} tokens x "
                  f"{len(opts.budgets)} budgets) to {output}")
    print_summary(summarize(table, quantile, threshold), quantile, threshold, fmt)


def print_summary(summary, quantile: float, threshold: float, fmt: str) -> None:
    """Mean and tail alpha per bin and budget, on stdout; `above` says whether the tail clears the
    threshold."""
    columns = ("bin", "budget", "tokens", "mean_alpha", "tail_alpha", "above")
    rows = [[r["bin"], r["budget"], r["tokens"], r["mean_alpha"], r["tail_alpha"],
             ("yes" if r["above"] else "no") if fmt == "table" else r["above"]]
            for r in summary.to_pylist()]
    emit(columns, rows, fmt, title=f"alpha per bin and budget (tail = {quantile:g} quantile, "
                                   f"above = tail >= {threshold})")
