"""MoE experts on the CPU, computed job by job, so that fused jobs route and train exactly as alone.

transformers runs a layer's experts (`@use_experts_implementation`: 3D weight stacks, not linear layers) over
every routed token of the batch, each expert's rows in one product. On a CPU a product's rounding depends on its
number of rows where there are few (fewer than about five: MKL's small-matrix path), so a job whose few tokens
reach an expert would be rounded differently beside other jobs' tokens than alone. Here each expert multiplies
each job's rows of the step (`StepLayout.job_ranges`) in a product of its own, in the job's own order: a job's
every product is the same alone or fused (tests/unit/engine/test_isolation.py), in its reference passes too. It
costs a product per expert and job reaching it instead of one per expert.

Set on CPU bases only (`use_segment_experts`); on CUDA transformers' grouped product stays (one launch a layer;
no bit-for-bit claim there, as for every CUDA product). Outside a step all tokens are one group: transformers'
grouped way, expert by expert."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from actors.engine.experts_lora import EXPERTS_NAME, ROUTED_NAME, job_adapters
from actors.engine.layout import current_layout

__all__ = ["EXPERTS_NAME", "ROUTED_NAME", "route_adapted_experts", "segment_experts_forward", "use_segment_experts"]


def _group_of_tokens(num_tokens: int, device: torch.device) -> tuple[torch.Tensor, list[str | None]]:
    """Each token's group in the current step and each group's adapter (the job whose segment it is, None outside
    every segment): the stream cut at every job's bounds (`StepLayout.job_ranges`) and every segment's, so a job's
    tokens are a group of their own, whatever is beside them; one group outside a step (generation)."""
    layout = current_layout()
    if layout is None or layout.num_tokens != num_tokens:
        return torch.zeros(num_tokens, dtype=torch.long, device=device), [None]
    key = ("moe_groups", str(device))
    if key not in layout.tensors:
        cuts = ({b for r in layout.job_ranges for b in r}
                | {b for _, start, end in layout.segments for b in (start, end)})
        bounds = sorted({0, num_tokens} | {min(max(b, 0), num_tokens) for b in cuts})
        lengths = torch.tensor([end - start for start, end in zip(bounds, bounds[1:], strict=False)])
        owners = [next((name for name, start, end in layout.segments if start <= first < end), None)
                  for first in bounds[:-1]]
        layout.tensors[key] = (torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device), owners)
    return layout.tensors[key]


def _project(module: torch.nn.Module, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
             ) -> torch.Tensor:
    """One expert's projection of its rows, as transformers' grouped linear makes it (weights (out, in), or
    (in, out) where the module stores them transposed)."""
    out = rows @ weight if module.is_transposed else F.linear(rows, weight)
    return out + bias if bias is not None else out


def _factors(made: dict, owner: str, stack: str, lora) -> tuple:
    key = (owner, stack)
    if key not in made:
        made[key] = lora[stack].factors()
    return made[key]


def segment_experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped experts forward (up or gate-up projection, gate or activation, optional post-norm, down
    projection, routing weights, a per-token sum over its top-k), with the rows grouped by (expert, job)."""
    num_tokens, top_k = top_k_index.shape
    # a token's experts in ascending order, whatever order the router gave them (an unsorted top-k's order may
    # follow the size of its input): its k contributions are then summed in the same order alone and fused
    top_k_index, by_expert = torch.sort(top_k_index, dim=-1)
    top_k_weights = torch.gather(top_k_weights, -1, by_expert)
    group_of_token, owners = _group_of_tokens(num_tokens, hidden_states.device)
    count_of_groups = max(len(owners), 1)
    adapters = job_adapters(module)
    factors: dict = {}   # (job, stack) -> its adapter's per-expert factors, made once this forward
    expert_ids = top_k_index.reshape(-1)
    groups = expert_ids * count_of_groups + group_of_token.repeat_interleave(top_k)
    _, order = torch.sort(groups, stable=True)       # by expert, then job, then token: the job's own order
    counts = torch.bincount(groups, minlength=module.num_experts * count_of_groups).tolist()
    rows = hidden_states[order // top_k]
    up_weights = module.gate_up_proj if module.has_gate else module.up_proj
    up_biases = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias) if module.has_bias else None
    # each group's rows as the views of one split (its backward one cat, where a slice a group would zero a
    # gradient the size of every row for each group)
    pieces = iter(torch.split(rows, [count for count in counts if count]))
    outputs = []
    for group, count in enumerate(counts):
        if count == 0:
            continue
        expert = group // count_of_groups
        owner = owners[group % count_of_groups] if adapters is not None else None
        lora = adapters[owner] if owner is not None and owner in adapters else {}
        up_name = "gate_up_proj" if module.has_gate else "up_proj"
        inputs = next(pieces)
        part = _project(module, inputs, up_weights[expert], up_biases[expert] if up_biases is not None else None)
        if up_name in lora:
            part = part + lora[up_name].delta(inputs, expert, _factors(factors, owner, up_name, lora))
        part = module._apply_gate(part) if module.has_gate else module.act_fn(part)
        inputs = part
        part = _project(module, inputs, module.down_proj[expert],
                        module.down_proj_bias[expert] if module.has_bias else None)
        if "down_proj" in lora:
            part = part + lora["down_proj"].delta(inputs, expert, _factors(factors, owner, "down_proj", lora))
        outputs.append(part)
    out = torch.cat(outputs) if outputs else hidden_states.new_zeros(0, hidden_states.shape[-1])
    if module.has_post_expert_norm:
        out = module.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return out[back].view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def has_experts(model: torch.nn.Module) -> bool:
    """Whether the model has transformers' experts modules (3D weight stacks)."""
    return any(isinstance(getattr(module, "down_proj", None), torch.nn.Parameter) and module.down_proj.dim() == 3
               for module in model.modules())


def _set_implementation(model: torch.nn.Module, name: str, forward) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(name, forward)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(name)
    else:
        model.config._experts_implementation = name


def use_segment_experts(model: torch.nn.Module) -> bool:
    """On a CPU model with experts, compute them job by job (this module); True where it did."""
    devices = {parameter.device.type for parameter in model.parameters()} - {"meta"}   # a pipeline stage's others
    if devices != {"cpu"} or not has_experts(model):
        return False
    _set_implementation(model, EXPERTS_NAME, segment_experts_forward)
    return True


GROUPED = "_aspen_grouped_experts"   # the config's own implementation, kept where ROUTED_NAME replaced it


def routed_experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of a layer holding LoRA adapters on its stacks job by job (`segment_experts_forward`); those of
    every other layer as the model's own implementation computes them (on CUDA transformers' grouped product)."""
    if job_adapters(module) is not None:
        return segment_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    own = getattr(module.config, GROUPED, "eager")
    forward = ALL_EXPERTS_FUNCTIONS.get_interface(own, type(module).forward.__wrapped__)
    return forward(module, hidden_states, top_k_index, top_k_weights)


def route_adapted_experts(model: torch.nn.Module) -> None:
    """Before LoRA adapters join a model's expert stacks: where its experts run transformers' grouped product (a
    CUDA base), the layers holding such adapters take the job-by-job way (which a product over every job's rows
    could not adapt per job) and the others keep the grouped one (`routed_experts_forward`)."""
    own = getattr(model.config, "_experts_implementation", None)
    if own in (EXPERTS_NAME, ROUTED_NAME) or not has_experts(model):
        return
    setattr(model.config, GROUPED, own or "eager")
    _set_implementation(model, ROUTED_NAME, routed_experts_forward)
