"""bench/lora_mfu.py's baselines compute what they claim: baseline (b)'s packed row with its varlen attention
(boundaries from the position ids) gives the loss and LoRA gradients of the same sequences padded in a batch
through the HF model's own attention (a CPU, float32: (b)'s per-sequence path); on CUDA, its varlen kernel
equals per-sequence sdpa in bf16. And bench's step statistics and (c)'s sizing from a hand computation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from peft import get_peft_model

from tests.helpers.peft_reference import randomize_b
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance, unit_roundoff

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))   # only while these modules import: bench/ holds names like memory, pipeline
try:
    import lora_bench
    import lora_mfu
    import peft_baselines
finally:
    sys.path.remove(str(BENCH))


def _sequences(vocab: int, lengths: list[int]) -> list[tuple[list[int], list[int]]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for length in lengths:
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
        out.append((ids, [-100] * (length // 4) + ids[length // 4:]))
    return out


def test_packed_row_with_the_varlen_attention_equals_the_padded_batch():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    lengths = [37, 5, 80, 23]
    batch = _sequences(config.vocab_size, lengths)
    results = []
    for packed in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        if packed:
            model.set_attn_implementation(peft_baselines.PACKED_ATTENTION)
        peft_model = randomize_b(get_peft_model(model, peft_baselines.lora_config()), seed=1)
        layout = peft_baselines.packed_tensors if packed else peft_baselines.padded_tensors
        tensors = layout(batch, torch.device("cpu"))
        loss = peft_model(**tensors, use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
    (padded_loss, padded_grads), (packed_loss, packed_grads) = results
    terms = llama_chain_terms(config, sequence=max(lengths), tokens=sum(lengths))
    assert abs(float(packed_loss - padded_loss)) <= rounding_tolerance(terms, float(padded_loss.abs()))
    assert packed_grads.keys() == padded_grads.keys() and padded_grads
    for name, expected in padded_grads.items():
        bound = rounding_tolerance(terms, float(expected.abs().max()))
        assert float((packed_grads[name] - expected).abs().max()) <= bound, name


def test_the_packed_row_starts_a_sequence_where_its_position_restarts():
    batch = _sequences(50, [3, 2, 4])
    row = peft_baselines.packed_tensors(batch, torch.device("cpu"))
    assert row["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    cu, longest = peft_baselines._cu_seqlens(row["position_ids"])
    assert cu.tolist() == [0, 3, 5, 9] and longest == 4
    # no label at a sequence's first token: the shifted loss never predicts it from the sequence before
    labels = row["labels"][0].tolist()
    assert labels[0] == labels[3] == labels[5] == -100


@pytest.mark.skipif(not torch.cuda.is_available() or peft_baselines.varlen_attn is None,
                    reason="needs CUDA and torch's varlen kernel")
def test_the_varlen_kernel_equals_per_sequence_sdpa_in_bf16():
    lengths = [37, 80, 5, 128]
    positions = torch.tensor([[i for n in lengths for i in range(n)]], device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, sum(lengths), 64, device="cuda", dtype=torch.bfloat16, generator=generator)
               for heads in (8, 2, 2))
    out, _ = peft_baselines.packed_attention(None, q, k, v, None, scaling=0.125, position_ids=positions)
    start, expected = 0, []
    for n in lengths:
        expected.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start:start + n].float(), k[:, :, start:start + n].float(), v[:, :, start:start + n].float(),
            is_causal=True, scale=0.125, enable_gqa=True))
        start += n
    expected = torch.cat(expected, dim=2).transpose(1, 2)
    # each output a convex combination of bf16 values: the kernel rounds its probabilities and its output to
    # bf16 (u each, relative to the largest |v|), the float32 reference does neither
    bound = 4 * unit_roundoff(torch.bfloat16) * float(v.abs().max())
    assert float((out.float() - expected).abs().max()) <= bound


def test_step_summary_and_the_concurrent_sizing_by_hand():
    summary = lora_bench.step_summary([0.3, 0.1, 0.2, 0.4, 0.5], [30, 10, 20, 40, 50])
    assert summary["median_step_s"] == 0.3 and summary["p10_step_s"] == 0.1 and summary["p90_step_s"] == 0.5
    assert summary["tokens_per_s"] == pytest.approx(150 / 1.5)
    # a 141 GB card, 16 GB held per process, 13 MB a padded token: 4 x (16 + 1.07 + n x 768 x 0.013) <= 127
    peft = {"card_memory_bytes": 141e9, "held_before_steps_bytes": 16e9, "step_bytes_per_token": 13e6}
    assert lora_mfu.concurrent_sequences(peft, quick=False) == 1   # 2 x 768 x 13 MB = 20 GB > 14.6 GB of room
    peft["step_bytes_per_token"] = 8e6
    assert lora_mfu.concurrent_sequences(peft, quick=False) == 2   # 12.3 GB fits, 4 x 768 x 8 MB = 24.6 does not
    # an 80 GB H100 (85.9e9 bytes): 0.9 x 85.9 / 4 - 16 - 1.07 = 2.3 GB of room, one 768-token step 6.1 GB: none
    peft["card_memory_bytes"] = 85.9e9
    assert lora_mfu.concurrent_sequences(peft, quick=False) == 0


def test_four_peft_processes_that_cannot_fit_the_card_are_not_started(monkeypatch, tmp_path):
    """(c) on a card where four copies of the base leave no room for one sequence's step (the 8B shape on an
    80 GB H100) is recorded as not run, with the sizes that rule it out, and not counted as a failed side."""
    started = []

    def side(name, args, shape, extra, timeout):
        started.append(name)
        return {"status": "passed", "tokens_per_s": 1000.0, "card_memory_bytes": 85.9e9,
                "held_before_steps_bytes": 16e9, "step_bytes_per_token": 8e6}

    monkeypatch.setattr(lora_mfu, "own_process", side)
    args = lora_mfu.argparse.Namespace(quick=False, sides=["peft", "concurrent"], profile=None, profile_peers=False,
                                       side_timeout=60, json=tmp_path / "mfu.json")
    result = lora_mfu.run_shape("llama-3.1-8b", args)
    assert started == ["peft"]
    concurrent = result["sides"]["concurrent"]
    assert concurrent["status"] == "not run: does not fit"
    assert "16.0 GB each" in concurrent["reason"] and "6.1 GB" in concurrent["reason"], concurrent["reason"]
    assert "aspen_over_concurrent" not in result["ratios"]


def test_the_careful_peft_loop_halves_its_sequences_a_step_until_its_longest_batch_fits(monkeypatch):
    """(a) as a careful user sets it on a smaller card: 8 sequences a step, and where a step over the 8 longest runs
    out of the card's memory, 4, then 2 (the 8B shape's 86 GB on an H200 exceed an 80 GB H100). Caused here by an
    out-of-memory error at more than 2 sequences; the adapter of each try is taken off again, the base returned."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    sequences = _sequences(300, [8, 40, 12, 30, 20, 16, 24, 36, 28, 10])
    tried = []

    def train_steps(peft_model, batches, device, packed, clock):
        (batch,) = batches
        tried.append(sorted(len(ids) for ids, _ in batch))
        if len(batch) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return [], []

    monkeypatch.setattr(peft_baselines, "train_steps", train_steps)
    count, base = peft_baselines.fitting_per_step(model, sequences, torch.device("cuda"), 8, packed=False)
    assert count == 2
    assert tried == [[12, 16, 20, 24, 28, 30, 36, 40], [28, 30, 36, 40], [36, 40]]   # the longest each time
    assert base is model or isinstance(base, LlamaForCausalLM)
    assert not any("lora" in name for name, _ in base.named_parameters())
    # on a CPU (RAM, not a card) the count asked is kept, untried
    tried.clear()
    assert peft_baselines.fitting_per_step(model, sequences, torch.device("cpu"), 8, packed=False)[0] == 8
    assert tried == []
