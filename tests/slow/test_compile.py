"""`compile: default` (actors/engine/compiled.py) against the eager step: the same adapters and losses from a few
fused steps of three jobs (CPU: torch.compile's aot_eager backend, the same graphs without code generation; CUDA:
inductor, in tests/gpu/test_cuda.py's way: skipped without a GPU); the bucket padding changes no job's loss or
gradient, even when the padding's activations are NaN; the compiled graphs stay bounded (a step whose bucket
length was seen before compiles nothing, whatever its segments and sequence lengths); a DPO job compiles as an SFT
job; the combinations not offered are refused naming the fields and the fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from actors.engine.adapter_surgery import remove_adapter, set_adapters_training
from actors.engine.attention import ATTENTION_NAME, varlen_attention_forward
from actors.engine.compiled import MIN_BUCKET, bucket_length, buckets_between, pad_to_bucket
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.job import TrainingJob
from actors.engine.layout import step_layout
from actors.engine.models import from_module
from actors.engine.packing import JobMicroBatch, pack
from actors.engine.trainer import FusedTrainer
from tests.helpers.fused import VOCAB, job_spec, relative_difference
from tests.helpers.models import random_examples, tiny_model

DROPPING = {"r": 4, "alpha": 8, "dropout": 0.2, "target_modules": "all-linear"}


class CountingBackend:
    """torch.compile backend: `inner`, counting the graphs handed to it (one per compiled piece and shape)."""

    def __init__(self, inner: str):
        self.inner = lookup_backend(inner)
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return self.inner(graph, example_inputs)


FORWARDS = (FusedLoraLinear.forward, varlen_attention_forward)

# one backend for the whole module: torch.compile's caches are per backend, so the tests share their graphs
BACKEND = CountingBackend("aot_eager")


def _jobs(max_steps: int = 4):
    return [
        (job_spec("a", lora=DROPPING, max_steps=max_steps), random_examples(0, vocab=VOCAB), 0),
        (job_spec("b", lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}, max_steps=max_steps,
                  lr=1e-2), random_examples(1, vocab=VOCAB, max_len=60), 1),
        (job_spec("c", batch_size=2, max_steps=max_steps), random_examples(2, vocab=VOCAB), 2),
    ]


def _train(base, jobs, joins: dict[int, int] | None = None, **options) -> tuple[dict, dict[str, list[float]], dict]:
    """Each job's adapter after training and its losses step by step; job i joins after step joins[i] (else at the
    start). With a counting compile backend, also: how many steps compiled nothing though their (bucket length,
    adapted layers) had been seen before (`reused`), the job sets, and the buckets met."""
    joins = joins or {}
    trainer = FusedTrainer(base, step_tokens=150, **options)
    handles = [TrainingJob.create(spec, base, examples, [], seed=seed) for spec, examples, seed in jobs]
    for index, job in enumerate(handles):
        if joins.get(index, 0) == 0:
            trainer.add_job(job)
    by_name = {job.name: job for job in handles}
    losses: dict[str, list[float]] = {job.name: [] for job in handles}
    backend = options.get("compile_backend")
    seen: set[tuple[int, frozenset]] = set()
    compiles = {"reused": 0, "job_sets": set(), "buckets": set()}
    step = 0
    while True:
        before = backend.graphs if backend is not None else 0
        report = trainer.train_step()
        if report is None:
            break
        step += 1
        for index, job in enumerate(handles):
            if joins.get(index) == step:
                trainer.add_job(job)
        for result in report.results:
            losses[result.job].append(result.loss)
        if backend is not None:
            # a step's graphs depend on its length and on which layers' outputs need a gradient (the union of its
            # jobs' target_modules), never on its jobs' segments or sequence lengths
            key = (report.tokens, frozenset(name for job in report.jobs for name in by_name[job].adapter.layers))
            if key in seen:
                assert backend.graphs == before, f"step {step} ({report.tokens} tokens, {report.jobs}) recompiled"
                compiles["reused"] += 1
            seen.add(key)
            compiles["job_sets"].add(tuple(report.jobs))
            compiles["buckets"].add(report.tokens)
    weights = {job.name: {k: v.detach().clone() for k, v in job.adapter.named_parameters()} for job in handles}
    for job in handles:
        assert job.step == job.spec.max_steps
        trainer.remove_job(job.name)
    return weights, losses, compiles


def test_bucket_lengths_are_few_and_pad_less_than_a_quarter():
    for tokens in range(1, 9000):
        bucket = bucket_length(tokens)
        assert bucket >= tokens and bucket >= MIN_BUCKET
        if tokens > MIN_BUCKET:
            assert bucket - tokens < tokens / 4, tokens
    assert len(buckets_between(1, 8192)) == 29   # 64, then 4 per doubling from 64 up to 8192


def test_compiled_steps_train_the_eager_adapters_and_recompile_only_for_new_buckets():
    """Three jobs (dropout on one, two ranks, different targets; two join late), steps of varying lengths and job
    sets: the compiled steps (aot_eager) give each job the eager steps' losses and adapters, to float32 rounding
    (aot_autograd's backward formulas round differently from eager's in the last bits, which Adam's normalised
    updates carry into the adapters: atol 1e-5 on weights of size ~0.1); a step whose bucket length
    (and adapted layers) was seen before compiles nothing."""
    base = from_module(tiny_model("llama", VOCAB), None)
    joins = {1: 3, 2: 5}
    eager, eager_losses, _ = _train(base, _jobs(5), joins)
    before = BACKEND.graphs
    compiled, compiled_losses, compiles = _train(base, _jobs(5), joins, compile="default", compile_backend=BACKEND)
    assert BACKEND.graphs > before, "nothing was compiled"
    # the eager-only switches of the step's forward are undone after it (evaluation and generation run as ever)
    assert FusedLoraLinear.forward is FORWARDS[0] and ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] is FORWARDS[1]
    # (the compiled trainer composes its steps by their padded length: other job sets than the eager one's; each
    # job's adapter does not depend on its neighbours, tests/unit/engine/test_isolation.py)
    assert all(tokens == bucket_length(tokens) for tokens in compiles["buckets"]), compiles
    assert len(compiles["buckets"]) > 1 and len(compiles["job_sets"]) >= 3 and compiles["reused"] >= 4, compiles
    print(f"{len(compiles['buckets'])} buckets, {BACKEND.graphs - before} graphs, {compiles['reused']} steps reused")
    for name in eager_losses:
        assert compiled_losses[name] == pytest.approx(eager_losses[name], abs=1e-5), name
    spec, examples, seed = _jobs()[0]
    start = {k: v.detach().clone() for k, v in
             TrainingJob.create(spec, base, examples, [], seed=seed).adapter.named_parameters()}
    remove_adapter(base.model, "a")
    assert relative_difference(eager["a"], start) > 1e-2, "the adapter did not train"
    for name in eager:
        for key in eager[name]:
            torch.testing.assert_close(compiled[name][key], eager[name][key], rtol=0, atol=1e-5)


def test_compiled_steps_of_a_base_with_stateful_layers_train_the_eager_adapters(monkeypatch):
    """Qwen3.5's Gated DeltaNet layers (actors/engine/stateful_layers.py: their convolution and delta rule run per
    sequence, eagerly, as the other layout readers) under `compile: default`: each job's losses and adapter are the
    eager steps', to float32 rounding as above, with the bucket padding's own sequences cut as pieces too."""
    from actors.engine import stateful_layers
    from actors.engine.layout import current_layout
    from tests.helpers.model_families import build_config, build_model

    base = from_module(build_model(build_config("qwen3_5_text", vocab_size=VOCAB)), None)
    eager, eager_losses, _ = _train(base, _jobs(3))
    padded = []   # the padding tokens after the jobs' (the bucket padding's own sequences) of each row cut
    pieces = stateful_layers._row_pieces
    monkeypatch.setattr(stateful_layers, "_row_pieces", lambda length: padded.append(
        length - current_layout().segments[-1][2]) or pieces(length))
    compiled, compiled_losses, _ = _train(base, _jobs(3), compile="default", compile_backend=BACKEND)
    assert max(padded) > 0
    for name in eager_losses:
        assert compiled_losses[name] == pytest.approx(eager_losses[name], abs=1e-5), name
    for name in eager:
        assert max(float(v.abs().max()) for k, v in eager[name].items() if "lora_B" in k) > 0, name
        for key in eager[name]:
            torch.testing.assert_close(compiled[name][key], eager[name][key], rtol=0, atol=1e-5)


def test_compiled_steps_train_a_dpo_job_beside_an_sft_job_as_eager_steps_do():
    """A DPO job (its reference: an eager no-adapter forward) and an SFT job fused, compiled against eager: the
    same losses and adapters to float32 rounding (the padding sequences hold no preference pair's targets)."""
    from actors.spec.job_spec import JobSpec
    from tests.helpers.pairs import random_pairs

    common = {"data": "unused.jsonl", "lr": 1e-2, "warmup_steps": 1, "max_steps": 2,
              "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}}
    jobs = [(JobSpec(name="dpo", format={"type": "preference"}, method="dpo", batch_size=2, **common),
             random_pairs(0, 4, VOCAB), 0),
            (JobSpec(name="sft", format={"type": "text"}, batch_size=3, **common),
             random_examples(1, count=6, vocab=VOCAB), 1)]
    base = from_module(tiny_model("llama", VOCAB), None)
    eager, eager_losses, _ = _train(base, jobs)
    compiled, compiled_losses, compiles = _train(base, jobs, compile="default", compile_backend=BACKEND)
    assert ("dpo", "sft") in compiles["job_sets"], compiles
    for name in eager_losses:
        assert compiled_losses[name] == pytest.approx(eager_losses[name], abs=1e-5), name
        for key in eager[name]:
            torch.testing.assert_close(compiled[name][key], eager[name][key], rtol=0, atol=1e-5)


def _losses_and_gradients(base, jobs, micro_batches, batch):
    for job in jobs:
        for parameter in job.adapter.parameters():
            parameter.grad = None
    with step_layout(batch.layout):
        hidden = base.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                              attention_mask=None, use_cache=False).last_hidden_state[0]
    logits = base.lm_head(hidden[batch.target_index])
    losses = torch.nn.functional.cross_entropy(logits, batch.target_ids, reduction="none")
    sums = torch.zeros(len(jobs)).index_add_(0, batch.target_job, losses)
    sums.sum().backward()
    gradients = {job.name: {k: v.grad.clone() for k, v in job.adapter.named_parameters()} for job in jobs}
    return sums.detach(), gradients


def test_bucket_padding_changes_no_jobs_loss_or_gradients_even_when_it_is_nan():
    """The padded stream (eager, no compile) against the unpadded one: each job's loss and adapter gradients are
    the same; with the padding's hidden states set to NaN at every layer's entry, still the same (no job reads the
    padding, forward or backward)."""
    base = from_module(tiny_model("llama", VOCAB), None)
    jobs = [TrainingJob.create(spec, base, examples, [], seed=seed) for spec, examples, seed in _jobs()]
    set_adapters_training(base.model, False)   # no dropout draws: the two passes see the same adapters
    micro_batches = [JobMicroBatch(job.name, job.take()) for job in jobs]
    plain = pack(micro_batches)
    padded = pad_to_bucket(plain, base.pad_token_id)
    assert padded.num_tokens == bucket_length(plain.num_tokens) > plain.num_tokens
    reference = _losses_and_gradients(base, jobs, micro_batches, plain)
    results = [_losses_and_gradients(base, jobs, micro_batches, padded)]

    def poison(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        poisoned = hidden.clone()
        poisoned[:, plain.num_tokens:] = float("nan")
        return ((poisoned, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": poisoned})

    hooks = [layer.register_forward_pre_hook(poison, with_kwargs=True) for layer in base.decoder.layers]
    try:
        results.append(_losses_and_gradients(base, jobs, micro_batches, padded))
    finally:
        for hook in hooks:
            hook.remove()
    for sums, gradients in results:
        torch.testing.assert_close(sums, reference[0], rtol=0, atol=1e-6)
        for name, tensors in reference[1].items():
            for key, gradient in tensors.items():
                assert torch.isfinite(gradients[name][key]).all(), (name, key)
                torch.testing.assert_close(gradients[name][key], gradient, rtol=0, atol=1e-7)


def test_combinations_not_offered_are_refused_naming_the_fix():
    from actors.service.scheduler.config import TrainerConfig
    from actors.spec.run_spec import RunSpec

    base = from_module(tiny_model("llama", VOCAB), None)
    with pytest.raises(ValueError, match="recompute: none"):
        FusedTrainer(base, compile="default", recompute="layers")
    with pytest.raises(ValueError, match="quantization: none"):
        FusedTrainer(dataclasses.replace(base, quantization="nf4"), compile="default")
    with pytest.raises(ValueError, match="compile must be one of"):
        FusedTrainer(base, compile="max")
    with pytest.raises(ValueError, match="set compile: none or recompute: none"):
        TrainerConfig(compile="default", recompute="layers")
    with pytest.raises(ValueError, match="set compile: none or quantization: none"):
        RunSpec(compile="default", quantization="int8", jobs=[{"name": "a", "data": "d.jsonl",
                                                               "format": {"type": "text"}}])
    assert TrainerConfig(compile="default").compile == "default"


def test_a_jobs_file_with_compile_trains_its_jobs_compiled(tiny_model_dirs, tmp_path, monkeypatch):
    """`compile: default` in a jobs file reaches the trainer that steps its jobs (`aspen run --in-process`): its
    decoder layers go through torch.compile (the backend sees graphs) and every step's stream is padded up to a
    bucket length, as its step log shows; the same file without it compiles nothing and pads no step."""
    import json

    from actors.engine import trainer as trainer_module
    from actors.engine.compiled import CompiledLayers
    from actors.engine.models import load_base_model
    from actors.service.scheduler.local_run import train_locally
    from actors.spec.run_spec import RunSpec
    from tests.helpers.service import job_dict, write_task_data

    counting = CountingBackend("aot_eager")
    monkeypatch.setattr(trainer_module, "CompiledLayers",
                        lambda decoder, backend: CompiledLayers(decoder, backend=counting))
    base_dir = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "task")
    graphs, rows = {}, {}
    for mode in ("default", "none"):
        before = counting.graphs
        spec = RunSpec.model_validate({"base_model": base_dir, "output_dir": str(tmp_path / mode), "step_tokens": 512,
                                       "compile": mode, "jobs": [job_dict("a", data, 2), job_dict("b", data, 2)]})
        train_locally(spec, base=load_base_model(base_dir, dtype="float32", device="cpu"), progress=False)
        graphs[mode] = counting.graphs - before
        rows[mode] = [json.loads(line) for line in (tmp_path / mode / "trainer.jsonl").read_text().splitlines()]
    assert graphs["default"] > 0 and graphs["none"] == 0
    buckets = set(buckets_between(MIN_BUCKET, 8192))
    assert rows["default"] and all(r["tokens"] in buckets and r["padding_tokens"] > 0
                                   for r in rows["default"]), rows["default"]
    assert rows["none"] and all(r["padding_tokens"] == 0 for r in rows["none"]), rows["none"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_steps_on_cuda_train_the_adapters_the_eager_steps_train():
    """On CUDA in bfloat16 with inductor: the same losses and adapters as the eager steps, to bfloat16 rounding
    of the base's activations (inductor fuses the norms and activations, rounding in other places)."""
    model = tiny_model("llama", VOCAB).to("cuda", torch.bfloat16)
    base = from_module(model, None)
    eager, eager_losses, _ = _train(base, _jobs())
    backend = CountingBackend("inductor")
    compiled, compiled_losses, _ = _train(base, _jobs(), compile="default", compile_backend=backend)
    assert backend.graphs > 0
    for name in eager_losses:
        assert compiled_losses[name] == pytest.approx(eager_losses[name], rel=2e-2), name
    for name in eager:
        for key in eager[name]:
            assert relative_difference({key: compiled[name][key]}, {key: eager[name][key]}) < 5e-2, (name, key)
