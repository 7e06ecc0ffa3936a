"""Tiny random Llama, Qwen2 and Mistral models built from configs, and random token examples."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

REPO = Path(__file__).resolve().parents[2]


SHARED_DATA = REPO.parent / "shared" / "data"


VOCAB = 4096  # SmolLM2's tokenizer cut to its first 4,096 tokens (tests/helpers/tokenizer_cut.py)


MISTRAL_WINDOW = 16


def tiny_config(arch: str, vocab_size: int = VOCAB):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, pad_token_id=2, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "mistral":
        # a window shorter than most random_examples (8-40 tokens): the sliding path is exercised
        return MistralConfig(**common, sliding_window=MISTRAL_WINDOW)
    raise ValueError(arch)


MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM}


def tiny_model(arch: str = "llama", vocab_size: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODEL_CLASSES[arch](tiny_config(arch, vocab_size)).eval()


def random_examples(seed: int, count: int = 16, vocab: int = VOCAB, min_len: int = 8, max_len: int = 40,
                    prompt_share: float = 0.4):
    """Examples of random tokens; the first part of each is prompt (labels -100)."""
    from actors.data import Example

    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
        prompt = max(1, int(length * prompt_share))
        examples.append(Example(tuple(ids), tuple([-100] * prompt + ids[prompt:])))
    return examples
