"""A fixed order of micro-batches and padding for the Hugging Face Trainer reference."""

from __future__ import annotations

import torch

from actors.data import Example


class FixedOrder:
    """A BatchSource that hands out `examples` in order, `batch_size` at a time (HF's SequentialSampler)."""

    def __init__(self, examples: list[Example], batch_size: int):
        self.examples, self.batch_size, self.position = examples, batch_size, 0

    @property
    def exhausted(self) -> bool:
        return self.position >= len(self.examples)

    def next_batch(self) -> list[Example] | None:
        if self.exhausted:
            return None
        batch = self.examples[self.position:self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def pad_rows(rows: list[dict]) -> dict[str, torch.Tensor]:
    longest = max(len(r["input_ids"]) for r in rows)
    return {"input_ids": torch.tensor([r["input_ids"] + [0] * (longest - len(r["input_ids"])) for r in rows]),
            "labels": torch.tensor([r["labels"] + [-100] * (longest - len(r["labels"])) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (longest - len(r["input_ids"]))
                                            for r in rows])}
