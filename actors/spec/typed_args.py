"""Specs and settings cross process boundaries as the validated objects their sender built (a pydantic model
pickles without being validated again): `expect_type` refuses anything else where it arrives, naming what
came instead, rather than failing later on a missing attribute."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def expect_type(value: Any, kind: type[T], what: str) -> T:
    """`value` itself when it is a `kind`; else a TypeError that says what came and what to do."""
    if isinstance(value, kind):
        return value
    raise TypeError(f"{what} must arrive as a {kind.__module__}.{kind.__qualname__}, not a "
                    f"{type(value).__module__}.{type(value).__qualname__}: build it with the aspen client of the "
                    "same version as the service (`Client.submit`, `Client.sweep`), which validates it first")
