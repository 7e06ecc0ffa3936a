"""A GGUF file's linear layers named as transformers names them once it has converted the file, read from the file's
header alone (no torch, no conversion: some 0.1 s for smollm2-135m's, where converting takes 10-30 s), so that
`lora.target_modules` is checked before a GGUF base's first run starts (orchestrator/target_layers.py).

The header (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): `GGUF`, a version, the tensor and key-value
counts, the key-values (the architecture, its block count, the tokenizer's vocabulary...), then each tensor's name,
dimensions, type and offset. transformers' converter (`get_gguf_hf_weights_map`) names each tensor through gguf-py's
table of names (`get_tensor_name_map`), from the Hugging Face name to the GGUF one; read backwards, a GGUF name has
many Hugging Face names (one per family that ever used it), so `ARCHITECTURES` says, for each GGUF architecture aspen
trains, the one its transformers model class uses, checked against the converter on that class for each of them
(tests/unit/engine/test_gguf_header.py). Another architecture is refused (`UnsupportedArchitecture`: its trainer
could not train it); a tensor the table does not know answers None: its layers are checked by its trainer."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GGUF"
# value types: their sizes (8: a string, 9: an array)
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj"}
_LLAMA = {**_ATTENTION, "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GPT2 = {"attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


@dataclass(frozen=True)
class Architecture:
    """How transformers' converter names a GGUF architecture's linear layers: its model type, the blocks' prefix, each
    block tensor's name there (`blk.N.<gguf>` -> `<blocks>.N.<hf>`), and the tensors outside the blocks."""

    model_type: str
    blocks: str
    names: dict[str, str]
    outside: dict[str, str] = field(default_factory=dict)


