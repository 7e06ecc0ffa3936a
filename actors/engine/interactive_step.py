"""Interactive models' forward and forward-backward calls (the Tinker API's `forward` / `forward_backward`),
fused: the datums of every call in one packed pass through the base, each call's tokens through its own
model's adapter, each call's loss its own (actors/engine/tinker_losses.py), one backward for all of them.

Isolation holds as in a fused step of aspen's own jobs: a call's tokens see only their own sequence
(varlen attention over packed sequences) and their own adapter (the fused LoRA layers' segments), so each
adapter's gradients come from its own calls alone and a call's outputs equal those of the same call run
alone. A datum's `target_tokens[i]` is the target of input position i; its output `logprobs[i]` is the
model's log-probability of that token there.

Calls may also share a fused step of aspen's own jobs (`FusedTrainer.run_step`'s `calls`): `with_calls` puts their
datums after the jobs' tokens in the step's stream and `call_losses` gives their losses from the step's hidden
states, added to the jobs' before its one backward; each side ends as apart."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from actors.engine.adapter_surgery import set_adapters_training
from actors.engine.custom_loss import CustomLoss, CustomLossError, combine_metrics, run_loss
from actors.engine.head_logits import log_probs
from actors.engine.head_lora import head_adapter
from actors.engine.layout import StepLayout, step_layout
from actors.engine.loss import target_log_probs
from actors.engine.models import BaseModel
from actors.engine.packing import FusedBatch
from actors.engine.tinker_losses import LOSS_FUNCTIONS, LossInputError, check_inputs, loss_config


@dataclass(frozen=True)
class CallDatum:
    """One datum: its input tokens and its loss_fn_inputs (each one value per input token)."""

    tokens: tuple[int, ...]
    inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelCall:
    """One forward(_backward) call of one model: its adapter, datums, loss function and its config; for
    `loss_fn="custom"` the user's loss (actors/engine/custom_loss.py)."""

    adapter: str
    datums: tuple[CallDatum, ...]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    custom: CustomLoss | None = None


@dataclass
class CallOutput:
    """Per datum, the target tokens' log-probabilities and the elementwise loss (none for a custom loss: its
    datums' losses are scalars), and a custom loss's metrics; the call's summed loss."""

    logprobs: list[torch.Tensor] = field(default_factory=list)
    elementwise_loss: list[torch.Tensor] = field(default_factory=list)
    loss_sum: float = 0.0
    datum_metrics: list[dict[str, float]] = field(default_factory=list)

    @property
    def metrics(self) -> dict[str, float]:
        return {"loss:sum": self.loss_sum, **(combine_metrics(self.datum_metrics) if self.datum_metrics else {})}


def check_call(call: ModelCall, vocab_size: int, max_length: int) -> dict[str, float]:
    """The call's loss config with defaults; a datum that the base cannot take refused, naming it. A custom loss
    runs on each datum here first (on the host), so that one that would fail in the step fails its call alone."""
    custom = call.loss_fn == "custom"
    if custom and call.custom is None:
        raise LossInputError("loss_fn 'custom' runs a loss made by create_custom_loss (its loss_id)")
    config = {} if custom else loss_config(call.loss_fn, call.loss_fn_config)
    if not call.datums:
        raise LossInputError("the call has no datums")
    if custom:
        try:
            call.custom.check_call_size(len(call.datums))
        except CustomLossError as error:
            raise LossInputError(str(error)) from None
    for index, datum in enumerate(call.datums):
        length = len(datum.tokens)
        if length == 0:
            raise LossInputError(f"datum {index}: model_input is empty")
        if length > max_length:
            raise LossInputError(f"datum {index}: model_input has {length} tokens; the base takes at most "
                                 f"{max_length}")
        if custom:
            _check_custom(call.custom, datum, length, index)
        else:
            check_inputs(call.loss_fn, datum.inputs, length, index)
        for name, values in (("model_input", torch.tensor(datum.tokens)),
                             ("target_tokens", datum.inputs["target_tokens"])):
            if int(values.min()) < 0 or int(values.max()) >= vocab_size:
                raise LossInputError(f"datum {index}: {name} holds a token outside the base's vocabulary "
                                     f"(0..{vocab_size - 1})")
    return config


def _check_custom(loss: CustomLoss, datum: CallDatum, length: int, index: int) -> None:
    targets = datum.inputs.get("target_tokens")
    if targets is None or targets.dim() not in (1, 2) or targets.shape[0] != length:
        raise LossInputError(f"datum {index}: loss_fn_inputs 'target_tokens' needs one target (N,) or K targets (N, K) "
                             f"per model_input token ({length})")
    try:
        loss.check_datum(datum.inputs, tuple(targets.shape), index)
    except CustomLossError as error:
        raise LossInputError(str(error)) from None


