"""Dataset formats (`format:` of a job): alpaca, prompt_response (checked `str.format` templates), chat,
text."""

from __future__ import annotations

import re
import string
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

# --------------------------------------------------------------------------
# Dataset formats
# --------------------------------------------------------------------------

ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


STORED = "stored"
"""Validation context key: a spec read back from where it was kept once accepted (a job table's row), to which
checks added since are not applied again (`model_validate_json(text, context={STORED: True})`): a job accepted
by an earlier version still loads."""

TEMPLATE_SPEC_LIMIT = 1000
"""Largest width or precision a template's format spec may ask for (``{x:>1000}``): a larger one would
build that many characters per row (``{x:>999999999}`` is a gigabyte string per row)."""

# Python's format spec mini-language: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(
    r"(?:(?P<fill>.)?(?P<align>[<>=^]))?(?P<sign>[-+ ])?z?#?0?(?P<width>\d+)?[,_]?"
    r"(?:\.(?P<precision>\d+))?(?P<type>[bcdeEfFgGnosxX%])?",
    re.DOTALL,
)


def _check_format_spec(template: str, name: str, spec: str, conversion: str | None) -> None:
    """Refuse what a field's conversion and format spec could do to every row: a conversion other than
    ``!s``/``!r``/``!a``, a nested field (``{x:{width}}``), a width or precision over
    ``TEMPLATE_SPEC_LIMIT``, or a spec that a text value cannot take (``{x:d}``)."""
    if conversion is not None and conversion not in ("s", "r", "a"):
        raise ValueError(
            f"template {template!r}, field '{name}': conversion '!{conversion}' is not one of !s, !r, !a"
        )
    if not spec:
        return
    if "{" in spec or "}" in spec:
        raise ValueError(
            f"template {template!r}, field '{name}': nested replacement fields in a format spec "
            f"('{{{name}:{spec}}}') are not supported; write the width or precision as a number "
            f"(at most {TEMPLATE_SPEC_LIMIT})"
        )
    match = _FORMAT_SPEC.fullmatch(spec)
    if match is None:
        raise ValueError(f"template {template!r}, field '{name}': format spec {spec!r} is not valid for a text value")
    for part in ("width", "precision"):
        digits = match.group(part)
        if digits is not None and int(digits) > TEMPLATE_SPEC_LIMIT:
            raise ValueError(
                f"template {template!r}, field '{name}': format spec {spec!r} has {part} {int(digits)}, over the "
                f"limit of {TEMPLATE_SPEC_LIMIT}"
            )
    try:
        format("text", spec)  # row values are strings: a spec they cannot take fails here, not per row
    except ValueError as exc:
        raise ValueError(
            f"template {template!r}, field '{name}': format spec {spec!r} is not valid for a text value: {exc}"
        ) from exc


def _template_fields(template: str) -> list[str]:
    """Field names used by a ``str.format`` template, in order, deduplicated.

    Raises ``ValueError`` for malformed templates, positional fields (``{}``,
    ``{0}``), attribute/index access (``{a.b}``, ``{a[0]}``), conversions other
    than ``!s``/``!r``/``!a``, nested fields in a format spec (``{a:{b}}``) and a
    width or precision over ``TEMPLATE_SPEC_LIMIT``.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"template {template!r} does not parse: {exc} (write literal braces as '{{{{' and '}}}}')"
        ) from exc
    names: list[str] = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if name == "" or name.isdigit():
            raise ValueError(
                f"template {template!r} has a positional field '{{{name}}}'; "
                "name a row field instead, e.g. '{question}'"
            )
        if name[:1] in ("'", '"'):   # JSON in a prompt: `{"a": 1}` is read as a field named '"a"'
            literal = "{" + name + (f":{spec}" if spec else "") + "}"
            raise ValueError(
                f"template {template!r} reads {literal!r} as a row field; to write braces as text, double them: "
                f"{literal.replace('{', '{{').replace('}', '}}')!r}"
            )
        if "." in name or "[" in name:
            raise ValueError(
                f"template {template!r} uses '{{{name}}}'; only plain row field names are "
                "supported (no attribute or index access); for a value nested in a column, use a "
                "plain name and map it with columns, e.g. '{text}' with columns: {text: q.text}"
            )
        _check_format_spec(template, name, spec or "", conversion)
        if name not in names:
            names.append(name)
    return names


class AlpacaFormat(BaseModel):
    """Stanford Alpaca rows: ``instruction``, optional ``input``, ``output``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["alpaca"] = Field("alpaca", description="rows with instruction, optional input, output")

    def fields(self) -> set[str]:
        return {"instruction", "input", "output"}


