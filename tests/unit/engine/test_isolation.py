"""Isolation on every accepted dtype and quantization: four jobs of different lengths (and different sequence
lengths inside each job, ranks, batch sizes, dropout, accumulation) trained fused for several steps end with
exactly the adapter weights and the per-step losses of each job trained alone (the independent reference).

Why equality is exact on the CPU, not just close:
- every operation of the base on a job's tokens is per token (embeddings, norms, activations, each row of
  a linear layer) or per sequence (attention runs sequence by sequence), and the LoRA updates and the loss
  run on the job's own slice, so in exact arithmetic nothing a job computes depends on its neighbours;
- in floating point, the one way a neighbour could still matter is a matrix product whose rounding depends
  on the number of rows or on where the job's rows start in memory. Each output element of a CPU product
  is one dot product over the inner dimension, accumulated in an order that depends on that dimension
  only: for float32 once Intel MKL runs in conditional numerical reproducibility mode (`MKL_CBWR`, which
  `actors.engine` sets; without it MKL's float32 product of a rank-4 adapter rounds differently for 12 of
  16 start offsets of the same rows, which left the first job of a fused step 4e-7 relative off its solo
  run after 6 steps), for bfloat16 and float16 in oneDNN's kernels, which accumulate in float32 and round
  each element once;
- int8 (bitsandbytes, threshold 0) quantizes each token's row with its own absmax and multiplies in exact
  integer arithmetic; NF4 dequantizes the (fixed) weight and multiplies in the compute dtype. Neither
  depends on the other tokens. With LLM.int8()'s outlier threshold it would (test below).
On CUDA, cuBLAS chooses its kernel (tiling, split-K) by the number of rows, so a job's sums are reordered
when the fused step has more rows; there equality holds only to a bound, not asserted here (no GPU here)."""

from __future__ import annotations

import pytest
import torch

from actors.data import Example
from actors.engine.models import from_module, quantize_linears
from actors.spec.job_spec import JobSpec
from tests.helpers.isolation import CONFIGS, VOCAB, assert_isolated, base_for, four_jobs, train
from tests.helpers.model_families import build_config, build_model
from tests.helpers.models import random_examples, tiny_model


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fused_jobs_equal_their_solo_runs_exactly(config):
    assert_isolated(base_for(config), four_jobs())


def _outlier_base(threshold: float):
    """An int8 base where the tokens 150..299 (the loud job's) carry one feature far above the others, so
    that after the norm it exceeds LLM.int8()'s usual outlier threshold (6.0): about sqrt(hidden) = 8."""
    pytest.importorskip("bitsandbytes")
    model = tiny_model("llama", VOCAB)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[150:] *= 0.1
        embeddings[150:, 0] = 1.0
    quantize_linears(model, "int8", torch.float32, torch.device("cpu"))
    for module in model.modules():
        if hasattr(module, "state") and hasattr(module.state, "threshold"):
            module.state.threshold = threshold
    return from_module(model, None)


def _quiet_and_loud_jobs():
    quiet = random_examples(0, count=6, vocab=150, min_len=8, max_len=20)
    loud = [Example(tuple(i + 147 for i in e.input_ids), tuple(-100 if t == -100 else t + 147 for t in e.labels))
            for e in random_examples(1, count=6, vocab=150, min_len=8, max_len=20)]
    spec = {"data": "unused.jsonl", "format": {"type": "text"}, "batch_size": 3, "max_steps": 2, "lr": 1e-2,
            "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}}
    return [(JobSpec(name="quiet", **spec), quiet, 0), (JobSpec(name="loud", **spec), loud, 1)]


def test_int8_outlier_threshold_would_let_one_job_change_another():
    """The reason int8 runs with threshold 0: with LLM.int8()'s 6.0, the columns where the loud job has an
    outlier are computed in 16 bits for every token of the step, the quiet job's included, so the quiet
    job's adapter differs from its solo run; with threshold 0 it is exactly its solo run."""
    jobs = _quiet_and_loud_jobs()
    mixed = _outlier_base(6.0)
    fused, _ = train(mixed, jobs)
    solo, _ = train(mixed, jobs[:1])
    assert any(not torch.equal(fused["quiet"][k], solo["quiet"][k]) for k in solo["quiet"]), \
        "the loud job's outliers did not reach the quiet job: the test shows nothing"
    assert_isolated(_outlier_base(0.0), jobs)


@pytest.mark.parametrize("config,kernel", [("bfloat16", "segments"), ("bfloat16", "grouped_mm"),
                                           ("float32", "segments"), ("int8-bfloat16", "grouped_mm"),
                                           ("nf4-bfloat16", "segments")])
def test_the_cuda_lora_path_keeps_fused_jobs_equal_to_their_solo_runs_exactly(monkeypatch, config, kernel):
    """The CUDA path (actors/engine/lora_cuda.py: adapters in the base's dtype on their own segments, one
    autograd function with the base product; per segment or grouped_mm), run here on the CPU: the same
    argument as above holds, since each job's products read its own rows only (a quantized base's output
    gets the updates added in place)."""
    from actors.engine import lora_cuda

    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    calls = []
    original = lora_cuda.linear_with_adapters
    monkeypatch.setattr(lora_cuda, "linear_with_adapters", lambda *args: calls.append(1) or original(*args))
    assert_isolated(base_for(config), four_jobs())
    assert calls, "the CUDA path was not taken"


# glm4_moe's router (and minimax_m2's, afmoe's) takes a sigmoid of each token's expert scores over the whole
# (tokens, experts) tensor: where a token's scores do not fill whole iterations of the CPU's vector loop (2 x 16
# floats with AVX-512), whether they fall in the vectorised body or the scalar tail, which rounds differently,
# depends on the tokens before them. 32 experts fill them whatever the CPU (released checkpoints: 128 to 256);
# softmax routers work row by row.
MOE_CASES = [("qwen3_moe", {}), ("mixtral", {}), ("gpt_oss", {}), ("glm4_moe", {"n_routed_experts": 32}),
             ("ernie4_5_moe", {}), ("minimax_m2", {"num_local_experts": 32}), ("afmoe", {"num_experts": 32}),
             ("hunyuan_v1_moe", {})]


@pytest.mark.parametrize("model_type, fields", MOE_CASES, ids=[case for case, _ in MOE_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_moe_jobs_fused_equal_their_solo_runs_exactly(model_type, fields, dtype):
    """MoE bases: each token's route (its top-k experts, their weights) is its own, and the CPU's experts multiply
    each packed sequence's rows in a product of their own (actors/engine/moe_experts.py), so fused jobs route and
    train exactly as alone."""
    config = build_config(model_type, vocab_size=VOCAB, **fields)
    assert_isolated(from_module(build_model(config).to(dtype), None), four_jobs())
