"""The model-support contract (actors/engine/model_support.py) against independent references: for every row
of the verified table, a tiny random model of that architecture (tests/helpers/model_families.py): several
sequences of different lengths, from several jobs each with its own non-zero adapter, packed into one fused
step, give per sequence the loss of the unfused Hugging Face model (eager attention, with PEFT holding the
job's adapter) run alone on that sequence with `labels`, and each adapter's gradient equals PEFT's; so do the
evaluation and logits paths, and the static RoPE variants. Sliding windows are shorter than the sequences.
Each architecture's special features are shown to matter: turned off in the reference, its loss moves by far
more than the tolerance."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from actors.checkpoint.peft_io import save_adapter
from actors.data import Example
from actors.engine.generate import greedy_generate
from actors.engine.job import TrainingJob
from actors.engine.lora_targets import MLP_AS_EXPERTS_TYPES
from actors.engine.model_support import SUPPORTED
from actors.engine.models import from_module
from actors.engine.recompute import decoder_layers
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from tests.helpers.model_families import (
    CASES,
    build_config,
    build_model,
    examples,
    job_loss_and_gradients,
    relative,
    step_with_token_losses,
)

LOSS_TOLERANCE = 1e-5       # relative, fp32 on the CPU
GRADIENT_TOLERANCE = 1e-5   # relative (Frobenius norm of the difference over the norm), fp32 on the CPU
EXACT_RATIO = 4             # where the two float32 gradients differ by more: the engine's error from the exact ones
                            # at most this many times the reference's (`assert_gradients_agree`)
FEATURE_EFFECT = 1e-3       # a feature turned off in the reference moves its loss by more than this (relative)

# Static RoPE variants, on Llama (one of them also on gpt-oss and Gemma 3 in CASES)
ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
}


def job_spec(name: str, count: int, lora: dict) -> JobSpec:
    # grad_accum=2: the fused step leaves the gradients in place (no optimizer step after one micro-batch)
    return JobSpec(name=name, data="unused.jsonl", format={"type": "text"}, batch_size=count, grad_accum=2,
                   max_steps=5, lr=1e-3, lora=lora)


JOBS = [("job-a", [24, 13], {"r": 4, "alpha": 8, "target_modules": "all-linear"}),
        ("job-b", [19, 6, 30], {"r": 2, "alpha": 6, "target_modules": "all-linear"}),
        ("job-c", [11, 22], {"r": 8, "alpha": 8, "target_modules": "all-linear"})]


def sequence_reference(model: torch.nn.Module, batch: list[Example]) -> list[torch.Tensor]:
    """The unfused model alone on each sequence: its loss (mean over its targets), differentiable."""
    losses = []
    for example in batch:
        ids = torch.tensor([example.input_ids])
        labels = torch.tensor([example.labels])
        losses.append(model(input_ids=ids, labels=labels, use_cache=False).loss)
    return losses


def target_count(example: Example) -> int:
    return sum(label != -100 for label in example.labels[1:])


def assert_gradients_agree(engine: torch.Tensor, peft: torch.Tensor, peft_model: torch.nn.Module,
                           batch: list[Example], counts: list[int], name: str) -> None:
    """The engine's adapter gradients (`engine`, flat, PEFT's sorted names) equal PEFT's in float32 (`peft`) within
    GRADIENT_TOLERANCE; where they differ by more, the float64 copy of the reference decides: both float32
    computations sum the same terms along the same chain in other orders, so their errors from the exact gradients
    are draws of one rounding walk, as large as the chain's conditioning makes it (a tiny random model may amplify
    its first layer's roundings: Gemma 4's by 20x on an Intel Xeon), and the engine's may be at most EXACT_RATIO
    times the reference's (the errors spread over thousands of entries: the two norms are close)."""
    error = relative(engine, peft)
    if error <= GRADIENT_TOLERANCE:
        return
    exact_model = copy.deepcopy(peft_model).double()
    for parameter in exact_model.parameters():
        parameter.grad = None
    try:
        losses = sequence_reference(exact_model, batch)
    except RuntimeError as failure:   # (a kernel without float64, e.g. grouped experts: the float32 bound stands)
        raise AssertionError(f"{name}: gradients {error:.2e} apart, no float64 reference ({failure})") from failure
    (sum(loss * count for loss, count in zip(losses, counts, strict=True)) / sum(counts)).backward()
    grads = {n.replace(".default", "").removeprefix("base_model.model."): p.grad   # PEFT's names, as `peft`'s
             for n, p in exact_model.named_parameters() if "lora_" in n}
    exact = torch.cat([grads[n].flatten() for n in sorted(grads)])
    engine_error, peft_error = relative(engine.double(), exact), relative(peft.double(), exact)
    assert engine_error <= max(GRADIENT_TOLERANCE, EXACT_RATIO * peft_error), (
        f"{name}: the engine's gradients {engine_error:.2e} from the exact ones (float64), the reference's float32 "
        f"{peft_error:.2e}; {error:.2e} apart")


