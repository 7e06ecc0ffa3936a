"""ShareGPT conversations as chat messages: a `conversations` list of `{from, value}` turns (roles human,
gpt, system; user and assistant also taken) becomes the `{role, content}` messages the chat format renders
with the tokenizer's chat template, so that the loss falls on the gpt / assistant turns only.

A conversation is recognised by its turns: objects with `from` and `value` and no `role` (columnar files
fill a missing key with null, so a null `role` counts as none)."""

from __future__ import annotations

from typing import Any

from actors.data.rows import _row_error, _type_name

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
"""ShareGPT's `from` values and the chat role each becomes."""


def is_sharegpt(messages: Any) -> bool:
    """Whether a row's message list is in ShareGPT form (its first turn has `from` and `value`, no `role`)."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
        return False
    first = messages[0]
    return "from" in first and "value" in first and first.get("role") is None


def sharegpt_messages(turns: list[Any], field: str, source: str, line: int) -> list[dict[str, Any]]:
    """The `{role, content}` messages of a ShareGPT conversation; a turn that is not an object with a known
    `from` and a string `value` is a `DataError` naming the file, the row and the turn."""
    messages: list[dict[str, Any]] = []
    for index, turn in enumerate(turns):
        where = f"{field}[{index}]"
        if not isinstance(turn, dict):
            raise _row_error(source, line, f"field '{where}' must be an object with 'from' and 'value' (a ShareGPT "
                                           f"turn), got {_type_name(turn)}", field=where)
        for key in ("from", "value"):
            if key not in turn:
                raise _row_error(source, line, f"field '{where}.{key}' is missing (a ShareGPT turn has 'from' and "
                                               "'value')", field=f"{where}.{key}")
            if not isinstance(turn[key], str):
                raise _row_error(source, line, f"field '{where}.{key}' must be a string, got "
                                               f"{_type_name(turn[key])}", field=f"{where}.{key}")
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            known = ", ".join(SHAREGPT_ROLES)
            raise _row_error(source, line, f"field '{where}.from' is {turn['from']!r}, not a ShareGPT role this "
                                           f"format knows ({known})", field=f"{where}.from")
        messages.append({"role": role, "content": turn["value"]})
    return messages
