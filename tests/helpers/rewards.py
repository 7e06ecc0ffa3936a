"""Reward functions for GRPO tests (a job names them as `tests.helpers.rewards:NAME`), and a tokenizer of
plain token numbers for tiny random models with no real tokenizer."""

from __future__ import annotations


def sevens(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    """The share of a completion's tokens that are token 7 (texts of `NumberTokenizer`)."""
    return [text.split().count("7") / max(len(text.split()), 1) for text in completions]


def shorter(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    """Higher for shorter completions (a reward that varies within any group of sampled texts)."""
    return [1.0 / (1 + len(text)) for text in completions]


def sevens_if_asked(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float | None]:
    """`sevens`, or None (it does not apply: TRL's convention) where the row's reference is "skip"."""
    return [None if row["reference"] == "skip" else text.split().count("7") / max(len(text.split()), 1)
            for text, row in zip(completions, rows, strict=True)]


def shorter_if_said(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float | None]:
    """`shorter`, or None where the completion is empty or the row's reference is "skip"."""
    return [None if not text or row["reference"] == "skip" else 1.0 / (1 + len(text))
            for text, row in zip(completions, rows, strict=True)]


def not_finite(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    return [float("nan")] * len(completions)


def score_mean(prediction: str, row: dict) -> float:
    """A generation metric of the user's: the share of the reference's characters found in the prediction."""
    return sum(char in prediction for char in row["reference"]) / max(len(row["reference"]), 1)


def raises(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    raise RuntimeError("the reward service is down")


def too_few(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    return [1.0]


def hangs(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    """A reward that never returns (a sandbox that never answers)."""
    import time

    while True:
        time.sleep(1.0)


def exits(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    """A reward that ends its interpreter."""
    import os

    os._exit(3)


def prints(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    """`shorter`, saying so on stdout (Python's and the C library's)."""
    import os

    print("scoring", len(completions), "completions")
    os.write(1, b"a C library's line\n")
    return shorter(prompts, completions, rows)


class NumberTokenizer:
    """Decodes token ids as their numbers separated by spaces; token 2 is the end of a sequence."""

    eos_token_id = 2
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) in (0, 2)))


def words(prompts: list[str], completions: list[str], rows: list[dict]) -> list[str]:
    return ["good"] * len(completions)
