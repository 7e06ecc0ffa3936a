"""Decoding over a pipeline's stages (eval_generate and "try it" on a pipeline trainer), as `generate.decode` does
on one device: the same left-padded batch (`generate.decode_batch`, built by every stage from the request), each
stage's layers with a KV cache of their own, each row through its adapter.

Stage 0 leads (`lead`): it runs its layers over the step's tokens and sends their hidden states on; the last
stage turns its output into the rows' last-position logits and sends them back to stage 0 (control channel,
host memory), which picks the next tokens (greedy or sampled: the caller's `choose`) and tells every stage whether
there is a next step (the rows still decoding: a row that ended keeps its last position on every stage, as on
one device, never fed past what its request was checked for). The others serve (`serve`) until told there is
none. The pipeline is drained first (the head's `generate`), so no training operation interleaves.

Each stage's cache holds its own layers only: their attention modules are numbered from 0 for the call (their
index in the whole model is put back after), and the stage's decoder view takes the masked attention the model
takes for the call, so that its masks are built as on one device.

A row may go through an adapter no job trains ("try it" on a finished job): each stage holds its share of it,
frozen, between the head's `HeldAdapter` messages (`StageDecoder.hold`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from actors.engine.adapter_surgery import AdapterHandle, add_adapter, remove_adapter
from actors.engine.generate import DecodeLoop, cache_keyword, decode_batch, decoding
from actors.engine.layout import step_layout
from actors.engine.pipeline.stage_jobs import load_share_tensors, share_tensors
from actors.engine.pipeline.stage_model import StageModel
from actors.engine.pipeline.transport import TAG_ACTIVATION, TAG_COMMAND, TAG_REPLY, StageLinks
from actors.spec.lora_config import LoraConfig


@dataclass(frozen=True)
class GenerateRequest:
    """The rows to decode: (adapter name or None for the base alone, prompt ids), in request order."""

    requests: tuple[tuple[str | None, tuple[int, ...]], ...]


@dataclass(frozen=True)
class HeldAdapter:
    """An adapter held frozen for decoding calls only: with `lora`, added on the stage's layers (answered: its
    share's tensors, `stage_jobs.share_tensors`); with `tensors` (the whole adapter's, by name), copied into it;
    with neither, dropped."""

    name: str
    lora: LoraConfig | None = None
    tensors: dict[str, torch.Tensor] | None = None


class StageDecoder:
    """One stage's part of a decoding call over the pipeline; `held`: the adapters it holds for such calls only."""

    def __init__(self, model: StageModel, links: StageLinks):
        self.model = model
        self.links = links
        self.held: dict[str, AdapterHandle] = {}

    def hold(self, request: HeldAdapter) -> dict[str, torch.Tensor] | None:
        """Add, fill or drop a held adapter (`HeldAdapter`); adding answers this stage's share of its tensors."""
        model = self.model.base.model
        if request.lora is not None:
            handle = add_adapter(model, request.name, request.lora, seed=0)
            for parameter in handle.parameters():
                parameter.requires_grad_(False)
            self.held[request.name] = handle
            return share_tensors(handle)
        if request.tensors is not None:
            load_share_tensors(self.held[request.name], request.tensors)
            return None
        if self.held.pop(request.name, None) is not None:
            remove_adapter(model, request.name)
        return None

    def lead(self, request: GenerateRequest, choose: Callable[[torch.Tensor], list[int]],
             finished: Callable[[int, int], bool]) -> None:
        """Stage 0: the decoding loop (`generate.run_decoding`), every stage taking part in each step."""
        model, links = self.model, self.links
        batch = decode_batch(request.requests, model.base.pad_token_id, model.base.device)
        vocab = int(model.base.lm_head.weight.shape[0])

        def go_on(more: bool) -> None:   # the rows still decoding (an ended one keeps its position), or False
            for stage in range(1, model.stages):
                links.send_object(list(loop.active) if more else False, stage, TAG_COMMAND)

        with self._decoding() as forward:
            def logits(feed: torch.Tensor) -> torch.Tensor:
                output = forward(batch, feed, None)
                if model.last:
                    return model.base.output_logits(output[:, -1])
                links.send(output, model.stage + 1, TAG_ACTIVATION)
                return links.recv_host((batch.rows, vocab), torch.float32, model.stages - 1, TAG_REPLY).to(
                    model.base.device)

            loop = DecodeLoop(batch, logits, choose, finished, model.base.device, go_on)
            while loop.step():
                pass

    def serve(self, request: GenerateRequest) -> None:
        """Every stage but 0: each step's hidden states from the stage before, through this stage's layers, on to
        the next (the last: the rows' logits to stage 0), until stage 0 says there is no next step."""
        model, links = self.model, self.links
        base = model.base
        batch = decode_batch(request.requests, base.pad_token_id, base.device)
        width = batch.input_ids.shape[1]
        with self._decoding() as forward:
            while True:
                hidden = links.recv((batch.rows, width, model.hidden_size), base.dtype, model.stage - 1,
                                    TAG_ACTIVATION)
                output = forward(batch, None, hidden)
                if model.last:
                    links.send_host(base.output_logits(output[:, -1]), 0, TAG_REPLY)
                else:
                    links.send(output, model.stage + 1, TAG_ACTIVATION)
                active = links.recv_object(0, TAG_COMMAND)
                if not active:
                    break
                batch.step(base.device, active)   # as stage 0's: an ended row keeps its last position
                width = 1

    @contextlib.contextmanager
    def _decoding(self) -> Iterator[Callable]:
        """The stage's forward with a KV cache for one decoding call: (batch, token feed or None, hidden states or
        None) -> this stage's output; its layers numbered from 0 and its view's attention the model's meanwhile."""
        from transformers import DynamicCache  # transformers is imported by the model already

        model = self.model
        view = model.view
        layers = list(view.layers)
        numbers = [layer.self_attn.layer_idx for layer in layers]
        cache = DynamicCache(config=view.config)
        keyword = cache_keyword(view)
        before = getattr(view.config, "_attn_implementation", None)

        def forward(batch, feed: torch.Tensor | None, hidden: torch.Tensor | None) -> torch.Tensor:
            width = feed.shape[1] if feed is not None else hidden.shape[1]
            inputs = {"input_ids": feed} if feed is not None else {"inputs_embeds": hidden}
            with step_layout(batch.layout(width)):
                return view(**inputs, attention_mask=batch.mask, position_ids=batch.positions, use_cache=True,
                            **{keyword: cache}).last_hidden_state

        try:
            for local, layer in enumerate(layers):
                layer.self_attn.layer_idx = local
            with torch.no_grad(), decoding(model.base.model):
                view.config._attn_implementation = model.base.model.config._attn_implementation
                yield forward
        finally:
            view.config._attn_implementation = before
            for layer, number in zip(layers, numbers, strict=True):
                layer.self_attn.layer_idx = number


def stage_requests(requests: Sequence[tuple[str | None, Sequence[int]]]) -> GenerateRequest:
    return GenerateRequest(tuple((adapter, tuple(int(token) for token in prompt)) for adapter, prompt in requests))
