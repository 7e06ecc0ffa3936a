"""Fused training against independent references: a solo run of the same job (isolation), PEFT (same
logits from the saved adapter), and plain transformers (same first-step loss)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from actors.checkpoint.peft_io import save_adapter
from actors.engine.job import TrainingJob
from actors.engine.models import from_module, load_base_model
from actors.engine.operations import count_operations
from actors.engine.trainer import FusedTrainer
from tests.helpers.fused import VOCAB, job_spec, relative_difference
from tests.helpers.models import random_examples, tiny_config, tiny_model


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit the same adapter: isolation's truth on the CPU (tests/unit/engine/test_isolation.py says why)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(base, specs_and_data, *, layout="packed", step_tokens=100_000, composer=None,
          reports=None) -> dict[str, dict[str, torch.Tensor]]:
    trainer = FusedTrainer(base, step_tokens=step_tokens, layout=layout, composer=composer)
    jobs = []
    for spec, examples, seed in specs_and_data:
        job = TrainingJob.create(spec, base, examples, [], seed=seed)
        trainer.add_job(job)
        jobs.append(job)
    while (report := trainer.train_step()) is not None:
        if reports is not None:
            reports.append(report)
    weights = {job.name: {k: v.detach().clone() for k, v in job.adapter.named_parameters()} for job in jobs}
    for job in jobs:
        assert job.step == job.spec.max_steps
        trainer.remove_job(job.name)
    return weights


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_fused_adapter_equals_solo_run(arch, layout):
    """Isolation: an adapter trained alongside other jobs ends with exactly the weights of the job trained alone."""
    base = from_module(tiny_model(arch, VOCAB), None)
    target = (job_spec("target", grad_accum=2), random_examples(0, vocab=VOCAB), 0)
    others = [
        (job_spec("other-1", lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}, lr=1e-2),
         random_examples(1, vocab=VOCAB, max_len=60), 1),
        (job_spec("other-2", batch_size=2, lora={"r": 2, "alpha": 4, "dropout": 0.1, "target_modules": "all-linear"}),
         random_examples(2, vocab=VOCAB), 2),
    ]
    start = None
    fused = train(base, [others[0], target, others[1]], layout=layout)["target"]
    solo = train(base, [target], layout=layout)["target"]
    start_job = TrainingJob.create(target[0], base, target[1], [], seed=0)
    start = {k: v.detach().clone() for k, v in start_job.adapter.named_parameters()}
    assert relative_difference(solo, start) > 1e-2, "the adapter did not train"
    assert identical(solo, fused), relative_difference(solo, fused)


def test_isolation_holds_with_dropout_and_a_tight_token_budget():
    """Each adapter draws its own dropout masks, and jobs that wait for a step keep their data order."""
    base = from_module(tiny_model("llama", VOCAB), None)
    target = (job_spec("target", lora={"r": 4, "alpha": 8, "dropout": 0.2, "target_modules": "all-linear"}),
              random_examples(0, vocab=VOCAB), 0)
    other = (job_spec("other", batch_size=4), random_examples(5, vocab=VOCAB, max_len=60), 5)
    fused = train(base, [other, target], step_tokens=150)["target"]
    solo = train(base, [target], step_tokens=150)["target"]
    assert identical(solo, fused), relative_difference(solo, fused)


def test_base_is_frozen_and_gets_no_gradients():
    base = from_module(tiny_model("qwen2", VOCAB), None)
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    trainer = FusedTrainer(base)
    for i in range(2):
        trainer.add_job(TrainingJob.create(job_spec(f"j{i}", max_steps=3), base, random_examples(i, vocab=VOCAB), [],
                                           seed=i))
    while trainer.train_step() is not None:
        pass
    lora_names = {n for n, _ in base.model.named_parameters() if ".adapters." in n}
    for name, parameter in base.model.named_parameters():
        if name not in lora_names:
            assert parameter.grad is None and not parameter.requires_grad, name
    for name in list(trainer.jobs):
        trainer.remove_job(name)
    for key, value in before.items():
        assert torch.equal(base.model.state_dict()[key], value), key


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_saved_adapter_gives_peft_the_same_logits(arch, tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs[arch]
    base = load_base_model(str(folder), device="cpu")
    spec = job_spec("peft-check", max_steps=4, lr=2e-2,
                    lora={"r": 4, "alpha": 12, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]})
    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec, base, random_examples(3), [], seed=3)
    trainer.add_job(job)
    while trainer.train_step() is not None:
        pass
    save_adapter(job.adapter, tmp_path / "adapter", str(folder))
    ids = torch.tensor([random_examples(9, count=1, min_len=20, max_len=20)[0].input_ids] * 2)
    engine_logits = trainer.logits("peft-check", ids)

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    plain_logits = reference(input_ids=ids).logits
    peft_model = PeftModel.from_pretrained(reference, tmp_path / "adapter").eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits
    assert (peft_logits - plain_logits).abs().max() > 1e-3, "the adapter has no effect: nothing was compared"
    assert (engine_logits - peft_logits).abs().max() <= 1e-4


def test_first_step_loss_equals_plain_transformers_loss(tiny_model_dirs):
    folder = tiny_model_dirs["mistral"]
    base = load_base_model(str(folder), device="cpu")
    examples = random_examples(4, count=3)
    trainer = FusedTrainer(base)
    for i in range(2):  # a neighbour job in the same step must not change the target job's loss
        other = TrainingJob.create(job_spec(f"n{i}", max_steps=1, warmup_steps=0), base, random_examples(10 + i), [],
                                   seed=10 + i)
        trainer.add_job(other)
    job = TrainingJob.create(job_spec("first", batch_size=3, max_steps=1, warmup_steps=0), base, examples, [], seed=0)
    trainer.add_job(job)
    batch = job.peek()
    report = trainer.train_step()
    assert set(report.jobs) == {"n0", "n1", "first"}
    engine_loss = next(r.loss for r in report.results if r.job == "first")

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    longest = max(len(e) for e in batch)
    ids = torch.tensor([list(e.input_ids) + [2] * (longest - len(e)) for e in batch])
    labels = torch.tensor([list(e.labels) + [-100] * (longest - len(e)) for e in batch])
    mask = torch.tensor([[1] * len(e) + [0] * (longest - len(e)) for e in batch])
    with torch.no_grad():
        reference_loss = float(reference(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert engine_loss == pytest.approx(reference_loss, rel=1e-5)


def test_minpad_groups_jobs_by_length_and_keeps_them_isolated():
    """MinPad (OptimalBatch) on mLoRA's padded_fused layout: far less padding than round-robin fusing of
    every job, every job still trains all its steps, each adapter equals its solo run to 1e-5 relative.
    Not exactly: padded_fused pads every row of a step to the step's longest row, so a job fused with a
    longer one runs its attention over more (masked) key positions than alone; the masked keys add exact
    zeros, but the kernel's blocking and vector tails over the key length change the order of its sums
    (float32 rounding, ~1e-7 per attention output). Measured: 2.2e-6 relative after 6 steps."""
    from policies.minpad import MinPadPolicy

    base = from_module(tiny_model("llama", VOCAB), None)
    jobs = [(job_spec(f"short-{i}", max_steps=6), random_examples(i, vocab=VOCAB, min_len=6, max_len=12), i)
            for i in range(2)]
    jobs += [(job_spec(f"long-{i}", max_steps=6), random_examples(10 + i, vocab=VOCAB, min_len=70, max_len=80), 10 + i)
             for i in range(2)]
    round_robin, minpad = [], []
    train(base, jobs, layout="padded_fused", reports=round_robin)
    fused = train(base, jobs, layout="padded_fused", composer=MinPadPolicy(), reports=minpad)

    def padding(reports):
        return sum(r.padding_tokens for r in reports) / sum(r.tokens for r in reports)

    assert padding(round_robin) > 0.4          # short rows padded to the long jobs' length
    assert padding(minpad) < 0.25
    groups = ({"short-0", "short-1"}, {"long-0", "long-1"})
    assert all(any(set(r.jobs) <= group for group in groups) for r in minpad), [r.jobs for r in minpad]
    for spec, examples, seed in (jobs[0], jobs[3]):
        solo = train(base, [(spec, examples, seed)], layout="padded_fused")[spec.name]
        assert relative_difference(solo, fused[spec.name]) <= 1e-5


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_grouped_adapters_keep_fused_equal_to_solo(monkeypatch, layout):
    """The batched LoRA way (CUDA's default, forced here on the CPU): a job trained beside others with
    other ranks, targets and dropout still ends with the weights of the job trained alone, to 1e-5 relative.
    Not exactly: alone, a job's update runs the per-segment products (grouping needs two adapters), fused the
    batched ones over the jobs' padded batch, whose gradient sums over the longest job's length (the padding
    rows add exact zeros) in another kernel and order: float32 rounding. Measured: 5.2e-7 relative after
    20 steps. (Both ways take only the job's own tokens, which tests/unit/engine/test_isolation.py checks exactly.)"""
    from actors.engine import lora_grouped

    monkeypatch.setattr(lora_grouped, "GROUPING", "grouped")
    base = from_module(tiny_model("llama", VOCAB), None)
    target = (job_spec("target", lora={"r": 4, "alpha": 8, "dropout": 0.2, "target_modules": "all-linear"}),
              random_examples(0, vocab=VOCAB), 0)
    others = [
        (job_spec("other-1", lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}, lr=1e-2),
         random_examples(1, vocab=VOCAB, max_len=60), 1),
        (job_spec("other-2", batch_size=2, lora={"r": 2, "alpha": 4, "dropout": 0.1, "target_modules": "all-linear"}),
         random_examples(2, vocab=VOCAB), 2),
    ]
    fused = train(base, [others[0], target, others[1]], layout=layout)["target"]
    solo = train(base, [target], layout=layout)["target"]
    assert relative_difference(solo, fused) <= 1e-5


def _operations_per_step(base, jobs: int, sequences: list) -> int:
    """Operations of one fused step (forward, backward, optimizer), `jobs` jobs sharing `sequences`."""
    per_job = len(sequences) // jobs
    trainer = FusedTrainer(base, step_tokens=100_000, layout="packed")
    chosen = []
    for index in range(jobs):
        job = TrainingJob.create(job_spec(f"job-{index}", batch_size=per_job), base, sequences, [], seed=index)
        trainer.add_job(job)
        chosen.append((job, sequences[index * per_job:(index + 1) * per_job]))
    trainer.run_step(chosen)   # the optimizers' first step allocates their state
    count = count_operations(lambda: trainer.run_step(chosen))
    for job, _ in chosen:
        trainer.remove_job(job.name)
    return count


def test_grouped_adapters_add_no_operations_per_layer_and_job(monkeypatch):
    """What a fused step costs per job where steps are bound by kernel launches (a small model on a GPU):
    grouped, an extra job adds the same few operations (its optimizer step, its loss) to a 2-layer model as
    to a 4-layer one: nothing per layer and job, forward or backward; per segment it adds some per layer."""
    from actors.engine import lora_grouped

    sequences = random_examples(0, count=12, vocab=VOCAB, min_len=20, max_len=20)
    growth = {}
    for mode in ("grouped", "segments"):
        monkeypatch.setattr(lora_grouped, "GROUPING", mode)
        for layers in (2, 4):
            config = tiny_config("llama", VOCAB)
            config.num_hidden_layers = layers
            torch.manual_seed(0)
            base = from_module(LlamaForCausalLM(config).eval(), None)
            growth[mode, layers] = (_operations_per_step(base, 6, sequences)
                                    - _operations_per_step(base, 2, sequences)) / 4
    assert growth["grouped", 4] == growth["grouped", 2], growth
    assert growth["segments", 4] > growth["segments", 2] + 20, growth   # the counter sees per-layer work


def test_warm_up_leaves_the_base_as_it_was():
    """The trainer's start-up step: afterwards no adapter is attached, the base's weights and the random
    generator are untouched, and a job trains to the same adapter as on a base that never warmed up."""
    from actors.engine.fused_linear import FusedLoraLinear
    from actors.engine.warmup import warm_up

    fresh = from_module(tiny_model("llama", VOCAB), None)
    warmed = from_module(tiny_model("llama", VOCAB), None)
    before = {k: v.clone() for k, v in warmed.model.state_dict().items()}
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    assert warm_up(warmed) > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any(isinstance(m, FusedLoraLinear) for m in warmed.model.modules())
    after = warmed.model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    job = (job_spec("target", lora={"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": "all-linear"}),
           random_examples(0, vocab=VOCAB), 0)
    assert relative_difference(train(fresh, [job])["target"], train(warmed, [job])["target"]) == 0


def test_warm_up_steps_one_token_count_divisible_by_16_and_one_not(monkeypatch):
    """Triton compiles a kernel anew where an integer argument (a step's token count reaches Liger's RoPE and
    RMSNorm) turns divisible by 16 or stops being so: the warm-up's two steps have one count of each kind, for any
    trainer budget, so that neither compile falls in a real step."""
    from actors.engine import warmup
    from actors.engine.trainer import FusedTrainer

    counts: list[int] = []
    real = FusedTrainer.run_step

    def counted(self, chosen, **options):
        counts.append(sum(len(example.input_ids) for _, examples in chosen for example in examples))
        return real(self, chosen, **options)

    monkeypatch.setattr(FusedTrainer, "run_step", counted)
    base = from_module(tiny_model("llama", VOCAB), None)
    for budget in (40, 256, 700, 4096):
        counts.clear()
        warmup.warm_up(base, budget)
        assert len(counts) == 2 and counts[0] % 16 == 0 and counts[1] % 16 != 0, (budget, counts)
