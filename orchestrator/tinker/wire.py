"""The Tinker API's protobuf bodies, read and written with the SDK's own schema (`tinker.proto`): a
`forward_backward` request (optionally zstd-compressed) into aspen's `ModelCall` of `CallDatum`s, and a call's
outputs into the `ForwardBackwardOutput` message its SDK decodes (per datum `logprobs` and `elementwise_loss`,
each of its targets' shape: (N,), or (N, K) for cross_entropy's top-k targets, a custom loss's `logprobs` alone;
the metric `loss:sum`, and a custom loss's own). Only text
model inputs are taken: an image or dmel chunk is refused, naming the datum."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import _tensor_data_from_proto

from actors.engine.interactive_step import CallDatum, CallOutput, ModelCall
from actors.engine.prompt_scores import TargetCells
from actors.engine.tinker_sampling import SampleResult

PROTO_TYPE = "application/x-protobuf"
MAX_BODY_BYTES = 64 * 1024 * 1024   # a forward_backward body (after decompression)


class WireError(ValueError):
    """A body that cannot be read as the SDK writes it; the message says what is wrong."""


@dataclass(frozen=True)
class ForwardBackwardBody:
    model_id: str
    seq_id: int
    forward_only: bool
    call: ModelCall
    loss_id: str | None = None   # loss_fn "custom": its loss_fn_config's loss_id (create_custom_loss's answer)


def decompress(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise WireError(f"Content-Encoding '{encoding}' is not one aspen reads (zstd or none)")
    import zstandard

    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY_BYTES)
    except zstandard.ZstdError as error:
        raise WireError(f"the zstd body could not be decompressed: {error}") from None


def read_forward_backward(body: bytes, adapter_of: Callable[[str], str]) -> ForwardBackwardBody:
    """The request's model, sequence number and call (`adapter_of(model_id)`: the adapter's name on the
    base). Raises WireError for a body that is not the SDK's message or holds a non-text input."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as error:
        raise WireError(f"the body is not a tinker ForwardBackwardRequest ({type(error).__name__})") from None
    datums = []
    for index, datum in enumerate(message.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"datum {index}: a {chunk.WhichOneof('chunk')} chunk; aspen trains on text only")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
        inputs = {}
        for name, tensor in datum.loss_fn_inputs.items():
            try:
                values = _tensor_data_from_proto(tensor).to_torch()
            except (ValueError, RuntimeError) as error:
                raise WireError(f"datum {index}: loss_fn_inputs '{name}': {error}") from None
            if values.dim() > 2:
                raise WireError(f"datum {index}: loss_fn_inputs '{name}' has shape {tuple(values.shape)}; aspen takes "
                                "(N,) or, for cross_entropy's top-k targets, (N, K)")
            inputs[name] = values   # (N,), or (N, K): cross_entropy's top-k targets and their weights
        datums.append(CallDatum(tuple(tokens), inputs))
    loss_fn = message.loss_fn or "cross_entropy"
    loss_id = None
    if message.loss_fn_config_v2:
        config = {}
        for key, value in message.loss_fn_config_v2.items():
            if loss_fn == "custom" and key == "loss_id" and value.WhichOneof("value") == "text":
                loss_id = value.text
            elif value.WhichOneof("value") != "number":
                raise WireError(f"loss_fn_config '{key}' is text; aspen's losses take numbers (and loss_fn "
                                "'custom' its loss_id)")
            else:
                config[key] = value.number
    else:
        config = dict(message.loss_fn_config)
    if loss_fn == "custom" and (loss_id is None or config):
        raise WireError("loss_fn 'custom' takes loss_fn_config {'loss_id': <create_custom_loss's loss_id>} alone")
    call = ModelCall(adapter_of(message.model_id), tuple(datums), loss_fn, config or None)
    return ForwardBackwardBody(message.model_id, int(message.seq_id), bool(message.forward_only), call, loss_id)


def _batched(arrays: list[torch.Tensor]) -> pb.BatchedTensor:
    """Datums' arrays of one trailing shape ((N,) each, or (N, K) with the same K) as one BatchedTensor."""
    values = [array.detach().float().contiguous().numpy() for array in arrays]
    offsets = np.cumsum([0] + [value.nbytes for value in values]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(value.tobytes() for value in values), offsets=offsets.tobytes(),
                            dtype=pb.DTYPE_FLOAT32, trailing_shape=list(arrays[0].shape[1:]) if arrays else [])