def check_fused_step_against_hf(model: torch.nn.Module, tmp_path: Path, specs: list = JOBS) -> None:
    """`specs`: (name, sequence lengths, lora settings) of each job of the step."""
    reference = copy.deepcopy(model)
    base = from_module(model, None)
    # the layers the memory prior counts and `recompute: layers` wraps (a service's trainer reads them at start)
    assert len(decoder_layers(base.decoder)) == base.model.config.num_hidden_layers
    trainer = FusedTrainer(base, step_tokens=100_000)
    jobs, batches = [], []
    generator = torch.Generator().manual_seed(123)
    for index, (name, lengths, lora) in enumerate(specs):
        job = TrainingJob.create(job_spec(name, len(lengths), lora), base, examples(index, lengths), [], seed=index)
        with torch.no_grad():   # a non-zero adapter: B random too
            for layer in job.adapter.layers.values():
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.2)
        trainer.add_job(job)
        jobs.append(job)
        batches.append(list(job.peek()))

    report, token_losses = step_with_token_losses(trainer)
    assert report.jobs == [name for name, _, _ in specs] and all(r.optimizer_step is None for r in report.results)
    offset = 0
    for job, batch, result in zip(jobs, batches, report.results, strict=True):
        folder = tmp_path / job.name
        save_adapter(job.adapter, folder, "tiny")
        peft_model = PeftModel.from_pretrained(copy.deepcopy(reference), folder, is_trainable=True).eval()
        reference_losses = sequence_reference(peft_model, batch)
        counts = [target_count(e) for e in batch]
        for example, count, reference_loss in zip(batch, counts, reference_losses, strict=True):
            engine_loss = float(token_losses[offset:offset + count].mean())
            offset += count
            assert engine_loss == pytest.approx(reference_loss.item(), rel=LOSS_TOLERANCE), (job.name, len(example))
        job_loss, peft_grads, engine_grads = job_loss_and_gradients(peft_model, job.adapter, reference_losses, counts)
        assert result.loss == pytest.approx(job_loss.item(), rel=LOSS_TOLERANCE)
        flat_peft = torch.cat([peft_grads[k].flatten() for k in sorted(peft_grads)])
        flat_engine = torch.cat([engine_grads[k].flatten() for k in sorted(peft_grads)])
        assert flat_peft.norm() > 0
        assert_gradients_agree(flat_engine, flat_peft, peft_model, batch, counts, job.name)
        # the evaluation path and the logits path: the same transforms as the model's own forward
        with torch.no_grad():
            assert trainer.evaluate(job, batch) == pytest.approx(job_loss.item(), rel=LOSS_TOLERANCE)
            shortest = min(len(e) for e in batch)   # equal-length rows, longer than the window but for job-b
            rows = torch.tensor([e.input_ids[:shortest] for e in batch])
            peft_logits = peft_model(input_ids=rows, use_cache=False).logits
            assert relative(trainer.logits(job.name, rows), peft_logits) <= LOSS_TOLERANCE
            model = peft_model.base_model.model
            hidden = getattr(model, model.base_model_prefix)(input_ids=rows, use_cache=False).last_hidden_state
            assert relative(base.output_logits(hidden), peft_logits) <= LOSS_TOLERANCE   # greedy_generate's logits
    assert offset == token_losses.numel()


