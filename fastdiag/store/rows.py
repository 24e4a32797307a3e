"""Rows as JSON text: what the store writes into its TEXT columns."""
from __future__ import annotations

import json
import math


def _clean(value):
    """JSON-able copy with non-finite floats turned into None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):      # numpy / torch scalars
        try:
            return _clean(value.item())
        except (TypeError, ValueError):
            pass
    return value


def dumps(value) -> str:
    return json.dumps(_clean(value), allow_nan=False, separators=(",", ":"))