def write_output(output: CallOutput) -> bytes:
    """The call's outputs as the SDK's ForwardBackwardOutput message: one ArrayRecord per run of datums whose
    outputs share a trailing shape (top-k targets of another K start a new one, as the SDK reads ragged outputs)."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    start = 0
    while start < len(output.logprobs):
        end = start + 1
        shape = output.logprobs[start].shape[1:]
        while end < len(output.logprobs) and output.logprobs[end].shape[1:] == shape:
            end += 1
        record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=end - start)
        record.fields["logprobs"].CopyFrom(_batched(output.logprobs[start:end]))
        if output.elementwise_loss:   # (a custom loss has none: a scalar a datum)
            record.fields["elementwise_loss"].CopyFrom(_batched(output.elementwise_loss[start:end]))
        message.loss_fn_outputs.append(record)
        start = end
    for key, value in output.metrics.items():
        message.metrics[key] = value
    return message.SerializeToString()


TOPK_EMPTY = (0, -99999.0)   # the SDK's sentinel for a cell without a token (tinker.types.topk_logprobs)


def _topk(rows: list[tuple[list[int], list[float]] | None]) -> pb.TopkLogprobs:
    """Positions' top-k as the SDK's dense (length, k) matrices; an unscored position (None) all sentinels."""
    k = max((len(row[0]) for row in rows if row is not None), default=0)
    ids = np.full((len(rows), k), TOPK_EMPTY[0], dtype="<i4")
    logprobs = np.full((len(rows), k), TOPK_EMPTY[1], dtype="<f4")
    for index, row in enumerate(rows):
        if row is not None:
            ids[index, :len(row[0])], logprobs[index, :len(row[1])] = row[0], row[1]
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))


def write_samples(result: SampleResult) -> bytes:
    """A sampling call's result as the SDK's SampleResponse message: each sequence's tokens (int32), their
    log-probabilities (float32), why it ended and with topk_sample_logprobs each token's top-k; the prompt's
    log-probabilities (NaN where unscored: position 0, and before its last n with prompt_logprobs_last_n), its
    top-k, the asked tokens' log-probabilities (target_prompt_logprobs) and the alternative draws."""
    message = pb.SampleResponse()
    for sequence in result.sequences:
        sampled = pb.SampledSequence(
            stop_reason=pb.STOP_REASON_STOP if sequence.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype="<f4").tobytes())
        if sequence.topk:
            sampled.topk_sampled_logprobs.CopyFrom(_topk(list(sequence.topk)))
        message.sequences.append(sampled)
    if result.prompt_logprobs is not None:
        values = [np.nan if value is None else value for value in result.prompt_logprobs]
        message.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if result.topk_prompt is not None:
        message.topk_prompt_logprobs.CopyFrom(_topk(result.topk_prompt))
    prompt = result.prompt
    if prompt is not None and prompt.target is not None:
        message.target_prompt_logprobs.CopyFrom(_target_tensor(*prompt.target))
    if prompt is not None and prompt.alt is not None:
        tokens, logprobs = prompt.alt
        rows, k = len(tokens), len(tokens[0]) if tokens else 0
        message.prompt_alt_tokens.tokens.CopyFrom(pb.Tensor(
            dense=np.asarray(tokens, dtype="<i8").reshape(rows, k).tobytes(), dtype=pb.DTYPE_INT64, shape=[rows, k]))
        message.prompt_alt_tokens.logprobs.CopyFrom(pb.Tensor(
            dense=np.asarray(logprobs, dtype="<f4").reshape(rows, k).tobytes(), dtype=pb.DTYPE_FLOAT32,
            shape=[rows, k]))
    return message.SerializeToString()


def _target_tensor(target: TargetCells, values: list[float]) -> pb.Tensor:
    """The asked cells' log-probabilities in the layout they were asked in: sparse CSR with the same indices, or
    dense with NaN where no token was asked (-1)."""
    rows, columns = target.shape
    if target.sparse is not None:   # a cell asked as -1 inside the CSR keeps its place, NaN
        crow, indices = target.sparse
        asked = {(row, column): value for (row, column, _), value in zip(target.cells, values, strict=True)}
        listed = [asked.get((row, indices[index]), np.nan) for row in range(rows)
                  for index in range(crow[row], crow[row + 1])]
        return pb.Tensor(sparse_csr=pb.SparseCsr(values=np.asarray(listed, dtype="<f4").tobytes(),
                                                 crow_indices=np.asarray(crow, dtype="<i8").tobytes(),
                                                 col_indices=np.asarray(indices, dtype="<i8").tobytes()),
                         dtype=pb.DTYPE_FLOAT32, shape=[rows, columns])
    dense = np.full((rows, columns), np.nan, dtype="<f4")
    for (row, column, _), value in zip(target.cells, values, strict=True):
        dense[row, column] = value
    return pb.Tensor(dense=dense.tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[rows, columns])
