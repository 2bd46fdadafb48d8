"""A command line that click cannot parse, as one `error: ...` line and exit 2, as every other refusal.

click's message takes Sparrow's style (a lower-case start, no closing full stop) and says whose --help to
read, also for an error that click's parser raises without naming its command (`parsing`). An unknown
option gets Sparrow's own hint: our name for another tool's option (FOREIGN_NAMES: vLLM, TRL, verl), else
the command's options that look like a typo of it, never click's loose look-alikes."""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

try:  # typer 0.2x parses with a copy of click of its own
    from typer._click.exceptions import NoSuchOption
    from typer._click.exceptions import UsageError as ParserError
except ImportError:
    from click.exceptions import NoSuchOption
    from click.exceptions import UsageError as ParserError

from .messages import say_error


@contextmanager
def parsing(ctx, args: list[str]) -> Iterator[None]:
    """Reading `ctx`'s command line `args`: an error of click's parser that names no command (an option
    without its value, a flag given one) is `ctx`'s, so that its line says whose --help to read
    (`parser_message`); an extra argument that follows a switch is said to be that switch's value."""
    try:
        yield
    except ParserError as e:
        if e.ctx is None:
            e.ctx, e.cmd = ctx, ctx.command
        switch = _switch_given_a_value(e, args)
        if switch is not None:
            e.message = (f"{e.message.rstrip('.')}: {switch} takes no value on {ctx.command_path}, it is a "
                         "switch")
        raise


def _switch_given_a_value(error: ParserError, args: list[str]) -> str | None:
    """The switch (a flag option) right before the first extra argument click refused, if one is."""
    extra = re.fullmatch(r"Got unexpected extra argument(?:s|\(s\))? \((.*)\)", error.format_message())
    if extra is None or error.ctx is None:
        return None
    options = _option_names(error.ctx)
    for name, value in zip(args, args[1:]):
        option = options.get(name)
        if option is not None and getattr(option, "is_flag", False) and extra.group(1).startswith(value):
            return name
    return None


@contextmanager
def parser_errors() -> Iterator[None]:
    """A command line that click cannot parse (an unknown command or option, a value of the wrong type, a
    missing option or argument) as one "error: ..." line and exit 2, as every other refusal: typer would
    draw the usage, a hint and a box of 5 or more lines, cut at 80 columns in a log, without "error:". A
    bare `sparrow` has printed its help already."""
    try:
        yield
    except ParserError as e:
        if type(e).__name__ != "NoArgsIsHelpError":  # click 8.2's; typer prints nothing more of it either
            say_error(parser_message(e))
        sys.exit(e.exit_code)


def parser_message(error: ParserError) -> str:
    """click's message in the style of Sparrow's own (a lower-case start, no closing full stop), an
    unknown option's hint our own (`option_hint`), and where to read the command's options."""
    if isinstance(error, NoSuchOption) and any(c.isspace() for c in error.option_name):
        message = _dashed_argument(error.option_name, error.ctx)
    elif isinstance(error, NoSuchOption):
        hint = option_hint(error.option_name, error.ctx)
        message = f"No such option: {error.option_name}" + (f". {hint}" if hint else "")
    else:
        message = error.format_message()
    message = message.strip().rstrip(".")
    message = message[:1].lower() + message[1:]
    ctx = error.ctx
    if ctx is not None and ctx.help_option_names:
        message += f" (try '{ctx.command_path} {ctx.help_option_names[0]}')"
    return message


def _dashed_argument(typed: str, ctx) -> str:
    """An argument that starts with a dash and holds a space (no option name does), such as a query that
    opens with an SQL comment: read as an option by the parser, so `--` must come before it."""
    shown = typed if len(typed) <= 30 and typed.isprintable() else \
        repr(typed[:30]) + ("..." if len(typed) > 30 else "")
    command = ctx.command_path if ctx is not None else "sparrow"
    return (f"{shown} starts with a dash, so it was read as an option; put -- before it, after the options, "
            f"to give it as an argument ({command} [OPTIONS] -- ARGUMENT)")


