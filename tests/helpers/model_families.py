"""Tiny random models of each architecture in aspen's verified table (actors/engine/model_support.py), built from
configs with their special features on (sliding windows, soft-capping, logit scaling, sinks, GLM's partial RoPE),
with the config fields that turn each feature off; random examples of their vocabulary; a relative difference."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from actors.data import Example

VOCAB = 128
WINDOW = 8            # sliding windows, shorter than every sequence but one of test_model_families.py's jobs

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, initializer_range=0.1)
LINEAR_LAYERS = ["linear_attention", "full_attention", "linear_attention"]
LINEAR_HEADS = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4)
LINEAR_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CONV_LAYERS = ["conv", "full_attention", "conv"]
SLIDING_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
ALL_FULL = ["full_attention"] * 3
GLM_ROPE = {"rope_type": "default", "rope_theta": 10.0, "partial_rotary_factor": 0.5}
GLM_ROPE_FULL = {"rope_type": "default", "rope_theta": 10.0}

# HunYuan's RoPE as its checkpoints write it
NTK_ALPHA = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}
# DeepSeek-style latent attention, tiny: q and kv through low-rank projections, 8 of each head's 24 q/k dims rotated
MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
       "head_dim": 8, "num_key_value_heads": 4}

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
    # Gemma 4: per-layer input embeddings (PLE), the last layer reusing an earlier one's keys and values (the E2B /
    # E4B models), keys as values on global layers (attention_k_eq_v), a wider MLP on the reusing layers, a head
    # dimension of its own on global layers, proportional RoPE there (a quarter of the angles rotated, as Gemma 4)
    "gemma4_text": ({"num_hidden_layers": 3, "sliding_window": WINDOW,   # (its last layer must be a global one)
                     "layer_types": ["sliding_attention", "full_attention", "full_attention"],
                     "final_logit_softcapping": 2.0, "hidden_size_per_layer_input": 8,
                     "vocab_size_per_layer_input": VOCAB, "num_kv_shared_layers": 1, "attention_k_eq_v": True,
                     "use_double_wide_mlp": True, "global_head_dim": 32,
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                            "rope_theta": 10000.0}}},
                    # (the per-layer inputs and the shared keys and values change the parameters: their own test)
                    [("final logit soft-capping", {"final_logit_softcapping": None}),
                     ("sliding window", {"sliding_window": 256}),
                     ("proportional RoPE", {"rope_parameters": {
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}})]),
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
    # MoE: 4 experts, 2 a token; the experts are not adapted (test_model_families.py shows they are not) but every
    # token's route goes through them, so a packed sequence's loss still checks the routing is the sequence's own
    # Qwen3.5: Gated DeltaNet (linear attention: a short causal convolution, then the gated delta rule) between
    # full-attention layers with an output gate and partial RoPE; the MoE variant, and Qwen3-Next, below
    "qwen3_5_text": ({"num_hidden_layers": 3, "layer_types": LINEAR_LAYERS, **LINEAR_HEADS}, []),
    "qwen3_5_moe_text": ({"num_hidden_layers": 3, "layer_types": LINEAR_LAYERS, **LINEAR_HEADS, **LINEAR_MOE}, []),
    "qwen3_next": ({"num_hidden_layers": 3, "layer_types": LINEAR_LAYERS, **LINEAR_HEADS, **LINEAR_MOE}, []),
    # LFM2: gated short convolutions (carried along the row, like Gated DeltaNet's) between attention layers
    "lfm2": ({"num_hidden_layers": 3, "layer_types": CONV_LAYERS, "conv_L_cache": 3}, []),
    "lfm2_moe": ({"num_hidden_layers": 3, "layer_types": CONV_LAYERS, "conv_L_cache": 3, "num_dense_layers": 1,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}, []),
    "qwen3_moe": ({"num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "norm_topk_prob": True, "mlp_only_layers": [1], "use_sliding_window": True,
                   "sliding_window": WINDOW},
                  [("sliding window", {"use_sliding_window": False}),
                   ("top-k normalisation", {"norm_topk_prob": False})]),
    "qwen2_moe": ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                   "shared_expert_intermediate_size": 48},
                  [("top-k normalisation", {"norm_topk_prob": False})]),
    "mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
                [("sliding window", {"sliding_window": None})]),
    "olmoe": ({"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 0.3}, [("clip_qkv", {"clip_qkv": None})]),
    # DeepSeek-V3: latent attention (q and kv through low-rank projections, 8 of each head's 24 query/key dims
    # rotated, interleaved), a dense first layer, then routed experts beside a shared one
    "deepseek_v3": ({"num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                     "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                     "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4, "rope_parameters": GLM_ROPE_FULL},
                    [("interleaved RoPE", {"rope_interleave": False})]),
    "glm4_moe": ({"num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                  "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                  "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
                  "rope_parameters": GLM_ROPE},
                 [("partial rotary factor", {"partial_rotary_factor": 1.0,
                                             "rope_parameters": {**GLM_ROPE, "partial_rotary_factor": 1.0}})]),
    "granitemoe": ({"num_local_experts": 4, "num_experts_per_tok": 2, "logits_scaling": 4.0,
                    "attention_multiplier": 0.5, "embedding_multiplier": 3.0, "residual_multiplier": 0.5},
                   [("logits_scaling", {"logits_scaling": 1.0}),
                    ("attention_multiplier", {"attention_multiplier": 0.25})]),
    # more MoE types, each with its dense first layer and a shared expert where it has them (whose MLP names PEFT
    # reads as the experts' on all of these: the adapter is left off them, test_model_families.py)
    "ernie4_5_moe": ({"num_hidden_layers": 3, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
                      "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "moe_layer_end_index": 2}, []),
    "deepseek_v2": ({"num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                     "moe_intermediate_size": 32, "first_k_dense_replace": 1, **MLA}, []),
    "glm4_moe_lite": ({"num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                       "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse", "sparse"], **MLA}, []),
    "dots1": ({"num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "moe_intermediate_size": 32, "first_k_dense_replace": 1, "layer_types": SLIDING_LAYERS,
               "sliding_window": WINDOW}, [("sliding layers", {"layer_types": ALL_FULL})]),
    "exaone_moe": ({"num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                    "mlp_layer_types": ["dense", "sparse", "sparse"], "layer_types": SLIDING_LAYERS,
                    "sliding_window": WINDOW},
                   [("sliding layers", {"layer_types": ALL_FULL})]),
    "solar_open": ({"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                    "moe_intermediate_size": 32}, []),
    "afmoe": ({"num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1,
               "num_dense_layers": 1, "moe_intermediate_size": 32, "layer_types": SLIDING_LAYERS,
               "sliding_window": WINDOW, "mup_enabled": True},
              [("sliding layers", {"layer_types": ALL_FULL}), ("muP input scaling", {"mup_enabled": False})]),
    "hunyuan_v1_moe": ({"num_experts": 4, "moe_topk": 2, "max_position_embeddings": 16, "rope_parameters": NTK_ALPHA},
                       [("NTK alpha", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})]),
    "flex_olmo": ({"num_experts": 4, "num_experts_per_tok": 2}, []),
    "minimax_m2": ({"num_local_experts": 4, "num_experts_per_tok": 2, "partial_rotary_factor": 0.5},
                   [("partial rotary factor", {"partial_rotary_factor": 1.0})]),
    "olmo": ({"clip_qkv": 0.3}, [("clip_qkv", {"clip_qkv": None})]),
    "olmo2": ({}, []),
    "olmo3": ({"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": SLIDING_LAYERS},
              [("sliding layers", {"layer_types": ALL_FULL})]),
    "ministral": ({"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": SLIDING_LAYERS},
                  [("sliding layers", {"layer_types": ALL_FULL})]),
    "exaone4": ({"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": SLIDING_LAYERS},
                [("sliding layers", {"layer_types": ALL_FULL})]),
    "starcoder2": ({"sliding_window": WINDOW}, [("sliding window", {"sliding_window": None})]),
    "stablelm": ({"partial_rotary_factor": 0.25, "qk_layernorm": True, "use_qkv_bias": True},
                 [("partial rotary factor", {"partial_rotary_factor": 1.0})]),
    "phi": ({"partial_rotary_factor": 0.5, "qk_layernorm": True},
            [("partial rotary factor", {"partial_rotary_factor": 1.0})]),
    "helium": ({}, []),
    "ernie4_5": ({"use_bias": True}, []),
    # HunYuan's NTK-alpha RoPE as its checkpoints write it ('dynamic' with a fixed alpha): static frequencies, so
    # sequences longer than max_position_embeddings, packed beside shorter ones, still get their own rotation
    # (a dynamic RoPE would rescale by the longest: test_model_refusals.py)
    "hunyuan_v1_dense": ({"max_position_embeddings": 16, "rope_parameters": NTK_ALPHA},
                         [("NTK alpha", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})]),
    "seed_oss": ({"attention_bias": True, "attention_out_bias": True}, []),
    "arcee": ({}, []),
    # Ministral 3: queries scaled by 1 + beta log(1 + floor(position / original max)) from position 8 on here
    "ministral3": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": 0.5,
                                        "rope_theta": 10000.0}},
                   [("llama 4 query scaling", {"rope_parameters": {
                       "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
                       "beta_slow": 1.0, "llama_4_scaling_beta": 0.0, "rope_theta": 10000.0}})]),
    "cwm": ({"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": SLIDING_LAYERS},
            [("sliding layers", {"layer_types": ALL_FULL})]),
    "jais2": ({}, []),
    "gpt_neox": ({"rotary_pct": 0.25, "use_parallel_residual": True},
                 [("partial rotary factor", {"rotary_pct": 1.0}),
                  ("parallel residual", {"use_parallel_residual": False})]),
    # GPT-J / CodeGen: RoPE on the first `rotary_dim` of each head's 16 dimensions (their default, 64, is a real
    # model's head; a quarter, as GPT-J-6B's 64 of 256), pairs interleaved; CodeGen's qkv_proj in 4 blocks
    "gptj": ({"rotary_dim": 4}, [("partial rotary dimensions", {"rotary_dim": 16})]),
    "codegen": ({"rotary_dim": 4}, [("partial rotary dimensions", {"rotary_dim": 16})]),
    # GPT-BigCode (StarCoder 1): one key/value head for all queries; learned absolute positions (no ablation keeps
    # the weights' shapes). OPT: learned positions offset by 2, pre-LN as OPT-125m..66b (OPT-350m's post-LN with
    # project_in / project_out passes in float64; its tiny random float32 model is too ill-conditioned to compare)
    "gpt_bigcode": ({"multi_query": True}, []),
    # GPT-2: Conv1D projections (loaded as linear layers); each layer's attention scaled by 1 / (layer + 1)
    "gpt2": ({"scale_attn_by_inverse_layer_idx": True},
             [("attention scaled by the inverse layer index", {"scale_attn_by_inverse_layer_idx": False})]),
    # Falcon-7B's layout (multi-query, parallel attention / MLP, one LayerNorm); its other layouts:
    # test_model_families.py's FALCON_LAYOUTS. Its config has no `head_dim` or `num_key_value_heads` (UNSET)
    "falcon": ({}, []),
    "opt": ({}, []),
    "iquestcoder": ({}, []),
    "bitnet": ({"hidden_act": "relu2"}, [("ReLU² activation", {"hidden_act": "silu"})]),
    "nanochat": ({"final_logit_softcapping": 2.0}, [("final logit soft-capping", {"final_logit_softcapping": None})]),
    "vaultgemma": ({"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": SLIDING_LAYERS,
                    "final_logit_softcapping": 2.0, "attn_logit_softcapping": 0.5, "query_pre_attn_scalar": 4},
                   [("final logit soft-capping", {"final_logit_softcapping": None}),
                    ("attention soft-capping", {"attn_logit_softcapping": None}),
                    ("sliding layers", {"layer_types": ALL_FULL})]),
    "apertus": ({}, []),
    "cohere": ({"logit_scale": 4.0, "use_qk_norm": False}, [("logit_scale", {"logit_scale": 1.0})]),
    # Command R7B / Command A: sliding layers with RoPE, global layers without any position encoding
    "cohere2": ({"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": SLIDING_LAYERS, "logit_scale": 4.0},
                [("logit_scale", {"logit_scale": 1.0}),
                 ("sliding window", {"sliding_window": 256}),
                 ("global layers without RoPE", {"layer_types": ["sliding_attention"] * 3, "sliding_window": 256})]),
    "smollm3": ({"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1]},
                [("NoPE layers", {"no_rope_layers": [1, 1, 1]})]),
    # GLM-4: q/k/v biases, RoPE on half of each head interleaved (not rotate-half), one fused gate_up_proj;
    # glm4 adds norms after the attention and the MLP (shown to matter in test_model_families.py); a small
    # rope_theta, so that rotating half of each head or all of it makes a clear difference on short sequences
    "glm": ({"rope_parameters": GLM_ROPE, "attention_bias": True},
            [("partial rotary factor", {"rope_parameters": {**GLM_ROPE, "partial_rotary_factor": 1.0}})]),
    "glm4": ({"rope_parameters": GLM_ROPE, "attention_bias": True},
             [("partial rotary factor", {"rope_parameters": {**GLM_ROPE, "partial_rotary_factor": 1.0}})]),
    "exaone": ({}, []),
    "internlm3": ({"qkv_bias": True, "bias": True}, []),
    "nemotron": ({"rope_parameters": GLM_ROPE},
                 [("partial rotary factor", {"rope_parameters": {**GLM_ROPE, "partial_rotary_factor": 1.0}})]),
    "persimmon": ({"rope_parameters": GLM_ROPE, "qk_layernorm": True},
                  [("partial rotary factor", {"rope_parameters": {**GLM_ROPE, "partial_rotary_factor": 1.0}})]),
    "hyperclovax": ({"logits_scaling": 4.0, "attention_multiplier": 0.5, "embedding_multiplier": 3.0,
                     "residual_multiplier": 0.5, "use_post_norm": True},
                    [("logits_scaling", {"logits_scaling": 1.0})]),
    "granite_swa": ({"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": SLIDING_LAYERS,
                     "layer_rope_theta": [10.0, 10000.0, 10.0], "logits_scaling": 4.0, "attention_multiplier": 0.5,
                     "embedding_multiplier": 3.0, "residual_multiplier": 0.5},
                    [("sliding layers", {"layer_types": ALL_FULL}),
                     ("a RoPE theta per layer", {"layer_rope_theta": [10000.0] * 3}),
                     ("logits_scaling", {"logits_scaling": 1.0})]),
    "biogpt": ({"scale_embedding": True, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
               [("embedding scale", {"scale_embedding": False})]),
}


# COMMON's fields a model type's config refuses (Falcon's `head_dim` is a property without a setter)
UNSET = {"falcon": ("head_dim", "num_key_value_heads")}


def build_config(model_type: str, **overrides):
    fields = {name: value for name, value in COMMON.items() if name not in UNSET.get(model_type, ())}
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


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def step_with_token_losses(trainer):
    """One fused step of the trainer's jobs: its report and every target token's loss, in the step's order (the
    engine's `target_cross_entropy` watched for the step)."""
    from actors.engine import step_objective

    captured = []
    real_loss = step_objective.target_cross_entropy

    def spy(*args, **kwargs):
        total, losses = real_loss(*args, **kwargs)
        captured.append(losses)
        return total, losses

    step_objective.target_cross_entropy = spy
    try:
        report = trainer.run_step(trainer.compose())
    finally:
        step_objective.target_cross_entropy = real_loss
    return report, captured[0]


def job_loss_and_gradients(peft_model, adapter, losses, counts):
    """A job's loss over its sequences' reference `losses` (each a mean over `counts` targets), backpropagated
    through `peft_model`; PEFT's adapter gradients and the engine's `adapter`'s (which sum the job's tokens'
    gradients until its optimizer step divides by their count), both under PEFT's names without the adapter's."""
    job_loss = sum(loss * count for loss, count in zip(losses, counts, strict=True)) / sum(counts)
    job_loss.backward()
    peft_grads = {name.replace(".default", "").removeprefix("base_model.model."): p.grad
                  for name, p in peft_model.named_parameters() if "lora_" in name}
    engine_grads = {name: p.grad / sum(counts) for name, p in adapter.named_parameters()}
    assert peft_grads.keys() == engine_grads.keys()
    return job_loss, peft_grads, engine_grads
