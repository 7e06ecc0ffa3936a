"""LoRA on an MoE base's expert stacks (`lora.target_parameters`, actors/engine/experts_lora.py) against PEFT's
ParamWrapper: several jobs, each with its own non-zero adapter on attention and on the experts, packed into one
fused step, give per sequence the loss of the unfused Hugging Face model with PEFT holding the job's adapter (loaded
from the folder aspen saved), alone on that sequence, and each adapter's gradient equals PEFT's; a job's experts
adapter is shown to matter; fused jobs end bit for bit as alone; the settings PEFT's wrapper refuses are refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import PeftModel

from actors.checkpoint.peft_io import save_adapter
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig
from tests.helpers import model_families as families
from tests.helpers.model_families import build_config, build_model, examples, relative

LOSS_TOLERANCE = 1e-5       # relative, float32 on the CPU (PEFT merges B A into the weight; aspen adds x A^T B^T)
GRADIENT_TOLERANCE = 1e-5

BOTH = ["experts.gate_up_proj", "experts.down_proj"]
JOBS = [("job-a", [24, 13], {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "target_parameters": BOTH}),
        ("job-b", [19, 6, 30], {"r": 2, "alpha": 6, "target_modules": ["o_proj"],
                                "target_parameters": ["mlp.experts.down_proj"]}),
        ("job-c", [11, 22], {"r": 8, "alpha": 8, "target_modules": ["k_proj"], "target_parameters": BOTH,
                             "use_rslora": True})]


def job_spec(name: str, count: int, lora: dict) -> JobSpec:
    return JobSpec(name=name, data="unused.jsonl", format={"type": "text"}, batch_size=count, grad_accum=2,
                   max_steps=5, lr=1e-3, lora=lora)


def make_jobs(base, jobs=JOBS, seed=123):
    made = []
    for name, lengths, lora in jobs:
        index = [n for n, _, _ in JOBS].index(name)   # a job's data, seed and B the same alone or beside others
        generator = torch.Generator().manual_seed(seed + index)
        job = TrainingJob.create(job_spec(name, len(lengths), lora), base, examples(index, lengths), [], seed=index)
        with torch.no_grad():   # a non-zero adapter: B random too
            for key, parameter in job.adapter.named_parameters():
                if key.endswith("lora_B.weight"):
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
        made.append(job)
    return made


def sequence_losses(model, batch):
    return [model(input_ids=torch.tensor([e.input_ids]), labels=torch.tensor([e.labels]), use_cache=False).loss
            for e in batch]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "ernie4_5_moe", "dots1",
                                        "minimax_m2"])
def test_a_fused_step_of_experts_adapters_equals_peft_alone_on_each_sequence(model_type, tmp_path):
    """gpt_oss: stacks stored transposed, with biases and an interleaved gate; deepseek_v3: a dense first layer."""
    model = build_model(build_config(model_type))
    reference = copy.deepcopy(model)
    base = from_module(model, None)
    trainer = FusedTrainer(base, step_tokens=100_000)
    chosen = JOBS if model_type != "deepseek_v3" else [   # latent attention: no q / k / v projections
        (name, lengths, {**lora, "target_modules": ["o_proj"]}) for name, lengths, lora in JOBS]
    jobs = make_jobs(base, chosen)
    batches = []
    for job in jobs:
        trainer.add_job(job)
        batches.append(list(job.peek()))
    report, token_losses = families.step_with_token_losses(trainer)
    assert report.jobs == [name for name, _, _ in JOBS]
    offset = 0
    for job, batch, result in zip(jobs, batches, report.results, strict=True):
        folder = tmp_path / job.name
        save_adapter(job.adapter, folder, "tiny")
        saved = json.loads((folder / "adapter_config.json").read_text())
        assert saved["target_parameters"] == job.spec.lora.target_parameters
        peft_model = PeftModel.from_pretrained(copy.deepcopy(reference), folder, is_trainable=True).eval()
        wrapped = [n for n, m in peft_model.named_modules() if type(m).__name__ == "ParamWrapper"]
        assert wrapped, "PEFT wrapped the expert stacks"
        losses = sequence_losses(peft_model, batch)
        counts = [sum(label != -100 for label in e.labels[1:]) for e in batch]
        for count, reference_loss in zip(counts, losses, strict=True):
            engine_loss = float(token_losses[offset:offset + count].mean())
            offset += count
            assert engine_loss == pytest.approx(reference_loss.item(), rel=LOSS_TOLERANCE), job.name
        job_loss, peft_grads, engine_grads = families.job_loss_and_gradients(peft_model, job.adapter, losses, counts)
        assert result.loss == pytest.approx(job_loss.item(), rel=LOSS_TOLERANCE)
        experts = [k for k in engine_grads if ".experts." in k or k.endswith("experts.lora_A.weight")
                   or ".experts.base_layer." in k]
        assert experts and all(engine_grads[k].norm() > 0 for k in experts)
        for key in sorted(peft_grads):
            assert relative(engine_grads[key], peft_grads[key]) <= GRADIENT_TOLERANCE, (job.name, key)


def test_the_experts_adapter_matters_and_a_jobs_tokens_reach_only_its_own():
    """Fused, each job's losses and gradients are bit for bit those of its step alone; and without its experts
    adapter a job's loss moves (the update is applied)."""
    def run(job_indices, drop_experts=False):
        model = build_model(build_config("qwen3_moe"))
        base = from_module(model, None)
        trainer = FusedTrainer(base, step_tokens=100_000)
        chosen = [JOBS[i] for i in job_indices]
        if drop_experts:
            chosen = [(n, lengths, {**lora, "target_parameters": []}) for n, lengths, lora in chosen]
        jobs = make_jobs(base, chosen)
        if drop_experts:   # the same attention adapters as with experts: B drawn in the same order
            reference_jobs = make_jobs(from_module(build_model(build_config("qwen3_moe")), None),
                                       [JOBS[i] for i in job_indices])
            with torch.no_grad():
                for job, ref in zip(jobs, reference_jobs, strict=True):
                    for (_, p), (_, q) in zip(job.adapter.named_parameters(), ref.adapter.named_parameters(),
                                                strict=False):
                        p.copy_(q)
        for job in jobs:
            trainer.add_job(job)
        report = trainer.run_step(trainer.compose())
        return {r.job: r.loss for r in report.results}, {
            job.name: {k: p.grad.clone() for k, p in job.adapter.named_parameters()} for job in jobs}

    fused_losses, fused_grads = run([0, 1, 2])
    for index in range(3):
        name = JOBS[index][0]
        alone_losses, alone_grads = run([index])
        assert fused_losses[name] == alone_losses[name], name
        for key, grad in alone_grads[name].items():
            assert torch.equal(fused_grads[name][key], grad), (name, key)
    without, _ = run([0], drop_experts=True)
    assert abs(without["job-a"] - fused_losses["job-a"]) > 1e-3 * abs(fused_losses["job-a"])


