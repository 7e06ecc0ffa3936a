"""Adapters added to and removed from a loaded, frozen model at run time, and the handle of one job's adapter.

Each targeted linear layer is wrapped in a FusedLoraLinear (and given its plain layer back when its last
adapter leaves); one job's adapter across its layers is an AdapterHandle (its parameters under PEFT's names);
a job's plain adapters' weights are pooled in one flat tensor for the CUDA path (`pool_masters`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from actors.engine import experts_lora, head_lora, lora_layer_state, lora_siblings, lora_stacks, moe_experts
from actors.engine.conv1d_layers import transposed_in_checkpoint
from actors.engine.experts_lora import ExpertsLora
from actors.engine.fused_linear import FusedLoraLinear, JobAdapters
from actors.engine.lora_adapter import LoraAdapter, base_weight, full_precision
from actors.engine.lora_masters import MasterPool
from actors.engine.lora_targets import match_targets, peft_target_modules, unadapted_problem
from actors.engine.model_support import SUPPORTED
from actors.engine.vera import VeraAdapter, VeraProjections
from actors.spec.lora_config import LoraConfig, needs_full_precision_base


def _is_linear(module: nn.Module) -> bool:
    # nn.Linear, and bitsandbytes' Linear8bitLt / Linear4bit (nn.Linear subclasses)
    return isinstance(module, nn.Linear)


def unadapted_names(model: nn.Module) -> tuple[str, ...]:
    """Names of linear layers LoRA leaves alone on this model's type (actors/engine/model_support.py says why)."""
    row = SUPPORTED.get(getattr(getattr(model, "config", None), "model_type", None))
    return row.unadapted if row is not None else ()