def run_calls(base: BaseModel, calls: list[ModelCall], *, backward: bool) -> list[CallOutput]:
    """Every call's datums through the base in one packed pass (each call a segment of its adapter), each
    call's loss summed, and with `backward` one backward over the sum: each adapter's `.grad` gains its own
    calls' gradients (an optimizer step applies them). Checks every call first: nothing runs when one fails."""
    vocab_size, max_length = base_limits(base)
    return run_checked(base, calls, [check_call(call, vocab_size, max_length) for call in calls], backward=backward)


def base_limits(base: BaseModel) -> tuple[int, int]:
    """(vocabulary size, longest sequence) a call's datums must fit."""
    return int(base.lm_head.weight.shape[0]), int(getattr(base.model.config, "max_position_embeddings", 1 << 30))


def run_checked(base: BaseModel, calls: list[ModelCall], configs: list[dict[str, float]], *,
                backward: bool) -> list[CallOutput]:
    """`run_calls` over calls already checked (`check_call`), each with its loss config."""
    block = CallBlock.of(calls)
    device = base.device
    layout = StepLayout(block.segments, block.sequences, len(block.ids))
    set_adapters_training(base.model, backward)
    with torch.set_grad_enabled(backward), step_layout(layout):
        hidden = base.decoder(input_ids=torch.tensor(block.ids, device=device)[None],
                              position_ids=torch.tensor(block.positions, device=device)[None],
                              attention_mask=None, use_cache=False).last_hidden_state[0]
        losses = call_losses(base, hidden, calls, configs, block.targets.to(device))
    if backward and losses.total is not None and losses.total.requires_grad:
        losses.total.backward()
    return losses.outputs()


@dataclass(frozen=True)
class FusedCalls:
    """Checked forward_backward calls (`check_call`) and their loss configs, to share a fused step of jobs."""

    calls: list[ModelCall]
    configs: list[dict[str, float]]

    def __bool__(self) -> bool:
        return bool(self.calls)

    @property
    def tokens(self) -> int:
        return sum(len(datum.tokens) for call in self.calls for datum in call.datums)


@dataclass(frozen=True)
class CallBlock:
    """The calls' datums as a block of a packed stream that starts at `offset`: their tokens and positions, each
    call a segment of its model's adapter, each datum a sequence, and every datum's target tokens in order."""

    ids: list[int]
    positions: list[int]
    segments: tuple[tuple[str, int, int], ...]
    sequences: tuple[tuple[int, int], ...]
    targets: torch.Tensor

    @staticmethod
    def of(calls: list[ModelCall], offset: int = 0) -> CallBlock:
        ids: list[int] = []
        segments, sequences = [], []
        for call in calls:
            start = len(ids)
            for datum in call.datums:
                sequences.append((offset + len(ids), offset + len(ids) + len(datum.tokens)))
                ids.extend(datum.tokens)
            segments.append((call.adapter, offset + start, offset + len(ids)))
        positions = [position for start, end in sequences for position in range(end - start)]
        targets = torch.cat([datum.inputs["target_tokens"].long().reshape(-1)   # (N, K) top-k targets row by row
                             for call in calls for datum in call.datums])
        return CallBlock(ids, positions, tuple(segments), tuple(sequences), targets)


@dataclass
class CallLosses:
    """The calls' losses on the device: `total` (differentiable, their sum) and, per call, its datums'
    log-probabilities and elementwise losses and its summed loss, read back by `outputs` (after the step's other
    work is queued, where the calls share a fused step)."""

    total: torch.Tensor | None
    logprobs: list[list[torch.Tensor]]
    elementwise: list[list[torch.Tensor]]
    sums: list[torch.Tensor]
    metrics: list[list[dict[str, torch.Tensor]]] = field(default_factory=list)   # a custom loss's, per datum

    def outputs(self) -> list[CallOutput]:
        return [CallOutput(logprobs=[t.detach().float().cpu() for t in logprobs],
                           elementwise_loss=[t.detach().float().cpu() for t in elementwise],
                           loss_sum=float(total.detach()),
                           datum_metrics=[{key: float(value) for key, value in datum.items()} for datum in metrics])
                for logprobs, elementwise, total, metrics in zip(self.logprobs, self.elementwise, self.sums,
                                                                 self.metrics, strict=True)]


def with_calls(jobs: FusedBatch, calls: list[ModelCall]) -> tuple[FusedBatch, CallBlock]:
    """A packed stream of jobs (host tensors) with the calls' datums after it, each call a segment of its model's
    adapter and each datum a sequence of its own; the jobs' targets are unchanged (the calls' are the block's)."""
    block = CallBlock.of(calls, offset=jobs.num_tokens)
    layout = StepLayout(jobs.layout.segments + block.segments, jobs.layout.sequences + block.sequences,
                        jobs.num_tokens + len(block.ids))
    return replace(jobs, layout=layout,
                   input_ids=torch.cat([jobs.input_ids, torch.tensor(block.ids, dtype=torch.long)]),
                   position_ids=torch.cat([jobs.position_ids, torch.tensor(block.positions, dtype=torch.long)])
                   ), block