@pytest.mark.parametrize(("settings", "message"), [
    ({"dropout": 0.1}, "lora.dropout > 0"),
    ({"use_dora": True}, "lora.use_dora"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights: pissa"),
    ({"kind": "vera"}, "lora.kind: vera"),
])
def test_settings_peft_does_not_take_on_expert_stacks_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(target_modules=["q_proj"], target_parameters=BOTH, **settings)


def test_a_target_naming_no_stack_and_a_dense_base_are_refused_naming_the_stacks():
    base = from_module(build_model(build_config("qwen3_moe")), None)
    lora = {"r": 2, "target_modules": ["q_proj"], "target_parameters": ["experts.w1"]}
    with pytest.raises(ValueError, match=r"experts\.w1 names no expert stack of this base; its stacks are "
                                         r"experts\.down_proj, experts\.gate_up_proj"):
        TrainingJob.create(job_spec("bad", 1, lora), base, examples(0, [10]), [], seed=0)
    assert not any("lora" in name for name, _ in base.model.named_parameters()), "nothing left attached"
    dense = from_module(build_model(build_config("llama")), None)
    with pytest.raises(ValueError, match="no expert weight stacks"):
        TrainingJob.create(job_spec("bad", 1, {**lora, "target_parameters": BOTH}), dense, examples(0, [10]), [],
                           seed=0)


def test_an_adapter_peft_saved_on_expert_stacks_continues_in_aspen(tmp_path):
    """PEFT's own save of an adapter on attention and both expert stacks: its config fits the job's lora, its
    tensors load into the job's adapter, and aspen's loss with it is PEFT's."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from actors.checkpoint.peft_io import load_adapter_weights
    from actors.spec.saved_adapter import config_problems

    model = build_model(build_config("mixtral"))
    peft_model = get_peft_model(copy.deepcopy(model), PeftLoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=BOTH))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(tmp_path / "saved")
    lora = {"r": 2, "alpha": 4, "target_modules": ["q_proj"], "target_parameters": BOTH}
    saved = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert config_problems(saved, LoraConfig(**lora)) == []
    assert config_problems(saved, LoraConfig(**{**lora, "target_parameters": ["experts.down_proj"]})) == [
        "lora.target_parameters is ['experts.down_proj'], the adapter's ['experts.down_proj', 'experts.gate_up_proj'] "
        "(the expert stacks it adapts): set lora.target_parameters: ['experts.down_proj', 'experts.gate_up_proj']"]
    base = from_module(model, None)
    batch = examples(7, [21])
    job = TrainingJob.create(job_spec("continued", 1, lora), base, batch, [], seed=0)
    load_adapter_weights(job.adapter, tmp_path / "saved")
    trainer = FusedTrainer(base, step_tokens=100_000)
    trainer.add_job(job)
    report = trainer.run_step(trainer.compose())
    with torch.no_grad():
        expected = sequence_losses(peft_model.eval(), batch)[0]
    assert report.results[0].loss == pytest.approx(expected.item(), rel=LOSS_TOLERANCE)


def test_a_jobs_placement_counts_every_experts_parameters():
    """The scheduler sizes a job's adapter from the trainer's reported stacks: 16 bytes per parameter the job's
    adapter then has (weight, gradient, two AdamW moments), expert stacks included; a stack it does not have is
    refused before placement."""
    from actors.engine.experts_lora import stack_shapes
    from actors.engine.lora_targets import match_targets
    from actors.service.scheduler.job_fit import job_adapter_bytes
    from policies.base import TrainerView

    model = build_model(build_config("qwen3_moe"))
    base = from_module(model, None)
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"], "target_parameters": BOTH}
    linear = [(name, model.get_submodule(name).in_features, model.get_submodule(name).out_features)
              for name in match_targets([n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)],
                                        ["q_proj", "v_proj"])]
    job = TrainingJob.create(job_spec("placed", 1, lora), base, examples(0, [10]), [], seed=0)
    view = TrainerView(id="t", base_model="tiny", quantization="none", memory_budget_bytes=1 << 40, base_bytes=0,
                       step_memory_bytes=0, jobs=(), linear_shapes=tuple(linear),
                       expert_shapes=tuple((name, *shape) for name, shape in stack_shapes(model).items()))
    assert job_adapter_bytes(LoraConfig(**lora), view) == 16 * job.adapter.num_parameters()
    with pytest.raises(ValueError, match=r"experts\.w2 names no expert stack of tiny; its stacks are "
                                         r"experts\.down_proj, experts\.gate_up_proj"):
        job_adapter_bytes(LoraConfig(**{**lora, "target_parameters": ["experts.w2"]}), view)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_memory_prior_counts_what_autograd_keeps_for_the_experts_adapters(dtype):
    """`experts_lora.activation_bytes` against the bytes of the distinct tensors (weights left out) autograd saves
    in a step's forward, with the experts adapter less those without it (the same job's attention adapter either
    way)."""
    from actors.engine.experts_lora import activation_bytes
    from actors.engine.layout import step_layout
    from actors.engine.packing import JobMicroBatch, pack

    def saved_bytes(target_parameters):
        model = build_model(build_config("qwen3_moe")).to(dtype)
        base = from_module(model, None)
        lora = {"r": 4, "target_modules": ["q_proj"], "target_parameters": target_parameters}
        batch_examples = examples(3, [40, 24])
        job = TrainingJob.create(job_spec("kept", 2, lora), base, batch_examples, [], seed=0)
        batch = pack([JobMicroBatch(job.name, batch_examples)], "packed", base.pad_token_id)
        storages = {}
        weights = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}

        def pack_hook(tensor):   # activations only: a weight's (an adapter's too) is held anyway
            if tensor.untyped_storage().data_ptr() not in weights:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda tensor: tensor), \
                step_layout(batch.layout):
            base.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                         attention_mask=None, use_cache=False)
        return sum(storages.values()), base.model, LoraConfig(**lora), batch.layout.num_tokens

    without, _, _, _ = saved_bytes([])
    with_experts, model, lora, tokens = saved_bytes(BOTH)
    per_token, kept = activation_bytes(model, lora)
    predicted = per_token * tokens + sum(bytes_per_token for _, bytes_per_token in kept) * tokens
    assert with_experts - without == pytest.approx(predicted, rel=0.02)


def test_on_a_base_computing_its_experts_grouped_only_the_adapted_layers_go_job_by_job(tmp_path, monkeypatch):
    """A CUDA base runs transformers' grouped experts product, which knows no job (shown on a CPU base set to it):
    when an adapter on expert stacks joins, the layers holding one take the job-by-job way and the others keep the
    grouped product; both jobs' losses are still PEFT's alone on each sequence."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from actors.engine import moe_experts

    model = build_model(build_config("olmoe"))
    reference = copy.deepcopy(model)
    base = from_module(model, None)
    model.set_experts_implementation("grouped_mm")
    calls = []
    grouped = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, "grouped_mm",
                        lambda module, *args: calls.append(("grouped", module)) or grouped(module, *args))
    segments = moe_experts.segment_experts_forward
    monkeypatch.setattr(moe_experts, "segment_experts_forward",
                        lambda module, *args: calls.append(("segments", module)) or segments(module, *args))
    jobs = [("job-a", [24, 13], {"r": 4, "alpha": 8, "target_modules": ["q_proj"],
                                 "target_parameters": ["layers.0.mlp.experts.down_proj"]}),
            ("job-b", [19, 6, 30], {"r": 2, "alpha": 6, "target_modules": ["o_proj"]})]
    made = make_jobs(base, jobs)
    trainer = FusedTrainer(base, step_tokens=100_000)
    for job in made:
        trainer.add_job(job)
    batches = [list(job.peek()) for job in made]
    report = trainer.run_step(trainer.compose())
    layers = [model.model.layers[index].mlp.experts for index in range(2)]
    assert [kind for kind, module in calls if module is layers[0]] == ["segments"]
    assert [kind for kind, module in calls if module is layers[1]] == ["grouped"]
    for job, batch, result in zip(made, batches, report.results, strict=True):
        save_adapter(job.adapter, tmp_path / job.name, "tiny")
        peft_model = PeftModel.from_pretrained(copy.deepcopy(reference), tmp_path / job.name).eval()
        with torch.no_grad():
            losses = sequence_losses(peft_model, batch)
        counts = [sum(label != -100 for label in e.labels[1:]) for e in batch]
        expected = sum(loss * count for loss, count in zip(losses, counts, strict=True)) / sum(counts)
        assert result.loss == pytest.approx(expected.item(), rel=LOSS_TOLERANCE), job.name


