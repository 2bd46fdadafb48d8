"""Every SPARROW_* variable the code reads is in docs/commands.md's table of environment variables."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_variable_the_code_reads_is_in_the_table():
    read = set()
    for folder in ("stages", "sparrow_cli", "schemas", "kernels"):
        for source in (ROOT / folder).rglob("*.py"):
            read |= set(re.findall(r"\b(SPARROW_[A-Z_]+)\b", source.read_text()))
    page = (ROOT / "docs" / "commands.md").read_text()
    table = page.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(SPARROW_[A-Z_]+)` \|", table, re.M))
    assert read and read == listed, (read - listed, listed - read)
