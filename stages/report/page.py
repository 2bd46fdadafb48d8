"""The HTML page that embeds every figure (one file to share), and the record it keeps of what the report
wrote, so that a rerun removes only its own stale figures."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from .canvas import Figure, shown


def listed_figures(out: Path) -> set[str]:
    """The PNGs the report already in `out` wrote: its index.html lists each as a figure id. That page is
    the record of what the report wrote, so a file it does not list (a user's) is never touched."""
    page = out / "index.html"
    if not page.is_file():
        return set()
    text = page.read_text(errors="replace")
    if "Sparrow report" not in text[:2000]:
        return set()
    names = {html.unescape(n) for n in re.findall(r"<figure id='([^']+)'>", text)}
    return {n for n in names if n.endswith(".png") and Path(n).name == n}


def remove_stale(out: Path, names: set[str]) -> None:
    """The previous report's figures that this one did not draw (their artifact is gone): removed once the
    new page is written, so the folder holds what the page shows and an interrupted report loses nothing."""
    for n in sorted(names):
        path = out / n
        if path.is_file() and not path.is_symlink():
            path.unlink()


def html_page(run_dir: Path, out: Path, figures: list[Figure], skipped: list[str]) -> str:
    name = html.escape(shown(str(run_dir)))
    parts = [f"<!doctype html><meta charset='utf-8'><title>Sparrow report: {name}</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto}img{max-width:100%}"
             "figure{margin:2em 0}figcaption{color:#444}</style>",
             f"<h1>Sparrow report: {name}</h1>"]
    for f in figures:
        title = html.escape(f.title)
        data = base64.b64encode((out / f.file).read_bytes()).decode()
        parts.append(f"<figure id='{html.escape(f.file)}'><h2>{title}</h2>"
                     f"<img src='data:image/png;base64,{data}' alt='{title}'>"
                     f"<figcaption>{html.escape(f.caption)} ({html.escape(f.file)})</figcaption></figure>")
    if skipped:
        parts.append("<h2>Not drawn</h2><ul>" + "".join(f"<li>{html.escape(shown(s))}</li>" for s in skipped)
                     + "</ul>")
    return "\n".join(parts) + "\n"
