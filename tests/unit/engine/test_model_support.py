"""The model-support contract (actors/engine/model_support.py) against independent references.

For every row of the verified table, a tiny random model of that architecture: several sequences of
different lengths, from several jobs each with its own non-zero adapter, packed into one fused step, give
per sequence the loss of the unfused Hugging Face model (eager attention, with PEFT holding the job's
adapter) run alone on that sequence with `labels`, and each adapter's gradient equals PEFT's. Sliding
windows are shorter than the sequences. Each architecture's special features are shown to matter: turned
off in the reference, its loss moves by far more than the tolerance. Refused features are refused at
load, with their message; docs/models.md's table is the code's table."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from actors.checkpoint.peft_io import save_adapter
from actors.data import Example
from actors.engine import step_objective as objective_module
from actors.engine.attention import use_varlen_attention, varlen_attention_forward
from actors.engine.job import TrainingJob
from actors.engine.layout import StepLayout, step_layout
from actors.engine.loss import target_cross_entropy
from actors.engine.model_support import (
    SUPPORTED,
    LogitTransform,
    UnsupportedModelError,
    check_model_support,
    markdown_table,
)
from actors.engine.models import from_module, load_base_model
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec

REPO = Path(__file__).resolve().parents[3]
VOCAB = 128
WINDOW = 8            # sliding windows, shorter than every sequence but one below
LOSS_TOLERANCE = 1e-5       # relative, fp32 on the CPU
GRADIENT_TOLERANCE = 1e-5   # relative (Frobenius norm of the difference over the norm), fp32 on the CPU
FEATURE_EFFECT = 1e-3       # a feature turned off in the reference moves its loss by more than this (relative)

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, initializer_range=0.1)
SLIDING_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
ALL_FULL = ["full_attention"] * 3
GLM_ROPE = {"rope_type": "default", "rope_theta": 10.0, "partial_rotary_factor": 0.5}

# model_type -> (config fields, [(what is turned off, config fields that turn it off)])
CASES: dict[str, tuple[dict, list[tuple[str, dict]]]] = {
    "llama": ({}, []),
    "mistral": ({"sliding_window": WINDOW}, [("sliding window", {"sliding_window": None})]),
    "qwen2": ({"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
              [("sliding-window layers", {"use_sliding_window": False})]),
    "qwen3": ({"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
              [("sliding-window layers", {"use_sliding_window": False})]),
    "gemma": ({}, []),
    "gemma2": ({"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": SLIDING_LAYERS,
                "final_logit_softcapping": 2.0, "attn_logit_softcapping": 0.5, "query_pre_attn_scalar": 4},
               [("final logit soft-capping", {"final_logit_softcapping": None}),
                ("attention soft-capping", {"attn_logit_softcapping": None}),
                ("sliding layers", {"layer_types": ALL_FULL}),
                ("query_pre_attn_scalar", {"query_pre_attn_scalar": 256})]),
    "gemma3_text": ({"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": SLIDING_LAYERS,
                     "final_logit_softcapping": 2.0, "query_pre_attn_scalar": 64,
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 10000.0}}},
                    [("final logit soft-capping", {"final_logit_softcapping": None}),
                     ("sliding layers", {"layer_types": ALL_FULL}),
                     ("query_pre_attn_scalar", {"query_pre_attn_scalar": 16})]),
    "phi3": ({"sliding_window": WINDOW}, [("sliding window", {"sliding_window": None})]),
    "granite": ({"logits_scaling": 4.0, "attention_multiplier": 0.5, "embedding_multiplier": 3.0,
                 "residual_multiplier": 0.5},
                [("logits_scaling", {"logits_scaling": 1.0}),
                 ("attention_multiplier", {"attention_multiplier": 0.25})]),
    "gpt_oss": ({"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": SLIDING_LAYERS,
                 "num_local_experts": 4, "num_experts_per_tok": 2,
                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": 64, "rope_theta": 10000.0}},
                [("sliding layers", {"layer_types": ALL_FULL})]),
    "olmo2": ({}, []),
    "cohere": ({"logit_scale": 4.0, "use_qk_norm": False}, [("logit_scale", {"logit_scale": 1.0})]),
    "smollm3": ({"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1]},
                [("NoPE layers", {"no_rope_layers": [1, 1, 1]})]),
    # GLM-4: q/k/v biases, RoPE on half of each head interleaved (not rotate-half), one fused gate_up_proj;
    # glm4 adds norms after the attention and the MLP (shown to matter below); a small rope_theta, so that
    # rotating half of each head or all of it makes a clear difference on short sequences
    "glm": ({"rope_parameters": GLM_ROPE, "attention_bias": True},
            [("partial rotary factor", {"rope_parameters": {**GLM_ROPE, "partial_rotary_factor": 1.0}})]),
    "glm4": ({"rope_parameters": GLM_ROPE, "attention_bias": True},
             [("partial rotary factor", {"rope_parameters": {**GLM_ROPE, "partial_rotary_factor": 1.0}})]),
}
# Static RoPE variants, on Llama (one of them also on gpt-oss and Gemma 3 above)
ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
}


def build_config(model_type: str, **overrides):
    fields = dict(COMMON)
    fields.update(CASES[model_type][0] if model_type in CASES else {})
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def build_model(config, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    if config.model_type == "gpt_oss":   # sinks start at zero: give each head its own
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    with torch.no_grad():   # GLM's q/k/v biases start at zero: make them count
        for name, parameter in model.named_parameters() if config.model_type in ("glm", "glm4") else ():
            if name.endswith("_proj.bias"):
                parameter.normal_(0.0, 0.5)
    return model


def examples(seed: int, lengths: list[int]) -> list[Example]:
    generator = torch.Generator().manual_seed(seed)
    made = []
    for length in lengths:
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        prompt = max(1, length // 3)
        made.append(Example(tuple(ids), tuple([-100] * prompt + ids[prompt:])))
    return made


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


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def check_fused_step_against_hf(model: torch.nn.Module, tmp_path: Path) -> None:
    reference = copy.deepcopy(model)
    base = from_module(model, None)
    trainer = FusedTrainer(base, step_tokens=100_000)
    jobs, batches = [], []
    generator = torch.Generator().manual_seed(123)
    for index, (name, lengths, lora) in enumerate(JOBS):
        job = TrainingJob.create(job_spec(name, len(lengths), lora), base, examples(index, lengths), [], seed=index)
        with torch.no_grad():   # a non-zero adapter: B random too
            for layer in job.adapter.layers.values():
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.2)
        trainer.add_job(job)
        jobs.append(job)
        batches.append(list(job.peek()))

    captured = []
    real_loss = objective_module.target_cross_entropy

    def spy(*args, **kwargs):
        total, losses = real_loss(*args, **kwargs)
        captured.append(losses)
        return total, losses

    objective_module.target_cross_entropy = spy
    try:
        report = trainer.run_step(trainer.compose())
    finally:
        objective_module.target_cross_entropy = real_loss
    assert report.jobs == [name for name, _, _ in JOBS] and all(r.optimizer_step is None for r in report.results)
    token_losses = captured[0]
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
        job_loss = sum(loss * count for loss, count in zip(reference_losses, counts, strict=True)) / sum(counts)
        assert result.loss == pytest.approx(job_loss.item(), rel=LOSS_TOLERANCE)
        job_loss.backward()
        peft_grads = {name.replace(".default", "").removeprefix("base_model.model."): p.grad
                      for name, p in peft_model.named_parameters() if "lora_" in name}
        # the adapter's gradient sums its tokens' gradients until its optimizer step divides by their count
        engine_grads = {name: p.grad / sum(counts) for name, p in job.adapter.named_parameters()}
        assert peft_grads.keys() == engine_grads.keys()
        flat_peft = torch.cat([peft_grads[k].flatten() for k in sorted(peft_grads)])
        flat_engine = torch.cat([engine_grads[k].flatten() for k in sorted(peft_grads)])
        assert flat_peft.norm() > 0
        assert relative(flat_engine, flat_peft) <= GRADIENT_TOLERANCE, job.name
        # the evaluation path and the logits path: the same transforms as the model's own forward
        with torch.no_grad():
            assert trainer.evaluate(job, batch) == pytest.approx(job_loss.item(), rel=LOSS_TOLERANCE)
            shortest = min(len(e) for e in batch)   # equal-length rows, longer than the window but for job-b
            rows = torch.tensor([e.input_ids[:shortest] for e in batch])
            peft_logits = peft_model(input_ids=rows, use_cache=False).logits
            assert relative(trainer.logits(job.name, rows), peft_logits) <= LOSS_TOLERANCE
            hidden = peft_model.base_model.model.model(input_ids=rows, use_cache=False).last_hidden_state
            assert relative(base.output_logits(hidden), peft_logits) <= LOSS_TOLERANCE   # greedy_generate's logits
    assert offset == token_losses.numel()


@pytest.mark.parametrize("model_type", list(SUPPORTED))
def test_fused_packed_step_equals_hf_and_peft(model_type, tmp_path):
    assert model_type in CASES, f"add a tiny config for '{model_type}' to CASES"
    check_fused_step_against_hf(build_model(build_config(model_type)), tmp_path)


@pytest.mark.parametrize("rope", list(ROPE_CASES))
def test_static_rope_variants_equal_hf(rope, tmp_path):
    check_fused_step_against_hf(build_model(build_config("llama", rope_parameters=ROPE_CASES[rope])), tmp_path)


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


# -- refusals -----------------------------------------------------------------------------------------

REFUSED = [
    ("starcoder2", {}, r"model_type 'starcoder2'\) is not in aspen's verified table .*: llama, mistral, qwen2"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     r"rope type 'dynamic'.*packed row's longest sequence.*refused"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                  "original_max_position_embeddings": 64, "rope_theta": 10000.0},
              "original_max_position_embeddings": 64},
     r"rope type 'longrope'.*short and long factors.*refused"),
    ("gemma3_text", {"use_bidirectional_attention": True}, r"use_bidirectional_attention=True.*refused"),
    ("gpt_oss", {"output_router_logits": True}, r"output_router_logits=True.*load-balancing loss.*refused"),
]


@pytest.mark.parametrize("model_type, fields, message", REFUSED)
def test_refused_at_load_with_its_reason(model_type, fields, message, tmp_path):
    config = build_config(model_type, **fields)
    with pytest.raises(UnsupportedModelError, match=message):
        from_module(build_model(config), None)
    # load_base_model refuses from the config alone, before any weight is read (the folder has none)
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=message):
        load_base_model(str(tmp_path), device="cpu")


CHATGLM_CONFIG = {"model_type": "chatglm", "architectures": ["ChatGLMModel"],
                  "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                               "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"},
                  "num_layers": 2, "hidden_size": 64, "padded_vocab_size": 128, "multi_query_attention": True,
                  "multi_query_group_num": 2, "kv_channels": 16, "ffn_hidden_size": 96}


def test_remote_code_chatglm_is_refused_naming_native_glm4(tmp_path):
    """The remote-code ChatGLM2/3 (its config.json names model_type 'chatglm' and its own Python classes):
    transformers cannot even read its config without trust_remote_code; aspen refuses it before anything is
    run, naming the transformers-native GLM-4 model types to use instead."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(CHATGLM_CONFIG))
    message = r"model_type 'chatglm'.*trust_remote_code.*refused; use a transformers-native GLM-4.*'glm' or 'glm4'"
    with pytest.raises(UnsupportedModelError, match=message):
        load_base_model(str(tmp_path), device="cpu")
    # another remote-code type aspen does not know: refused for its auto_map, naming the verified types
    (tmp_path / "config.json").write_text(json.dumps({**CHATGLM_CONFIG, "model_type": "internlm2"}))
    with pytest.raises(UnsupportedModelError, match=r"'internlm2'\) needs its own modeling code .*auto_map.*glm4"):
        load_base_model(str(tmp_path), device="cpu")
    # a config object of that type (e.g. built by remote code elsewhere) is refused the same way
    with pytest.raises(UnsupportedModelError, match=message):
        check_model_support(type("ChatGLMConfig", (), {"model_type": "chatglm"})())


