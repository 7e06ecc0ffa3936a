"""Strict JSON for every answer aspen prints or sends: a NaN or infinite number (a diverged job's loss, its grad
norm) is written as null, as the HTTP API sends it (orchestrator/http/responses.py) and a browser's
JSON.stringify writes it, since the bare NaN/Infinity tokens Python's json writes are refused by jq, a browser's
JSON.parse and most languages' parsers."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any


def finite(value: Any, spelled: Callable[[float], Any] = lambda number: None) -> Any:
    """`value` (dicts, lists and tuples of it, nested) with each NaN or infinite float replaced by `spelled` of it
    (None: null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else spelled(value)
    if isinstance(value, dict):
        return {key: finite(item, spelled) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item, spelled) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """`value` as strict JSON (`json.dumps`'s `options`): each non-finite number null."""
    return json.dumps(finite(value), allow_nan=False, **options)
