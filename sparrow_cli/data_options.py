"""The options that read users' datasets and score them (--answer-column, --reward, --reward-fn) and
fit their prompts' lengths (--max-prompt-length, --truncation, --filter-overlong-prompts), shared by the
commands that read them; docs/datasets.md has the formats and conventions."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .errors import UsageError

if TYPE_CHECKING:  # the stages load when a command runs, not when the CLI starts
    from sparrow.stages.core.prompt_set import PromptSet
    from sparrow.stages.core.user_data import DataOptions


def prompt_column_option():
    return typer.Option(None, "--prompt-column", metavar="<column>",
                        help="The prompt column of a verl or TRL / Hugging Face dataset, text or chat "
                        "messages (verl's data.prompt_key), e.g. question or problem; default: prompt. Its "
                        "other columns reach the reward as before; the prompt column is the prompt.")


def answer_column_option():
    return typer.Option(None, "--answer-column", help="The ground-truth column of a TRL / Hugging Face "
                        "dataset (a dotted path reaches into a struct, e.g. reward_model.ground_truth). "
                        "Default: reward_model.ground_truth for a verl dataset, else the first of answer, "
                        "solution, ground_truth, target that the file has.")


def _reward_name(value: str | None) -> str | None:
    """--reward in any case, as --format is taken, and by the task name its artifacts record (math-verify:
    math), so that a run records the choice."""
    if not value:
        return value
    from sparrow.stages.tasks.rewards import CHOICES, reward_choice

    task = reward_choice(value)
    return next((k for k, v in CHOICES.items() if v == task), value.strip().lower())


def _reward_fn_spec(value: str | None) -> str | None:
    """--reward-fn as path.py:function, a file named alone meaning its compute_score (as in verl)."""
    from sparrow.stages.tasks.reward_function import reward_fn_spec

    return reward_fn_spec(value) if value else value


def reward_option():
    return typer.Option(None, "--reward", callback=_reward_name,
                        help="Score every prompt with one reward instead of its task's scorer (any "
                        "case; math-verify and code-tests, the names its artifacts record, too): math "
                        "(math-verify of the completion against the ground truth, as verl's and TRL's "
                        "math rewards) or code (the ground truth's tests, JSON with inputs, "
                        "outputs and fn_name for call tests or without it for stdin/stdout, run on the "
                        "completion's program in the sandbox; reward = the share passed). A verl or TRL "
                        "dataset has no reward without --reward or --reward-fn.")


def reward_fn_option():
    return typer.Option(None, "--reward-fn", callback=_reward_fn_spec,
                        help="Score every prompt with your function, path.py:function (a file alone: its "
                        "compute_score, as verl's custom_reward_function; a file, not a module's dotted "
                        "path), run in this process: verl's compute_score(data_source, solution_str, "
                        "ground_truth, extra_info) returning a number or a dict with 'score' (its other "
                        "fields are kept in the artifact's reward_extra), or TRL's f(prompts, completions, "
                        "**columns) returning one number per completion; the signature tells which.")


def _reward_kwargs(value: str | None) -> dict | None:
    """--reward-kwargs as the keywords it holds (a JSON object), refused in one sentence otherwise."""
    if value is None:
        return None
    from sparrow.stages.tasks import RewardError
    from sparrow.stages.tasks.reward_function import parse_reward_kwargs

    try:
        return parse_reward_kwargs(value)
    except RewardError as e:
        raise UsageError(str(e)) from None


def reward_kwargs_option():
    return typer.Option(None, "--reward-kwargs", metavar="<json>",
                        help="Keywords for --reward-fn's function, a JSON object (verl's "
                        "custom_reward_function.reward_kwargs), e.g. '{\"min_words\": 5}': passed to every "
                        "call besides what verl or TRL passes (a key that is one of those is refused), and "
                        "recorded with the rewards.")


def max_prompt_length_option():
    return typer.Option(None, "--max-prompt-length", metavar="<int>",
                        help="Prompt tokens at most, after the chat template (verl's data.max_prompt_length, "
                        "TRL's max_prompt_length); a longer prompt is refused unless --truncation cuts it or "
                        "--filter-overlong-prompts leaves it out. Default: what the model's context leaves "
                        "beside --max-new-tokens.")


def truncation_option():
    return typer.Option("error", "--truncation", metavar="error|left|right|middle",
                        help="A prompt longer than --max-prompt-length (verl's data.truncation): error "
                        "refuses the run before any work; left keeps its last tokens (as TRL cuts), right "
                        "its first, middle its first and last halves. What was cut is noted and recorded.")


def filter_overlong_option():
    return typer.Option(False, "--filter-overlong-prompts/--no-filter-overlong-prompts",
                        help="Leave out the prompts longer than --max-prompt-length (without it: those that "
                        "do not fit the context beside --max-new-tokens) instead of refusing the run (verl's "
                        "data.filter_overlong_prompts); the others keep their ids and seeds. Said in a note "
                        "and recorded as filtered_prompts.")


def prompt_length(max_prompt_length: int | None = None, truncation: str = "error",
                  filter_overlong: bool = False):
    """The `PromptLength` of the flags, checked."""
    from sparrow.stages.core.prompt_length import PromptLength, Truncation

    try:
        length = PromptLength(max_prompt_length, Truncation.of(truncation), filter_overlong)
        length.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return length


def data_options(answer_column: str | None, reward: str | None, reward_fn: str | None,
                 reward_kwargs: str | None = None, length=None, prompt_column: str | None = None):
    """The `DataOptions` of the flags (with `length`, a `PromptLength`), checked before any work (the
    function is imported here, so a file that does not load is refused before any weights do)."""
    from sparrow.stages.core.prompt_length import PromptLength
    from sparrow.stages.core.user_data import DataOptions, DatasetError
    from sparrow.stages.tasks import RewardError

    options = DataOptions(answer_column, reward, reward_fn, _reward_kwargs(reward_kwargs),
                          length or PromptLength(), prompt_column)
    try:
        options.reward_task()
    except (DatasetError, RewardError) as e:
        raise UsageError(str(e)) from None
    return options


def read_eval_prompts(path: Path, data: DataOptions | None = None) -> PromptSet:
    """The --eval-prompts set, whose refusals name the flag (they name the file, as --prompts' do, and the
    two flags' files read alike)."""
    from sparrow.schemas import ArtifactError
    from sparrow.stages.core.prompt_set import PromptError, PromptSet
    from sparrow.stages.core.user_data import DatasetError

    try:
        return PromptSet.read(path, data)
    except (PromptError, DatasetError, ArtifactError) as e:
        said = str(e)
        raise UsageError(f"--eval-prompts {said}" if said.startswith(str(path)) else said) from None