def linear_module_names(model: nn.Module) -> list[str]:
    """Names of the linear layers LoRA may target (the output embedding, and the layers of names its model type
    leaves alone, excluded)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    left = unadapted_names(model)
    names = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in left:
            continue
        if isinstance(module, FusedLoraLinear):
            names.append(name)
        elif _is_linear(module) and module is not output and not name.endswith(".base"):
            names.append(name)
    return names


def check_adaptable(model: nn.Module, target_modules: list[str] | str) -> None:
    """ValueError for a target naming layers its model type leaves alone, saying why."""
    problem = unadapted_problem(target_modules, unadapted_names(model), model.config.model_type)
    if problem:
        raise ValueError(problem)


def resolve_targets(model: nn.Module, target_modules: list[str] | str) -> list[str]:
    """Module names matched by a LoRA config's `target_modules`, with PEFT's matching rule."""
    check_adaptable(model, target_modules)
    return match_targets(linear_module_names(model), target_modules)


def _full_precision(module: nn.Module) -> bool:
    """A plain float linear layer (not bitsandbytes' Linear8bitLt / Linear4bit, whatever it is wrapped in)."""
    return full_precision(module.base if isinstance(module, FusedLoraLinear) else module)


def _on_meta(module: nn.Module) -> bool:
    """A linear layer (wrapped or not) whose weight is on `meta`: held by another pipeline stage."""
    return (module.base if isinstance(module, FusedLoraLinear) else module).weight.is_meta


def _parent_and_child(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _wrap(model: nn.Module, name: str) -> FusedLoraLinear:
    parent, child = _parent_and_child(model, name)
    module = getattr(parent, child)
    if isinstance(module, FusedLoraLinear):
        return module
    fused = FusedLoraLinear(module)
    setattr(parent, child, fused)
    _link_siblings(parent)
    _SURGERIES[0] += 1
    return fused


def _unwrap(model: nn.Module, name: str) -> None:
    parent, child = _parent_and_child(model, name)
    module = getattr(parent, child)
    if isinstance(module, FusedLoraLinear):
        setattr(parent, child, module.base)
        module.siblings = None
        _link_siblings(parent)
        _SURGERIES[0] += 1


def _link_siblings(parent: nn.Module) -> None:
    """Give `parent`'s wrapped layers that read one input their set (actors/engine/lora_siblings.py), anew."""
    for names in lora_siblings.SIBLING_NAMES:
        wrapped = [layer for layer in (getattr(parent, name, None) for name in names)
                   if isinstance(layer, FusedLoraLinear)]
        siblings = lora_siblings.SiblingSet(wrapped) if len(wrapped) >= 2 else None
        for layer in wrapped:
            layer.siblings = siblings


class AdapterHandle:
    """The parameters of one job's adapter across all the layers it targets."""

    def __init__(self, name: str, config: LoraConfig, layers: dict[str, LoraAdapter | VeraAdapter],
                 generator: torch.Generator | None, peft_targets: list[str] | None = None,
                 projections: VeraProjections | None = None, experts: dict[str, ExpertsLora] | None = None,
                 head: head_lora.HeadLora | None = None, fan_in_fan_out: bool = False):
        self.name = name
        self.config = config
        self.layers = layers
        self.dropout_generator = generator
        self.peft_targets = peft_targets if peft_targets is not None else sorted(layers)
        self.projections = projections   # VeRA: the job's frozen projections, shared by its layers
        self.experts = experts or {}     # LoRA on expert stacks, by PEFT module name (actors/engine/experts_lora.py)
        self.head = head                 # LoRA on the LM head (actors/engine/head_lora.py), or None
        self.fan_in_fan_out = fan_in_fan_out   # its layers are GPT-2's Conv1D in the checkpoint (PEFT's flag)
        if head is not None:
            self.peft_targets = [*self.peft_targets, head_lora.HEAD_MODULE]

    def use_projections(self, projections: VeraProjections) -> None:
        """Make every layer of this VeRA adapter read `projections` (those of a saved adapter)."""
        self.projections = projections
        for layer in self.layers.values():
            layer.projections = projections

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """The trainable tensors under PEFT's names (adapter name stripped): `<module>.lora_A.weight`,
        `<module>.lora_B.weight` and, with DoRA, `<module>.lora_magnitude_vector`; VeRA's
        `<module>.vera_lambda_b` and `<module>.vera_lambda_d`; then the expert stacks' (`<experts>[.base_layer]
        .lora_A.weight`, PEFT's ParamWrapper keys); then the LM head's (`lm_head.lora_A.weight`)."""
        for module_name, layer in self.layers.items():
            if isinstance(layer, VeraAdapter):
                yield f"{module_name}.vera_lambda_b", layer.vera_lambda_b
                yield f"{module_name}.vera_lambda_d", layer.vera_lambda_d
                continue
            yield f"{module_name}.lora_A.weight", layer.lora_A
            yield f"{module_name}.lora_B.weight", layer.lora_B
            if layer.magnitude is not None:
                yield f"{module_name}.lora_magnitude_vector", layer.magnitude
        for module_name, stack in self.experts.items():
            yield f"{module_name}.lora_A.weight", stack.lora_A
            yield f"{module_name}.lora_B.weight", stack.lora_B
        if self.head is not None:
            yield f"{head_lora.HEAD_MODULE}.lora_A.weight", self.head.lora_A
            yield f"{head_lora.HEAD_MODULE}.lora_B.weight", self.head.lora_B

    def parameter_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(A's, the others): LoRA+'s two learning-rate groups, as PEFT's create_loraplus_optimizer splits
        them (lora_B and every 1-d parameter, DoRA's magnitudes included, in the second)."""
        first, second = [], []
        for name, parameter in self.named_parameters():
            (first if name.endswith(".lora_A.weight") else second).append(parameter)
        return first, second

    def frozen_initial(self) -> Iterable[tuple[str, torch.Tensor, torch.Tensor]]:
        """(module, A0, B0) of every layer with a frozen initial product (PiSSA / OLoRA)."""
        for module_name, layer in self.layers.items():
            if layer.lora_A0 is not None:
                yield module_name, layer.lora_A0, layer.lora_B0

    def held_gradient_bytes(self) -> int:
        """Bytes of gradient buffers its pooled adapters keep between steps (the CUDA path's: `MasterPool`)."""
        pools = self.__dict__.get("_pools")
        if pools is None:   # its layers never change
            pools = self._pools = list({id(found[0]): found[0] for layer in self.layers.values()
                                        if (found := getattr(layer, "master_pool", None)) is not None}.values())
        return sum([pool.grads.values.numel() * pool.grads.values.element_size() for pool in pools
                    if pool.grads.values is not None])

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def add_adapter(model: nn.Module, name: str, config: LoraConfig, *, seed: int,
                dtype: torch.dtype = torch.float32, head: bool = False) -> AdapterHandle:
    """Attach a new adapter to the (frozen) model without reloading it. `head`: LoRA on the LM head too (an
    interactive model's `train_unembed`: actors/engine/head_lora.py; float32, A drawn after every other layer's)."""
    if name in head_lora.held_names(model) or any(
            (isinstance(m, FusedLoraLinear) and name in m.adapters)
            or ((held := experts_lora.job_adapters(m)) is not None and name in held) for m in model.modules()):
        raise ValueError(f"an adapter named '{name}' is already attached")
    check_adaptable(model, config.target_modules)
    candidates = linear_module_names(model)
    # in the model's own order, layer by layer, whatever the order of `target_modules`: a pipeline stage then
    # holds a contiguous run of the adapter's tensors, and its gradient norm sums in the same order
    # (joint_steps.chained_sum) on one device and over stages
    named = config.target_modules
    if head and isinstance(named, list):   # `lm_head` is the head adapter's (a model of the head alone names it)
        named = [target for target in named if target != head_lora.HEAD_MODULE]
    wanted = set(match_targets(candidates, named)) if named else set()
    targets = [name for name in candidates if name in wanted]
    # a pipeline stage holds some layers only, the others on `meta` (actors/engine/pipeline/stage_model.py)
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    init_generator = torch.Generator().manual_seed(seed)
    dropout_generator = None
    if config.dropout > 0:
        dropout_generator = torch.Generator(device=device).manual_seed(seed + 1)
    reads_weight = config.use_dora or config.init_lora_weights.startswith(("pissa", "olora"))
    if needs_full_precision_base(config) is not None:
        quantized = [target for target in targets if not _full_precision(model.get_submodule(target))
                     and not _on_meta(model.get_submodule(target))]
        if quantized:
            problem = needs_full_precision_base(config)
            raise ValueError(f"adapter '{name}': {problem} (e.g. {quantized[0]} is "
                             f"{type(model.get_submodule(quantized[0])).__name__})")
    projections = None
    if config.kind == "vera":   # sized over every adapted layer, those of other pipeline stages included
        shapes = [(model.get_submodule(t).in_features, model.get_submodule(t).out_features) for t in targets]
        projections = VeraProjections.generate(config, shapes, device)
    layers: dict[str, LoraAdapter | VeraAdapter] = {}
    for module_name in targets:
        module = model.get_submodule(module_name)
        if projections is not None:
            if _on_meta(module):
                continue
            fused = _wrap(model, module_name)
            vera = VeraAdapter(fused.in_features, fused.out_features, config, projections, device=device, dtype=dtype)
            vera.dropout_generator = dropout_generator
            fused.adapters[name] = vera
            layers[module_name] = vera
            continue
        if _on_meta(module):
            # another pipeline stage's layer: draw what its initialisation draws, so that this stage's
            # layers start where they would on one device, and attach nothing
            LoraAdapter.initial_a(config, module.in_features, init_generator, dtype)
            continue
        fused = _wrap(model, module_name)
        adapter = LoraAdapter(fused.in_features, fused.out_features, config, generator=init_generator,
                              device=device, dtype=dtype, base_weight=base_weight(fused.base) if reads_weight else None,
                              seed=seed)
        adapter.dropout_generator = dropout_generator
        fused.adapters[name] = adapter
        layers[module_name] = adapter
    pool_masters(layers.values(), device)
    try:   # after the linear layers: their initialisation draws first, whatever the stacks
        if config.target_parameters:
            moe_experts.route_adapted_experts(model)
        experts = experts_lora.attach(model, name, config, generator=init_generator, dtype=dtype)
        adapted_head = head_lora.attach(model, name, config.r, config.alpha, generator=init_generator) if head else None
    except ValueError:
        remove_adapter(model, name)
        raise
    return AdapterHandle(name, config, layers, dropout_generator, peft_target_modules(candidates, targets),
                         projections, experts, adapted_head,
                         transposed_in_checkpoint([model.get_submodule(target) for target in targets]))


def pool_masters(layers: Iterable[nn.Module], device: torch.device) -> torch.Tensor | None:
    """Every plain adapter's A and B of one job made views of one flat tensor, every A first, then every B (their
    values kept): the CUDA path casts a job's whole adapter to the compute dtype, B times the scaling, in two
    operations a step (`lora_masters.MasterPool`), not two per layer. Each adapter keeps `master_pool` = (the pool,
    where its A starts, where its B starts)."""
    adapters = [layer for layer in layers if isinstance(layer, LoraAdapter) and layer.plain]
    if not adapters:
        return None
    dtype = adapters[0].lora_A.dtype
    a_total = sum(a.lora_A.numel() for a in adapters)
    flat = torch.empty(a_total + sum(a.lora_B.numel() for a in adapters), dtype=dtype, device=device)
    positions = {"lora_A": 0, "lora_B": a_total}
    starts: dict[int, dict[str, int]] = {}
    parameters: list[nn.Parameter] = []
    for adapter in adapters:
        for attribute in ("lora_A", "lora_B"):
            parameter = getattr(adapter, attribute)
            position = positions[attribute]
            view = flat[position:position + parameter.numel()].view(parameter.shape)
            view.copy_(parameter.detach())
            setattr(adapter, attribute, nn.Parameter(view))
            parameters.append(getattr(adapter, attribute))
            starts.setdefault(id(adapter), {})[attribute] = position
            positions[attribute] = position + parameter.numel()
    pool = MasterPool(flat, a_total, adapters[0].scaling, parameters)
    for adapter in adapters:
        adapter.master_pool = (pool, starts[id(adapter)]["lora_A"], starts[id(adapter)]["lora_B"])
    return flat


def remove_adapter(model: nn.Module, name: str) -> None:
    """Detach an adapter; layers left with no adapter get their plain linear layer back."""
    experts_lora.detach(model, name)
    head_lora.detach(model, name)
    for module_name, module in list(model.named_modules()):
        if isinstance(module, FusedLoraLinear) and name in module.adapters:
            del module.adapters[name]
            lora_layer_state.forget_masters(module.base)
            if module.siblings is not None:   # the stacks of the layers computed together held its copies too
                lora_stacks.KEPT.forget(module.siblings)
            if len(module.adapters) == 0:
                _unwrap(model, module_name)


_SURGERIES = [0]   # layers wrapped or unwrapped so far, in any model (`fused_layers`' kept lists)
FUSED_LAYERS = "_aspen_fused_layers"


def surgeries() -> int:
    """Layers wrapped or unwrapped so far, in any model: a count that moves whenever a model's structure changes."""
    return _SURGERIES[0]


def fused_layers(model: nn.Module) -> list[FusedLoraLinear]:
    """The model's fused layers, kept on the model until a layer is wrapped or unwrapped (walking every module of
    a large model a step was a measurable share of a step's host time)."""
    found = model.__dict__.get(FUSED_LAYERS)
    if found is None or found[0] != _SURGERIES[0]:
        found = model.__dict__[FUSED_LAYERS] = (_SURGERIES[0], [module for module in model.modules()
                                                                if isinstance(module, FusedLoraLinear)])
    return found[1]


def set_adapters_training(model: nn.Module, training: bool) -> None:
    """Adapter dropout on (training) or off (evaluation); the frozen base always stays in eval mode. A layer's
    adapters already in that mode are left as they are (an adapter joins its layer in the layer's mode:
    `JobAdapters`)."""
    for module in fused_layers(model):
        if module.adapters.training != training:
            module.adapters.train(training)


def freeze(model: nn.Module) -> None:
    for parameter in model.parameters():
        parameter.requires_grad_(False)


def non_finite_values(model: nn.Module, name: str) -> tuple[int, int]:
    """How many of adapter `name`'s values are NaN or infinite (a diverged training's), and how many it has."""
    bad = total = 0
    for module in model.modules():
        held = getattr(module, "adapters", None)
        if isinstance(held, JobAdapters) and name in held:
            for tensor in held[name].parameters():
                bad += int((~torch.isfinite(tensor.detach())).sum())
                total += tensor.numel()
    return bad, total
