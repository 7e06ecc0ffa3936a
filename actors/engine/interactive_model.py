"""An interactive model (a Tinker API training client's model): a LoRA adapter on the shared base whose
steps its user drives, call by call: gradients accumulate over `forward_backward` calls
(actors/engine/interactive_step.py) until `optim_step` applies one AdamW step with the parameters the call
gives, as the Tinker SDK defines them (torch.optim.AdamW's update; weight decay 0 unless given; gradient
clipping by global norm when `grad_clip_norm` > 0), and clears them. The step is computed as an aspen job's
(actors/engine/optim.py, joint_steps.py: the same fused AdamW kernel, the norm summed and the clip factor taken
the same way), so that a model whose calls carry a job's batches, weighted 1/N (N: the step's target tokens, a
power of two) and stepped with the job's settings, trains that job's adapter bit for bit
(tests/servers/test_tinker_vs_job.py).

Its adapter is LoRA on every linear layer of the base's decoder (attention's, the MLP's or both) and, with
`train_unembed` (the SDK's default), on the LM head (actors/engine/head_lora.py), rank as asked, alpha 32 at every
rank (as Thinking Machines' "LoRA Without Regret" sets it), no dropout; B starts at zero, so a new model is the
base."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from actors.engine.adapter_surgery import AdapterHandle, add_adapter, linear_module_names, remove_adapter
from actors.engine.experts_lora import stack_shapes
from actors.engine.host_tensors import on_host
from actors.engine.joint_steps import chained_sum
from actors.engine.lora_targets import stack_targets
from actors.engine.models import BaseModel
from actors.engine.optim import fused_option
from actors.spec.lora_config import LoraConfig
from actors.spec.model_parts import HEAD_MODULE, is_attention, part_targets

LORA_ALPHA = 32
MAX_RANK = 256


@dataclass(frozen=True)
class AdamStep:
    """One optimizer step's settings (the SDK's AdamParams)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def problem(self) -> str | None:
        if not self.learning_rate >= 0:
            return f"learning_rate must be >= 0 (got {self.learning_rate})"
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                return f"{name} must be in [0, 1) (got {getattr(self, name)})"
        if not self.eps > 0:
            return f"eps must be > 0 (got {self.eps})"
        if not self.weight_decay >= 0 or not self.grad_clip_norm >= 0:
            return "weight_decay and grad_clip_norm must be >= 0"
        return None


