"""The model-support contract: which architectures aspen trains exactly, and the load-time check that
refuses every other one, and every feature the engine cannot reproduce, naming the model type and feature.

The engine does not run a model's own `forward`: it runs the decoder under its own packed varlen
attention and computes the loss from the last hidden state with the LM head itself (actors/engine/
loss.py). Whatever a model does outside the decoder or inside its attention kernel therefore has to be
known here. Each row of `SUPPORTED` names a transformers `model_type` whose fused, packed training has
been checked (tests/unit/engine/test_model_families.py) against the unfused Hugging Face model alone on each sequence
(loss) and PEFT (adapter gradients), and says how its logits are transformed after the LM head
(`LogitTransform`). Refused everywhere: unverified model types; RoPE variants whose frequencies depend on
the sequence length (dynamic NTK, longrope), since in a packed row they would follow the longest sequence
packed beside a job's own; bidirectional attention; a router load-balancing loss added to the loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.engine.lora_targets import EXPERT_NAMES
from actors.engine.rope_support import rope_problems


class UnsupportedModelError(ValueError):
    """A base model the engine cannot train exactly; the message names the model type, the feature and
    what to do instead."""


@dataclass(frozen=True)
class LogitTransform:
    """What a model's forward does to the LM head's output before the loss:
    logits = softcap * tanh(raw * multiply / divide / softcap), or raw * multiply / divide without a cap."""

    multiply: float = 1.0      # Cohere's logit_scale
    divide: float = 1.0        # Granite's logits_scaling
    softcap: float | None = None  # Gemma 2 / 3's final_logit_softcapping

    @property
    def slope(self) -> float:
        """d logits / d raw before the soft-cap."""
        return self.multiply / self.divide


@dataclass(frozen=True)
class ArchitectureSupport:
    """One verified architecture: its transformers `model_type`, a real model of that type, what the engine
    reproduces beyond a plain Llama-like decoder (after the LM head; in attention; elsewhere), what it
    refuses for this type beyond what it refuses everywhere, its logit transform and its own checks."""

    model_type: str
    example: str
    logits: str = "—"
    attention: str = "causal"
    other: str = "—"
    refused: str = "—"
    transform: Callable[[Any], LogitTransform] = field(default=lambda config: LogitTransform())
    check: Callable[[Any], list[str]] = field(default=lambda config: [])
    # linear layers (by name) LoRA leaves alone on this type: PEFT and vLLM read these names as the experts'
    unadapted: tuple[str, ...] = ()


def _softcapped(config: Any) -> LogitTransform:
    cap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(softcap=float(cap) if cap else None)


def _granite_logits(config: Any) -> LogitTransform:
    return LogitTransform(divide=float(config.logits_scaling))


def _cohere_logits(config: Any) -> LogitTransform:
    return LogitTransform(multiply=float(config.logit_scale))


def _clovax_logits(config: Any) -> LogitTransform:   # muP as HyperCLOVA X writes it: times, not over, the scaling
    return LogitTransform(multiply=float(config.logits_scaling))


def _no_bidirectional(config: Any) -> list[str]:
    if getattr(config, "use_bidirectional_attention", False):
        return ["use_bidirectional_attention=True (tokens attend to later tokens, so a sequence's loss is not a "
                "causal LM loss and packed sequences would see each other's windows): refused; use a causal "
                "checkpoint of this model"]
    return []


def _gemma4_text(config: Any) -> list[str]:
    problems = []
    if getattr(config, "use_bidirectional_attention", None) == "all":   # "vision": text tokens stay causal
        problems.append("use_bidirectional_attention='all' (tokens attend to later tokens, so a sequence's loss is "
                        "not a causal LM loss): refused; use a causal checkpoint of this model")
    if getattr(config, "enable_moe_block", False):
        problems.append("enable_moe_block=True (Gemma 4's MoE block is not verified with packed, fused steps): "
                        "refused; use a dense Gemma 4 model")
    return problems


def _gpt2(config: Any) -> list[str]:
    if getattr(config, "add_cross_attention", False):
        return ["add_cross_attention=True (every layer also attends to an encoder's states, which a causal LM step "
                "has none of): refused; use a decoder-only GPT-2 checkpoint"]
    return []


def _falcon(config: Any) -> list[str]:
    if getattr(config, "alibi", False):
        return ["alibi=True (Falcon-RW's ALiBi biases are built from an attention mask over the whole row, which a "
                "packed step has none of): refused; use a rotary Falcon (falcon-7b, -40b, -180b, Falcon2-11B)"]
    return []


def _no_router_loss(config: Any) -> list[str]:
    if getattr(config, "output_router_logits", False):
        return ["output_router_logits=True (the model's loss adds the router's load-balancing loss, which aspen's "
                "loss does not compute): refused; set output_router_logits to false in the model's config.json"]
    return []


def _qwen2_moe(config: Any) -> list[str]:
    problems = _no_router_loss(config)
    if getattr(config, "use_sliding_window", False):
        problems.append("use_sliding_window=True (transformers' Qwen2-MoE attention gives its window to the mask "
                        "only, not to the attention kernel, so packed attention would attend past it): refused; "
                        "set use_sliding_window to false (as Qwen's MoE checkpoints have it)")
    return problems


_BIDIRECTIONAL = "`use_bidirectional_attention`"
_ROUTER = "`output_router_logits` (the router's loss)"
# transformers keeps a layer's experts as 3D parameters, not linear layers; its router is no linear layer either
_MOE_EXPERTS = "MoE experts (3D parameters) adapted by `target_parameters`, router frozen"
_EXPERT_NAMES = EXPERT_NAMES   # actors/engine/lora_targets.py says why
_ATTENTION_ONLY = "`target_modules` adapts attention only"
_MLP_AS_EXPERTS = (f"{_ATTENTION_ONLY}: dense and shared MLP layers are left too (PEFT reads their names as the "
                   "experts')")
# an MoE type whose dense / shared MLP names PEFT reads as the experts': router loss refused, those layers left
_MOE_MLP_AS_EXPERTS = {"refused": _ROUTER, "check": _no_router_loss, "unadapted": _EXPERT_NAMES}
# Qwen3.5 / Qwen3-Next: linear attention between full-attention layers (actors/engine/stateful_layers.py)
_GATED_DELTANET = ("Gated DeltaNet layers (a short causal convolution, then the gated delta rule: both run sequence by "
                   "sequence) between full-attention layers (q/k norm, an output gate)")
_QWEN3_5_OTHER = "partial RoPE; norms scaled by 1 + w"
# LFM2: gated short convolutions between attention layers (actors/engine/stateful_layers.py)
_SHORT_CONV = ("gated short-convolution layers (`in_proj` / `out_proj`; the convolution run sequence by sequence) "
               "between full-attention layers (q/k norm)")
SUPPORTED: dict[str, ArchitectureSupport] = {row.model_type: row for row in (
    ArchitectureSupport("llama", "meta-llama/Llama-3.2-1B"),
    ArchitectureSupport("mistral", "mistralai/Mistral-7B-v0.1", attention="sliding window"),
    ArchitectureSupport("qwen2", "Qwen/Qwen2.5-0.5B", attention="sliding-window layers (`use_sliding_window`)"),
    ArchitectureSupport("qwen3", "Qwen/Qwen3-0.6B", attention="sliding-window layers (`use_sliding_window`)",
                        other="q/k norm"),
    ArchitectureSupport("qwen3_5_text", "Qwen/Qwen3.5-9B (its text model)", attention=_GATED_DELTANET,
                        other=_QWEN3_5_OTHER),
    ArchitectureSupport("lfm2", "LiquidAI/LFM2-1.2B", attention=_SHORT_CONV, other="SwiGLU MLP (`w1` / `w3` / `w2`)"),
    ArchitectureSupport("gemma", "google/gemma-2b", other="embedding scale", refused=_BIDIRECTIONAL,
                        check=_no_bidirectional),
    ArchitectureSupport("gemma2", "google/gemma-2-2b", logits="tanh soft-cap (`final_logit_softcapping`)",
                        attention="soft-cap (`attn_logit_softcapping`); sliding/global layers; `query_pre_attn_scalar`",
                        other="embedding scale", refused=_BIDIRECTIONAL, transform=_softcapped,
                        check=_no_bidirectional),
    ArchitectureSupport("gemma3_text", "google/gemma-3-1b-pt", logits="tanh soft-cap (`final_logit_softcapping`)",
                        attention="sliding/global layers; `query_pre_attn_scalar`",
                        other="a RoPE per layer type; q/k norm", refused=_BIDIRECTIONAL, transform=_softcapped,
                        check=_no_bidirectional),
    ArchitectureSupport("gemma4_text", "google/gemma-4-e2b-it (its `text_config`)",
                        logits="tanh soft-cap (`final_logit_softcapping`)",
                        attention="sliding/global layers; keys as values on global layers (`attention_k_eq_v`: "
                                  "no `v_proj` there); later layers reusing an earlier layer's keys and values "
                                  "(`num_kv_shared_layers`: no `k_proj` / `v_proj` there; those names adapt the "
                                  "layers that compute keys and values, as PEFT's do)",
                        other="per-layer input embeddings; proportional RoPE (partial) on global layers; q/k/v norm",
                        refused=f"{_BIDIRECTIONAL} `all`; the MoE block (`enable_moe_block`)", transform=_softcapped,
                        check=_gemma4_text),
    ArchitectureSupport("phi3", "microsoft/Phi-3-mini-4k-instruct", attention="sliding window",
                        other="fused `qkv_proj` / `gate_up_proj` (LoRA adapts them whole)",
                        refused="longrope (the 128k models)"),
    ArchitectureSupport("granite", "ibm-granite/granite-3.1-2b-base", logits="÷ `logits_scaling`",
                        attention="`attention_multiplier` as the scale", other="embedding / residual multipliers",
                        transform=_granite_logits),
    ArchitectureSupport("gpt_oss", "openai/gpt-oss-20b", attention="sinks; sliding/full layers",
                        other="RoPE yarn; MoE experts are not linear layers: `target_modules` adapts attention, "
                              "`target_parameters` the expert stacks",
                        refused=_ROUTER, check=_no_router_loss),
    ArchitectureSupport("qwen3_moe", "Qwen/Qwen3-30B-A3B", attention="sliding window (`use_sliding_window`)",
                        other=f"q/k norm; {_MOE_EXPERTS}; {_MLP_AS_EXPERTS}", **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct", attention=_GATED_DELTANET,
                        other=f"{_QWEN3_5_OTHER}; {_MOE_EXPERTS}; {_MLP_AS_EXPERTS}", **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("qwen3_5_moe_text", "Qwen/Qwen3.5-35B-A3B (its text model)", attention=_GATED_DELTANET,
                        other=f"{_QWEN3_5_OTHER}; {_MOE_EXPERTS}; `target_modules` adapts attention, the shared "
                              "expert and its gate", refused=_ROUTER, check=_no_router_loss),
    ArchitectureSupport("lfm2_moe", "LiquidAI/LFM2-8B-A1B", attention=_SHORT_CONV,
                        other=f"dense first layers (`num_dense_layers`); a sigmoid router with expert biases; "
                              f"{_MOE_EXPERTS}; `target_modules` adapts attention, the convolutions' projections and "
                              "the dense layers' MLP", refused=_ROUTER, check=_no_router_loss),
    ArchitectureSupport("qwen2_moe", "Qwen/Qwen1.5-MoE-A2.7B", attention="q/k/v bias",
                        other=f"{_MOE_EXPERTS}; `target_modules` adapts attention, the shared expert and its gate",
                        refused=f"{_ROUTER}; `use_sliding_window`", check=_qwen2_moe),
    ArchitectureSupport("mixtral", "mistralai/Mixtral-8x7B-v0.1", attention="sliding window",
                        other=f"{_MOE_EXPERTS}; {_ATTENTION_ONLY}", refused=_ROUTER, check=_no_router_loss),
    ArchitectureSupport("olmoe", "allenai/OLMoE-1B-7B-0924", attention="q/k norm over all heads; `clip_qkv`",
                        other=f"{_MOE_EXPERTS}; {_ATTENTION_ONLY}", refused=_ROUTER, check=_no_router_loss),
    ArchitectureSupport("deepseek_v3", "deepseek-ai/DeepSeek-V3.1",
                        attention="multi-head latent attention (low-rank q / kv projections, RoPE on a part of each "
                                  "head, interleaved)",
                        other=f"{_MOE_EXPERTS}; {_MLP_AS_EXPERTS}", **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("glm4_moe", "zai-org/GLM-4.5-Air", attention="q/k/v bias; q/k norm (`use_qk_norm`)",
                        other=f"partial RoPE (`partial_rotary_factor`); {_MOE_EXPERTS}; {_MLP_AS_EXPERTS}",
                        **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("granitemoe", "ibm-granite/granite-3.1-3b-a800m-base", logits="÷ `logits_scaling`",
                        attention="`attention_multiplier` as the scale",
                        other=f"embedding / residual multipliers; {_MOE_EXPERTS}; {_ATTENTION_ONLY}",
                        refused=_ROUTER, transform=_granite_logits, check=_no_router_loss),
    ArchitectureSupport("ernie4_5_moe", "baidu/ERNIE-4.5-21B-A3B-PT",
                        other=f"interleaved RoPE; dense first layers; shared experts; {_MOE_EXPERTS}; "
                              f"{_MLP_AS_EXPERTS}", **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("deepseek_v2", "deepseek-ai/DeepSeek-V2-Lite",
                        attention="multi-head latent attention (low-rank q / kv projections, RoPE on a part of each "
                                  "head)",
                        other=f"dense first layers; shared experts; {_MOE_EXPERTS}; {_MLP_AS_EXPERTS}",
                        **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("glm4_moe_lite", "zai-org/GLM-4.7-Flash",
                        attention="multi-head latent attention (low-rank q / kv projections, RoPE on a part of each "
                                  "head)",
                        other=f"dense first layers; shared experts; sigmoid router; {_MOE_EXPERTS}; {_MLP_AS_EXPERTS}",
                        **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("dots1", "rednote-hilab/dots.llm1.base", attention="sliding/full layers; q/k norm",
                        other=f"dense first layers; shared experts; sigmoid router; {_MOE_EXPERTS}; {_MLP_AS_EXPERTS}",
                        **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("exaone_moe", "LGAI-EXAONE/K-EXAONE-236B-A23B", attention="sliding/full layers; q/k norm",
                        other=f"dense first layers; shared experts; sigmoid router; {_MOE_EXPERTS}; {_MLP_AS_EXPERTS}",
                        **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("solar_open", "upstage/Solar-Open-100B",
                        other=f"shared experts; sigmoid router; {_MOE_EXPERTS}; {_MLP_AS_EXPERTS}",
                        **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("afmoe", "arcee-ai/Trinity-Mini", attention="sliding/full layers; q/k norm; gated output",
                        other="muP input scaling (`mup_enabled`); dense first layers; shared experts; sigmoid router, "
                              "its `gate` a linear layer that `all-linear` adapts (as PEFT's does); MoE experts (3D "
                              f"parameters) adapted by `target_parameters`; {_MLP_AS_EXPERTS}", **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("hunyuan_v1_moe", "tencent/Hunyuan-A13B-Pretrain", attention="q/k norm",
                        other="NTK-alpha RoPE (`dynamic` with a fixed `alpha`: static frequencies); a shared MLP; a "
                              "float32 router, its `wg` a linear layer that `all-linear` adapts (as PEFT's does); MoE "
                              f"experts (3D parameters) adapted by `target_parameters`; {_MLP_AS_EXPERTS}",
                        **_MOE_MLP_AS_EXPERTS),
    ArchitectureSupport("flex_olmo", "allenai/FlexOlmo-7x7B-1T", attention="q/k norm over all heads",
                        other=f"norms after the blocks; {_MOE_EXPERTS}; {_ATTENTION_ONLY}", refused=_ROUTER,
                        check=_no_router_loss),
    ArchitectureSupport("minimax_m2", "MiniMaxAI/MiniMax-M2", attention="q/k norm over all heads; partial RoPE",
                        other=f"sigmoid router; {_MOE_EXPERTS}; {_ATTENTION_ONLY}", refused=_ROUTER,
                        check=_no_router_loss),
    ArchitectureSupport("olmo", "allenai/OLMo-1B-0724-hf", attention="`clip_qkv`", other="LayerNorm without weights"),
    ArchitectureSupport("olmo2", "allenai/OLMo-2-0425-1B", other="q/k norm over all heads; norms after the blocks"),
    ArchitectureSupport("olmo3", "allenai/Olmo-3-1025-7B", attention="sliding/full layers",
                        other="q/k norm over all heads; norms after the blocks"),
    ArchitectureSupport("cohere", "CohereForAI/c4ai-command-r-v01", logits="× `logit_scale`",
                        other="parallel attention / MLP block", transform=_cohere_logits),
    ArchitectureSupport("cohere2", "CohereLabs/c4ai-command-r7b-12-2024", logits="× `logit_scale`",
                        attention="sliding layers with RoPE, global layers without",
                        other="parallel attention / MLP block", transform=_cohere_logits),
    ArchitectureSupport("smollm3", "HuggingFaceTB/SmolLM3-3B", other="NoPE layers (`no_rope_layers`)"),
    ArchitectureSupport("ministral", "mistralai/Ministral-8B-Instruct-2410", attention="sliding/full layers"),
    ArchitectureSupport("exaone4", "LGAI-EXAONE/EXAONE-4.0-1.2B", attention="sliding/full layers",
                        other="q/k norm; norms after attention and MLP"),
    ArchitectureSupport("starcoder2", "bigcode/starcoder2-3b", attention="sliding window; biases",
                        other="LayerNorm; GELU MLP (`c_fc` / `c_proj`, biases)"),
    ArchitectureSupport("stablelm", "stabilityai/stablelm-2-1_6b",
                        attention="q/k/v bias (`use_qkv_bias`); per-head q/k LayerNorm (`qk_layernorm`)",
                        other="partial RoPE (`partial_rotary_factor`); LayerNorm"),
    ArchitectureSupport("phi", "microsoft/phi-2", attention="q/k LayerNorm (`qk_layernorm`)",
                        other="partial RoPE (`partial_rotary_factor`); parallel attention / MLP block; LayerNorm; "
                              "GELU MLP (`fc1` / `fc2`)"),
    ArchitectureSupport("helium", "kyutai/helium-1-2b", other="interleaved RoPE"),
    ArchitectureSupport("ernie4_5", "baidu/ERNIE-4.5-0.3B-PT", other="interleaved RoPE; biases (`use_bias`)"),
    ArchitectureSupport("hunyuan_v1_dense", "tencent/Hunyuan-7B-Pretrain", attention="q/k norm",
                        other="NTK-alpha RoPE (`dynamic` with a fixed `alpha`: static frequencies)"),
    ArchitectureSupport("seed_oss", "ByteDance-Seed/Seed-OSS-36B-Base",
                        attention="q/k/v and output biases (`attention_bias`, `attention_out_bias`)"),
    ArchitectureSupport("arcee", "arcee-ai/AFM-4.5B", other="ReLU² MLP without a gate (`up_proj` / `down_proj`)"),
    ArchitectureSupport("apertus", "swiss-ai/Apertus-8B-2509", attention="q/k norm", other="xIELU activation"),
    ArchitectureSupport("gpt_neox", "EleutherAI/pythia-1.4b", attention="fused `query_key_value`; biases",
                        other="partial RoPE (`rotary_pct`); parallel attention / MLP (`use_parallel_residual`); "
                              "LayerNorm; GELU MLP (`dense_h_to_4h` / `dense_4h_to_h`)"),
    ArchitectureSupport("gptj", "EleutherAI/gpt-j-6b", attention="RoPE on the first `rotary_dim` dimensions, pairs "
                        "interleaved", other="parallel attention / MLP; LayerNorm; GELU MLP (`fc_in` / `fc_out`)"),
    ArchitectureSupport("codegen", "Salesforce/codegen-350M-mono",
                        attention="fused `qkv_proj` in 4 model-parallel blocks; RoPE on the first `rotary_dim` "
                                  "dimensions, pairs interleaved",
                        other="parallel attention / MLP; LayerNorm; GELU MLP (`fc_in` / `fc_out`)"),
    ArchitectureSupport("gpt_bigcode", "bigcode/starcoderbase-1b",
                        attention="multi-query (`multi_query`); fused `c_attn`; biases",
                        other="learned absolute positions; LayerNorm; GELU MLP (`c_fc` / `c_proj`)"),
    ArchitectureSupport("gpt2", "openai-community/gpt2",
                        attention="fused `c_attn`; biases; scaled by 1 / (layer + 1) where "
                                  "`scale_attn_by_inverse_layer_idx`",
                        other="learned absolute positions; LayerNorm; GELU MLP (`c_fc` / `c_proj`); its `Conv1D` "
                              "projections (weights stored transposed) loaded as linear layers, adapters saved "
                              "with PEFT's `fan_in_fan_out`",
                        refused="`add_cross_attention`", check=_gpt2),
    ArchitectureSupport("falcon", "tiiuae/falcon-7b",
                        attention="multi-query (`multi_query`) or grouped (`num_kv_heads`, "
                                  "`new_decoder_architecture`); fused `query_key_value`",
                        other="parallel attention / MLP (`parallel_attn`); one or two LayerNorms before them "
                              "(`num_ln_in_parallel_attn`); GELU MLP (`dense_h_to_4h` / `dense_4h_to_h`)",
                        refused="`alibi` (Falcon-RW)", check=_falcon),
    ArchitectureSupport("opt", "facebook/opt-1.3b", attention="biases",
                        other="learned positions (offset 2); LayerNorm; ReLU MLP (`fc1` / `fc2`); `project_in` / "
                              "`project_out` where `word_embed_proj_dim` differs (adapted as linear layers)"),
    ArchitectureSupport("iquestcoder", "IQuestLab/IQuest-Coder-V1-40B-Instruct", other="Llama's own layers"),
    ArchitectureSupport("bitnet", "microsoft/bitnet-b1.58-2B-4T-bf16",
                        other="norms inside attention and the MLP (`attn_sub_norm`, `ffn_sub_norm`); ReLU² MLP; its "
                              "bf16 weights (the `-bf16` checkpoint, not the packed ternary one)"),
    ArchitectureSupport("ministral3", "mistralai/Ministral-3-8B-Base-2512",
                        attention="Llama 4's query scaling by position (`llama_4_scaling_beta`)", other="RoPE yarn"),
    ArchitectureSupport("cwm", "facebook/cwm", attention="sliding/full layers", other="RoPE llama3"),
    ArchitectureSupport("jais2", "inceptionai/Jais-2-8B-Chat", attention="biases",
                        other="LayerNorm; ReLU² MLP without a gate (biases)"),
    ArchitectureSupport("nanochat", "karpathy/nanochat-d32", logits="tanh soft-cap (`final_logit_softcapping`)",
                        attention="q/k norm without weights",
                        other="a norm before the layers too; ReLU² MLP without a gate", transform=_softcapped),
    ArchitectureSupport("vaultgemma", "google/vaultgemma-1b", logits="tanh soft-cap (`final_logit_softcapping`)",
                        attention="soft-cap (`attn_logit_softcapping`); sliding/global layers; `query_pre_attn_scalar`",
                        other="embedding scale", transform=_softcapped),
    ArchitectureSupport("glm", "THUDM/glm-4-9b-hf", attention="q/k/v bias",
                        other="partial, interleaved RoPE (`partial_rotary_factor`); fused `gate_up_proj` (LoRA "
                              "adapts it whole)", refused="the remote-code ChatGLM2/3 (`chatglm`)"),
    ArchitectureSupport("glm4", "THUDM/GLM-4-9B-0414", attention="q/k/v bias",
                        other="partial, interleaved RoPE (`partial_rotary_factor`); fused `gate_up_proj` (LoRA "
                              "adapts it whole); norms after attention and MLP",
                        refused="the remote-code ChatGLM2/3 (`chatglm`)"),
    ArchitectureSupport("exaone", "LGAI-EXAONE/EXAONE-3.0-7.8B-Instruct"),
    ArchitectureSupport("internlm3", "internlm/internlm3-8b-instruct", attention="biases (`bias`, `qkv_bias`)"),
    ArchitectureSupport("nemotron", "nvidia/Nemotron-Mini-4B-Instruct",
                        other="partial RoPE (`partial_rotary_factor`); LayerNorm with 1 + weight; ReLU² MLP without "
                              "a gate"),
    ArchitectureSupport("persimmon", "adept/persimmon-8b-base", attention="q/k LayerNorm (`qk_layernorm`); fused "
                        "`query_key_value`", other="partial RoPE (`partial_rotary_factor`); LayerNorm; ReLU² MLP"),
    ArchitectureSupport("hyperclovax", "naver-hyperclovax/HyperCLOVAX-SEED-Think-14B", logits="× `logits_scaling`",
                        attention="`attention_multiplier` as the scale",
                        other="embedding / residual multipliers; norms after the blocks (`use_post_norm`)",
                        transform=_clovax_logits),
    ArchitectureSupport("granite_swa", "ibm-granite/granite-swash-2b", logits="÷ `logits_scaling`",
                        attention="`attention_multiplier` as the scale; sliding/full layers",
                        other="a RoPE theta per layer (`layer_rope_theta`); embedding / residual multipliers",
                        transform=_granite_logits),
    ArchitectureSupport("biogpt", "microsoft/biogpt", attention="biases",
                        other="learned positions (offset 2); embedding scale (`scale_embedding`); LayerNorm; GELU MLP"),
)}

# Model types whose only implementation is the checkpoint's own Python code (`trust_remote_code`), which
# aspen never runs: each with what to use instead.
REMOTE_CODE: dict[str, str] = {
    "chatglm": "the remote-code ChatGLM2/3 / GLM-4 checkpoints (model_type 'chatglm', e.g. THUDM/chatglm3-6b or "
               "THUDM/glm-4-9b) run their own modeling code (trust_remote_code), which aspen never executes: "
               "refused; use a transformers-native GLM-4 checkpoint instead (model_type 'glm' or 'glm4', e.g. "
               "THUDM/glm-4-9b-hf, THUDM/glm-4-9b-chat-hf or THUDM/GLM-4-9B-0414)",
}


def _checkpoint_quantization(config: Any) -> list[str]:
    """A checkpoint quantized by its own method (GPTQ, AWQ, compressed-tensors, BitNet's packed ternary, FP8 kept
    in FP8): its layers are the method's own, not torch's linear layers LoRA wraps, and none is verified here;
    bitsandbytes (what `quantization: nf4` / `int8` loads) and FP8 that transformers dequantizes are taken."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return []
    read = quantization.get if isinstance(quantization, dict) else lambda key: getattr(quantization, key, None)
    method = read("quant_method")
    method = str(getattr(method, "value", method) or "")   # transformers' QuantizationMethod is an enum
    if method == "bitsandbytes" or (method == "fp8" and read("dequantize")):
        return []
    return [f"its checkpoint is quantized ({method or 'an unnamed method'}): LoRA here wraps torch's linear layers "
            "of a float base, or of one aspen quantizes itself with bitsandbytes: refused; use the model's float "
            "(bf16) checkpoint, with `quantization: nf4` or `int8` to hold it in less memory"
            + ("; or set \"dequantize\": true in its config.json's quantization_config" if method == "fp8" else "")]


