"""The field types the spec models share: the strict base model, numeric ranges (`Bounds`, `AutoOr`),
locations (a path or a storage URI) and names.

Every number has a finite, sane range (no inf or nan anywhere), and a value outside it is refused with a
message that names the range, e.g. `must be between -100 and 100 (got 600)`: one bad job must be refused
when it is submitted, never overflow or crash the service later (a policy's `4.0 ** priority`, SQLite's
64-bit INTEGER columns, a micro-batch no step can hold)."""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    PlainSerializer,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from actors.storage.storage_uri import StorageURI, as_location

# Safe as a folder name, an MQTT topic level and a module-dict key: no '/', '+', '#', '.', spaces.
JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
USER_NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
"""A user of a shared service (actors/service/accounts/users.py): also a folder name and an MQTT topic level."""
PATTERN_WORDS = {
    JOB_NAME_PATTERN: "1 to 64 letters, digits, '_' or '-', the first a letter or digit (it names a folder and an MQTT "
                      "topic level: no spaces, '/', '.', '+' or '#')",
    USER_NAME_PATTERN: "1 to 32 lower-case letters, digits, '_' or '-', the first a letter",
}
"""What a value of each name pattern may hold, in words (for messages: the regular expression is not one)."""

INT64_MAX = 2**63 - 1
"""The largest integer SQLite's INTEGER column (a signed 64-bit integer) holds."""


def _location(value: Any) -> Path | StorageURI:
    if not isinstance(value, (str, Path)):
        raise ValueError(f"expected a path or a storage URI (s3://bucket/prefix), not {type(value).__name__}")
    if isinstance(value, str) and not value.strip():
        raise ValueError("expected a path or a storage URI (s3://bucket/prefix), not an empty string")
    return as_location(value)


Location = Annotated[Path | StorageURI, PlainValidator(_location), PlainSerializer(str, return_type=str),
                     WithJsonSchema({"type": "string", "description": "a path or a storage URI"})]
"""A folder or file: a path, or a storage URI (`s3://bucket/prefix`, `gs://...`, `file:///...`) kept intact
as a `StorageURI` (actors/storage/storage_uri.py)."""


def _show(number: float) -> str:
    """A bound as a user would write it: whole floats without '.0', long integers with '_' separators."""
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    return f"{number:_}" if isinstance(number, int) and abs(number) >= 1_000_000 else str(number)


@dataclass(frozen=True)
class Bounds:
    """The allowed range of a numeric field, as `Annotated[int, Bounds(1, 65536)]`: checked after the type
    (and, for floats, finiteness: the models refuse inf and nan), with one message that names both ends
    and the value given. `low_open` / `high_open` exclude that end; `high_label` shows the upper end
    differently (e.g. '2**63')."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    high_label: str | None = None

    def describe(self) -> str:
        high = self.high_label or _show(self.high)
        if not self.low_open and not self.high_open:
            return f"between {_show(self.low)} and {high}"
        lower = f"greater than {_show(self.low)}" if self.low_open else f"at least {_show(self.low)}"
        upper = f"less than {high}" if self.high_open else f"at most {high}"
        return f"{lower} and {upper}"

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def _check(self, value: Any, handler: core_schema.ValidatorFunctionWrapHandler) -> Any:
        try:
            checked = handler(value)
        except ValidationError as error:
            if any(item["type"] == "finite_number" for item in error.errors()):
                raise PydanticCustomError("finite_number", "must be a finite number {range} (got {got})",
                                          {"range": self.describe(), "got": str(value)}) from error
            raise
        if not self.contains(checked):
            raise PydanticCustomError("out_of_range", "must be {range} (got {got})",
                                      {"range": self.describe(), "got": str(checked)})
        return checked

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_wrap_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        json_schema = handler(schema)
        json_schema["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        json_schema["exclusiveMaximum" if self.high_open else "maximum"] = self.high
        return json_schema


# Shared ranges. Integers that reach SQLite (priority, seed, steps) stay inside a signed 64-bit integer.
Priority = Annotated[int, Bounds(-100, 100)]
Seed = Annotated[int, Bounds(0, 2**63, high_open=True, high_label="2**63")]
StepCount = Annotated[int, Bounds(1, 10**9)]


@dataclass(frozen=True)
class AutoOr:
    """A numeric setting that may also be "auto", as `Annotated[int | Literal["auto"], AutoOr(Bounds(...))]`: "auto",
    anything else checked as a whole number within the bounds, with the bounds' one message (not pydantic's two
    errors of a union)."""

    bounds: Bounds

    def _check(self, value: Any) -> Any:
        if value == "auto":
            return value
        try:
            return _whole_number(self.bounds).validate_python(value)
        except ValidationError as error:
            first = error.errors()[0]
            raise PydanticCustomError(first["type"], "must be auto or a whole number " + self.bounds.describe()
                                      + " (got {got})", {"got": str(value)}) from None

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self._check)

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"anyOf": [{"const": "auto"}, {"type": "integer", "minimum": self.bounds.low,
                                              "maximum": self.bounds.high}]}


@functools.cache
def _whole_number(bounds: Bounds) -> TypeAdapter:
    return TypeAdapter(Annotated[int, bounds])


@functools.cache
def _scalar(annotation: Any) -> type | None:
    """int, float or bool where a field holds one of them (or None besides), else None."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _scalar(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
        return _scalar(kinds[0]) if len(kinds) == 1 else None
    return annotation if annotation in (int, float, bool) else None


class StrictModel(BaseModel):
    """No unknown field, no inf or nan, and truth values kept apart from numbers: pydantic's lax mode would take
    `max_steps: true` as 1 step and `use_dora: "yes"` or `streaming: 1` as true."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _truth_values_apart(cls, value: Any, info: ValidationInfo) -> Any:
        kind = _scalar(cls.model_fields[info.field_name].annotation) if info.field_name in cls.model_fields else None
        if kind in (int, float) and isinstance(value, bool):
            raise PydanticCustomError("number_type", "must be a number, not {value} (a truth value)",
                                      {"value": str(value).lower()})
        if kind is bool and not isinstance(value, bool):
            raise PydanticCustomError("bool_type", "must be true or false (got {value})", {"value": repr(value)})
        return value
