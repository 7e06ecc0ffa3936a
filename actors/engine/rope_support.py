"""Which RoPE variants a packed, fused step reproduces exactly: those whose inverse frequencies the config alone fixes
(each packed sequence, its positions restarting at 0, gets the rotation it gets alone); the variants recomputed from
the forward pass's longest position are refused, naming why (actors/engine/model_support.py asks `rope_problems`)."""

from __future__ import annotations

from typing import Any

# RoPE types whose inverse frequencies are fixed by the config alone (transformers' ROPE_INIT_FUNCTIONS):
# each packed sequence, its position ids restarting at 0, gets exactly the rotation it gets alone.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
# model types whose 'dynamic' RoPE with an `alpha` is static (`_fixed_alpha`)
FIXED_ALPHA_ROPE_TYPES = ("hunyuan_v1_dense", "hunyuan_v1_moe")
# Recomputed from `max(position_ids) + 1` of the whole forward pass (transformers' dynamic_rope_update):
# in a packed row that is the longest sequence of the step, another job's sequence as often as not.
LENGTH_DEPENDENT_ROPE = {
    "dynamic": "dynamic NTK scaling recomputes the RoPE frequencies from the longest position in the forward "
               "pass",
    "longrope": "longrope switches between its short and long factors by the longest position in the forward "
                "pass",
}


def _rope_types(config: Any) -> list[tuple[str | None, str, dict]]:
    """(layer type or None, rope type, its parameters) of every RoPE the config sets (transformers 5:
    `rope_parameters`, possibly one dict per layer type; older configs: `rope_scaling`)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(parameters, dict):
        return []
    nested = [(key, value) for key, value in parameters.items() if isinstance(value, dict)]
    if nested:
        return [(key, str(value.get("rope_type", value.get("type", "default"))), value) for key, value in nested]
    return [(None, str(parameters.get("rope_type", parameters.get("type", "default"))), parameters)]


def _fixed_alpha(config: Any, rope_type: str, parameters: dict) -> bool:
    """HunYuan's checkpoints label their NTK-alpha RoPE 'dynamic'; with a fixed `alpha` transformers' HunYuan
    models compute its frequencies once (a type of their own, which `dynamic_rope_update` leaves alone)."""
    return (getattr(config, "model_type", None) in FIXED_ALPHA_ROPE_TYPES and rope_type == "dynamic"
            and bool(parameters.get("alpha")))


def rope_problems(config: Any) -> list[str]:
    """Why each RoPE the config sets cannot be trained packed (none: every one is static)."""
    problems = []
    for layer_type, rope_type, parameters in _rope_types(config):
        where = f" (its {layer_type} layers)" if layer_type else ""
        if rope_type in STATIC_ROPE_TYPES or _fixed_alpha(config, rope_type, parameters):
            continue
        if rope_type in LENGTH_DEPENDENT_ROPE or "dynamic" in rope_type:
            reason = LENGTH_DEPENDENT_ROPE.get(rope_type, LENGTH_DEPENDENT_ROPE["dynamic"])
            problems.append(f"rope type '{rope_type}'{where}: {reason}, so in a fused step it scales by the packed "
                            "row's longest sequence and a job's result would depend on the jobs packed with it: "
                            f"refused; use a checkpoint with a static RoPE ({', '.join(STATIC_ROPE_TYPES)})")
        else:
            problems.append(f"rope type '{rope_type}'{where} is not verified with packed sequences: refused; "
                            f"verified RoPE types: {', '.join(STATIC_ROPE_TYPES)}")
    return problems
