"""Typed analysis results and their one JSON form. A result is a frozen dataclass whose fields are
declared in the order ``fastdiag analyze --json`` prints them; a field made with ``optional()`` is left
out of the JSON while it is None (the "error" of a result that could not be computed, or the numbers
of one that has an error), every other field is always written (None as null)."""
from __future__ import annotations

import dataclasses
from typing import Any

_OMIT_IF_NONE = {"omit_if_none": True}


def optional() -> Any:
    """A field that defaults to None and is absent from the JSON while it is None."""
    return dataclasses.field(default=None, metadata=_OMIT_IF_NONE)


def to_json(value):
    """Dataclasses as dicts (fields in declaration order, optional ones only when set), tuples as lists,
    recursively; everything else as it is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (getattr(value, f.name) is None and f.metadata.get("omit_if_none"))}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


class JSONResult:
    """``to_dict()``: the result as the JSON-able dict ``fastdiag analyze --json`` prints."""

    def to_dict(self) -> dict:
        return to_json(self)
