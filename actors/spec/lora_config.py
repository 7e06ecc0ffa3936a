"""One adapter's shape (`lora:` of a job): LoRA and its variants (rsLoRA, DoRA, PiSSA, OLoRA, LoRA+) or VeRA,
and the initialisations that need a full-precision base."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from actors.spec.field_types import Bounds, StrictModel

PISSA_NITER_PATTERN = r"^pissa_niter_[1-9][0-9]{0,3}$"
INIT_NAMES = ("default", "gaussian", "pissa", "olora")


def _init_lora_weights(value: Any) -> str:
    if value is True:   # PEFT's spelling of the default
        return "default"
    if isinstance(value, str) and (value in INIT_NAMES or re.match(PISSA_NITER_PATTERN, value)):
        return value
    raise PydanticCustomError(
        "init_lora_weights", "must be default, gaussian, pissa, pissa_niter_N (a randomized SVD of N iterations, "
        "e.g. pissa_niter_4) or olora (got {got})", {"got": repr(value)})


InitLoraWeights = Annotated[str, PlainValidator(_init_lora_weights), WithJsonSchema(
    {"anyOf": [{"enum": list(INIT_NAMES)}, {"type": "string", "pattern": PISSA_NITER_PATTERN}]})]
"""How a LoRA adapter starts (PEFT's `init_lora_weights`): one of INIT_NAMES, or `pissa_niter_N`."""

BASE_DEPENDENT_INITS = ("pissa", "olora")


def needs_full_precision_base(lora: LoraConfig) -> str | None:
    """Why `lora` cannot train on a quantized base (int8 / nf4), naming the field and the fix; None if it can.
    PiSSA / OLoRA decompose W and train on W - scaling B0 A0; PEFT re-quantizes that residual, which would
    be another base than the quantized W the other jobs share, and keeping W quantized while subtracting
    B0 A0 is not PEFT's model either: refused. (DoRA is accepted: its row norms read the dequantized W, as
    PEFT's.)"""
    if lora.init_lora_weights.startswith(BASE_DEPENDENT_INITS):
        return (f"lora.init_lora_weights: '{lora.init_lora_weights}' decomposes the base's full-precision "
                "weights and the base is quantized; set quantization: none, or init_lora_weights: default")
    return None


VERA_DEFAULT_RANK = 256   # PEFT's VeraConfig.r


class LoraConfig(StrictModel):
    """One adapter's shape. `target_modules` is a list of module names (matched like PEFT: the full
    dotted name or its last components) or the string `all-linear` (every linear layer but the LM head).
    `kind: vera` trains a VeRA adapter (PEFT's VeraConfig) instead: frozen random projections shared by the
    job's layers and two trainable scaling vectors per layer; `r` then defaults to 256."""

    kind: Literal["lora", "vera"] = Field(
        "lora", description="lora (LoRA and its variants: rsLoRA, DoRA, PiSSA, OLoRA, LoRA+) or vera (VeRA: frozen "
                            "random projections A (r, in) and B (out, r), shared by all adapted layers and sized for "
                            "the largest, and per layer trainable vectors lambda_d (r) and lambda_b (out), as PEFT's "
                            "VeraConfig)")
    r: Annotated[int, Bounds(1, 1024)] = Field(8, description="the adapter's rank (VeRA: its projections' rank, "
                                                              "default 256)")
    alpha: Annotated[float, Bounds(0, 65536, low_open=True)] = Field(
        16.0, description="scaling: the update is multiplied by alpha / r (alpha / sqrt(r) with use_rslora)")
    dropout: Annotated[float, Bounds(0.0, 1.0, high_open=True)] = Field(
        0.0, description="dropout on the adapter's input (each job draws its own masks)")
    use_rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(r)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        ["q_proj", "v_proj"], description="module names to adapt, or `all-linear` ([] with target_parameters: the "
                                          "expert stacks alone)")
    target_parameters: list[str] = Field(
        [], description="an MoE base's expert weight stacks to adapt as well (PEFT's target_parameters), matched like "
                        "PEFT: the full dotted name or its last components, e.g. [experts.gate_up_proj, "
                        "experts.down_proj]; each expert gets its own rank-r A and B (CPU trainers)")
    use_dora: bool = Field(False, description="DoRA (PEFT's use_dora): a trainable magnitude per output row, the "
                                              "weight's direction adapted by LoRA (on a quantized base, the "
                                              "norms of the dequantized weight, as PEFT)")
    init_lora_weights: InitLoraWeights = Field(
        "default", description="default (PEFT's True: A Kaiming-uniform, B zero), gaussian (A normal, std 1/r), "
                               "pissa (A, B from W's top-r singular values and vectors; pissa_niter_N: a "
                               "randomized SVD of N iterations) or olora (A, B from W's QR decomposition); with "
                               "pissa and olora the adapter starts at W's principal part and subtracts its "
                               "frozen initial product, so the shared base stays untouched (full-precision "
                               "bases only)")
    loraplus_lr_ratio: Annotated[float, Bounds(0, 1e6, low_open=True)] | None = Field(
        None, description="LoRA+: B (and DoRA's magnitude) learns at lr * this ratio, A at lr (PEFT's "
                          "create_loraplus_optimizer; the paper suggests 2 to 16; null: one lr)")
    projection_prng_key: Annotated[int, Bounds(0, 2**63 - 1)] = Field(
        0, description="VeRA: the seed of its random projections (PEFT's projection_prng_key)")
    d_initial: Annotated[float, Bounds(-1e6, 1e6)] = Field(
        0.1, description="VeRA: the initial value of every lambda_d (PEFT's d_initial; the paper suggests <= 0.1)")
    save_projection: bool = Field(
        True, description="VeRA: save the projections with the adapter (PEFT's save_projection); false: PEFT "
                          "draws them again from projection_prng_key when it loads the adapter")

    @model_validator(mode="before")
    @classmethod
    def _vera_rank(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kind") == "vera" and "r" not in data:
            return {**data, "r": VERA_DEFAULT_RANK}
        return data

    @model_validator(mode="after")
    def _kind_fields(self) -> LoraConfig:
        """VeRA has no alpha, no LoRA initialisation and no LoRA variant; VeRA's fields need kind: vera. A field
        at its default is accepted either way (a dumped spec carries every field)."""
        def changed(name: str) -> bool:
            return getattr(self, name) != type(self).model_fields[name].default

        if self.kind == "vera":
            for name, why in (("alpha", "VeRA has no alpha: its scaling vectors learn the scale"),
                              ("use_rslora", "rsLoRA scales LoRA's update by alpha / sqrt(r); VeRA has no such "
                                             "scaling"),
                              ("use_dora", "DoRA is a LoRA variant; PEFT's VeRA has no magnitude vector"),
                              ("init_lora_weights", "VeRA starts from lambda_b = 0 and lambda_d = d_initial"),
                              ("loraplus_lr_ratio", "LoRA+ sets B's learning rate; VeRA trains two vectors at one lr")):
                if changed(name):
                    raise ValueError(f"lora.{name} does not apply to lora.kind: vera ({why}); remove lora.{name} "
                                     "or use kind: lora")
        else:
            for name in ("projection_prng_key", "d_initial", "save_projection"):
                if changed(name):
                    raise ValueError(f"lora.{name} is a VeRA setting; set lora.kind: vera, or remove lora.{name}")
        return self

    @model_validator(mode="after")
    def _parameter_targets(self) -> LoraConfig:
        """PEFT's `ParamWrapper` (an expert stack's LoRA) takes plain LoRA only: no dropout (it cannot be factored
        out of a weight's update), no DoRA, no initialisation from the weights, no VeRA."""
        if not self.target_parameters:
            return self
        for refused, why in ((self.kind == "vera", "lora.kind: vera"), (self.dropout > 0, "lora.dropout > 0"),
                             (self.use_dora, "lora.use_dora"),
                             (self.init_lora_weights.startswith(BASE_DEPENDENT_INITS),
                              f"lora.init_lora_weights: {self.init_lora_weights}")):
            if refused:
                raise ValueError(f"lora.target_parameters adapts expert weight stacks with plain LoRA, as PEFT's "
                                 f"ParamWrapper, which does not take {why}; remove one of the two")
        return self

    @field_validator("target_parameters")
    @classmethod
    def _parameter_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", name):
                raise ValueError(f"{name!r} is not a parameter's dotted name; give e.g. experts.gate_up_proj")
        return value

    @model_validator(mode="after")
    def _non_empty(self) -> LoraConfig:
        """Something to adapt: a linear layer, or (PEFT's `target_modules: []` beside `target_parameters`) only
        expert stacks."""
        if isinstance(self.target_modules, list) and not self.target_modules and not self.target_parameters:
            raise ValueError("lora.target_modules: give at least one module name, e.g. [q_proj, v_proj], or "
                             "'all-linear'")
        return self

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r**0.5) if self.use_rslora else self.alpha / self.r
