"""The GSM8K prompt-response format of the data tests, and an example's targets (its labels other than -100)."""

from __future__ import annotations

from actors.data import Example, PromptResponseFormat

GSM8K = PromptResponseFormat(type="prompt_response", prompt="Question: {question}\nAnswer:", response=" {answer}")


def targets(example: Example) -> list[int]:
    return [label for label in example.labels if label != -100]
