"""GRPO jobs for tests: a spec, rows whose first half is the prompt, a tiny base whose tokens decode as numbers."""

from __future__ import annotations

from actors.data import Example
from actors.data.tokenize import IGNORE_INDEX
from actors.engine.models import from_module
from actors.spec.job_spec import JobSpec
from tests.helpers.isolation import VOCAB
from tests.helpers.models import random_examples, tiny_model
from tests.helpers.rewards import NumberTokenizer

# the rows are made here, not read: a format with a prompt, as a GRPO job's must be
PROMPTS = {"type": "prompt_response", "prompt": "{prompt}", "response": " {reference}"}


def grpo_spec(name: str, reward: str, **changes) -> JobSpec:
    return JobSpec(**{"name": name, "data": "unused.jsonl", "format": PROMPTS, "method": "grpo",
                      "grpo": {"reward": reward, "num_generations": 4, "max_new_tokens": 5, "temperature": 1.0},
                      "batch_size": 2, "max_steps": 2, "lr": 1e-2, "warmup_steps": 1,
                      "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}, **changes})


def prompt_rows(seed: int, count: int) -> list[Example]:
    """Rows whose first half is the prompt (the rest the target, whose text the built-in rewards compare)."""
    rows = []
    for example in random_examples(seed, count=count, vocab=VOCAB, min_len=6, max_len=12):
        half = len(example.input_ids) // 2
        rows.append(Example(example.input_ids, (IGNORE_INDEX,) * half + tuple(example.input_ids[half:])))
    return rows


def number_base():
    return from_module(tiny_model("llama", VOCAB), NumberTokenizer())
