"""A GGUF file's linear layers named as transformers names them once it has converted the file, read from the file's
header alone (no torch, no conversion: some 0.1 s for smollm2-135m's, where converting takes 10-30 s), so that
`lora.target_modules` is checked before a GGUF base's first run starts (orchestrator/target_layers.py).

The header (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): `GGUF`, a version, the tensor and key-value
counts, the key-values (the architecture, its block count, the tokenizer's vocabulary...), then each tensor's name,
dimensions, type and offset. transformers' converter (`get_gguf_hf_weights_map`) names each tensor through gguf-py's
table of names (`get_tensor_name_map`), from the Hugging Face name to the GGUF one; read backwards, a GGUF name has
many Hugging Face names (one per family that ever used it): the one transformers' model classes of
`MAPPED_ARCHITECTURES` use is `model.layers.N.<...>`, checked against the converter's own table for each of them
(tests/unit/storage/test_gguf_header.py). Another architecture answers None: its layers are checked by its trainer."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
# value types: their sizes (8: a string, 9: an array)
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
# architectures whose 2-D tensors transformers names `model.layers.N.*` as gguf-py's table lists them first (checked
# against transformers' converter); their converted models leave no layer alone (actors/engine/model_support.py). A
# Mistral GGUF file says `llama`; phi3, starcoder2, gemma2/3, falcon, bloom name some layers otherwise
MAPPED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "stablelm", "nemotron")
EMBEDDINGS = ("token_embd", "output")   # the input and output embeddings: no linear layer LoRA adapts


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
    but the embeddings), or None where its architecture is not one of `MAPPED_ARCHITECTURES` or a tensor has no
    name there. ValueError where the header cannot be read."""
    header = read_header(path)
    if header.architecture not in MAPPED_ARCHITECTURES or header.block_count is None:
        return None
    by_gguf = _hf_names(header.architecture, header.block_count)
    names = []
    for name, dims in header.tensors.items():
        if dims != 2 or name in EMBEDDINGS:
            continue
        if name not in by_gguf:
            return None
        names.append(by_gguf[name])
    return header.architecture, names


def _hf_names(architecture: str, block_count: int) -> dict[str, str]:
    """gguf-py's table read backwards: each block tensor's GGUF name -> the first Hugging Face name it lists as
    `model.layers.N.<...>` (the name transformers' model classes of these architectures give it)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    found: dict[str, str] = {}
    for hf_name, (_, gguf_name) in get_tensor_name_map(arch, block_count).mapping.items():
        block = gguf_name.split(".")[1] if gguf_name.startswith("blk.") else None
        if block is not None and hf_name.startswith(f"model.layers.{block}.") and gguf_name not in found:
            found[gguf_name] = hf_name
    return found
