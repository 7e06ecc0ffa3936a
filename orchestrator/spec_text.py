"""Job specs as text (a jobs file, a `POST /v1/jobs` body) read into data within limits. No text may make
the reader run for minutes or build a structure without end: limited are its nesting depth, its number of
values (after YAML aliases are expanded: a few bytes of `*name` can stand for billions), YAML anchors and
aliases at all where the text is not the user's own, and the time it takes to read (checked as it reads).

YAML is read with libyaml (PyYAML's C parser) where PyYAML has it, in two passes: the first walks the
parser's events and stops at the first limit exceeded, before anything is built (a body of a million `[`
stops at the 33rd); the second builds the data with PyYAML's safe constructor (mappings, lists, strings,
numbers, booleans, dates). Without libyaml the same limits hold on PyYAML's pure-Python parser, which is
slower (about 1 s for a line of nested brackets). JSON is parsed by `json` (C), then checked the same way.
Ray-free and torch-free."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import yaml

LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # libyaml where PyYAML was built with it
MAX_DEPTH = 32             # a jobs file nests 5 deep (file, jobs, job, format, columns)
CHECK_EVERY = 512          # events between looks at the clock


@dataclass(frozen=True)
class TextLimits:
    """What a spec's text may hold: `depth` nested mappings / lists, `values` values in all (mapping keys
    included, aliases counted as what they stand for), YAML anchors and aliases or not, and `seconds` of
    reading (None: no limit)."""

    depth: int = MAX_DEPTH
    values: int = 1_000_000
    aliases: bool = True
    seconds: float | None = None


class TooComplex(ValueError):
    """A text beyond its `TextLimits`: `kind` is too_deep, too_many_values, yaml_alias or too_slow, `reason`
    says which limit (or duplicate_key: a mapping's key written twice); `line` and `column` (1-based) where the
    reader stopped, when known."""

    def __init__(self, kind: str, message: str, line: int | None = None, column: int | None = None):
        self.kind, self.reason, self.line, self.column = kind, message, line, column
        where = f" (line {line}, column {column})" if line is not None else ""
        super().__init__(message + where)


def _at(mark: Any) -> dict[str, int]:
    return {"line": mark.line + 1, "column": mark.column + 1} if mark is not None else {}


def check_yaml(text: str, limits: TextLimits, loader: type = LOADER) -> None:
    """Walk `text`'s YAML events; `TooComplex` at the first limit exceeded, `yaml.YAMLError` for text that is
    not YAML (as far as it was read)."""
    deadline = None if limits.seconds is None else time.monotonic() + limits.seconds
    depth = values = 0
    sizes: dict[str, int] = {}                       # anchor -> the values it stands for
    open_collections: list[tuple[str | None, int]] = []   # (anchor, values before it) of each open collection
    keys = _MappingKeys()
    try:
        for count, event in enumerate(yaml.parse(text, Loader=loader)):
            keys.see(event)
            if not limits.aliases and isinstance(event, yaml.NodeEvent) and event.anchor is not None:
                raise TooComplex("yaml_alias", "YAML anchors and aliases (&name, *name) are not accepted here; write "
                                 "the values out", **_at(event.start_mark))
            if isinstance(event, yaml.AliasEvent):
                values += sizes.get(event.anchor, 1)   # an undefined alias: the parser's error comes later
            elif isinstance(event, yaml.ScalarEvent):
                values += 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.CollectionStartEvent):
                open_collections.append((event.anchor, values))
                values += 1
                depth += 1
                if depth > limits.depth:
                    raise TooComplex("too_deep", f"nested more than {limits.depth} deep (mappings and lists in "
                                     "one another); a job spec nests 5 deep", **_at(event.start_mark))
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
                anchor, before = open_collections.pop()
                if anchor is not None:
                    sizes[anchor] = values - before
            if values > limits.values:
                counted = " (aliases counted as what they stand for)" if limits.aliases else ""
                raise TooComplex("too_many_values", f"more than {limits.values} values{counted}",
                                 **_at(event.start_mark))
            if deadline is not None and count % CHECK_EVERY == 0 and time.monotonic() > deadline:
                raise TooComplex("too_slow", f"not read within {limits.seconds:g} s", **_at(event.start_mark))
    except yaml.YAMLError as error:
        if "maximum nesting depth" in str(error):   # libyaml's own limit (1000), met while it reads ahead
            raise TooComplex("too_deep", f"nested more than {limits.depth} deep (mappings and lists in one "
                             "another); a job spec nests 5 deep", **_at(getattr(error, "problem_mark", None))) from None
        raise


class _MappingKeys:
    """Each open mapping's keys, from the parser's events: a key written twice in one mapping is refused (YAML
    loaders keep the last silently: `max_steps: 1` ... `max_steps: 2` trained 2 steps, the first line unread)."""

    def __init__(self) -> None:
        self.open: list[tuple[dict[str, int], list[bool]] | None] = []   # a mapping's keys and "a key is next"

    def see(self, event: yaml.Event) -> None:
        top = self.open[-1] if self.open else None
        is_key = top is not None and top[1][0]
        if is_key and isinstance(event, yaml.ScalarEvent):
            seen, line = top[0], event.start_mark.line + 1
            if event.value in seen:
                raise TooComplex("duplicate_key", f"'{event.value}' is written twice in one mapping (lines "
                                 f"{seen[event.value]} and {line}), and only the last would count; keep one",
                                 **_at(event.start_mark))
            seen[event.value] = line
        if isinstance(event, yaml.CollectionStartEvent):
            self.open.append(({}, [True]) if isinstance(event, yaml.MappingStartEvent) else None)
            return
        if isinstance(event, yaml.CollectionEndEvent):
            self.open.pop()
            top = self.open[-1] if self.open else None
        if top is not None and isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent, yaml.CollectionEndEvent)):
            top[1][0] = not top[1][0]   # a key read: its value is next; a value read: a key


def load_yaml(text: str, limits: TextLimits, loader: type = LOADER) -> Any:
    """The data of one YAML document within `limits` (`TooComplex`, `yaml.YAMLError`)."""
    check_yaml(text, limits, loader)
    return yaml.load(text, Loader=loader)   # a safe loader: CSafeLoader or SafeLoader


def compose_yaml(text: str, limits: TextLimits = TextLimits()) -> yaml.Node | None:
    """The node tree of one YAML document (its marks give each value's line), within `limits`."""
    check_yaml(text, limits)
    return yaml.compose(text, Loader=LOADER)


def load_json(text: str, limits: TextLimits) -> Any:
    """The data of a JSON text within `limits` (`TooComplex`, `json.JSONDecodeError`)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise TooComplex("too_deep", f"nested more than {limits.depth} deep (objects and arrays in one another); a "
                         "job spec nests 5 deep") from None
    values = 0
    pending: list[tuple[Any, int]] = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        values += 1
        if values > limits.values:
            raise TooComplex("too_many_values", f"more than {limits.values} values")
        if isinstance(value, (dict, list)):
            if depth > limits.depth:
                raise TooComplex("too_deep", f"nested more than {limits.depth} deep (objects and arrays in one "
                                 "another); a job spec nests 5 deep")
            children = value.values() if isinstance(value, dict) else value
            values += len(value) if isinstance(value, dict) else 0   # the keys
            pending.extend((child, depth + 1) for child in children)
    return data
