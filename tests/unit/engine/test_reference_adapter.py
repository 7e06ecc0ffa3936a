"""A job that starts from a saved adapter compares itself with that adapter (`JobSpec.reference_adapter`), as TRL's
trainers do with a PEFT model whose adapter was trained before (a frozen copy, "ref"): DPO's loss, gradients and
reward metrics equal TRL's DPOTrainer's on such a model once the adapter has moved from its start; GRPO's KL
reference log-probabilities are PEFT's forward through the saved adapter; a job with a reference adapter fused
beside others trains exactly as alone, and its reference leaves the base with it."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from actors.checkpoint.initial_adapter import start_from_adapter
from actors.engine.adapter_surgery import fused_layers
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.packing import JobMicroBatch
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from tests.helpers.models import random_examples, tiny_model
from tests.helpers.pairs import ROWS, random_pairs
from tests.helpers.peft_reference import TARGETS, compare_gradients, copy_peft_lora, peft_config, randomize_b
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

LORA = {"r": 4, "alpha": 8, "target_modules": TARGETS}


def _saved_adapter(folder, seed: int = 0, vocab: int | None = None):
    """A PEFT adapter with random B (a trained one), saved; the model it is on."""
    from peft import get_peft_model

    model = tiny_model("llama") if vocab is None else tiny_model("llama", vocab)
    peft_model = randomize_b(get_peft_model(model, peft_config()), seed)
    peft_model.save_pretrained(folder)
    return peft_model


def _moved(peft_model, seed: int) -> None:
    """The trained adapter ("default") moved off its start, as by a step of training; its "ref" copy stays."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if ".default." in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)


def test_dpo_from_a_saved_adapter_equals_trl_whose_reference_is_a_copy_of_it(tiny_tokenizer, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from tests.helpers.pairs import trl_pairs

    peft_model = _saved_adapter(tmp_path / "sft")
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(ROWS), beta=0.1, report_to=[],
                     use_cpu=True)
    trl = DPOTrainer(model=peft_model, args=args, train_dataset=Dataset.from_list(ROWS),
                     processing_class=tiny_tokenizer)
    assert set(trl.model.peft_config) == {"default", "ref"}   # TRL's reference: a frozen copy of the adapter
    _moved(trl.model, 1)
    batch = next(iter(trl.get_train_dataloader()))
    _, _, pairs = trl_pairs(ROWS, tiny_tokenizer, tmp_path / "pairs")   # the same rows as aspen's pairs
    loss = trl.compute_loss(trl.model, batch)
    loss.backward()
    logged = trl._metrics["train"]
    assert abs(logged["rewards/margins"][-1]) > 1e-3, "the adapter did not move from its reference: nothing compared"

    base = from_module(tiny_model("llama"), None)
    spec = JobSpec(name="dpo", data="unused.jsonl", format={"type": "preference"}, method="dpo", batch_size=len(ROWS),
                   grad_accum=2, max_steps=5, lora=LORA, init_adapter=str(tmp_path / "sft"))
    assert spec.reference_adapter
    job = TrainingJob.create(spec, base, pairs, [], seed=0)
    start_from_adapter(job.adapter, tmp_path / "sft")
    copy_peft_lora(job, trl.model)   # where TRL's adapter moved to
    trainer = FusedTrainer(base)
    trainer.add_job(job)
    trainer.hold_reference(job, lambda handle: start_from_adapter(handle, tmp_path / "sft"))
    result = trainer.train_step().results[0]
    gradient_difference, largest = compare_gradients(job, len(pairs), trl.model)
    metrics = job.accumulator.metrics
    longest = max(len(row) for pair in pairs for row in pair.rows)
    tokens = sum(len(row) for pair in pairs for row in pair.rows)
    config = base.model.config
    gradient_tolerance = rounding_tolerance(llama_chain_terms(config, sequence=longest, tokens=tokens), largest)
    logps = len(pairs) * max(abs(metrics["logps/chosen"]), abs(metrics["logps/rejected"]))
    logp_tolerance = rounding_tolerance(llama_chain_terms(config, sequence=longest, tokens=longest, backward=False),
                                        2 * logps)
    print(f"loss {loss.item():.6f} vs {result.loss:.6f}, gradient difference {gradient_difference:.2e} "
          f"(tolerance {gradient_tolerance:.2e}), margin {metrics['rewards/margins']:.4f}")
    assert gradient_difference <= gradient_tolerance
    beta = spec.preference.beta
    assert abs(result.loss - loss.item()) <= beta * 4 * logp_tolerance
    reward = beta * 2 * logp_tolerance
    for name, tolerance in (("rewards/chosen", reward), ("rewards/rejected", reward),
                            ("rewards/margins", 2 * reward)):
        assert abs(metrics[name] - logged[name][-1]) <= tolerance, (name, metrics[name], logged[name][-1])

    trainer.remove_job("dpo")
    assert not any("dpo@reference" in layer.adapters for layer in fused_layers(base.model)), "reference left behind"


