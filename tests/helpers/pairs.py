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


def trl_pairs(rows: list[dict], tokenizer, output_dir) -> tuple[object, dict, list[PreferencePair]]:
    """TRL's DPOTrainer over `rows` (a new adapter on a tiny llama): the trainer, its first batch (every row) and
    that batch's sequences as aspen's pairs (chosen rows first, then rejected; right padding)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from tests.helpers.models import tiny_model
    from tests.helpers.peft_reference import peft_config

    args = DPOConfig(output_dir=str(output_dir), per_device_train_batch_size=len(rows), beta=0.1, report_to=[],
                     use_cpu=True)
    # a new adapter (peft_config): TRL's reference is then the base, the adapter disabled (a model that already
    # holds an adapter would get a frozen copy of it as its reference instead)
    trl = DPOTrainer(model=tiny_model("llama"), args=args, train_dataset=Dataset.from_list(rows),
                     processing_class=tokenizer, peft_config=peft_config())
    batch = next(iter(trl.get_train_dataloader()))
    count = batch["input_ids"].shape[0] // 2
    sequences = []
    for i in range(2 * count):
        real = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][real].tolist()
        completion = batch["completion_mask"][i][real].bool().tolist()
        sequences.append((Example(tuple(ids), tuple(t if c else -100 for t, c in zip(ids, completion, strict=True))),
                          completion.index(True)))
    pairs = [PreferencePair(sequences[i][0], sequences[count + i][0], sequences[i][1]) for i in range(count)]
    return trl, batch, pairs