def call_losses(base: BaseModel, hidden: torch.Tensor, calls: list[ModelCall], configs: list[dict[str, float]],
                targets: torch.Tensor) -> CallLosses:
    """Each call's loss from the final hidden states of its block's tokens (`hidden`: (block tokens, d), in
    `CallBlock` order; `targets`: the block's target tokens on hidden's device)."""
    device = hidden.device
    head = base.lm_head
    rows = _target_rows(calls)
    at = hidden if rows is None else hidden.index_select(0, rows.to(device))   # a position's row once per target
    if any(head_adapter(base.model, call.adapter) is not None for call in calls):   # a model trains the LM head
        logprobs = _per_call_log_probs(base, at, calls, targets)
    else:
        logprobs = target_log_probs(at, head.weight, head.bias, targets, transform=base.logit_transform)
    losses = CallLosses(None, [], [], [])
    offset = 0
    for call, config in zip(calls, configs, strict=True):
        call_loss = None
        losses.logprobs.append([])
        losses.elementwise.append([])
        losses.metrics.append([])
        for datum in call.datums:
            shape = datum.inputs["target_tokens"].shape   # (N,), or (N, K): K targets a position
            count = shape.numel()
            datum_logprobs = logprobs[offset:offset + count].reshape(shape)
            offset += count
            inputs = {name: value.to(device=device, dtype=torch.float32)   # (a custom loss may read the targets)
                      for name, value in datum.inputs.items() if name != "target_tokens" or call.custom is not None}
            if call.custom is not None:   # a scalar loss a datum, and its metrics (checked by `check_call`)
                datum_loss, metrics = run_loss(call.custom, datum_logprobs, inputs)
                losses.metrics[-1].append(metrics)
            else:
                elementwise = LOSS_FUNCTIONS[call.loss_fn](datum_logprobs, inputs, config)
                datum_loss = elementwise.sum()
                losses.elementwise[-1].append(elementwise)
            call_loss = datum_loss if call_loss is None else call_loss + datum_loss
            losses.logprobs[-1].append(datum_logprobs)
        losses.sums.append(call_loss)
        losses.total = call_loss if losses.total is None else losses.total + call_loss
    return losses


def _per_call_log_probs(base: BaseModel, at: torch.Tensor, calls: list[ModelCall], targets: torch.Tensor
                        ) -> torch.Tensor:
    """The targets' log-probabilities call by call, each through its own model's LM head (`head_lora`: adapted
    with `train_unembed`), so that a head adapter's gradient comes from its own call's rows alone."""
    pieces, offset = [], 0
    for call in calls:
        count = sum(datum.inputs["target_tokens"].numel() for datum in call.datums)
        pieces.append(log_probs(base, at[offset:offset + count], targets[offset:offset + count], call.adapter))
        offset += count
    return torch.cat(pieces)


def _target_rows(calls: list[ModelCall]) -> torch.Tensor | None:
    """The hidden row of each target in `CallBlock` order where a datum has K > 1 targets a position (cross_entropy's
    top-k distillation: its position's row K times, so the head scores each of them); None where every datum has
    one target a position (the hidden states as they are)."""
    shapes = [datum.inputs["target_tokens"].shape for call in calls for datum in call.datums]
    if all(len(shape) == 1 for shape in shapes):
        return None
    rows, start = [], 0
    for shape in shapes:
        positions = torch.arange(start, start + shape[0])
        rows.append(positions if len(shape) == 1 else positions.repeat_interleave(shape[1]))
        start += shape[0]
    return torch.cat(rows)


def split_passes(calls: list[ModelCall], max_tokens: int | None) -> list[list[tuple[int, ModelCall]]]:
    """The calls in passes of at most `max_tokens` tokens (a trainer's step size: the memory a pass may take),
    each a list of (the call's index, its part): calls that fit together share a pass, in order; a call larger
    than the limit goes in parts of whole datums (a datum larger than the limit alone). None: one pass. A call's
    parts' gradients add up to the whole call's (its loss is a sum over its datums), and its outputs are theirs
    joined (`join_outputs`)."""
    if max_tokens is None:
        return [list(enumerate(calls))]
    passes: list[list[tuple[int, ModelCall]]] = [[]]
    room = max_tokens
    for index, call in enumerate(calls):
        part: list[CallDatum] = []
        for datum in call.datums:
            if len(datum.tokens) > room and (part or passes[-1]):
                if part:
                    passes[-1].append((index, replace(call, datums=tuple(part))))
                    part = []
                passes.append([])
                room = max_tokens
            part.append(datum)
            room -= len(datum.tokens)
        if part:
            passes[-1].append((index, replace(call, datums=tuple(part))))
    return [p for p in passes if p]


def join_outputs(parts: list[CallOutput]) -> CallOutput:
    """One call's output from the outputs of its parts, in order."""
    if len(parts) == 1:
        return parts[0]
    return CallOutput(logprobs=[t for part in parts for t in part.logprobs],
                      elementwise_loss=[t for part in parts for t in part.elementwise_loss],
                      loss_sum=sum(part.loss_sum for part in parts),
                      datum_metrics=[m for part in parts for m in part.datum_metrics])