def test_the_grpo_kl_reference_is_peft_through_the_saved_adapter(tmp_path):
    from actors.engine.grpo import reference_token_log_probs

    _saved_adapter(tmp_path / "sft", vocab=300)
    reference = PeftModel.from_pretrained(tiny_model("llama", 300), tmp_path / "sft").eval()
    base = from_module(tiny_model("llama", 300), None)
    spec = JobSpec(name="grpo", data="unused.jsonl", format={"type": "text"}, batch_size=2, max_steps=2, lora=LORA,
                   init_adapter=str(tmp_path / "sft"))
    job = TrainingJob.create(spec, base, random_examples(3, count=4, vocab=300), [], seed=0)
    trainer = FusedTrainer(base)
    trainer.add_job(job)
    trainer.hold_reference(job, lambda handle: start_from_adapter(handle, tmp_path / "sft"))
    with torch.no_grad():
        for parameter in job.adapter.parameters():
            parameter.fill_(0.3)   # the job's own adapter, wherever it is, plays no part in its reference
    examples = random_examples(7, count=3, vocab=300, min_len=10, max_len=16)
    plain_model = tiny_model("llama", 300).eval()
    got = reference_token_log_probs(base, JobMicroBatch("grpo", examples), 1.0, 64, "grpo@reference")
    expected, plain = [], []
    with torch.no_grad():
        for example in examples:
            ids = torch.tensor([example.input_ids])
            labels = torch.tensor(example.labels[1:])
            keep = labels != -100
            for model, out in ((reference, expected), (plain_model, plain)):
                logits = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
                out.extend(logits[keep].gather(1, labels[keep][:, None])[:, 0].tolist())
    longest = max(len(e.input_ids) for e in examples)
    bound = rounding_tolerance(llama_chain_terms(base.model.config, sequence=longest, tokens=1, backward=False),
                               2 * max(abs(value) for value in expected))
    assert max(abs(a - b) for a, b in zip(got.tolist(), expected, strict=True)) <= bound
    assert max(abs(a - b) for a, b in zip(expected, plain, strict=True)) > 100 * bound, "the adapter did nothing"