class InteractiveModel:
    """A model's adapter on `base` and its AdamW state."""

    def __init__(self, base: BaseModel, name: str, rank: int, *, seed: int = 0,
                 train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = False):
        if not 1 <= rank <= MAX_RANK:
            raise ValueError(f"rank must be between 1 and {MAX_RANK} (got {rank})")
        self.base, self.name, self.rank = base, name, rank
        self.config = interactive_lora(base, rank, train_attn=train_attn, train_mlp=train_mlp,
                                       train_unembed=train_unembed)
        self.train_unembed = train_unembed
        self.adapter: AdapterHandle = add_adapter(base.model, name, self.config, seed=seed, head=train_unembed)
        parameters = self.adapter.parameters()
        self.optimizer = torch.optim.AdamW(parameters, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0,
                                           **fused_option(parameters))
        self.steps = 0

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """One AdamW step over the gradients accumulated since the last; they are cleared after it."""
        problem = step.problem()
        if problem is not None:
            raise ValueError(f"adam_params: {problem}")
        norm = clip_gradients(self.adapter.parameters(), step.grad_clip_norm)
        for group in self.optimizer.param_groups:
            group.update(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps,
                         weight_decay=step.weight_decay)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": float(norm)}

    def optimizer_tensors(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """AdamW's moments by the adapter's parameter names (`<name>.exp_avg`, `<name>.exp_avg_sq`) and its
        step count (`step`), as saved with a model's state. `copy`: each moment a snapshot of its own; False
        for a write that ends before the next step (on a CPU the moments themselves: two adapters' worth not
        copied)."""
        tensors: dict[str, torch.Tensor] = {}
        steps = 0
        for name, parameter in self.adapter.named_parameters():
            state = self.optimizer.state.get(parameter, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    tensors[f"{name}.{key}"] = on_host(state[key], copy=copy)
            steps = max(steps, int(state.get("step", 0)))
        tensors["step"] = torch.tensor([steps], dtype=torch.int64)
        return tensors

    def load(self, weights: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor] | None) -> None:
        """Weights by the adapter's parameter names, and optionally AdamW's moments and step
        (`optimizer_tensors`' names): what a saved state restores. A state of another rank or other trained parts
        raises ValueError naming both models' settings; a missing, misshapen or extra tensor, naming it; before
        anything changes."""
        parameters = dict(self.adapter.named_parameters())
        if (differ := settings_differ(weights, parameters, self.rank)) is not None:
            raise ValueError(f"the saved state's LoRA settings are not this model's: {differ}; a state loads into a "
                             "model created with its settings (the Tinker SDK's create_training_client_from_state "
                             "creates one from the state itself: its rank and trained parts)")
        for name, parameter in parameters.items():
            if name not in weights or weights[name].shape != parameter.shape:
                raise ValueError(f"the saved state has no tensor {name} of shape {tuple(parameter.shape)}")
        extra = sorted(set(weights) - set(parameters))
        if extra:
            raise ValueError(f"the saved state has tensors this model lacks ({', '.join(extra[:3])}"
                             f"{', ...' if len(extra) > 3 else ''})")
        with torch.no_grad():
            for name, parameter in parameters.items():
                parameter.copy_(weights[name])
        if optimizer is None:
            return
        steps = torch.tensor(float(optimizer["step"][0]), dtype=torch.float32)
        fused = bool(self.optimizer.param_groups[0].get("fused"))
        for name, parameter in parameters.items():
            if f"{name}.exp_avg" in optimizer:
                # as torch's own load_state_dict: a fused AdamW keeps its step count on the parameter's device
                device = parameter.device
                self.optimizer.state[parameter] = {"step": steps.to(device, copy=True) if fused else steps.clone(),
                                                   "exp_avg": optimizer[f"{name}.exp_avg"].to(device, copy=True),
                                                   "exp_avg_sq": optimizer[f"{name}.exp_avg_sq"].to(device, copy=True)}

    def snapshot(self, name: str) -> AdapterHandle:
        """A frozen copy of the adapter as it is now, attached to the base as `name` (what a sampler samples)."""
        copy = add_adapter(self.base.model, name, self.config, seed=0, head=self.train_unembed)
        with torch.no_grad():
            for (_, target), (_, source) in zip(copy.named_parameters(), self.adapter.named_parameters(),
                                                strict=True):
                target.copy_(source)
                target.requires_grad_(False)
        return copy

    def close(self) -> None:
        """Take the adapter off the base (its weights are gone unless saved)."""
        remove_adapter(self.base.model, self.name)


def clip_gradients(parameters: list[torch.nn.Parameter], limit: float) -> float:
    """The gradients' global norm, and with `limit` > 0 the gradients scaled to at most that norm, as an aspen
    job's step takes them (joint_steps.gradient_squares, chained_sum, apply_step): each tensor's norm squared in
    float64, summed from the last tensor back, the factor min(limit / (norm + 1e-6), 1)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norm = math.sqrt(chained_sum(torch.stack(torch._foreach_norm(grads)).to(torch.float64).square_().tolist()))
    if limit > 0:
        torch._foreach_mul_(grads, [min(limit / (norm + 1e-6), 1.0)] * len(grads))
    return norm


def target_modules(base: BaseModel, *, train_attn: bool, train_mlp: bool) -> list[str]:
    """The decoder's linear layers to adapt: attention's, the MLP's, or both (the LM head is `train_unembed`'s:
    `interactive_lora`), as the scheduler names them (actors/spec/model_parts.py)."""
    return part_targets(linear_module_names(base.model), train_attn=train_attn, train_mlp=train_mlp)


def settings_differ(saved: dict[str, torch.Tensor], own: dict[str, torch.Tensor], rank: int) -> str | None:
    """"rank 8 (this model: 4), train_mlp False (this model: True)": where a saved state's LoRA rank (its
    `lora_A` tensors' rows) or trained parts differ from a model's (`own` its tensors, `rank` its rank); None
    where they agree."""
    ranks = {int(tensor.shape[0]) for name, tensor in saved.items() if name.endswith(".lora_A.weight")}
    theirs: dict[str, object] = {"rank": ranks.pop() if len(ranks) == 1 else None, **trained_parts(list(saved))}
    mine: dict[str, object] = {"rank": rank, **trained_parts(list(own))}
    differ = [f"{key} {theirs[key]} (this model: {mine[key]})" for key in mine
              if theirs[key] is not None and theirs[key] != mine[key]]
    return ", ".join(differ) or None


def trained_parts(tensor_names: list[str]) -> dict[str, bool]:
    """`train_attn`, `train_mlp`, `train_unembed` of the model whose adapter tensors have these names (a saved
    state's: `<module>.lora_A.weight`, an expert stack's too), as `target_modules` sorts a base's layers."""
    modules = {name.split(".lora_")[0].removesuffix(".base_layer") for name in tensor_names if ".lora_" in name}
    return {"train_attn": any(is_attention(m) for m in modules if m != HEAD_MODULE),
            "train_mlp": any(not is_attention(m) for m in modules if m != HEAD_MODULE),
            "train_unembed": HEAD_MODULE in modules}


def interactive_lora(base: BaseModel, rank: int, *, train_attn: bool, train_mlp: bool,
                     train_unembed: bool = False) -> LoraConfig:
    """A Tinker model's adapter: its linear layers (`target_modules`) and, with the MLP on an MoE base, every expert
    stack (as Tinker trains the experts there); with `train_unembed` alone, `lm_head` its only target (the head's
    adapter itself is `add_adapter`'s `head`). ValueError where that adapts nothing."""
    if not (train_attn or train_mlp or train_unembed):
        raise ValueError("train_attn, train_mlp and train_unembed are all false: nothing to train")
    targets = target_modules(base, train_attn=train_attn, train_mlp=train_mlp) if train_attn or train_mlp else []
    stacks = stack_targets(stack_shapes(base.model)) if train_mlp else []
    if not targets and not stacks:
        if not train_unembed:
            raise ValueError(NO_MLP_LAYERS)
        targets = [HEAD_MODULE]
    return LoraConfig(r=rank, alpha=LORA_ALPHA, dropout=0.0, target_modules=targets, target_parameters=stacks)


NO_MLP_LAYERS = ("train_mlp alone, but nothing of this base's MLP is adapted (on some MoE types its dense and "
                 "shared MLP layers are left alone: docs/models.md): train attention too (train_attn=True)")
