"""What a step's adapters keep in memory for backward, and the loss's transient: the analytic part of a fused
step's peak (`memory_prior` adds the base's part, measured on the model by probe steps).

Per job, what its adapters keep per token of its own (the rank-r hidden, dropout's mask and dropped input, DoRA's
and VeRA's extra rows) and which layer inputs they keep once for the whole stream (the layers reading one tensor
share it: q/k/v, gate/up): `adapter_terms`, kept per LoRA config by `StepMemoryPrior.terms`; a step's jobs
combined: `combined_bytes`; the loss's chunked logits and kept hidden states: `loss_transient_bytes`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.data import Example
from actors.data.pairs import example_rows
from actors.engine.loss import DEFAULT_CHUNK
from actors.spec.lora_config import LoraConfig

ADAPTER_WIDTH = 4   # adapters train in float32


def adapter_bytes(jobs: list[tuple[LoraConfig, list[str], int]], linear_shapes: dict[str, tuple[int, int]],
                  input_groups: dict[str, int], base_dtype: torch.dtype, *, compute_path: bool = False) -> int:
    """Bytes autograd keeps for a step's adapters (a frozen base saves no linear layer's input itself).
    `jobs`: per job its LoRA config, the linear layers it adapts and its tokens in the step. Per adapted
    layer (in, out) and token: the rank-r hidden A·x; with dropout the mask and the dropped input (in each);
    without, the input A reads: where the base is float32 that is the layer's input itself, a slice of the
    whole stream's tensor, kept once for every layer that reads the same tensor (`input_groups`: q/k/v
    share one, so do gate/up) and the whole stream long; otherwise its float32 copy (in, per layer).
    DoRA keeps two (out) rows more per token (the base's output and the low-rank update, which the
    magnitude's gradient reads), and computes each layer's row norms of W + B A on a transient of about
    three float32 (out, in) matrices (one layer at a time: the largest counts once). VeRA keeps per token
    and layer A x (r, for lambda_d's gradient) and the B product (out, for lambda_b's) and no input (its
    projections are frozen), besides dropout's mask and dropped input.
    `compute_path`: plain LoRA adapters take the CUDA path (actors/engine/lora_cuda.py, `lora_cuda.applies`),
    which keeps in the base's dtype the rank-r hidden per token and layer, with dropout the mask (in), and the
    layer's input itself, once per input tensor, the whole stream long."""
    return combined_bytes([(adapter_terms(lora, names, linear_shapes, input_groups, base_dtype,
                                          compute_path=compute_path), tokens) for lora, names, tokens in jobs])


@dataclass(frozen=True)
class AdapterTerms:
    """One job's share of `adapter_bytes`, whatever its tokens: bytes per token of its own, the inputs it keeps
    (bytes per stream token, by the input tensor's group: kept once for every job and layer that reads it) and the
    largest transient it computes (DoRA's row norms)."""

    per_token: int
    kept_inputs: tuple[tuple[object, int], ...]
    transient: int


def adapter_terms(lora: LoraConfig, names: list[str], linear_shapes: dict[str, tuple[int, int]],
                  input_groups: dict[str, int], base_dtype: torch.dtype, *, compute_path: bool = False
                  ) -> AdapterTerms:
    """A job's `AdapterTerms` (`adapter_bytes` says what each counts)."""
    per_job = 0
    kept_inputs: dict[object, int] = {}
    dora_transient = 0
    width = torch.finfo(base_dtype).bits // 8 if base_dtype.is_floating_point else ADAPTER_WIDTH
    plain = lora.kind != "vera" and not lora.use_dora and lora.init_lora_weights in ("default", "gaussian")
    for name in names:
        in_features = linear_shapes[name][0]
        if compute_path and plain:
            per_job += (lora.r + (in_features if lora.dropout > 0 else 0)) * width
            kept_inputs[input_groups.get(name, id(name))] = in_features * width
            continue
        per_token = lora.r
        if lora.kind == "vera":
            per_token += linear_shapes[name][1]
            if lora.dropout > 0:
                per_token += 2 * in_features
            per_job += per_token * ADAPTER_WIDTH
            continue
        if lora.use_dora:
            out_features = linear_shapes[name][1]
            per_token += 2 * out_features
            dora_transient = max(dora_transient, 3 * in_features * out_features * ADAPTER_WIDTH)
        if lora.dropout > 0:   # the mask is kept only where the input itself needs a gradient
            per_token += in_features if name in input_groups.get("no_grad", ()) else 2 * in_features
        elif base_dtype != torch.float32:
            per_token += in_features
        else:
            kept_inputs[input_groups.get(name, id(name))] = in_features * ADAPTER_WIDTH
        per_job += per_token * ADAPTER_WIDTH
    return AdapterTerms(per_job, tuple(kept_inputs.items()), dora_transient)


def combined_bytes(jobs: list[tuple[AdapterTerms, int]]) -> int:
    """`adapter_bytes` of jobs given as (their `AdapterTerms`, their tokens in the step). The kept inputs are united
    over each distinct terms object once, in the order of its last job (a later job's width of an input wins, as in
    `adapter_bytes`): jobs sharing one (`StepMemoryPrior.terms` gives equal terms as one object) cost one union."""
    kept_inputs: dict[object, int] = {}
    for terms in reversed(list({id(terms): terms for terms, _ in reversed(jobs)}.values())):
        kept_inputs.update(terms.kept_inputs)
    stream = sum(tokens for _, tokens in jobs)
    return (sum(terms.per_token * tokens for terms, tokens in jobs) + sum(kept_inputs.values()) * stream
            + max((terms.transient for terms, _ in jobs), default=0))


def linear_input_groups(model: torch.nn.Module, run_forward) -> dict[str, int]:
    """Which linear layers read the same input tensor (one id per tensor), seen in one forward pass, and
    (under "no_grad") those whose input needs no gradient whatever adapters sit upstream (e.g. the first
    layer's attention projections: the frozen embeddings' norm; seen with an adapter on every layer)."""
    from actors.engine.fused_linear import FusedLoraLinear

    groups: dict[str, int] = {}
    no_grad: set[str] = set()
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, FusedLoraLinear):
            def record(_module, args, name=name):
                groups[name] = args[0].untyped_storage().data_ptr()
                if not args[0].requires_grad:
                    no_grad.add(name)
            handles.append(module.register_forward_pre_hook(record))
    try:
        run_forward()
    finally:
        for handle in handles:
            handle.remove()
    ids = {ptr: i for i, ptr in enumerate(dict.fromkeys(groups.values()))}
    return {**{name: ids[ptr] for name, ptr in groups.items()}, "no_grad": frozenset(no_grad)}


def loss_transient_bytes(targets: int, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                         chunk: int = DEFAULT_CHUNK) -> int:
    """The loss's bytes at its peak (actors/engine/loss.py): the gathered hidden states and the hidden-state
    gradient it keeps for backward (targets x hidden each), the per-token losses and weights, plus one
    chunk's logits in the model's dtype, their float32 copy where that differs, and logsumexp's scratch."""
    if targets == 0:
        return 0
    width = torch.finfo(dtype).bits // 8
    rows = min(chunk, targets)
    logits = rows * vocab_size * (width + (4 if dtype != torch.float32 else 0) + 4)
    return 2 * targets * hidden_size * width + 2 * targets * 4 + logits


def example_targets(examples: list[Example]) -> int:
    """Target tokens of a micro-batch (the positions whose next token is a label)."""
    return sum(e.loss_targets for e in example_rows(examples))
