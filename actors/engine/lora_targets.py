"""Which linear layers a LoRA config's `target_modules` selects, by name and PEFT's matching rule: plain
string work with no torch, so that the scheduler (which sizes an adapter from a trainer's layer shapes) and
the memory prior use it without importing the model code."""

from __future__ import annotations

import difflib

# transformers 4 named each MoE expert's layers so; PEFT (and vLLM) still read an adapter's layers of these names on
# these model types as the experts' (converting them to the 3D stacks): aspen leaves them alone there
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MLP_AS_EXPERTS_TYPES = ("qwen3_moe", "deepseek_v3", "glm4_moe", "ernie4_5_moe", "deepseek_v2", "glm4_moe_lite", "dots1",
                        "exaone_moe", "solar_open", "afmoe", "hunyuan_v1_moe", "qwen3_next")


def adapted_shapes(target_modules: list[str] | str, linear_shapes: dict[str, tuple[int, int]]) -> list[tuple[int, int]]:
    """The (in, out) shapes of the linear layers that `target_modules` adapts, of a model whose linear
    layers have `linear_shapes` (ValueError naming the fix for a target that matches none)."""
    return [linear_shapes[name] for name in match_targets(list(linear_shapes), target_modules)]


def peft_target_modules(candidates: list[str], targets: list[str]) -> list[str]:
    """PEFT's `target_modules` for exactly the layers `targets` out of the linear layers `candidates`: a
    short name ('q_proj') where the targets hold every layer of that name, else those layers' full paths
    (PEFT matches a full path exactly), so that PEFT puts the adapter where it was trained, no more."""
    chosen = set(targets)
    out: set[str] = set()
    for short in {name.rsplit(".", 1)[-1] for name in targets}:
        every = [name for name in candidates if name.rsplit(".", 1)[-1] == short]
        if all(name in chosen for name in every):
            out.add(short)
        else:
            out.update(name for name in every if name in chosen)
    return sorted(out)


def unadapted_problem(target_modules: list[str] | str, unadapted: tuple[str, ...] | list[str],
                      model_type: str | None) -> str | None:
    """Why `target_modules` names layers a base of `model_type` leaves alone (their short names `unadapted`), or
    None where it names none of them."""
    named = [] if target_modules == "all-linear" else [t for t in target_modules if t.rsplit(".", 1)[-1] in unadapted]
    if not named:
        return None
    return (f"lora.target_modules: {', '.join(named)}: on a {model_type} base PEFT and vLLM read an adapter's layers "
            "of that name as its MoE experts' (transformers 4's names), so aspen does not adapt them (docs/models.md, "
            "MoE bases); target attention")


def target_problem(candidates: list[str], unadapted: tuple[str, ...] | list[str], model_type: str | None,
                   target_modules: list[str] | str) -> str | None:
    """Why `target_modules` cannot adapt a base whose linear layers are `candidates` (a layer its model type leaves
    alone, a name that matches none: the names it has and the nearest one), or None where it can."""
    problem = unadapted_problem(target_modules, unadapted, model_type)
    if problem is None:
        try:
            match_targets(candidates, target_modules)
        except ValueError as error:
            problem = str(error)
    return problem


def match_targets(candidates: list[str], target_modules: list[str] | str) -> list[str]:
    """Which of the linear layers named `candidates` a LoRA config's `target_modules` selects."""
    if target_modules == "all-linear":
        return candidates
    chosen: list[str] = []
    for target in target_modules:
        matched = [n for n in candidates if n == target or n.endswith("." + target)]
        if not matched:
            short = sorted({n.rsplit(".", 1)[-1] for n in candidates})
            moe = (f"; on the MoE types {', '.join(MLP_AS_EXPERTS_TYPES)} aspen leaves layers named "
                   f"{' / '.join(EXPERT_NAMES)} alone, as PEFT and vLLM read them as the experts' (docs/models.md)"
                   if target.rsplit(".", 1)[-1] in EXPERT_NAMES else "")
            close = difflib.get_close_matches(target.rsplit(".", 1)[-1], short, n=1, cutoff=0.6)
            meant = f"did you mean '{close[0]}'? " if close and not moe else ""   # not a typo there
            raise ValueError(f"lora.target_modules: '{target}' matches no linear layer of the base model; {meant}"
                             f"its linear layers are named {', '.join(short)} (or use 'all-linear'){moe}")
        chosen.extend(m for m in matched if m not in chosen)
    return chosen


def matching_shapes(targets: list[str], shapes: dict[str, tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The (experts, in, out) of every MoE expert stack `targets` (`lora.target_parameters`) names, by PEFT's
    matching (the full dotted name, or its last components), from `experts_lora.stack_shapes`."""
    return [shape for key, shape in shapes.items()
            if any(key == target or key.endswith("." + target) for target in targets)]


def stack_targets(stack_names) -> list[str]:
    """`target_parameters` naming every expert stack of a base (`experts_lora.stack_shapes`' keys, e.g.
    model.layers.0.mlp.experts.down_proj) by its module's and its own name: [experts.down_proj, ...]."""
    return sorted({".".join(name.split(".")[-2:]) for name in stack_names})