@pytest.mark.parametrize("model_type", list(SUPPORTED))
def test_fused_packed_step_equals_hf_and_peft(model_type, tmp_path):
    assert model_type in CASES, f"add a tiny config for '{model_type}' to CASES"
    check_fused_step_against_hf(build_model(build_config(model_type)), tmp_path)


@pytest.mark.parametrize("model_type", list(SUPPORTED))
def test_greedy_decoding_is_hf_generate(model_type):
    """aspen's decoding (a left-padded batch with a KV cache: sampling, "try it", generation evals) gives the
    tokens Hugging Face's `generate` gives on the unfused model, prompt by prompt, ending at its end token."""
    model = build_model(build_config(model_type))
    reference = copy.deepcopy(model)
    eos = model.config.eos_token_id
    prompts = [[5, 9, 33, 7, 60, 12, 4, 90, 11, 13, 17], [71, 3, 45]]   # the shorter one padded on the left
    ours = greedy_generate(from_module(model, None), None, prompts, 8, {eos})
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            expected = reference.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                          eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == expected, (model_type, prompt)


@pytest.mark.parametrize("rope", list(ROPE_CASES))
def test_static_rope_variants_equal_hf(rope, tmp_path):
    check_fused_step_against_hf(build_model(build_config("llama", rope_parameters=ROPE_CASES[rope])), tmp_path)


# Falcon's layouts beside Falcon-7B's (CASES): Falcon-40B / 180B's (grouped keys and values, a LayerNorm for attention
# and one for the MLP) and Falcon2-11B's (grouped, one LayerNorm)
FALCON_LAYOUTS = {
    "new decoder, two norms": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "new decoder, one norm": {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1},
}


@pytest.mark.parametrize("layout", list(FALCON_LAYOUTS))
def test_falcon_layouts_equal_hf(layout, tmp_path):
    model = build_model(build_config("falcon", **FALCON_LAYOUTS[layout]))
    assert model.transformer.h[0].self_attention.num_kv_heads == 2
    check_fused_step_against_hf(model, tmp_path)


def _hf_loss(model: torch.nn.Module, batch: list[Example]) -> float:
    with torch.no_grad():
        return float(sum(sequence_reference(model, batch)))


@pytest.mark.parametrize("model_type, feature, off",
                         [(t, f, off) for t, (_, features) in CASES.items() for f, off in features])
def test_each_feature_changes_the_reference_loss(model_type, feature, off):
    """The comparison above has teeth: each feature it claims to handle, turned off in the reference
    (same weights), moves the loss by far more than the tolerance."""
    model = build_model(build_config(model_type))
    ablated = build_model(build_config(model_type, **off))
    ablated.load_state_dict(model.state_dict())
    batch = examples(0, [24, 13, 19])
    with_feature, without = _hf_loss(model, batch), _hf_loss(ablated, batch)
    assert abs(with_feature - without) > FEATURE_EFFECT * abs(with_feature), feature


