"""Plain data as JSON and back: what crosses between the host and a sandboxed program.

Only built-in data crosses: None, bool, int, float (NaN and infinities included), str, bytes, list,
tuple, dict, set and frozenset, nested. JSON carries the first five and lists as they are; a one-key
object tags the others (`{"tuple": [...]}`, `{"dict": [[key, value], ...]}`, `{"set": [...]}`,
`{"frozenset": [...]}`, `{"bytes": "<hex>"}`). `decode` builds exactly these types and nothing else, so
a value the host compares has the built-in types' `==`, never one a program wrote.

The sandbox gets a copy of this file to encode what its function returns, so it imports only the standard
library.
"""

from __future__ import annotations

from typing import Any

SCALARS = (bool, int, float, str)
TAGGED = {tuple: "tuple", set: "set", frozenset: "frozenset"}


def encode(value: Any) -> Any:
    """`value` as JSON-able data; TypeError for anything that is not plain built-in data."""
    if value is None or type(value) in SCALARS:
        return value
    for base in SCALARS:  # a subclass crosses as its base type's value
        if isinstance(value, base):
            return base(value)
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    for kind, tag in TAGGED.items():
        if isinstance(value, kind):
            return {tag: [encode(v) for v in value]}
    raise TypeError(f"a {type(value).__name__} is not plain data")


def decode(data: Any) -> Any:
    """The value `encode` gave `data` for, built from built-in types only; ValueError or TypeError for
    anything `encode` cannot have written."""
    if data is None or type(data) in SCALARS:
        return data
    if type(data) is list:
        return [decode(v) for v in data]
    if type(data) is not dict or len(data) != 1:
        raise ValueError("not an encoded value")
    (tag, items), = data.items()
    if tag == "bytes" and type(items) is str:
        return bytes.fromhex(items)
    if type(items) is not list:
        raise ValueError("not an encoded value")
    if tag == "dict":
        return {decode(k): decode(v) for k, v in items}
    kinds = {t: k for k, t in TAGGED.items()}
    if tag not in kinds:
        raise ValueError(f"unknown tag {tag!r}")
    return kinds[tag](decode(v) for v in items)
