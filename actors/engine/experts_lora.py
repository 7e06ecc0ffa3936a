"""LoRA on an MoE base's expert weight stacks (`lora.target_parameters`, PEFT's `ParamWrapper`): each expert of a
stack gets its own rank-r A and B, held as PEFT holds them, so that a saved adapter is PEFT's.

A stack of E experts with weights (E, out, in) (or (E, in, out) where transformers stores them transposed) gets
`lora_A` (r E, in), expert-major, and `lora_B` (out, r E), expert-minor: expert e's factors are
`lora_A.view(E, r, in)[e]` and `lora_B.view(out, r, E)[:, :, e]`, and its update `scaling B_e A_e`, exactly PEFT's
`get_delta_weight`. PEFT nests one wrapper per adapted stack of a module, in the order of the module's parameters,
so the first of two adapted stacks is saved under `<experts>.base_layer.lora_A.weight` and the second under
`<experts>.lora_A.weight` (`peft_module_names`).

The update is computed on the rows each expert receives, job by job, by the experts implementation that already
groups them so (actors/engine/moe_experts.py): `scaling (x A_e^T) B_e^T` added to the expert's product, in the
adapter's float32, so a job's tokens reach its own adapters only."""

from __future__ import annotations

import math

import torch
from torch import nn

from actors.engine.fused_linear import JobAdapters
from actors.spec.lora_config import LoraConfig

EXPERTS_NAME = "aspen_segments"
"""transformers' experts implementation that computes each expert's rows job by job (actors/engine/moe_experts.py)."""

ROUTED_NAME = "aspen_routed"
"""transformers' experts implementation that takes that way in the layers holding expert adapters only, the model's
own (grouped) elsewhere: what a CUDA base switches to when the first such adapter joins."""

ADAPTERS = "aspen_experts_lora"
"""The attribute of an experts module holding its adapters: job name -> {stack name: ExpertsLora}."""


class ExpertsLora(nn.Module):
    """One job's LoRA on one expert stack: A (r E, in) and B (out, r E), PEFT's layout."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, config: LoraConfig, *,
                 generator: torch.Generator, device: torch.device, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_experts, self.rank = num_experts, config.r
        self.in_features, self.out_features = in_features, out_features
        self.scaling = config.scaling
        lora_a = torch.empty(config.r * num_experts, in_features, dtype=dtype)
        if config.init_lora_weights == "gaussian":
            nn.init.normal_(lora_a, std=1 / config.r, generator=generator)
        else:   # PEFT's default: nn.Linear(in, r E)'s Kaiming-uniform (its fan-in is `in`), B zero
            nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=generator)
        self.lora_A = nn.Parameter(lora_a.to(device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, config.r * num_experts, dtype=dtype, device=device))

    def factors(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Every expert's A^T (in, r) and B^T (r, out), made once a forward: one unbind each, whose backward
        gathers every expert's gradient into one tensor (indexing expert by expert would build a whole-stack
        gradient for each)."""
        lora_a = self.lora_A.view(self.num_experts, self.rank, self.in_features).transpose(1, 2)
        lora_b = self.lora_B.view(self.out_features, self.rank, self.num_experts).permute(2, 1, 0)
        return lora_a.unbind(0), lora_b.unbind(0)

    def delta(self, rows: torch.Tensor, expert: int,
              factors: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None) -> torch.Tensor:
        """The update of expert `expert` for its `rows` (in features each), in the rows' dtype (`factors`: this
        forward's `factors()`)."""
        lora_a, lora_b = factors if factors is not None else self.factors()
        hidden = rows.to(self.lora_A.dtype) @ lora_a[expert]
        return ((hidden @ lora_b[expert]) * self.scaling).to(rows.dtype)


def expert_stacks(module: nn.Module) -> list[str]:
    """The names of a module's expert weight stacks (3D parameters), in the module's order (PEFT's nesting)."""
    return [name for name, parameter in module.named_parameters(recurse=False) if parameter.dim() == 3]


def targeted_stacks(model: nn.Module, targets: list[str]) -> dict[str, list[str]]:
    """Each experts module's name and its stacks `targets` name (PEFT's matching: the full dotted name, or its last
    components), in the model's order. ValueError for a target that names no stack, saying which stacks there are."""
    found: dict[str, list[str]] = {}
    matched: set[str] = set()
    everything: list[str] = []
    for module_name, module in model.named_modules():
        for stack in expert_stacks(module):
            key = f"{module_name}.{stack}"
            everything.append(key)
            hits = [target for target in targets if key == target or key.endswith("." + target)]
            if hits:
                found.setdefault(module_name, []).append(stack)
                matched.update(hits)
    missing = [target for target in targets if target not in matched]
    if missing:
        if not everything:
            raise ValueError(f"lora.target_parameters: {', '.join(missing)}: this base has no expert weight stacks "
                             "(it is not an MoE model); remove lora.target_parameters")
        names = sorted({key.split(".")[-2] + "." + key.split(".")[-1] for key in everything})
        raise ValueError(f"lora.target_parameters: {', '.join(missing)} names no expert stack of this base; its "
                         f"stacks are {', '.join(names)}")
    return found


