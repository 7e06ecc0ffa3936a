"""The Tinker API's JSON answers built with the SDK's own types (`tinker.types`): `typed` validates an answer's
fields against the type the SDK reads it into and serializes it from that type, so that a field aspen sends and
the installed SDK does not know (renamed or dropped in a later SDK, which its types would silently ignore: they
take extra fields) fails aspen's tests and its call, saying which, rather than reaching users as a missing value.

The wire shape stays what the SDK parses: the fields aspen sets, nothing the type would add by default
(`exclude_unset`), and a future's `type` (which the SDK's futures carry) also where the type has no such field
(OptimStepResponse).

A NaN or infinite number in a JSON answer (a diverged loop's optimizer metric) is sent as the string "NaN",
"Infinity" or "-Infinity" (`SdkJSONResponse`, every /api/v1 route's): the SDK reads a future's JSON with orjson,
which refuses the NaN/Infinity tokens (the call would fail as unreadable), and null is no float to its types,
while its pydantic types read those strings back as the float. Answers in protobuf (forward_backward's outputs,
samples) carry non-finite floats as they are."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from orchestrator.strict_json import finite

NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}   # as pydantic's ser_json_inf_nan="strings"


class UnknownField(HTTPException):
    """An answer's field the SDK's type does not have: aspen's answer is out of step with the installed SDK (a
    route's answer: 500 saying so; a future's: the call fails so, category "server")."""

    category = "server"

    def __init__(self, detail: str):
        super().__init__(500, detail)

    def __str__(self) -> str:
        return str(self.detail)


def typed(sdk_type: type[BaseModel], tag: str | None = None, /, **fields: Any) -> dict[str, Any]:
    """`fields` as the SDK's `sdk_type` reads them, serialized from it (JSON), with `tag` as its `type` (the
    future's); UnknownField for a field (nested too) the type does not have, pydantic's ValidationError for a value
    it does not take."""
    known_tag = tag is not None and "type" in sdk_type.model_fields
    answer = sdk_type.model_validate(fields | ({"type": tag} if known_tag else {}))
    dumped = answer.model_dump(mode="json", exclude_unset=True)
    if dropped := _dropped(fields, dumped):
        raise UnknownField(f"aspen's answer has {', '.join(dropped)}, which the installed tinker SDK "
                           f"({version('tinker')}) has no field for in {sdk_type.__name__}: aspen's Tinker routes "
                           "(orchestrator/tinker/) are out of step with this SDK version; install the version aspen "
                           "is tested with (pyproject.toml) or update the route")
    return dumped if tag is None or known_tag else {"type": tag} | dumped


def _dropped(given: dict[str, Any], dumped: dict[str, Any], where: str = "") -> list[str]:
    """The keys of `given` (nested dicts too, as `where.key`) that `dumped` lacks: fields the type ignored."""
    missing = []
    for key, value in given.items():
        if key not in dumped:
            missing.append(f"'{where}{key}'")
        elif isinstance(value, dict) and isinstance(dumped[key], dict):
            missing += _dropped(value, dumped[key], f"{where}{key}.")
    return missing


class SdkJSONResponse(JSONResponse):
    """The Tinker API's JSON: a NaN or infinite float as "NaN", "Infinity" or "-Infinity" (the module says why)."""

    def render(self, content: Any) -> bytes:
        return super().render(finite(content, lambda number: NON_FINITE[str(number)]))