def test_on_the_cuda_path_an_optimizer_step_moves_the_experts_adapters_too(monkeypatch):
    """The CUDA LoRA path (run on a CPU bfloat16 base: `lora_cuda.COMPUTE = "base"`, experts grouped as on CUDA):
    a job with stacks beside its pooled linear adapters keeps torch's AdamW over all of them (the one-pass AdamW
    takes a pool alone), so two optimizer steps move every tensor of its adapter (the first its Bs from zero, the
    second its As, whose gradient is zero while B is)."""
    from actors.engine import lora_cuda

    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    model = build_model(build_config("qwen3_moe")).to(torch.bfloat16)
    base = from_module(model, None)
    model.set_experts_implementation("grouped_mm")
    spec = JobSpec(name="cuda-path", data="unused.jsonl", format={"type": "text"}, batch_size=2, grad_accum=1,
                   max_steps=5, lr=1e-2, lora={"r": 4, "target_modules": ["q_proj", "v_proj"],
                                                "target_parameters": BOTH})
    job = TrainingJob.create(spec, base, examples(0, [20, 12]), [], seed=0)
    before = {name: p.detach().clone() for name, p in job.adapter.named_parameters()}
    trainer = FusedTrainer(base, step_tokens=100_000)
    trainer.add_job(job)
    for _ in range(2):
        report = trainer.run_step(trainer.compose())
        assert report.results[0].optimizer_step is not None
    assert job.optimizer.flat is None
    for name, parameter in job.adapter.named_parameters():
        assert not torch.equal(parameter.detach(), before[name]), name