def test_dynamic_rope_would_make_a_job_depend_on_its_neighbours():
    """Why dynamic NTK is refused: transformers rescales by the longest position of the whole forward,
    so the same sequence gets another loss when a long one is packed beside it."""
    model = build_model(build_config("llama", max_position_embeddings=16,
                                     rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10.0}))
    use_varlen_attention(model)
    short, long = examples(0, [12])[0], examples(1, [40])[0]

    def first_sequence_logits(sequences: list[Example]) -> torch.Tensor:
        ids = torch.tensor([[t for e in sequences for t in e.input_ids]])
        positions = torch.cat([torch.arange(len(e)) for e in sequences])[None]
        with torch.no_grad(), step_layout(StepLayout.single("none", [len(e) for e in sequences])):
            return model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, :len(short)]

    alone, packed = first_sequence_logits([short]), first_sequence_logits([short, long])
    assert relative(packed, alone) > 1e-3


def test_attention_refuses_an_argument_it_does_not_implement():
    class Bidirectional(torch.nn.Module):
        is_causal = False

    query = torch.randn(1, 2, 6, 8)
    with step_layout(StepLayout.single("x", [6])):
        with pytest.raises(NotImplementedError, match="Bidirectional passes is_causal=False"):
            varlen_attention_forward(Bidirectional(), query, query, query, None)
        with pytest.raises(NotImplementedError, match="passes chunk_size"):
            varlen_attention_forward(torch.nn.Module(), query, query, query, None, chunk_size=4)