# The GGUF architectures transformers converts (GGUF_SUPPORTED_ARCHITECTURES) whose model types aspen trains
# (actors/engine/model_support.py), each named as transformers' converter names it (`get_gguf_hf_weights_map`:
# tests/unit/engine/test_gguf_header.py checks each against it). A Mistral GGUF file says `llama`. Other
# architectures (bloom, t5, mamba, deci...; those transformers does not convert) are refused: UnsupportedArchitecture
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "model.layers", _LLAMA),
    "qwen2": Architecture("qwen2", "model.layers", _LLAMA),
    "qwen3": Architecture("qwen3", "model.layers", _LLAMA),
    "stablelm": Architecture("stablelm", "model.layers", _LLAMA),
    "nemotron": Architecture("nemotron", "model.layers", _LLAMA),
    "gemma2": Architecture("gemma2", "model.layers", _LLAMA),
    "gemma3": Architecture("gemma3_text", "model.layers", _LLAMA),
    "gemma4": Architecture("gemma4_text", "model.layers", {
        **_LLAMA, "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection"},
        {"per_layer_model_proj": "model.per_layer_model_projection"}),
    "phi3": Architecture("phi3", "model.layers", {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                                                  "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}),
    "starcoder2": Architecture("starcoder2", "model.layers", {**_ATTENTION, "ffn_up": "mlp.c_fc",
                                                              "ffn_down": "mlp.c_proj"}),
    "falcon": Architecture("falcon", "transformer.h", {
        "attn_qkv": "self_attention.query_key_value", "attn_output": "self_attention.dense",
        "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}),
    "gpt2": Architecture("gpt2", "transformer.h", _GPT2),
    "qwen2moe": Architecture("qwen2_moe", "model.layers", {
        **_ATTENTION, "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}),
    "qwen3moe": Architecture("qwen3_moe", "model.layers", _ATTENTION),
    "gpt-oss": Architecture("gpt_oss", "model.layers", _ATTENTION),
    "minimax-m2": Architecture("minimax_m2", "model.layers", _ATTENTION),
    "lfm2": Architecture("lfm2", "model.layers", {
        **_ATTENTION, "attn_output": "self_attn.out_proj", "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
        "ffn_down": "feed_forward.w2", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj"}),
}
MAPPED_ARCHITECTURES = tuple(ARCHITECTURES)
# 2-D weights that are no linear layer LoRA adapts: embeddings, the output head, MoE routers, a short convolution
NOT_LINEAR = ("token_embd", "output", "position_embd", "per_layer_token_embd", "ffn_gate_inp", "shortconv.conv")


class UnsupportedArchitecture(ValueError):
    """A GGUF file of an architecture aspen cannot train from GGUF: what it is, what to do."""

    def __init__(self, path: str | Path, architecture: str | None):
        self.architecture = architecture
        super().__init__(
            f"base_model {path} is a GGUF file of architecture '{architecture}', which aspen does not train from a "
            f"GGUF file (transformers does not convert it, or aspen does not train its model type); GGUF "
            f"architectures it trains: {', '.join(MAPPED_ARCHITECTURES)}. Give a GGUF file of one of those, or the "
            "base's Hugging Face folder where its model type is one docs/models.md lists")


@dataclass(frozen=True)
class GgufHeader:
    architecture: str | None
    block_count: int | None
    tensors: dict[str, int]   # name (without .weight / .bias) -> its number of dimensions, of the .weight tensors


def read_header(path: str | Path) -> GgufHeader:
    """The architecture, block count and weight tensors' names of a GGUF file (ValueError where it is not one this
    reader knows: not GGUF, version 1, big-endian, cut short)."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _parse(data, Path(path))
        except (struct.error, IndexError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: its GGUF header is cut short or malformed ({error})") from None


def _parse(data: mmap.mmap, path: Path) -> GgufHeader:
    if data[:4] != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it starts {data[:4]!r}, not {MAGIC!r})")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (this reader knows versions 2 and 3, little-endian)")
    at = 24
    values: dict[str, object] = {}
    for _ in range(kv_count):
        key, at = _string(data, at)
        (kind,), at = struct.unpack_from("<I", data, at), at + 4
        if kind in (STRING,) or kind in SIZES:
            value, at = _scalar(data, at, kind)
            values[key] = value
        elif kind == ARRAY:
            at = _skip_array(data, at)
        else:
            raise ValueError(f"{path}: key {key} has value type {kind}, which GGUF does not define")
    tensors: dict[str, int] = {}
    for _ in range(tensor_count):
        name, at = _string(data, at)
        (dims,), at = struct.unpack_from("<I", data, at), at + 4
        at += 8 * dims + 4 + 8   # the dimensions, the type, the offset
        if name.endswith(".weight"):
            tensors[name.removesuffix(".weight")] = dims
    arch = values.get("general.architecture")
    blocks = values.get(f"{arch}.block_count")
    return GgufHeader(arch if isinstance(arch, str) else None, blocks if isinstance(blocks, int) else None, tensors)


def _string(data: mmap.mmap, at: int) -> tuple[str, int]:
    (size,) = struct.unpack_from("<Q", data, at)
    return bytes(data[at + 8:at + 8 + size]).decode("utf-8"), at + 8 + size


def _scalar(data: mmap.mmap, at: int, kind: int) -> tuple[object, int]:
    if kind == STRING:
        return _string(data, at)
    form = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}[kind]
    return struct.unpack_from(form, data, at)[0], at + SIZES[kind]


def _skip_array(data: mmap.mmap, at: int) -> int:
    kind, count = struct.unpack_from("<IQ", data, at)
    at += 12
    if kind in SIZES:
        return at + count * SIZES[kind]
    if kind == STRING:   # each its length, then its bytes (a vocabulary: some 50 000 of them)
        for _ in range(count):
            at += 8 + struct.unpack_from("<Q", data, at)[0]
        return at
    if kind == ARRAY:
        for _ in range(count):
            at = _skip_array(data, at)
        return at
    raise ValueError(f"an array of value type {kind}, which GGUF does not define")


def hf_linear_names(path: str | Path) -> tuple[str, list[str]] | None:
    """The GGUF file's model type and the names transformers gives its linear layers once converted (the 2-D weights
    but embeddings, the output head and routers), or None where a 2-D weight has no name in `ARCHITECTURES` (a
    variant this table does not know: its trainer checks the names). UnsupportedArchitecture where aspen does not
    train its architecture; ValueError where the header cannot be read."""
    header = read_header(path)
    arch = ARCHITECTURES.get(str(header.architecture))
    if arch is None:
        raise UnsupportedArchitecture(path, header.architecture)
    names = []
    for name, dims in header.tensors.items():
        parts = name.split(".", 2)
        block = parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit()
        hf = (f"{arch.blocks}.{parts[1]}.{arch.names[parts[2]]}" if block and parts[2] in arch.names
              else None if block else arch.outside.get(name))
        if hf is not None and dims <= 2:   # (a shared expert's gate may be written 1-D)
            names.append(hf)
        elif dims == 2 and (parts[2] if block else name) not in NOT_LINEAR:
            return None
    return arch.model_type, names