def test_a_merged_export_of_an_experts_adapter_is_the_trained_model(tmp_path):
    """`aspen export --merge` of an adapter on expert stacks: the file-by-file merge does not apply (a checkpoint keeps
    each expert's weights apart; transformers stacks them as it loads), so PEFT merges the loaded model, whose loss
    on a sequence is the job's in a step."""
    from actors.checkpoint.adapter_export import _streamable_base, merged_model

    model = build_model(build_config("qwen3_moe"))
    model.save_pretrained(tmp_path / "base")
    base = from_module(model, None)
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj"], "target_parameters": BOTH}
    job = make_jobs(base, [("job-a", [23], lora)])[0]
    batch = list(job.peek())
    save_adapter(job.adapter, tmp_path / "adapter", "tiny")
    trainer = FusedTrainer(base, step_tokens=100_000)
    trainer.add_job(job)
    loss = trainer.run_step(trainer.compose()).results[0].loss
    assert _streamable_base(tmp_path / "adapter", str(tmp_path / "base")) is None
    merged, _ = merged_model(tmp_path / "adapter", base=str(tmp_path / "base"), dtype="float32")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        expected = sequence_losses(merged.eval(), batch)[0]
    assert loss == pytest.approx(expected.item(), rel=LOSS_TOLERANCE)