class PromptResponseFormat(BaseModel):
    """Two ``str.format`` templates naming row fields, e.g.
    ``prompt="Question: {question}\\nAnswer:"``, ``response=" {answer}"``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["prompt_response"] = Field("prompt_response", description="two templates over the row's fields")
    prompt: str = Field(description="template of the prompt, e.g. `Question: {question}\\nAnswer:`")
    response: str = Field(description="template of the target, naming at least one row field, e.g. ` {answer}`")

    @field_validator("prompt", "response")
    @classmethod
    def _check_template(cls, value: str, info: ValidationInfo) -> str:
        stored = (info.context or {}).get(STORED)
        if value and not _template_fields(value) and info.field_name == "response" and not stored:   # "": no target
            name = value.strip() if value.strip().isidentifier() else "answer"
            raise ValueError(f"template {value!r} names no row field, so every row's target would be this same text; "
                             f"put the row field that holds the target in braces, e.g. ' {{{name}}}'")
        return value

    def ordered_fields(self) -> list[str]:
        """Field names in order of first use (prompt first, then response)."""
        names = _template_fields(self.prompt)
        names += [n for n in _template_fields(self.response) if n not in names]
        return names

    def fields(self) -> set[str]:
        return set(self.ordered_fields())


class ChatFormat(BaseModel):
    """Rows holding a list of ``{role, content}`` messages (or ShareGPT ``{from, value}`` turns: human, gpt,
    system; see sharegpt.py), rendered through the tokenizer's chat template; the assistant turns are the
    targets (the last one only, with `mask_history`)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["chat"] = Field("chat", description="messages through the tokenizer's chat template")
    messages_field: str = Field("messages", description="the row field holding the messages (`conversations` for "
                                                        "ShareGPT data: its {from, value} turns are recognised)")
    mask_history: bool = Field(False, description="only the last assistant turn is a target; the earlier turns "
                                                  "are context (a conversation's history, few-shot examples), "
                                                  "as LLaMA-Factory's mask_history. A GRPO job's prompt is then "
                                                  "everything before the last assistant turn")

    def fields(self) -> set[str]:
        return {self.messages_field}


class TextFormat(BaseModel):
    """Plain text in one field; every token is a target."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = Field("text", description="plain text; every token is a target")
    field: str = Field("text", description="the row field holding the text")

    def fields(self) -> set[str]:
        return {self.field}


class PreferenceFormat(BaseModel):
    """Preference pairs for `method: dpo` / `orpo`: a prompt and two completions, the preferred one and the
    rejected one (actors/data/pairs.py). A row whose prompt is text holds text completions; a
    row whose prompt is a list of ``{role, content}`` messages is rendered with the tokenizer's chat
    template, its completions being assistant messages (a list of them, or one text)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["preference"] = Field("preference", description="prompt, chosen and rejected (DPO, ORPO)")
    prompt_field: str = Field("prompt", description="the row field holding the prompt (text or messages)")
    chosen_field: str = Field("chosen", description="the row field holding the preferred completion")
    rejected_field: str = Field("rejected", description="the row field holding the rejected completion")

    def fields(self) -> set[str]:
        return {self.prompt_field, self.chosen_field, self.rejected_field}


def _type_alone(value: object) -> object:
    """`format: alpaca` as `format: {type: alpaca}`: a format whose fields all have defaults named by its type
    alone (one that needs fields, such as prompt_response, is then refused for the field it lacks)."""
    return {"type": value} if isinstance(value, str) else value


DataFormat = Annotated[
    AlpacaFormat | PromptResponseFormat | ChatFormat | TextFormat | PreferenceFormat,
    Field(discriminator="type"),
    BeforeValidator(_type_alone),
]
