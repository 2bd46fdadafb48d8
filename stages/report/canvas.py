"""What every figure shares: matplotlib without a display, a panel that says why it is empty, and the saved
PNG with its title and caption drawn in (so that it says what it shows when it travels alone)."""

from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass
from pathlib import Path

from sparrow.schemas.io import write_bytes


@dataclass
class Figure:
    file: str
    title: str
    caption: str
    points: int  # data points drawn
    said: tuple[str, ...] = ()  # the words drawn where a panel had nothing to show


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def integer_steps(axis) -> None:
    """Ticks at whole steps only, even where the view holds one whole number (a run of one step), where
    matplotlib's integer locator would fall back to fractions."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def say(ax, why: str) -> None:
    """A panel with nothing to draw says why, in place of empty axes."""
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.text(0.5, 0.5, "\n".join(textwrap.wrap(why, 40)), ha="center", va="center", transform=ax.transAxes,
            fontsize=10, color="#555")


def shown(text: str) -> str:
    """Text for a figure or the page: control characters (of a file's name) as the escapes a terminal is
    shown (\\x1b), never drawn as a missing glyph nor written raw into the HTML."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def save(fig, out: Path, name: str, title: str, caption: str, plt, points: int, top_in: float = 0.0
          ) -> Figure:
    """Title above (and `top_in` inches for a figure legend), the caption (wrapped to the figure's width)
    below the axes, then the PNG."""
    title, caption = shown(title), shown(caption)
    width_in, height_in = fig.get_size_inches()
    lines = textwrap.wrap(caption, int(width_in * 15))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.15 * (len(lines) + 1) / height_in, 1, 1 - top_in / height_in))
    said = tuple(dict.fromkeys(" ".join(t.get_text().split()) for ax in fig.axes for t in ax.texts))  # once
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=8, color="#333", va="bottom")
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_bytes(out / name, png.getvalue())  # atomic: an interrupted report never leaves half a PNG
    return Figure(name, title, caption, points, said)