@dataclass(frozen=True)
class ForeignName:
    """An option name of another tool for an idea Sparrow names otherwise."""

    ours: str  # Sparrow's option for the idea
    theirs: str  # whose name it is, as the help cites it
    flag: bool = False  # a switch, so that only a switch of ours answers for it
    unlike: tuple[str, str] | None = None  # (an option, how ours differs on the commands that have it)


_STEPS = ("--ppo-epochs", "which counts steps of rollouts, each of --ppo-epochs optimizer updates")
# What a vLLM, TRL or verl user types, for the commands that do not accept it as an alias (ALIASES). A
# hint names our option only where the command has it; a name listed here never gets a look-alike hint.
FOREIGN_NAMES: dict[str, ForeignName] = {
    "--n": ForeignName("--samples", "vLLM's n"),
    "--rollout-n": ForeignName("--samples", "verl's rollout.n"),
    "--prompt-key": ForeignName("--prompt-column", "verl's data.prompt_key"),
    "--train-files": ForeignName("--prompts", "verl's data.train_files"),
    "--val-files": ForeignName("--eval-prompts", "verl's data.val_files"),
    "--train-batch-size": ForeignName("--prompts-per-step", "verl's data.train_batch_size"),
    "--reward-funcs": ForeignName("--reward-fn", "TRL's reward_funcs"),
    "--num-return-sequences": ForeignName("--samples", "transformers' num_return_sequences"),
    "--enforce-eager": ForeignName("--eager", "vLLM's enforce_eager", flag=True),
    "--num-speculative-tokens": ForeignName("--speculate", "vLLM's num_speculative_tokens"),
    "--num-iterations": ForeignName("--ppo-epochs", "TRL's num_iterations"),
    "--loss-type": ForeignName("--loss-agg", "TRL's loss_type"),
    "--loss-agg-mode": ForeignName("--loss-agg", "verl's loss_agg_mode"),
    "--clip-ratio-low": ForeignName("--epsilon", "verl's clip_ratio_low"),
    "--clip-ratio-high": ForeignName("--epsilon-high", "verl's clip_ratio_high"),
    "--kl-loss-coef": ForeignName("--kl-coef", "verl's kl_loss_coef"),
    "--grad-clip": ForeignName("--max-grad-norm", "verl's grad_clip"),
    "--per-device-train-batch-size": ForeignName(
        "--micro-batch", "TRL's per_device_train_batch_size",
        unlike=("--micro-batch", "sequences per forward/backward; a step's batch is --prompts-per-step x "
                "--samples")),
    "--gradient-accumulation-steps": ForeignName(
        "--micro-batch", "TRL's gradient_accumulation_steps",
        unlike=("--micro-batch", "the sequences per forward/backward: a step accumulates the gradient of "
                "all its --prompts-per-step x --samples sequences")),
    "--lora-r": ForeignName("--lora-rank", "TRL's lora_r"),
    "--max-steps": ForeignName("--steps", "TRL's max_steps", unlike=_STEPS),
    "--total-training-steps": ForeignName("--steps", "verl's total_training_steps"),
    "--save-steps": ForeignName("--checkpoint-every", "TRL's save_steps", unlike=_STEPS),
    "--save-freq": ForeignName("--checkpoint-every", "verl's save_freq"),
    "--eval-steps": ForeignName("--eval-every", "TRL's eval_steps", unlike=_STEPS),
    "--test-freq": ForeignName("--eval-every", "verl's test_freq"),
    "--vllm-gpu-memory-utilization": ForeignName("--gpu-memory-utilization",
                                                 "TRL's vllm_gpu_memory_utilization"),
}
HINT_SIMILARITY = 0.8  # of the names without their dashes: a typo (--sampels), not a neighbour (--n, --dense)


