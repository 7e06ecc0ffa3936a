"""bench/peft_baselines.py's profiled steps (bench/lora_mfu.py --profile-peers): two of a PEFT side's optimizer
steps run under torch.profiler, each with its forward, backward and AdamW step in the trace, written where the
cost model's profile fit reads a trace (trace.json.gz and summary.json), and the base model left as it was: the
adapter removed, the frozen weights untouched."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))   # only while these modules import: bench/ holds names like memory, pipeline
try:
    import peft_baselines
finally:
    sys.path.remove(str(BENCH))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_two_profiled_steps_of_a_peft_side_leave_their_trace_and_the_base_as_it_was(tmp_path, packed):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if packed:
        model.set_attn_implementation(peft_baselines.PACKED_ATTENTION)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    sequences = []
    for length in (12, 30, 7, 21, 16, 9, 25, 14):
        ids = torch.randint(3, config.vocab_size, (length,), generator=generator).tolist()
        sequences.append((ids, ids))
    summary = peft_baselines.profile_job(model, sequences, torch.device("cpu"), per_step=2, packed=packed,
                                         float32_adapters=True, out=tmp_path, median_step_s=0.01)
    assert summary["steps"] == 2
    assert {path.name for path in tmp_path.iterdir()} >= {"trace.json.gz", "summary.json", "by_cpu.txt"}
    events = json.loads(gzip.decompress((tmp_path / "trace.json.gz").read_bytes()))["traceEvents"]
    names = [event.get("name", "") for event in events]
    assert sum(name.startswith("Optimizer.step#AdamW.step") for name in names) == 2
    assert sum(name == "autograd::engine::evaluate_function: MmBackward0" for name in names) > 0
    after = model.state_dict()
    assert after.keys() == before.keys()   # the adapter removed: no lora_A / lora_B left on the base
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