def test_greedy_decoding_through_an_experts_adapter_is_peft_generates(tmp_path):
    """Decoding (a KV cache, a left-padded batch of prompts) goes through each prompt's own expert adapters as
    PEFT's `generate` does with the adapter; an adapter on the stacks alone (`target_modules: []`) decodes too."""
    from actors.engine.generate import greedy_generate

    model = build_model(build_config("qwen3_moe"))
    reference = copy.deepcopy(model)
    base = from_module(model, None)
    jobs = make_jobs(base, [("job-a", [10], {"r": 4, "alpha": 8, "target_modules": ["q_proj"],
                                             "target_parameters": BOTH}),
                            ("job-b", [10], {"r": 2, "alpha": 8, "target_modules": [], "target_parameters": BOTH})])
    with torch.no_grad():   # larger updates, so that the greedy tokens change
        for job in jobs:
            for _, parameter in job.adapter.named_parameters():
                parameter.mul_(8)
    prompts = [[5, 9, 33, 7], [71, 2, 45, 88, 19, 6]]
    bare = greedy_generate(base, None, prompts, 6, set())
    for job in jobs:
        save_adapter(job.adapter, tmp_path / job.name, "tiny")
        peft_model = PeftModel.from_pretrained(copy.deepcopy(reference), tmp_path / job.name).eval()
        expected = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=6, eos_token_id=-1, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
        got = greedy_generate(base, job.name, prompts, 6, set())
        assert got == expected, job.name
        assert got != bare, job.name
