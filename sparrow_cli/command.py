"""The typer Command and Group that every `sparrow` command is built with.

An idea's other names (ALIASES: vLLM's, verl's, TRL's and Sparrow's older ones) are accepted, while
--help shows the option under one name and lists the others in its help. Flags show no value
placeholder. Every subcommand takes -q/--quiet. --help is laid out whole (help_layout) and fails as any
stdout writer does (console.writing_stdout); a parse error names the command it belongs to (parser_errors)."""

from __future__ import annotations

import functools

import typer
from typer.core import TyperCommand, TyperGroup

from .console import console, writing_stdout
from .help_layout import whole_help_cells
from .parser_errors import parsing, refuse_repeated_options


def _bare_flags(params: list) -> list:
    """Flags take no value: --help shows no value placeholder (such as <bool>) beside them."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    return params


# The other names of an idea's option (vLLM's, verl's or TRL's, and Sparrow's older ones), keyed by the name
# that every command with the idea declares. docs/commands.md, "Option names", lists them.
ALIASES: dict[str, tuple[str, ...]] = {
    "--max-num-seqs": ("--max-batch", "--batch-size", "--batch"),
    "--samples": ("--num-generations",),
    "--max-new-tokens": ("--max-completion-length", "--max-tokens", "--max-response-length"),
    "--output": ("--output-dir",),
    "--lr": ("--learning-rate",),
    "--kl-coef": ("--beta", "--kl-loss-coef"),
    "--eager": ("--enforce-eager",),
    "--speculate": ("--num-speculative-tokens",),
    "--ppo-epochs": ("--num-iterations",),
    "--loss-agg": ("--loss-type",),
    "--epsilon": ("--clip-ratio-low",),
    "--epsilon-high": ("--clip-ratio-high",),
}


def take_aliases(params: list) -> dict:
    """Each option named in ALIASES -> its other names, taken out of its declared names (so that --help
    shows the option under its one name, the others in a last sentence of its help): every command with
    the idea answers to all of them, except a name that already names another of its options (distill's
    --batch-size, its trajectories per step, stays that); a switch answers only to the aliases it declares
    (fit-cost's and plan-schedule's --speculate switches are another idea than a token count)."""
    taken = {name for param in params for name in (*param.opts, *getattr(param, "secondary_opts", ()))}
    aliases = {}
    for param in params:
        primary = next((n for n in param.opts if n in ALIASES), None)
        if primary is None:
            continue
        names = [a for a in ALIASES[primary] if a in param.opts or (a not in taken and not param.is_flag)]
        if not names:
            continue
        param.opts = [n for n in param.opts if n not in names]
        param.help = f"{param.help or ''} Also {', '.join(names)}.".lstrip()
        aliases[param] = names
    return aliases


class Command(TyperCommand):
    """A subcommand whose --help shows flags without a value placeholder, whose options answer to their
    names in ALIASES (`take_aliases`), and which takes -q/--quiet (`quiet_option`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aliases = take_aliases(self.params)
        self.params.append(quiet_option())

    def get_params(self, ctx) -> list:
        return _bare_flags(super().get_params(ctx))

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        with parsing(ctx, list(args)):  # the parser empties `args`
            return super().parse_args(ctx, args)

    def make_parser(self, ctx):
        parser = super().make_parser(ctx)
        parse = parser.parse_args

        def parse_once(args: list[str]):
            given = list(args)  # the parser empties `args`
            opts, rest, order = parse(args=args)
            refuse_repeated_options(ctx, order, given)
            return opts, rest, order

        parser.parse_args = parse_once
        for param, names in self.aliases.items():
            if param.is_flag:  # an alias of a switch takes no value
                parser.add_option(obj=param, opts=names, dest=param.name, action="store_const", const=True)
            else:
                parser.add_option(obj=param, opts=names, dest=param.name,
                                  action="append" if param.multiple else "store", nargs=param.nargs)
        return parser

    def format_help(self, ctx, formatter) -> None:
        with writing_stdout(), whole_help_cells():  # a full disk or a closed stdout: one sentence
            super().format_help(ctx, formatter)


@functools.cache
def quiet_option():
    """-q/--quiet: stderr holds only warnings and errors (no progress, notes or summary) for this command;
    stdout's data and the files written are the same. Built as typer builds any option, then shared."""
    probe = typer.Typer()

    @probe.command()
    def _quiet(quiet: bool = typer.Option(
            False, "--quiet/--no-quiet", "-q", is_eager=True, expose_value=False, callback=_be_quiet,
            help="Print only warnings and errors on stderr: no progress, notes or summary (stdout's data "
                 "and the files written are the same).")) -> None:
        """Never run: only its option is taken."""

    return typer.main.get_command(probe).params[0]


def _be_quiet(ctx, param, value: bool) -> None:
    """Quiet from here to the command's end (`Sparrow.invoke` lifts it, also after a refused command line)."""
    if value:
        console.quiet = True


class Group(TyperGroup):
    """The `sparrow` command itself, its flags (--version, --help) shown as its subcommands' are."""

    def get_params(self, ctx) -> list:
        return _bare_flags(super().get_params(ctx))

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        with parsing(ctx, list(args)):  # the parser empties `args`
            return super().parse_args(ctx, args)

    def format_help(self, ctx, formatter) -> None:
        with writing_stdout(), whole_help_cells():
            super().format_help(ctx, formatter)