def test_readme_table_is_the_code_table():
    page = (REPO / "docs" / "models.md").read_text()
    assert "# Supported models" in page
    assert markdown_table() in page, "docs/models.md's table differs from model_support.markdown_table(): paste it"


# -- the pieces, against their own references -------------------------------------------------------------

@pytest.mark.parametrize("transform", [LogitTransform(softcap=1.5), LogitTransform(divide=4.0),
                                       LogitTransform(multiply=3.0)], ids=["softcap", "divide", "multiply"])
def test_chunked_loss_with_a_logit_transform_equals_autograd(transform):
    """The loss computes its gradient in the forward pass, chunk by chunk: against autograd through the
    transform written out (Gemma's cap * tanh(raw / cap), Granite's raw / s, Cohere's raw * s)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 16, generator=generator, dtype=torch.float64) * 3
    weight = torch.randn(40, 16, generator=generator, dtype=torch.float64)
    bias = torch.randn(40, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 40, (11,), generator=generator)
    token_weights = torch.rand(11, generator=generator, dtype=torch.float64)

    reference_hidden = hidden.clone().requires_grad_(True)
    logits = (reference_hidden @ weight.T + bias) * transform.multiply / transform.divide
    if transform.softcap is not None:
        logits = transform.softcap * torch.tanh(logits / transform.softcap)
    per_token = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    (per_token * token_weights).sum().backward()

    engine_hidden = hidden.float().requires_grad_(True)
    total, losses = target_cross_entropy(engine_hidden, weight.float(), bias.float(), targets, token_weights.float(),
                                         chunk=3, transform=transform)
    total.backward()
    # the engine's logits are float32, the reference's float64: 1e-5 relative (norm of the difference)
    assert relative(losses.double(), per_token.detach()) <= 1e-5
    assert relative(engine_hidden.grad.double(), reference_hidden.grad) <= 1e-5


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_softcap_and_sink_attention_equals_the_models_eager_attention(model_type, device):
    """The per-sequence path for soft-capping (Gemma 2) and sinks (gpt-oss) against the model's own eager
    attention run on each sequence with its causal sliding-window mask. On CUDA in bfloat16 this is also
    the path taken instead of the varlen kernels, which lack both features."""
    eager = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}").eager_attention_forward
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 17, 30]
    layout = StepLayout.single("x", lengths)

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, layout.num_tokens, 16, generator=generator).to(device, dtype)

    query, key, value = tensor(4), tensor(2), tensor(2)
    module = torch.nn.Module().to(device)
    module.num_key_value_groups = 2
    module.sinks = torch.nn.Parameter(torch.randn(4, generator=generator).to(device, dtype), requires_grad=False)
    module.eval()
    features = {"softcap": 0.7} if model_type == "gemma2" else {"s_aux": module.sinks}
    with step_layout(layout):
        ours, _ = varlen_attention_forward(module, query, key, value, None, scaling=0.5, sliding_window=WINDOW,
                                           **features)
    expected = []
    for start, end in layout.sequences:
        index = torch.arange(end - start, device=device)
        distance = index[:, None] - index[None, :]
        allowed = (distance >= 0) & (distance < WINDOW)
        mask = torch.zeros(end - start, end - start, device=device, dtype=dtype)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        extra = {"softcap": 0.7} if model_type == "gemma2" else {}
        out, _ = eager(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], mask,
                       scaling=0.5, dropout=0.0, **extra)
        expected.append(out)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(ours.float(), torch.cat(expected, dim=1).float(), rtol=tolerance, atol=tolerance)