def peft_module_names(module_name: str, stacks: list[str]) -> dict[str, str]:
    """Each adapted stack's module name in PEFT's saved keys: the first of n nested wrappers sits n - 1
    `base_layer`s deep."""
    return {stack: module_name + ".base_layer" * (len(stacks) - 1 - index) for index, stack in enumerate(stacks)}


def stack_shape(module: nn.Module, stack: str) -> tuple[int, int, int]:
    """(experts, in, out) of a stack, stored (E, out, in), or (E, in, out) where the module says `is_transposed`."""
    experts, first, second = getattr(module, stack).shape
    return (experts, first, second) if getattr(module, "is_transposed", False) else (experts, second, first)


def stack_shapes(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Every expert stack of the model, `<module>.<stack>` -> (experts, in, out): what the scheduler sizes an
    adapter of `target_parameters` by (`policies.adapter_memory.expert_parameters`)."""
    return {f"{module_name}.{stack}": stack_shape(module, stack) for module_name, module in model.named_modules()
            for stack in expert_stacks(module)}


def activation_bytes(model: nn.Module, lora: LoraConfig) -> tuple[int, tuple[tuple[object, int], ...]]:
    """What a job's expert adapters keep for the backward (actors/engine/adapter_activations.py's terms): per token
    of its own, each of a token's top-k routes keeps the rank-r hidden of every adapted stack and the adapted
    stack's input in float32: the down projection's (each job's rows a tensor of their own), and the up
    projection's (a float32 copy per job on a bfloat16 base; on a float32 base the layer's gathered rows
    themselves, kept once for the whole stream: bytes per stream token under the layer's key)."""
    if not lora.target_parameters:
        return 0, ()
    top_k = int(getattr(model.config, "num_experts_per_tok", 1) or 1)
    float32 = next(model.parameters()).dtype == torch.float32
    per_token, kept = 0, {}
    for key, (_, in_features, _) in stack_shapes(model).items():
        if not any(key == target or key.endswith("." + target) for target in lora.target_parameters):
            continue
        module_name, _, stack = key.rpartition(".")
        per_token += top_k * lora.r * 4
        if stack != "down_proj" and float32:
            kept[("experts_rows", module_name)] = top_k * in_features * 4
        else:
            per_token += top_k * in_features * 4
    return per_token, tuple(kept.items())


def attach(model: nn.Module, name: str, config: LoraConfig, *, generator: torch.Generator,
           dtype: torch.dtype = torch.float32) -> dict[str, ExpertsLora]:
    """Give job `name` its adapters on every stack `config.target_parameters` names; returns them under their
    PEFT module names (`<module>.lora_A.weight` is then PEFT's key). The model must compute its experts job by
    job (actors/engine/moe_experts.py: a CPU base does; a CUDA base is routed first): ValueError otherwise."""
    if not config.target_parameters:
        return {}
    stacks = targeted_stacks(model, config.target_parameters)
    if getattr(model.config, "_experts_implementation", None) not in (EXPERTS_NAME, ROUTED_NAME):
        raise ValueError("lora.target_parameters: this base computes its experts without knowing the step's jobs "
                         f"({model.config._experts_implementation}); `moe_experts.route_adapted_experts` routes them "
                         "(adapter_surgery.add_adapter calls it)")
    adapters: dict[str, ExpertsLora] = {}
    for module_name, names in stacks.items():
        module = model.get_submodule(module_name)
        if not hasattr(module, ADAPTERS):
            module.add_module(ADAPTERS, JobAdapters())
        job_adapters = nn.ModuleDict()
        device = getattr(module, names[0]).device
        peft_names = peft_module_names(module_name, names)
        for stack in names:
            experts, in_features, out_features = stack_shape(module, stack)
            adapter = ExpertsLora(experts, in_features, out_features, config, generator=generator, device=device,
                                  dtype=dtype)
            job_adapters[stack] = adapter
            adapters[peft_names[stack]] = adapter
        getattr(module, ADAPTERS)[name] = job_adapters
    return adapters


def detach(model: nn.Module, name: str) -> None:
    """Remove job `name`'s expert adapters; a module left with none loses its container."""
    for module in list(model.modules()):
        held = getattr(module, ADAPTERS, None)
        if isinstance(held, JobAdapters) and name in held:
            del held[name]
            if len(held) == 0:
                delattr(module, ADAPTERS)


def job_adapters(module: nn.Module) -> JobAdapters | None:
    """The expert adapters an experts module holds, by job (None: none)."""
    held = module._modules.get(ADAPTERS)
    return held if held is not None and len(held) else None