@pytest.mark.parametrize("path", ["float32", "cuda-path-bfloat16-segments", "cuda-path-bfloat16-grouped_mm"])
def test_a_job_with_a_reference_adapter_trains_fused_exactly_as_alone(tmp_path, monkeypatch, path):
    """A dpo job starting from a saved adapter (its reference) beside a dpo job on the base's reference and an
    sft job: after four fused steps each adapter equals the same job's alone, bit for bit (the reference pass
    packs both dpo jobs' pairs, each through its own reference); on the CPU's float32 path, and on the CUDA path
    run here in bfloat16 (the frozen copy's masters cast like a job's, in the reference passes only)."""
    dtype = torch.float32
    if path.startswith("cuda-path"):
        from tests.helpers.cuda_path_runs import on_the_cuda_path

        calls = on_the_cuda_path(monkeypatch, path.rsplit("-", 1)[1])
        dtype = torch.bfloat16
    _saved_adapter(tmp_path / "sft", vocab=300)
    examples = random_examples(4, count=12, vocab=300)
    specs = {
        "from-sft": JobSpec(name="from-sft", data="unused.jsonl", format={"type": "preference"}, method="dpo",
                            batch_size=2, max_steps=4, lr=1e-2, lora=LORA, init_adapter=str(tmp_path / "sft")),
        "fresh": JobSpec(name="fresh", data="unused.jsonl", format={"type": "preference"}, method="dpo",
                         batch_size=2, max_steps=4, lr=1e-2, lora=LORA),
        "sft": JobSpec(name="sft", data="unused.jsonl", format={"type": "text"}, batch_size=2, max_steps=4,
                       lr=1e-2, lora=LORA)}
    data = {"from-sft": random_pairs(1, 8), "fresh": random_pairs(2, 8), "sft": examples}

    seeds = {"from-sft": 0, "fresh": 1, "sft": 2}

    def train(names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        base = from_module(tiny_model("llama", 300).to(dtype), None)
        trainer = FusedTrainer(base)
        for name in names:
            job = TrainingJob.create(specs[name], base, data[name], [], seed=seeds[name])
            if specs[name].init_adapter is not None:
                start_from_adapter(job.adapter, tmp_path / "sft")
            trainer.add_job(job)
            if specs[name].reference_adapter:
                trainer.hold_reference(job, lambda handle: start_from_adapter(handle, tmp_path / "sft"))
        while trainer.train_step() is not None:
            pass
        return {name: {key: p.detach().clone() for key, p in trainer.jobs[name].adapter.named_parameters()}
                for name in names}

    fused = train(list(specs))
    for name in specs:
        alone = train([name])[name]
        assert alone.keys() == fused[name].keys()
        for key, value in alone.items():
            assert torch.equal(fused[name][key], value), (name, key)
    if path.startswith("cuda-path"):
        assert calls.layers, "the CUDA path was not taken"


def test_admission_counts_the_reference_adapters_bytes(tmp_path):
    """A job with a reference adapter needs, at admission, the bytes the held copy has: its parameters, fp32."""
    from actors.engine.adapter_surgery import linear_module_names
    from actors.engine.lora_targets import adapted_shapes
    from policies.adapter_memory import adapter_memory_bytes

    _saved_adapter(tmp_path / "sft", vocab=300)
    base = from_module(tiny_model("llama", 300), None)
    spec = JobSpec(name="dpo", data="unused.jsonl", format={"type": "preference"}, method="dpo", batch_size=2,
                   max_steps=2, lora=LORA, init_adapter=str(tmp_path / "sft"))
    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec, base, random_pairs(1, 4), [], seed=0)
    trainer.add_job(job)
    trainer.hold_reference(job, lambda handle: start_from_adapter(handle, tmp_path / "sft"))
    held = trainer.references.held["dpo"]
    assert all(not parameter.requires_grad for parameter in held.parameters())
    model = base.model
    linear = {name: (model.get_submodule(name).in_features, model.get_submodule(name).out_features)
              for name in linear_module_names(model)}
    shapes = adapted_shapes(LORA["target_modules"], linear)
    extra = adapter_memory_bytes(4, shapes, frozen_copy=True) - adapter_memory_bytes(4, shapes)
    assert extra == sum(p.numel() * p.element_size() for p in held.parameters()) > 0


def test_a_grpo_job_from_a_saved_adapter_starts_at_zero_kl_to_it(tmp_path):
    """Through the trainer's step: a grpo job with a KL term that starts from a saved adapter has, at its first step
    (its adapter still the saved one), a KL of exactly 0 to its reference, which is that adapter; the same job
    compared with the base instead (no reference adapter held) has a KL above 0."""
    from tests.helpers.grpo_jobs import grpo_spec, number_base, prompt_rows
    from tests.helpers.isolation import VOCAB

    _saved_adapter(tmp_path / "sft", vocab=VOCAB)
    spec = grpo_spec("grpo", "contains", grpo={"reward": "contains", "num_generations": 4, "max_new_tokens": 5,
                                                "beta": 0.04},
                     lora=LORA, init_adapter=str(tmp_path / "sft"), grad_accum=2)
    assert spec.reference_adapter

    def first_kl(hold: bool) -> float:
        base = number_base()
        trainer = FusedTrainer(base)
        job = TrainingJob.create(spec, base, prompt_rows(0, 4), [], seed=0)
        start_from_adapter(job.adapter, tmp_path / "sft")
        trainer.add_job(job)
        if hold:
            trainer.hold_reference(job, lambda handle: start_from_adapter(handle, tmp_path / "sft"))
        trainer.train_step()   # grad_accum 2: no optimizer step yet, the adapter is still the saved one
        return job.accumulator.metrics["kl"]

    assert first_kl(hold=True) == 0.0
    assert first_kl(hold=False) > 1e-4
