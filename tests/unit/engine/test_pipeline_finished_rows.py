"""Decoding over a pipeline's stages (actors/engine/pipeline/stage_generation.py) with a row that ended while
another decodes on: every stage keeps the ended row at its last position, as stage 0 and one device do
(actors/engine/generate.py, `DecodeBatch.step`'s `active`). The stages after the first fed it on, one position
further each step, past the base's context: a base with a table of learned positions (GPT-2's kind; none such is
cut into stages yet, so its lookup is stood in for by a check on every stage's rotary embedding) failed the whole
batch with an IndexError. The live row's logits checked against Hugging Face's own forward of it alone: two
stages on the CPU, processes of this one."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.service.pipeline.pipeline_engine import start_pipeline
from actors.service.scheduler.config import TrainerConfig
from tests.helpers.models import VOCAB
from tests.helpers.pipeline import one_thread_per_process

CONTEXT = 16


def learned_positions_base(folder: str):
    """The base at `folder`, each stage's position lookup refusing positions past the context, as a table of
    CONTEXT learned positions does (IndexError). A stage process's loader (picklable: a partial of this)."""
    from actors.engine.models import load_base_model

    base = load_base_model(folder, dtype="float32", device="cpu")

    def lookup(module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if int(positions.max()) >= CONTEXT:
            raise IndexError(f"position {int(positions.max())} of a table of {CONTEXT} positions")

    base.model.model.rotary_emb.register_forward_pre_hook(lookup, with_kwargs=True)
    return base


@pytest.fixture(autouse=True)
def one_thread():
    yield from one_thread_per_process()


def saved_base(folder, tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         tie_word_embeddings=False, pad_token_id=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def alone(model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Each step's next-token logits of `prompt` decoded greedily alone (Hugging Face's forward, no cache)."""
    tokens, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            last = model(torch.tensor([tokens])).logits[0, -1]
            logits.append(last)
            tokens.append(int(last.argmax()))
    return logits


def test_a_row_ended_in_a_pipelines_batch_keeps_its_last_position_on_every_stage(tmp_path, tiny_tokenizer):
    model = saved_base(tmp_path / "base", tiny_tokenizer)
    short, long = [5, 17, 3, 99, 42, 7, 11, 23, 31, 8], [5, 9, 13]   # the long one decodes to the context's end
    steps = {0: 1, 1: CONTEXT - len(long)}
    config = TrainerConfig(base_model=str(tmp_path / "base"), stages=2, stage_split="even", threads=1)
    engine = start_pipeline(config, functools.partial(learned_positions_base, str(tmp_path / "base")), threads=1)
    seen: list[torch.Tensor] = []
    taken = {0: 0, 1: 0}

    def choose(logits: torch.Tensor) -> list[int]:
        seen.append(logits[1].clone())
        return [int(row.argmax()) for row in logits]

    def finished(index: int, token: int) -> bool:
        taken[index] += 1
        return taken[index] >= steps[index]

    try:
        engine.head.generate([(None, short), (None, long)], choose, finished)
    finally:
        engine.close()
    expected = alone(model, long, steps[1])
    assert len(seen) == len(expected)
    # the ended row passed the context from the 9th step on (10 + 8 > 16): each step the live row's logits, as alone
    for step, (got, want) in enumerate(zip(seen, expected, strict=True)):
        assert torch.allclose(got, want, atol=1e-4), (step, float((got - want).abs().max()))
