"""--help laid out so that nothing in it is cut, at any width, on a terminal, in a pipe or in a log.

typer's tables cut option names, types, defaults and long words of help to "..." where their columns do
not fit. Here an options panel keeps each option's names and type whole beside a help column that wraps,
or, where the console is too narrow for that, stacks each option over its help (`whole_cells`); the
commands panel folds long words (`folded`). typer's private panel printers are wrapped only while --help
prints, and one that a typer release changed is left to typer's own layout, so --help never fails."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.text import Text

HELP_MIN_WIDTH = 30  # the least width an option's help gets beside its names; narrower, it goes below them
PANEL_FRAME = 4  # an options panel's border and padding, both sides


@contextmanager
def whole_help_cells() -> Iterator[None]:
    """typer's --help, its panels laid out so that nothing in them is cut: typer's own tables cut option
    names, types, defaults and long words of help to "..." wherever their columns do not fit (80 columns, a
    pipe, a log). typer prints each panel with one `console.print`, where its table is laid out first: the
    options by `whole_cells`, the commands with their descriptions folded (`folded`).

    The panel printers are typer's private functions: one that a typer release renamed, or that it calls
    another way, or a table of another shape, is left to typer's own layout, so that --help never fails."""
    from typer import rich_utils

    layouts = {"_print_options_panel": whole_cells, "_print_commands_panel": folded}
    typer_panels = {name: panel for name in layouts if callable(panel := getattr(rich_utils, name, None))}
    for name, panel in typer_panels.items():
        setattr(rich_utils, name, functools.partial(_laid_out, panel, layouts[name]))
    make_console = getattr(rich_utils, "_get_rich_console", None)
    if callable(make_console):
        rich_utils._get_rich_console = functools.partial(_at_least_help_width, make_console)
    try:
        yield
    finally:
        for name, panel in typer_panels.items():
            setattr(rich_utils, name, panel)
        if callable(make_console):
            rich_utils._get_rich_console = make_console


HELP_FLOOR = 40  # the narrowest help laid out; a narrower terminal (COLUMNS=20, or 0) wraps its lines


def _at_least_help_width(make_console: Callable, *args, **kwargs) -> Console:
    """typer's help console, at least HELP_FLOOR wide: at COLUMNS=0 rich prints nothing at all, and below
    it no option's name fits beside anything."""
    console = make_console(*args, **kwargs)
    if console.width < HELP_FLOOR:
        console.width = HELP_FLOOR
    return console


def _laid_out(typer_panel: Callable, layout: Callable, *args, **kwargs) -> None:
    if isinstance(kwargs.get("console"), Console):
        kwargs["console"] = _LayoutConsole(kwargs["console"], layout)
    typer_panel(*args, **kwargs)


class _LayoutConsole:
    """The console a help panel is printed on: its table laid out by `layout` first; anything else asked
    of it is the console's."""

    def __init__(self, console: Console, layout: Callable):
        self.console, self.layout = console, layout

    def print(self, panel, *args, **kwargs) -> None:
        from rich.panel import Panel
        from rich.table import Table

        if isinstance(panel, Panel) and isinstance(panel.renderable, Table):
            panel.renderable = self.layout(panel.renderable, self.console)
        self.console.print(panel, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.console, name)


def folded(table, console: Console):
    """A table whose cells fold a word wider than their column onto the next line, never cut it."""
    for column in table.columns:
        column.overflow = "fold"
    return table


def whole_cells(table, console: Console):
    """typer's options table (the required mark where any option is required, the names, the negative
    names, the type, the help) laid out so that nothing in it is cut: the names and the type each on one
    line beside a help column of at least HELP_MIN_WIDTH (and its longest word), which wraps; where the
    console is too narrow for that, each option's names and type on a line of their own, its help indented
    below. A help word wider than the space it has (a long path) folds onto the next line. A table of
    another shape than typer's 6 or 7 columns is left as it is."""
    from rich.measure import Measurement

    if len(table.columns) not in (6, 7):
        return table
    cells = [list(column.cells) for column in table.columns]
    for help_cell in cells[-1]:
        for item in getattr(help_cell, "renderables", ()):
            if isinstance(item, Text):
                item.overflow = "fold"
    options = console.options
    widest = [max((Measurement.get(console, options, c).maximum for c in column), default=0)
              for column in cells[:-1]]
    help_words = max((Measurement.get(console, options, item).minimum
                      for cell in cells[-1] for item in getattr(cell, "renderables", ())), default=0)
    room = console.width - PANEL_FRAME - sum(w + 2 for w in widest) - 2  # 2: each column's padding
    if room >= max(HELP_MIN_WIDTH, help_words):
        for column in table.columns[:-1]:
            column.no_wrap, column.overflow = True, "fold"  # only the help column gives way
        return table
    return _stacked(list(zip(*cells)), marked=len(table.columns) == 7)


def _stacked(rows: list[tuple], marked: bool):
    """Each option as a line of its names and type (`* --name, -n / --no-name <type>`), its help below."""
    from rich.padding import Padding
    from rich.table import Table

    grid = Table.grid(expand=True)
    grid.add_column(overflow="fold")
    for *names, kind, help_cell in rows:
        texts = [Text(c) if isinstance(c, str) else c for c in (*names, kind)]
        mark = texts.pop(0) if marked else Text()
        groups = [Text(", ").join([t for t in group if t.plain]) for group in (texts[0:2], texts[2:4])]
        line = Text(" ").join([t for t in (mark, Text(" / ").join([g for g in groups if g.plain]), texts[4])
                               if t.plain])
        grid.add_row(line)
        grid.add_row(Padding(help_cell, (0, 0, 0, 4)))
    return grid
