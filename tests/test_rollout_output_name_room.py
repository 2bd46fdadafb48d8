"""`rollout -o OUT` journals into `OUT.partial/` beside OUT, under the name the user gave (so that `sparrow
sql` tells whose journal it is): a name too long for its file system to take those 8 bytes more is refused
before any work, in one sentence naming the limit; every name that leaves room is taken.

The independent expectation is the file system's own: making the folder `OUT.partial` fails with
ENAMETOOLONG exactly for the names refused.
"""

from __future__ import annotations

import errno
import os

import pytest
from typer.testing import CliRunner

from sparrow.schemas import write_artifact
from sparrow.schemas.locations import UnusableOutput, journal_folder
from sparrow.stages.rollout_journal import check_folder

from cli_checks import error_line

SUFFIX = ".partial"


def name_of(size: int) -> str:
    return "r" * (size - len(".parquet")) + ".parquet"


def test_the_longest_name_with_room_is_taken_and_one_byte_more_is_refused(tmp_path):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    fits, too_long = tmp_path / name_of(limit - len(SUFFIX)), tmp_path / name_of(limit - len(SUFFIX) + 1)
    (tmp_path / (fits.name + SUFFIX)).mkdir()  # the file system takes it...
    with pytest.raises(OSError) as e:  # ...and not one byte more
        (tmp_path / (too_long.name + SUFFIX)).mkdir()
    assert e.value.errno == errno.ENAMETOOLONG
    assert journal_folder(fits).name == fits.name + SUFFIX
    with pytest.raises(UnusableOutput) as refused:
        check_folder(too_long, resume=False, force=False)
    said = str(refused.value)
    assert f"would have a name of {limit + 1} bytes" in said and f"at most {limit} bytes here" in said
    assert f"choose a name of at most {limit - len(SUFFIX)} bytes" in said and "\n" not in said


def test_the_cli_refuses_it_in_one_line_and_leaves_nothing(tmp_path):
    from sparrow.cli.app import app

    prompts = write_artifact([{"prompt_id": "p0", "task": "gsm_symbolic", "prompt": "What is 2+2?",
                               "prompt_token_ids": None, "answer": "4", "metadata": None}],
                             tmp_path / "p.parquet", "prompts")
    out = tmp_path / name_of(os.pathconf(tmp_path, "PC_NAME_MAX") - 5)
    r = CliRunner().invoke(app, ["rollout", "--prompts", str(prompts), "--samples", "1", "--max-new-tokens",
                                 "4", "-o", str(out)])
    line = error_line(r)
    assert "cannot be written by a rollout: its journal" in line and "Traceback" not in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.parquet"]