def test_gemma4_per_layer_inputs_and_shared_keys_and_values_matter():
    """Gemma 4's features that change its parameters, each turned off with the same weights where they remain: its
    per-layer input embeddings dropped (the tables, gates and projections gone); a layer that reuses an earlier
    layer's keys and values computing its own from its own input with that layer's weights. Each moves the loss,
    so the fused step's equality above covers both; a text model of Gemma 4 that attends only to text (`vision`)
    is taken, as its text tokens attend causally."""
    batch = examples(0, [24, 13, 19])
    model = build_model(build_config("gemma4_text"))
    no_inputs = build_model(build_config("gemma4_text", hidden_size_per_layer_input=0))
    loaded = no_inputs.load_state_dict(model.state_dict(), strict=False)
    assert not loaded.missing_keys and loaded.unexpected_keys
    assert all("per_layer" in name for name in loaded.unexpected_keys)
    assert abs(_hf_loss(model, batch) - _hf_loss(no_inputs, batch)) > FEATURE_EFFECT * _hf_loss(model, batch)

    shared = build_model(build_config("gemma4_text", use_double_wide_mlp=False))   # the MLP's width kept
    own = build_model(build_config("gemma4_text", use_double_wide_mlp=False, num_kv_shared_layers=0))
    state = shared.state_dict()
    last, producer = len(shared.model.layers) - 1, len(shared.model.layers) - 2
    assert shared.model.layers[last].self_attn.is_kv_shared_layer
    for name in own.state_dict():
        if name not in state:   # the reusing layer's own key projection and norms: the producer's weights
            state[name] = state[name.replace(f"layers.{last}.", f"layers.{producer}.")]
    own.load_state_dict(state)
    assert abs(_hf_loss(shared, batch) - _hf_loss(own, batch)) > FEATURE_EFFECT * _hf_loss(shared, batch)
    from_module(build_model(build_config("gemma4_text", use_bidirectional_attention="vision")), None)