def causal_lm_config(config: Any) -> Any:
    """The config of the model transformers' AutoModelForCausalLM builds from `config`: a composite (vision-language)
    checkpoint's text config where the causal-LM class of its type is the text model alone (Qwen3.5's released
    checkpoints: `qwen3_5` builds `Qwen3_5ForCausalLM` of its `text_config`, the vision tower left unread); `config`
    itself otherwise (Gemma 3's `gemma3` builds the whole vision-language model, which the table does not hold)."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    if text is config or text is None:
        return config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        built = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return config
    return text if isinstance(text, built.config_class) else config


def _text_model_hint(config: Any) -> str:
    """For a composite checkpoint whose text model's type is in the table but whose causal-LM class is the whole
    vision-language model (Gemma 3): what to give instead."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else None
    if text is None or text is config or getattr(text, "model_type", None) not in SUPPORTED:
        return ""
    return (f". Its text model ({text.model_type}) is in the table, but transformers builds the whole "
            f"vision-language model from this checkpoint: give a checkpoint of the text model alone (a "
            f"{text.model_type} config.json)")


def check_model_support(config: Any, name: str | None = None) -> LogitTransform:
    """Refuse (UnsupportedModelError) what the engine cannot train exactly; return the logit transform of
    a supported model. `config` is a transformers config (a composite checkpoint's: its text model's,
    `causal_lm_config`); `name` the base model as the user gave it."""
    checkpoint, config = config, causal_lm_config(config)
    model_type = getattr(config, "model_type", None)
    named = model_type if config is checkpoint else f"{model_type}' of '{checkpoint.model_type}"
    subject = f"base_model '{name}' (model_type '{named}')" if name else f"model_type '{named}'"
    if model_type in REMOTE_CODE:
        raise UnsupportedModelError(f"{subject}: {REMOTE_CODE[model_type]}")
    row = SUPPORTED.get(model_type)
    if row is None:
        raise UnsupportedModelError(
            f"{subject} is not in aspen's verified table of architectures, whose fused training is tested to "
            f"equal the unfused model's: {', '.join(SUPPORTED)}. An unverified architecture may do something "
            "outside the decoder or inside its attention (logit scaling, soft-capping, sinks, length-dependent "
            "RoPE) that the engine would silently drop; use a model of a verified type" + _text_model_hint(config))
    problems = rope_problems(config) + _checkpoint_quantization(checkpoint) + row.check(config)
    if problems:
        raise UnsupportedModelError(f"{subject}: " + "; ".join(problems))
    return row.transform(config)