def option_hint(typed: str, ctx) -> str | None:
    """What to say of an unknown option: our name for another tool's (FOREIGN_NAMES, also spelt with
    underscores), else the command's options that look like a typo of it. click's own suggestions (difflib
    at 0.6 on the whole names) point a vLLM user's --n at --dense and --quiet at --budget."""
    options = _option_names(ctx)
    name = typed.replace("_", "-")
    foreign = FOREIGN_NAMES.get(name)
    if foreign is not None:
        ours = options.get(foreign.ours)
        if ours is None or bool(getattr(ours, "is_flag", False)) != foreign.flag:
            return None
        if foreign.unlike is not None and foreign.unlike[0] in options:
            return f"Sparrow's nearest to {foreign.theirs} is {foreign.ours}, {foreign.unlike[1]}"
        return f"Sparrow's name for {foreign.theirs} is {foreign.ours}"
    if name in options:  # --top_p
        return f"Did you mean {name}?"
    if not name.startswith("--"):
        return None
    longs = {option[2:]: option for option in options if option.startswith("--")}
    close = difflib.get_close_matches(name[2:], longs, n=3, cutoff=HINT_SIMILARITY)
    return f"Did you mean {' or '.join(longs[c] for c in close)}?" if close else None


def _option_names(ctx) -> dict:
    """Every option name of `ctx`'s command, its aliases (ALIASES) and --no- forms included -> its option."""
    if ctx is None:
        return {}
    command = ctx.command
    names = {}
    for param in command.get_params(ctx):
        for name in (*param.opts, *getattr(param, "secondary_opts", ())):
            names[name] = param
    for param, aliases in getattr(command, "aliases", {}).items():
        names.update(dict.fromkeys(aliases, param))
    return names


# what to do instead where an option given twice reads as a wish for several values
REPEATED_ADVICE = {
    "--prompts": "to use several datasets, join them into one file first: with a.parquet and b.parquet in "
               "DIR, sparrow sql \"SELECT * FROM a UNION ALL BY NAME SELECT * FROM b\" --run DIR -o "
               "all.parquet",
    "--reward-fn": "Sparrow scores with one reward function; to sum several as TRL does, call them from one "
                 "function",
}


def refuse_repeated_options(ctx, order: list, args: list[str]) -> None:
    """A UsageError where an option of ONE_VALUE was given more than once (under any of its names): click
    keeps the last silently, and a second --prompts or --reward-fn reads as a wish for both. Anything else
    given again (--seed 1 ... --seed 2, -o a ... -o b) is the override that scripts rely on, in Sparrow as
    in argparse's tools (vLLM, TRL): the last one counts. The values are shown as
    typed in `args`, where they can be found there."""
    counts: dict = {}
    for param in order:
        if _one_of_a_kind(param):
            counts[param] = counts.get(param, 0) + 1
    repeated = next((p for p, n in counts.items() if n > 1), None)
    if repeated is None:
        return
    names = {n for n, p in _option_names(ctx).items() if p is repeated}
    given = [f"{name} {value}" for name, value in _given(args, names)]
    shown = f" ({', then '.join(given)})" if len(given) > 1 else ""
    flag = next((o for o in repeated.opts if o.startswith("--")), repeated.opts[0])
    advice = REPEATED_ADVICE.get(flag)
    raise ParserError(f"{flag} is given {_times(counts[repeated])}{shown}, but it takes one value"
                      f"{'; ' + advice if advice else ''}", ctx=ctx)


# the options whose repeat reads as a wish for several, as other tools take several: the datasets and
# artifacts a command reads (verl's data.train_files list), what scores the rewards (TRL's reward_funcs
# list)
ONE_VALUE = ("--prompts", "--eval-prompts", "--completions", "--rollouts", "--profile", "--reward",
             "--reward-fn")


def _one_of_a_kind(param) -> bool:
    return (getattr(param, "param_type_name", "") == "option" and any(o in ONE_VALUE for o in param.opts)
            and not param.multiple)


def _given(args: list[str], names: set[str]) -> list[tuple[str, str]]:
    """(name, value) of each occurrence of an option of `names` in `args`, as `--name value` or
    `--name=value`; nothing after `--`."""
    found = []
    for i, arg in enumerate(args):
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        if name in names and (eq or i + 1 < len(args)):
            found.append((name, value if eq else args[i + 1]))
    return found


def _times(n: int) -> str:
    return {2: "twice", 3: "three times"}.get(n, f"{n} times")
