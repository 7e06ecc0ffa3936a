"""Preference rows (prompt, chosen, rejected) as text, and random preference pairs of token ids."""

from __future__ import annotations

import torch

from actors.data import Example
from actors.data.pairs import PreferencePair

# three rows of a preference data file, for the tests against TRL and the preference jobs' data and service tests
ROWS = [{"prompt": "Question: what is 2+2?\nAnswer:", "chosen": " 4", "rejected": " five, I think"},
        {"prompt": "Name a colour.", "chosen": " Blue is a colour.", "rejected": " A dog"},
        {"prompt": "Say hi", "chosen": " Hello there!", "rejected": " Go away"}]


def random_pairs(seed: int, count: int, vocab: int = 300) -> list[PreferencePair]:
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 12, (1,), generator=generator)),),
                               generator=generator).tolist()
        sides = []
        for _ in range(2):
            completion = torch.randint(3, vocab, (int(torch.randint(1, 15, (1,), generator=generator)),),
                                       generator=generator).tolist()
            ids = prompt + completion
            sides.append(Example(tuple(ids), tuple([-100] * len(prompt) + completion)))
        pairs.append(PreferencePair(sides[0], sides[1], len(prompt)))
    return pairs