def check_raw_config(raw: dict, name: str | None = None) -> None:
    """Refuse a config.json (as a plain dict, read without running any of the checkpoint's code) of a
    remote-code model type (REMOTE_CODE), which transformers itself cannot even parse without
    `trust_remote_code`; anything else is left to `check_model_support` on the parsed config."""
    model_type = raw.get("model_type")
    if model_type in REMOTE_CODE:
        subject = f"base_model '{name}' (model_type '{model_type}')" if name else f"model_type '{model_type}'"
        raise UnsupportedModelError(f"{subject}: {REMOTE_CODE[model_type]}")
    if raw.get("auto_map"):
        subject = f"base_model '{name}' (model_type '{model_type}')" if name else f"model_type '{model_type}'"
        raise UnsupportedModelError(
            f"{subject} needs its own modeling code (`auto_map`, trust_remote_code), which aspen never runs: "
            f"refused; use a transformers-native checkpoint of a verified type: {', '.join(SUPPORTED)}")


def markdown_table() -> str:
    """The table of README.md's "Supported models" section (a test keeps the two the same)."""
    lines = ["| model type | example | logits | attention | also | refused (besides the refusals for all) |",
             "|---|---|---|---|---|---|"]
    for row in SUPPORTED.values():
        lines.append(f"| `{row.model_type}` | {row.example} | {row.logits} | {row.attention} | {row.other} "
                     f"| {row.refused} |")
    return "\n".join(lines)