def test_gemma4_k_and_v_targets_adapt_the_layers_that_compute_keys_and_values_as_peft_does(tmp_path):
    """Gemma 4's layers that reuse an earlier layer's keys and values (`num_kv_shared_layers`) have no k_proj and no
    v_proj, and its global layers whose keys are their values (`attention_k_eq_v`) no v_proj: a job naming k_proj and
    v_proj adapts those of the layers that have them, the modules PEFT adapts on the same model for the same names
    (the reference), and its fused step's losses and gradients are PEFT's with the adapter it saved."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    model = build_model(build_config("gemma4_text"))
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.is_kv_shared_layer for a in attention] == [False, False, True]
    assert [a.layer_type for a in attention] == ["sliding_attention", "full_attention", "full_attention"]
    targets = ["k_proj", "v_proj"]
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    adapted = {name.removeprefix("base_model.model.") for name, module in peft_model.named_modules()
               if isinstance(module, LoraLayer)}
    assert adapted == {"model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
                       "model.layers.1.self_attn.k_proj"}
    job = TrainingJob.create(job_spec("kv", 1, {"r": 4, "alpha": 8, "target_modules": targets}),
                             from_module(copy.deepcopy(model), None), examples(0, [10]), [], seed=0)
    assert set(job.adapter.layers) == adapted
    check_fused_step_against_hf(model, tmp_path, specs=[
        ("kv", [24, 13], {"r": 4, "alpha": 8, "target_modules": targets}),
        ("qkv", [19, 6], {"r": 2, "alpha": 6, "target_modules": ["q_proj", "k_proj", "v_proj"]})])


def test_gpt_oss_sinks_matter_and_experts_are_not_adapted():
    model = build_model(build_config("gpt_oss"))
    ablated = copy.deepcopy(model)
    with torch.no_grad():
        for layer in ablated.model.layers:
            layer.self_attn.sinks.fill_(-1e4)   # a sink that takes no probability: no sink
    batch = examples(0, [24, 13])
    assert abs(_hf_loss(model, batch) - _hf_loss(ablated, batch)) > FEATURE_EFFECT * _hf_loss(model, batch)
    base = from_module(model, None)
    job = TrainingJob.create(job_spec("moe", 1, {"r": 2, "target_modules": "all-linear"}), base,
                             examples(0, [10]), [], seed=0)
    assert {name.rsplit(".", 1)[-1] for name in job.adapter.layers} == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_glm_interleaved_rope_and_glm4_post_norms_matter(tmp_path):
    """GLM's RoPE rotates interleaved pairs of the first half of each head, and GLM-4 normalises the outputs of
    its attention and MLP: a model without them (rotate-half RoPE; the post-norms as identities) has
    another loss, so the fused step's equality above covers both; GLM's fused gate_up_proj is adapted whole."""
    from transformers.models.glm import modeling_glm
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as rotate_half_rope

    batch = examples(0, [24, 13])
    glm = build_model(build_config("glm"))
    interleaved = _hf_loss(glm, batch)
    original = modeling_glm.apply_rotary_pos_emb

    def half_rope(q, k, cos, sin, unsqueeze_dim=1):
        rotary = cos.shape[-1]
        q_rot, k_rot = rotate_half_rope(q[..., :rotary], k[..., :rotary], cos, sin, unsqueeze_dim)
        return torch.cat([q_rot, q[..., rotary:]], -1), torch.cat([k_rot, k[..., rotary:]], -1)

    modeling_glm.apply_rotary_pos_emb = half_rope
    try:
        assert abs(_hf_loss(glm, batch) - interleaved) > FEATURE_EFFECT * interleaved
    finally:
        modeling_glm.apply_rotary_pos_emb = original

    glm4 = build_model(build_config("glm4"))
    with torch.no_grad():
        for layer in glm4.model.layers:
            layer.post_self_attn_layernorm.weight.normal_(1.0, 0.5)
            layer.post_mlp_layernorm.weight.normal_(1.0, 0.5)
    without_post_norms = copy.deepcopy(glm4)
    for layer in without_post_norms.model.layers:
        layer.post_self_attn_layernorm = torch.nn.Identity()
        layer.post_mlp_layernorm = torch.nn.Identity()
    assert abs(_hf_loss(glm4, batch) - _hf_loss(without_post_norms, batch)) > FEATURE_EFFECT * _hf_loss(glm4, batch)
    check_fused_step_against_hf(glm4, tmp_path)   # with non-trivial post-norms

    job = TrainingJob.create(job_spec("glm", 1, {"r": 2, "target_modules": "all-linear"}), from_module(glm, None),
                             examples(0, [10]), [], seed=0)
    assert {name.rsplit(".", 1)[-1] for name in job.adapter.layers} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_up_proj", "down_proj"}


@pytest.mark.parametrize("model_type", MLP_AS_EXPERTS_TYPES)
def test_moe_types_whose_mlp_names_peft_reads_as_experts_adapt_attention_only(model_type):
    """On these types PEFT converts an adapter's gate_proj / up_proj / down_proj to the experts' (transformers 4's
    names): all-linear leaves the dense and shared MLP layers alone (the test above shows PEFT then loads the
    adapter where it was trained), and naming them is refused, saying why."""
    base = from_module(build_model(build_config(model_type)), None)
    mlp = [name for name, module in base.model.named_modules()
           if name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj") and isinstance(module, torch.nn.Linear)]
    assert mlp, "the tiny config has a dense or shared MLP"
    job = TrainingJob.create(job_spec("moe", 1, {"r": 2, "target_modules": "all-linear"}), base,
                             examples(0, [10]), [], seed=0)
    assert not {name.rsplit(".", 1)[-1] for name in job.adapter.layers} & {"gate_proj", "up_proj", "down_proj"}
    with pytest.raises(ValueError, match=r"down_proj: on a .* base PEFT and vLLM read .* MoE experts'.*target "
                                         r"attention"):
        TrainingJob.create(job_spec("mlp", 1, {"r": 2, "target_modules": ["o_proj", "down_proj"]}), base,
                           examples(0, [10]), [], seed=0)
    # the scheduler, which sizes a job from the trainer's linear layers alone, says the same
    from actors.engine.lora_targets import adapted_shapes

    assert {t for t, row in SUPPORTED.items() if row.unadapted} == set(MLP_AS_EXPERTS_TYPES)
    with pytest.raises(ValueError, match=r"'down_proj' matches no linear layer.*PEFT and vLLM read them as the "
                                         r"experts'"):
        adapted_shapes(["down_proj"], {"model.layers.0.self_attn.o_proj": (64, 64)})
