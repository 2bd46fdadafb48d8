"""`sparrow prompts`: build a prompts artifact for a task, formatted for a model's chat template.

Everything the user typed is checked before any work (task, count, split, model, context length); then
only the model's tokenizer is loaded, never its weights. Progress (a bar on a terminal, lines in a log)
appears only when generation runs longer than a second.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from sparrow.stages.tasks import TASKS, Task, TaskError, get_task, make_prompts
from sparrow.stages.tasks.code import DEFAULT_LEVEL, DEFAULT_TESTS, MAX_TESTS
from sparrow.stages.tasks.longcontext import DEFAULT_CONTEXT_TOKENS, MIN_CONTEXT_TOKENS

from .console import console
from .errors import UsageError, friendly_errors
from .options import check_host_memory, model_file, non_negative_seed, output_path
from .paths import check_output, force_option, output_help
from .progress import LogProgress, live_progress

LAYOUTS = {"sparrow": "Sparrow", "verl": "verl", "trl": "TRL"}  # --layout -> the name a message gives it


class _LazyProgress:
    """A progress callback that shows progress once the work has taken more than `delay` seconds: a bar
    with the time left on a terminal, whole lines in a log (LogProgress), so that a quick run shows none."""

    def __init__(self, total: int, label: str, delay: float = 1.0):
        self.total, self.label, self.delay = total, label, delay
        self.started = time.monotonic()
        self.bar = None
        self.task_id = None
        self.log: LogProgress | None = None

    def __call__(self, done: int) -> None:
        late = time.monotonic() - self.started > self.delay
        if self.bar is None and live_progress() and late and done < self.total:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=console, transient=True)
            self.bar.start()
            self.task_id = self.bar.add_task(self.label, total=self.total)
        if self.bar is not None:
            self.bar.update(self.task_id, completed=done)
        if self.log is None and not live_progress() and late:
            self.log = LogProgress(self.label)
            self.log.start = self.started
        if self.log is not None:
            self.log(done, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _context_tokens(task_name: str, long_context: bool, requested: int | None, model: str,
                    max_positions: int) -> int | None:
    if not long_context:
        if requested is not None:
            long_tasks = ", ".join(t.name for t in TASKS.values() if t.long_context)
            raise UsageError(f"--context-tokens applies only to long-context tasks ({long_tasks}), "
                             f"not to {task_name}")
        return None
    if requested is None:
        default = min(DEFAULT_CONTEXT_TOKENS, max_positions // 2)
        if default < MIN_CONTEXT_TOKENS:
            raise UsageError(f"{model}'s context of {max_positions} tokens leaves no room for a long-context "
                             f"prompt of at least {MIN_CONTEXT_TOKENS} tokens and its answer; use a model "
                             "with a longer context, or a task that is not long-context")
        return default
    if requested > max_positions:
        raise UsageError(f"--context-tokens {requested} exceeds the context of {model} "
                         f"({max_positions} tokens)")
    if requested < MIN_CONTEXT_TOKENS:
        raise UsageError(f"--context-tokens must be at least {MIN_CONTEXT_TOKENS}, got {requested}")
    return requested


def _check_request(spec: Task, n: int, split: str | None, code: dict[str, int]) -> None:
    """What the task itself refuses (a split it lacks, more prompts than its problems, the code task's
    options given to another or out of range), before any work."""
    for name in code:
        if name not in spec.options:
            raise UsageError(f"--{name} applies only to --task code, not to {spec.name}")
    if split is not None and "split" not in spec.options:
        with_splits = ", ".join(t.name for t in TASKS.values() if "split" in t.options)
        raise UsageError(f"--split applies only to tasks with a fixed set of problems ({with_splits}), not "
                         f"to {spec.name}, whose prompts are generated")
    if spec.check is not None:
        try:
            spec.check(n, **({"split": split} if split is not None else {}), **code)
        except TaskError as e:
            raise UsageError(str(e)) from None


@friendly_errors
def prompts(
    task: str = typer.Option(..., "--task", help=f"task to generate: {', '.join(TASKS)} (case-insensitive)"),
    n: int = typer.Option(16, "--n", help="number of prompts"),
    seed: int = typer.Option(0, "--seed", callback=non_negative_seed,
                             help="generator seed: same seed, same prompts; another seed holds prompts "
                                  "out by their inputs and wording (for code, the same functions: "
                                  "humaneval --split holds problems out)"),
    model: str = typer.Option("smollm2-135m", "--model",
                              help="preset, checkpoint dir or .gguf; its tokenizer and chat template "
                                   "format the prompts"),
    context_tokens: int | None = typer.Option(
        None, "--context-tokens",
        help=f"long-context tasks: the most tokens a prompt may have, chat template included (its "
             f"prompt_token_ids; the document holds as many records as fit, so a prompt falls short by "
             f"less than one record), at least {MIN_CONTEXT_TOKENS} (default {DEFAULT_CONTEXT_TOKENS}, or "
             "half the model's context if that is less)"),
    split: str | None = typer.Option(
        None, "--split",
        help="humaneval only: a fixed partition of its 164 problems, so that training and evaluation "
             "prompts never share one whatever the seeds: test (every fourth problem, HumanEval/0, /4, "
             "...: 41), train (the other 123) or all (default)"),
    level: int | None = typer.Option(
        None, "--level", help=f"code only: 1 one-liner functions, 2 functions that need a loop or a "
                              f"condition, 0 both (default {DEFAULT_LEVEL})"),
    tests: int | None = typer.Option(
        None, "--tests", help=f"code only: hidden tests per prompt, 1 to {MAX_TESTS} "
                              f"(default {DEFAULT_TESTS})"),
    layout: str = typer.Option("sparrow", "--layout", metavar="sparrow|verl|trl",
                               help="sparrow: a prompts artifact (the template's text and token ids); verl: "
                               "a verl dataset (chat messages as prompt, data_source sparrow/<task>, "
                               "reward_model.ground_truth, extra_info), for verl's data.train_files with "
                               "this package's stages/integrations/verl.py as custom_reward_function.path "
                               "(compute_score); trl: a TRL conversational dataset (prompt as chat messages, "
                               "task, answer, metadata, prompt_id) scored by "
                               "sparrow.stages.integrations.trl_tasks.task_reward. Sparrow reads both as "
                               "datasets too (docs/tasks.md)."),
    output: Path = typer.Option(..., "-o", "--output", help=output_help("the prompts artifact"),
                                parser=output_path()),
    force: bool = force_option(),
) -> None:
    """Generate prompts with verifiable answers for a task, formatted with the model's chat template (or
    as a verl dataset, --layout verl)."""
    from sparrow.schemas import write_artifact
    from sparrow.stages.model.loading import resolve_config
    from sparrow.stages.model.names import model_name
    from sparrow.stages.tasks.tokenizers import load_model_tokenizer

    spec = get_task(task.lower())
    layout = layout.strip().lower()
    if layout not in LAYOUTS:
        raise UsageError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if n < 1:
        raise UsageError(f"--n must be at least 1, got {n}")
    given = {k: v for k, v in (("level", level), ("tests", tests)) if v is not None}
    _check_request(spec, n, split, given)
    defaults = {"level": DEFAULT_LEVEL, "tests": DEFAULT_TESTS}
    code = {k: v for k, v in given.items() if v != defaults[k]}  # a default changes nothing, ids included
    check_host_memory(n, f"{n:,} prompts (--n)", "write fewer prompts per file")
    kind = "prompts" if layout == "sparrow" else "dataset"  # a trainer's dataset: Parquet with a mark
    check_output(output, kind, force, inputs={"--model": model_file(model)})
    config = resolve_config(model)
    context = _context_tokens(spec.name, spec.long_context, context_tokens, model,
                              config.max_position_embeddings)

    tokenizer = load_model_tokenizer(model)
    if tokenizer is None:
        raise UsageError(f"model {model} has no tokenizer, and prompts need one to apply its chat template")
    progress = _LazyProgress(n, f"{spec.name} prompts")
    try:
        rows = make_prompts(spec, n, seed, tokenizer, progress=progress, context_tokens=context, split=split,
                            messages=layout != "sparrow", **code)
    except TaskError as e:
        raise UsageError(str(e)) from None
    finally:
        progress.close()

    metadata = {"task": spec.name, "n": n, "seed": seed, "model": model_name(model)}
    if context is not None:
        metadata["context_tokens"] = context
    if split is not None:
        metadata["split"] = split
    metadata.update(code)
    if layout != "sparrow":
        return _write_dataset(layout, rows, output, split, spec.name, model)
    path = write_artifact(rows, output, "prompts", metadata)

    lengths = [len(r["prompt_token_ids"]) for r in rows]
    console.print(
        f"[green]wrote[/] {len(rows)} {spec.name} prompts (seed {seed}, model {model}) to [bold]{path}[/]\n"
        f"prompt tokens: mean {sum(lengths) / len(lengths):.0f}, min {min(lengths)}, max {max(lengths)}",
        highlight=False,
    )


def _write_dataset(layout: str, rows: list[dict], output: Path, split: str | None, task: str,
                   model: str) -> None:
    """The prompts as a verl or TRL dataset, and how the trainer reads and scores it."""
    from sparrow.schemas.io import write_table
    from sparrow.schemas.locations import DATASET_KEY, is_stdio
    from sparrow.stages.integrations import trl_tasks, verl

    table = verl.verl_dataset(rows, split or "train") if layout == "verl" else trl_tasks.trl_dataset(rows)
    path = write_table(table.replace_schema_metadata({DATASET_KEY: layout}), output)
    where = "FILE" if is_stdio(output) else path.resolve()
    if layout == "verl":
        how = (f"verl: data.train_files={where} custom_reward_function.path={verl.__file__} "
               "custom_reward_function.name=compute_score")
    else:
        how = (f"TRL: load_dataset(\"parquet\", data_files=\"{where}\", split=\"train\") with "
               "reward_funcs=sparrow.stages.integrations.trl_tasks.task_reward")
    lengths = [len(r["prompt_token_ids"]) for r in rows]
    console.print(
        f"[green]wrote[/] {len(rows)} {task} prompts as a {LAYOUTS[layout]} dataset to [bold]{path}[/] "
        f"(prompt tokens with {model}'s template: mean {sum(lengths) / len(lengths):.0f}, max "
        f"{max(lengths)})\n{how}",
        highlight=False, soft_wrap=True)
