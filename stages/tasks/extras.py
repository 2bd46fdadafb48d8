"""The fields a user's reward function returns beside its score, as the strict JSON object of the
`reward_extra` column (rollouts and rewards artifacts): one encoder for `sparrow rollout` and
`sparrow reward`.

Design decisions:
- Whatever plain JSON can hold is kept as the value it is, so a query compares numbers as numbers:
  numpy and torch scalars and arrays become Python numbers and lists (`.tolist()`), other real numbers
  (Decimal, Fraction) floats, tuples and sets lists, and a NaN or an infinity null, as verl's
  `reward_extra_info` keeps the values and `sql --format json` writes non-finite numbers. The column is
  strict JSON (no bare NaN).
- Keys become strings as `json.dumps` writes them (1 -> "1", True -> "true", None -> "null"), and any
  other key its `str()` ((1, 2) -> "(1, 2)"); where two keys end up the same string, the later wins.
  Values JSON has no type for (a datetime, an object) are kept as their `str()`.
- Only what cannot be written at all is refused: a container that holds itself, or a nesting deeper
  than Python can walk. The refusal is one sentence naming the function and the row.
- A dataset's columns travel to a user's reward function inside a prompt's metadata, which is JSON
  (`column_json`, `column_value`): the values pyarrow reads that JSON has no type for (datetime, date,
  time, timedelta, Decimal, bytes) are written as a tagged object {TAG: type, "value": text} and read back
  as those Python values, the values `datasets` hands TRL's reward functions (a datetime keeps its UTC
  offset, not the name of its time zone). A dict of the user's that is exactly such a pair would be read
  back as the value; no dataset is expected to hold one.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from sparrow.schemas.footer import file_json

from .base import RewardError, row_of

DEMAND = ("a reward function returns a finite number or a dict with a numeric 'score', whose other fields "
          "must be JSON-serialisable")


class _Unencodable(ValueError):
    """A value no JSON can hold; the message says what is wrong with it."""


def extra_json(extra: Mapping[str, Any] | None, task: str, prompt_id: str,
               metadata: str | Mapping[str, Any] | None) -> str | None:
    """The `reward_extra` cell of a completion: `extra` (the fields beside the score that `task`'s
    function returned for prompt `prompt_id`) as a strict JSON object with sorted keys, None when there
    are none; RewardError naming the function and the row when it cannot be encoded."""
    if not extra:
        return None
    try:
        plain = _plain(extra, ())
    except _Unencodable as e:
        raise RewardError(f"{_function(task)} returned fields beside 'score' that cannot be JSON ({e}) on "
                          f"{_row(prompt_id, metadata)}; {DEMAND}") from None
    except RecursionError:
        raise RewardError(f"{_function(task)} returned fields beside 'score' nested too deeply to write as "
                          f"JSON on {_row(prompt_id, metadata)}; {DEMAND}") from None
    return json.dumps(plain, sort_keys=True, allow_nan=False)


def _plain(value: Any, path: tuple[int, ...]) -> Any:
    """`value` as plain JSON values; `path` holds the ids of the containers it is inside."""
    if value is None or isinstance(value, str | bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, Mapping | list | tuple | set | frozenset):
        if id(value) in path:
            raise _Unencodable("it holds itself: a circular reference")
        inside = (*path, id(value))
        if isinstance(value, Mapping):
            return {_key(k): _plain(v, inside) for k, v in value.items()}
        return [_plain(v, inside) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy and torch scalars and arrays
    if callable(tolist) and hasattr(value, "dtype"):
        return _plain(tolist(), path)
    return str(value)


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    item = getattr(key, "item", None)  # a numpy scalar key
    if callable(item) and hasattr(key, "dtype"):
        key = item()
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(key)
    return str(key)


# a user's function's task name -> its --reward-fn as given (`shown_as`): messages name the path typed
GIVEN: dict[str, str] = {}


def shown_as(task: str, spec: str) -> None:
    """Messages about `task` (a user's function) name it as `--reward-fn spec`, the path as typed."""
    GIVEN[task] = spec


def _function(task: str) -> str:
    """How a message names the reward: a user's function as `--reward-fn dir/file.py:name`, as given (its
    task name is `reward-fn:file.py:name`)."""
    kind, sep, name = task.partition(":")
    return f"--{kind} {GIVEN.get(task, name)}" if sep and kind == "reward-fn" else f"the {task} reward"


def _row(prompt_id: str, metadata: str | Mapping[str, Any] | None) -> str:
    """The dataset row a prompt came from (its metadata's file and row), with its prompt id."""
    meta = metadata
    if isinstance(metadata, str):
        try:
            meta = file_json(metadata)
        except ValueError:
            meta = None
    if isinstance(meta, Mapping) and isinstance(meta.get("row"), int) and meta.get("file"):
        return f"{row_of(meta['row'])} of {meta['file']} (prompt {prompt_id!r})"
    return f"prompt {prompt_id!r}"


# ---------------------------------------------------------------- a dataset's columns as JSON

TAG = "$sparrow.type"
_ENCODE: dict[type, tuple[str, Callable[[Any], str]]] = {
    datetime.datetime: ("datetime", lambda v: v.isoformat()),
    datetime.date: ("date", lambda v: v.isoformat()),
    datetime.time: ("time", lambda v: v.isoformat()),
    datetime.timedelta: ("timedelta", lambda v: str(v // datetime.timedelta(microseconds=1))),
    decimal.Decimal: ("decimal", str),
    bytes: ("bytes", lambda v: base64.b64encode(v).decode("ascii")),
}
_DECODE: dict[str, Callable[[str], Any]] = {
    "datetime": datetime.datetime.fromisoformat,
    "date": datetime.date.fromisoformat,
    "time": datetime.time.fromisoformat,
    "timedelta": lambda v: datetime.timedelta(microseconds=int(v)),
    "decimal": decimal.Decimal,
    "bytes": base64.b64decode,
}


def column_json(value: Any) -> Any:
    """A column's value as JSON values, the types JSON lacks tagged (module docstring); anything else
    unknown as its text."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {str(k): column_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [column_json(v) for v in value]
    kind = next((k for k in type(value).__mro__ if k in _ENCODE), None)
    if kind is None:
        return str(value)
    name, text = _ENCODE[kind]
    return {TAG: name, "value": text(value)}


def column_value(value: Any) -> Any:
    """`column_json`'s output read back as Python values."""
    if isinstance(value, list):
        return [column_value(v) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {TAG, "value"} and value[TAG] in _DECODE and isinstance(value["value"], str):
        return _DECODE[value[TAG]](value["value"])
    return {k: column_value(v) for k, v in value.items()}
