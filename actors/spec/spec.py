"""Job and run specifications (pydantic): what a user writes in `jobs.yaml`, validated field by field.

Every number has a finite, sane range (no inf or nan anywhere), and a value outside it is refused with a
message that names the range, e.g. `must be between -100 and 100 (got 600)`: one bad job must be refused
when it is submitted, never overflow or crash the service later (a policy's `4.0 ** priority`, SQLite's
64-bit INTEGER columns, a micro-batch no step can hold)."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    PlainSerializer,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, InitErrorDetails, PydanticCustomError, core_schema

from actors.data import DataFormat
from actors.data.tables import hub_id_problem
from actors.spec.base_settings import Compile, Dtype, Kernels, Layout, Quantization, Recompute
from actors.storage.storage_uri import StorageURI, as_location

# Safe as a folder name, an MQTT topic level and a module-dict key: no '/', '+', '#', '.', spaces.
JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
USER_NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
"""A user of a shared service (actors/service/accounts/users.py): also a folder name and an MQTT topic level."""

INT64_MAX = 2**63 - 1
"""The largest integer SQLite's INTEGER column (a signed 64-bit integer) holds."""


def _location(value: Any) -> Path | StorageURI:
    if not isinstance(value, (str, Path)):
        raise ValueError(f"expected a path or a storage URI (s3://bucket/prefix), not {type(value).__name__}")
    if isinstance(value, str) and not value.strip():
        raise ValueError("expected a path or a storage URI (s3://bucket/prefix), not an empty string")
    return as_location(value)


Location = Annotated[Path | StorageURI, PlainValidator(_location), PlainSerializer(str, return_type=str),
                     WithJsonSchema({"type": "string", "description": "a path or a storage URI"})]
"""A folder or file: a path, or a storage URI (`s3://bucket/prefix`, `gs://...`, `file:///...`) kept intact
as a `StorageURI` (actors/storage/storage_uri.py)."""


def canonical_base_model(value: str) -> str:
    """A base model as trainers and jobs compare it: an existing local path becomes absolute."""
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def _show(number: float) -> str:
    """A bound as a user would write it: whole floats without '.0', long integers with '_' separators."""
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    return f"{number:_}" if isinstance(number, int) and abs(number) >= 1_000_000 else str(number)


@dataclass(frozen=True)
class Bounds:
    """The allowed range of a numeric field, as `Annotated[int, Bounds(1, 65536)]`: checked after the type
    (and, for floats, finiteness: the models refuse inf and nan), with one message that names both ends
    and the value given. `low_open` / `high_open` exclude that end; `high_label` shows the upper end
    differently (e.g. '2**63')."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    high_label: str | None = None

    def describe(self) -> str:
        high = self.high_label or _show(self.high)
        if not self.low_open and not self.high_open:
            return f"between {_show(self.low)} and {high}"
        lower = f"greater than {_show(self.low)}" if self.low_open else f"at least {_show(self.low)}"
        upper = f"less than {high}" if self.high_open else f"at most {high}"
        return f"{lower} and {upper}"

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def _check(self, value: Any, handler: core_schema.ValidatorFunctionWrapHandler) -> Any:
        try:
            checked = handler(value)
        except ValidationError as error:
            if any(item["type"] == "finite_number" for item in error.errors()):
                raise PydanticCustomError("finite_number", "must be a finite number {range} (got {got})",
                                          {"range": self.describe(), "got": str(value)}) from error
            raise
        if not self.contains(checked):
            raise PydanticCustomError("out_of_range", "must be {range} (got {got})",
                                      {"range": self.describe(), "got": str(checked)})
        return checked

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_wrap_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        json_schema = handler(schema)
        json_schema["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        json_schema["exclusiveMaximum" if self.high_open else "maximum"] = self.high
        return json_schema


# Shared ranges. Integers that reach SQLite (priority, seed, steps) stay inside a signed 64-bit integer.
Priority = Annotated[int, Bounds(-100, 100)]
Seed = Annotated[int, Bounds(0, 2**63, high_open=True, high_label="2**63")]
StepCount = Annotated[int, Bounds(1, 10**9)]
MAX_STEP_TOKENS = 16_777_216
"""The largest `step_tokens` a run or trainer may have (16 Mi tokens in one fused step)."""
StepTokens = Annotated[int, Bounds(16, MAX_STEP_TOKENS)]
AUTO_STEP_TOKENS_FLOOR = 4096
"""`step_tokens: auto` is at least this where memory allows (a CPU composes smaller steps, a micro-batch up to this
running alone); a jobs file is checked against it."""


@dataclass(frozen=True)
class AutoOr:
    """A numeric setting that may also be "auto", as `Annotated[int | Literal["auto"], AutoOr(Bounds(...))]`: "auto",
    anything else checked as a whole number within the bounds, with the bounds' one message (not pydantic's two
    errors of a union)."""

    bounds: Bounds

    def _check(self, value: Any) -> Any:
        if value == "auto":
            return value
        try:
            return _whole_number(self.bounds).validate_python(value)
        except ValidationError as error:
            first = error.errors()[0]
            raise PydanticCustomError(first["type"], "must be auto or a whole number " + self.bounds.describe()
                                      + " (got {got})", {"got": str(value)}) from None

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self._check)

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"anyOf": [{"const": "auto"}, {"type": "integer", "minimum": self.bounds.low,
                                              "maximum": self.bounds.high}]}


@functools.cache
def _whole_number(bounds: Bounds) -> TypeAdapter:
    return TypeAdapter(Annotated[int, bounds])


StepTokensSetting = Annotated[int | Literal["auto"], AutoOr(Bounds(16, MAX_STEP_TOKENS))]
STEP_TOKENS_DESCRIPTION = ("token budget of one fused step (padding included); auto: steps of 1024 on CPU (a "
                           "micro-batch of up to 4096 runs alone), on a GPU the largest step up to 8192 tokens that "
                           "the trainer's memory model fits in its budget")


def step_tokens_floor(setting: int | str) -> int:
    """The fewest tokens a step of this setting may hold: itself, or auto's floor."""
    return AUTO_STEP_TOKENS_FLOOR if setting == "auto" else int(setting)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


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


def compile_problem(compile: str, *, recompute: str, quantization: str) -> str | None:
    """Why `compile` cannot go with this recompute mode or quantization, naming the fields and the fix; None if
    it can (`actors.engine.compiled`)."""
    if compile == "none":
        return None
    if recompute != "none":
        return (f"compile: {compile} with recompute: {recompute} is not offered (the recomputation's checkpoint wraps "
                "the decoder layers that compile compiles); set compile: none or recompute: none")
    if quantization != "none":
        return (f"compile: {compile} on a quantized base (quantization: {quantization}) is not offered "
                "(bitsandbytes' layers do not trace under torch.compile); set compile: none or quantization: none")
    return None


Stages = Annotated[int, Bounds(1, 256)]
StageSplit = list[Annotated[int, Bounds(1, 100_000)]] | Literal["even", "measured"]
STAGES_DESCRIPTION = ("pipeline stages the base's decoder is cut into, each a process of its own on its own device "
                      "(in-process: one GPU each where the machine has as many, else all on its first GPU; on Ray a "
                      "stage actor each, with num_gpus / num_cpus per stage; on CPU the cores shared); 1: the "
                      "single-device trainer")
KERNELS_DESCRIPTION = ("liger: Liger-Kernel's fused RMSNorm, RoPE, SwiGLU and LM-head cross-entropy on a CUDA "
                       "base (the `gpu` extra); auto: those where Liger is installed and the base is on CUDA in "
                       "bfloat16 / float16; none: the model's own operations")
STAGE_SPLIT_DESCRIPTION = ("with stages >= 2: decoder layers per stage (a list), even, or measured (balanced by "
                           "each layer's measured time and memory)")


def pipeline_problem(stages: int, split: list[int] | str, *, quantization: str, dtype: str, layout: str,
                     compile: str, kernels: str = "auto") -> str | None:
    """Why a trainer of `stages` pipeline stages cannot have these settings, naming the field and the fix; None
    if it can (actors/engine/pipeline/)."""
    if stages == 1:
        return None
    if isinstance(split, list) and len(split) != stages:
        return f"stage_split lists {len(split)} stages' layer counts and stages is {stages}: give one count per stage"
    if quantization != "none":
        return (f"stages: {stages} with quantization: {quantization} is not offered (a stage loads its tensors in "
                "full precision); set quantization: none or stages: 1")
    if dtype == "float16":
        return ("stages >= 2 with dtype: float16 is not offered (float16's per-job loss scaling over stages is not "
                "built); set dtype: bfloat16")
    if layout != "packed":
        return f"stages >= 2 packs its micro-batches; set layout: packed (not {layout}) or stages: 1"
    if compile != "none":
        return f"stages >= 2 runs its stages eagerly; set compile: none (not {compile}) or stages: 1"
    if kernels == "liger":
        return ("stages >= 2 runs its stages without fused kernels (each loads its layers on the CPU first); set "
                "kernels: auto or none (not liger) or stages: 1")
    return None


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
        ["q_proj", "v_proj"], description="module names to adapt, or `all-linear`")
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

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one module name, e.g. [q_proj, v_proj], or 'all-linear'")
        return value

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r**0.5) if self.use_rslora else self.alpha / self.r


class EarlyStopConfig(StrictModel):
    """Stop a job once further training stops paying off: a power law fitted to its eval losses (or its
    smoothed train loss where it has no eval split) predicts less than `min_improvement` (relative) or less
    than `min_delta` (absolute) from now to the end of its budget, or the loss has not beaten its best by
    at least `min_delta` for `patience` evaluations; judged after at least `patience` + 3 evaluations."""

    min_improvement: Annotated[float, Bounds(0, 100)] = Field(
        0.01, description="the relative loss improvement still worth the rest of the budget (0.01: 1%)")
    min_delta: Annotated[float, Bounds(0, 1e6)] | None = Field(
        None, description="the absolute loss improvement (in loss units) that counts: a loss not lower than its "
                          "best by more than this is no improvement (an equal one neither), and a predicted "
                          "remaining gain below it stops the job (null: 0.1% of the job's first recorded loss, "
                          "its first eval loss or, without an eval split, its first train loss; the stop "
                          "reason shows the value used)")
    patience: Annotated[int, Bounds(1, 10_000)] = Field(
        3, description="evaluations without enough improvement before stopping")


class MlflowTracking(StrictModel):
    """Where a job's MLflow run goes: one run per job (found again by its job id when the job resumes),
    with the job's spec as parameters, its loss, eval loss, learning rate, gradient norm and tokens/s as
    metrics per optimizer step, and its final adapter as an artefact (`adapter/`)."""

    tracking_uri: str | None = Field(
        None, description="an MLflow tracking URI (http://host:5000, file:///mnt/mlruns, databricks, ...); null: "
                          "$MLFLOW_TRACKING_URI of the trainer's process, else a file store in the job's folder "
                          "(<job>/mlruns; aspen sets MLFLOW_ALLOW_FILE_STORE=true, mlflow's opt-in to its "
                          "file store, while it writes there)")
    experiment: str = Field("aspen", min_length=1, max_length=500, description="the MLflow experiment's name")


class TrackingConfig(StrictModel):
    """Experiment tracking of a job. A tracker that fails (a bad URI, an unreachable server, a full disk)
    is logged once and switched off for that job; the job trains on."""

    tensorboard: bool = Field(False, description="TensorBoard event files in the job's folder (<job>/tb): "
                                                 "`tensorboard --logdir <output_dir>`")
    mlflow: MlflowTracking | None = Field(None, description="an MLflow run per job: `true` (the defaults) or "
                                                            "{tracking_uri, experiment}")

    @field_validator("mlflow", mode="before")
    @classmethod
    def _bool_means_defaults(cls, value: Any) -> Any:
        if value is True:
            return MlflowTracking()
        if value is False:
            return None
        return value


class PreferenceConfig(StrictModel):
    """The preference objective of a `method: dpo`, `orpo` or `cpo` job (as TRL's DPOConfig / ORPOConfig /
    CPOConfig)."""

    beta: Annotated[float, Bounds(0, 1000, low_open=True)] = Field(
        0.1, description="DPO: the temperature of the sigmoid loss (how far the adapter may move from the base, "
                         "its reference); ORPO: the weight (lambda) of the odds-ratio term beside the chosen "
                         "completion's language-modelling loss; CPO: the temperature of its sigmoid loss on the "
                         "completions' log-probability margin")
    cpo_alpha: Annotated[float, Bounds(0, 1000)] = Field(
        1.0, description="CPO only: the weight of the chosen sequence's language-modelling (NLL) term (TRL's "
                         "cpo_alpha; 0 leaves the preference term alone)")


PREFERENCE_METHODS = ("dpo", "orpo", "cpo")

REWARDS = ("exact_match", "contains", "regex")


class GrpoConfig(StrictModel):
    """The objective of a `method: grpo` job (as TRL's GRPOConfig): each prompt's `num_generations`
    completions sampled with the job's own adapter on its trainer, scored by `reward`, and trained on their
    group-relative advantages."""

    reward: str = Field(description="exact_match (the completion, stripped, equals the row's target text), "
                                    "contains, regex (`pattern` finds the same answer in both), or "
                                    "module:function, called as function(prompts, completions, rows) -> list of "
                                    "floats with rows [{prompt, reference}] (texts), one reward per completion")
    pattern: str | None = Field(None, description="regex: the answer's pattern, e.g. '####\\s*(-?[0-9.,]+)'")
    num_generations: Annotated[int, Bounds(2, 256)] = Field(8, description="completions sampled per prompt (G)")
    max_new_tokens: Annotated[int, Bounds(1, 4096)] = Field(
        64, description="the longest completion (it also ends at the tokenizer's EOS); TRL's max_completion_length")
    temperature: Annotated[float, Bounds(0, 100, low_open=True)] = Field(
        1.0, description="sampling temperature; the log-probabilities trained on are taken at it too (as TRL)")
    top_k: Annotated[int, Bounds(0, 10**6)] = Field(0, description="sample among the k likeliest tokens (0: all)")
    beta: Annotated[float, Bounds(0, 1000)] = Field(
        0.0, description="weight of the KL term to the base with the adapter off (TRL's default 0: none)")
    epsilon: Annotated[float, Bounds(0, 10)] = Field(0.2, description="the ratio's clipping range")
    loss_type: Literal["dapo", "grpo"] = Field(
        "dapo", description="dapo: the mean over every completion token of the optimizer step (TRL's default); "
                            "grpo: each completion's token mean, averaged over the completions")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantages divided by the rewards' standard deviation in the prompt's group, in the "
                             "micro-batch, or not at all")

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, value: str) -> str:
        if value in REWARDS:
            return value
        if not re.match(USER_METRIC_PATTERN, value):
            raise ValueError(f"'{value}' is neither {', '.join(REWARDS)} nor module:function (a "
                             "function(prompts, completions, rows) -> list of floats that Python can import)")
        return value

    @model_validator(mode="after")
    def _pattern_for_regex(self) -> GrpoConfig:
        if self.reward == "regex" and not self.pattern:
            raise ValueError("reward regex needs pattern (e.g. '####\\s*(-?[0-9.,]+)')")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as error:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {error}") from None
        return self

GENERATION_METRICS = ("exact_match", "contains", "regex")
USER_METRIC_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"


class GenerationEval(StrictModel):
    """A generation metric at each evaluation: the adapter continues each held-out row's prompt greedily
    (its trainer, between steps, batched over adapters) and the continuation is scored against the row's
    target text; the evaluation's score is the mean over the rows (higher is better)."""

    metric: str = Field(description="exact_match (the stripped texts are equal), contains (the target text is in "
                                    "the continuation), regex (`pattern` finds the same answer in both: its first "
                                    "group, or the whole match), or module:function, called as function(prediction, "
                                    "row) -> float with row {prompt, reference} (texts)")
    pattern: str | None = Field(None, description="regex: the answer's pattern, e.g. '####\\s*(-?[0-9.,]+)'")
    max_new_tokens: Annotated[int, Bounds(1, 4096)] = Field(64, description="the longest continuation (it also "
                                                                          "ends at the tokenizer's EOS)")
    rows: Annotated[int, Bounds(1, 10**6)] | None = Field(None, description="score the first this many eval rows "
                                                                           "(null: all of them)")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value in GENERATION_METRICS:
            return value
        if not re.match(USER_METRIC_PATTERN, value):
            raise ValueError(f"'{value}' is neither {', '.join(GENERATION_METRICS)} nor module:function (a "
                             "function(prediction, row) -> float that Python can import)")
        import importlib

        module, _, function = value.partition(":")
        try:
            found = getattr(importlib.import_module(module), function, None)
        except ImportError as error:
            raise ValueError(f"cannot import module '{module}' of metric '{value}' ({error}); put it on PYTHONPATH "
                             "(or in the Ray job's working_dir)") from None
        if not callable(found):
            raise ValueError(f"module '{module}' has no function '{function}' (metric '{value}')")
        return value

    @model_validator(mode="after")
    def _pattern_with_regex(self) -> GenerationEval:
        if self.metric == "regex":
            if not self.pattern:
                raise ValueError("metric regex needs `pattern` (the answer's regular expression)")
            try:
                re.compile(self.pattern)
            except re.error as error:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {error}") from None
        elif self.pattern is not None:
            raise ValueError(f"pattern applies to metric regex, not {self.metric}; remove it")
        return self


class JobSpec(StrictModel):
    """One fine-tuning job: its data, its adapter and its optimisation."""

    name: str = Field(pattern=JOB_NAME_PATTERN, description="the job's name: its folder and MQTT topic level")
    data: Location = Field(description="the dataset: a JSONL file or one JSON array of rows, a .parquet or .arrow "
                                       "file, a folder saved by datasets' save_to_disk, or a folder of such files; a "
                                       "path or a storage URI (s3://bucket/train.parquet, gs://..., file:///...); "
                                       "no hub ids (nothing is downloaded)")
    format: DataFormat = Field(description="how rows become prompt and target tokens (by `type`, below)")
    split: str = Field("train", min_length=1, description="the split of a saved DatasetDict or of a folder whose "
                                                         "file names name splits (train-*.parquet, test.jsonl)")
    columns: dict[str, str] | None = Field(
        None, description="the format's field names mapped to the dataset's column names, e.g. {instruction: "
                          "question, output: answer}")
    streaming: bool = Field(False, description="read and tokenize the data a window of rows at a time instead of "
                                               "whole (data larger than memory); eval_split must then be a count "
                                               "(the first rows)")
    shuffle_window: Annotated[int, Bounds(0, 10**7)] = Field(
        1000, description="streaming: rows shuffled together (each window of this many rows is permuted with the "
                          "job's seed and epoch; at least the data's rows: the non-streaming order); 0: in order")
    lora: LoraConfig = Field(LoraConfig(), description="the adapter")
    batch_size: Annotated[int, Bounds(1, 65536)] = Field(
        4, description="sequences per micro-batch (preference pairs for dpo / orpo / cpo)")
    grad_accum: Annotated[int, Bounds(1, 65536)] = Field(1, description="micro-batches per optimizer step")
    lr: Annotated[float, Bounds(0, 10, low_open=True)] = Field(3e-4, description="peak learning rate (AdamW)")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("linear", description="decay after warm-up")
    warmup_steps: Annotated[int, Bounds(0, 10**9)] = Field(0, description="optimizer steps of linear warm-up")
    weight_decay: Annotated[float, Bounds(0, 10)] = Field(0.0, description="AdamW weight decay")
    max_grad_norm: Annotated[float, Bounds(0, 1e6, low_open=True)] | None = Field(
        1.0, description="clip the adapter's gradient norm (null: no clipping)")
    max_steps: StepCount | None = Field(None, description="optimizer steps")
    epochs: Annotated[float, Bounds(0, 10_000, low_open=True)] | None = Field(
        None, description="passes over the data (with max_steps, the smaller budget wins; neither: 1 epoch)")
    max_seq_len: Annotated[int, Bounds(8, 1_048_576)] = Field(512, description="tokens per sequence (longer rows "
                                                                               "are cut)")
    train_on_prompt: bool = Field(False, description="also learn the prompt tokens (else their labels are -100); "
                                                     "orpo: its NLL term covers the chosen sequence's prompt too "
                                                     "(as TRL's ORPOTrainer)")
    eval_split: Annotated[float, Bounds(0, 10**9)] = Field(0.0, description="held-out rows: a fraction (< 1) or "
                                                                           "a count (a whole number >= 1)")
    eval_every: StepCount | None = Field(None, description="optimizer steps between evaluations")
    eval_generate: GenerationEval | None = Field(
        None, description="also score greedy generations of the eval rows at each evaluation (an sft job's; its "
                          "eval_split must hold rows): exact match, contains, regex or a function of yours")
    checkpoint_every: StepCount = Field(50, description="optimizer steps between checkpoints")
    checkpoint_every_s: Annotated[float, Bounds(1, 10**7)] | None = Field(
        600.0, description="seconds between time-based checkpoints, beside the step-based `checkpoint_every`: a "
                           "crash then loses at most this much wall time of the job's training (None: only "
                           "`checkpoint_every`)")
    early_stop: EarlyStopConfig | None = Field(None, description="stop when training stops paying off")
    priority: Priority = Field(0, description="higher runs first under priority-aware policies")
    seed: Seed | None = Field(None, description="the job's own seed (default: the run's)")
    tracking: TrackingConfig | None = Field(None, description="TensorBoard and MLflow tracking of this job "
                                                              "(default: the run's `tracking`)")
    method: Literal["sft", "dpo", "orpo", "cpo", "grpo"] = Field(
        "sft", description="sft: learn the targets; dpo (Direct Preference Optimization; its reference is the "
                           "base, the adapter off), orpo (odds-ratio preference optimization) or cpo (Contrastive "
                           "Preference Optimization, no reference): learn from preference pairs (format type "
                           "preference); grpo (Group Relative Policy Optimization): learn from the rewards of "
                           "completions the adapter samples for each row's prompt (`grpo`)")
    preference: PreferenceConfig = Field(PreferenceConfig(), description="the dpo / orpo / cpo objective")
    grpo: GrpoConfig | None = Field(None, description="the grpo objective: its reward and sampling (method grpo)")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value.lower() in {"trainer", "service", "con", "nul", "aux", "prn"}:
            raise ValueError(f"'{value}' is reserved; choose another job name")
        return value

    @field_validator("eval_split")
    @classmethod
    def _fraction_or_count(cls, value: float) -> float:
        if value >= 1 and not value.is_integer():
            raise PydanticCustomError(
                "eval_split", "must be a fraction less than 1 or a whole count of rows (got {got})",
                {"got": str(value)})
        return value

    @field_validator("data")
    @classmethod
    def _not_a_hub_uri(cls, value: Path | StorageURI) -> Path | StorageURI:
        problem = hub_id_problem(str(value)) if isinstance(value, StorageURI) else None
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _data_options(self) -> JobSpec:
        if self.streaming and 0 < self.eval_split < 1:
            raise ValueError(f"eval_split={self.eval_split} is a fraction, which streaming cannot take (the rows are "
                             "not all read up front): give a count of rows, e.g. eval_split: 200 (the first rows)")
        fields = getattr(self.format, "fields", None)
        if self.columns and fields is not None:
            unknown = sorted(set(self.columns) - set(fields()))
            if unknown:
                raise ValueError(f"columns maps {', '.join(unknown)}, not a field of format {self.format.type} "
                                 f"(its fields: {', '.join(sorted(fields()))}); map the format's field names to "
                                 "the dataset's column names")
        return self

    @model_validator(mode="after")
    def _method_fits_format(self) -> JobSpec:
        pairs = self.format.type == "preference"
        if self.method in PREFERENCE_METHODS and not pairs:
            raise ValueError(f"method '{self.method}' learns from preference pairs: set format to "
                             f"{{type: preference}} (rows with prompt, chosen, rejected), not '{self.format.type}'")
        if self.method == "sft" and pairs:
            raise ValueError("format preference holds preference pairs: set method to dpo, orpo or cpo (sft learns "
                             "from one target sequence per row)")
        if self.method == "sft" and self.preference != PreferenceConfig():
            raise ValueError("preference settings apply to method dpo, orpo or cpo; this job's method is sft")
        if self.method != "cpo" and self.preference.cpo_alpha != PreferenceConfig().cpo_alpha:
            raise ValueError(f"preference.cpo_alpha applies to method cpo; this job's method is {self.method} "
                             "(remove it)")
        if (self.method == "grpo") != (self.grpo is not None):
            raise ValueError("method grpo needs `grpo: {reward: ...}` (its reward and sampling)" if self.grpo is None
                             else f"grpo settings apply to method grpo; this job's method is {self.method}")
        if self.method == "grpo" and pairs:
            raise ValueError("method grpo samples its own completions for each row's prompt: use a format with a "
                             "prompt and a target text (alpaca, prompt_response, chat), not preference")
        if self.eval_generate is not None and self.method not in ("sft", "grpo"):
            raise ValueError(f"eval_generate scores generations against an sft job's target text; method "
                             f"'{self.method}' has none (remove eval_generate)")
        if self.eval_generate is not None and not self.eval_split:
            raise ValueError("eval_generate scores the held-out rows, and eval_split holds none: set eval_split "
                             "(e.g. 64 rows)")
        if self.method == "dpo" and self.train_on_prompt:
            raise ValueError("train_on_prompt does not apply to method dpo (its loss compares the completions); "
                             "remove it (with orpo or cpo it adds the prompt to the chosen sequence's "
                             "language-modelling term)")
        return self

    @property
    def sequences_per_example(self) -> int:
        """Sequences one example adds to a micro-batch: 2 for a preference pair, a grpo job's
        num_generations completions, else 1."""
        if self.grpo is not None:
            return self.grpo.num_generations
        return 2 if self.method in PREFERENCE_METHODS else 1

    @model_validator(mode="after")
    def _has_budget(self) -> JobSpec:
        if self.max_steps is None and self.epochs is None:
            object.__setattr__(self, "epochs", 1.0)
        if self.warmup_steps and self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds max_steps ({self.max_steps})")
        return self


def _micro_batch_overflow(job: JobSpec, step_tokens: int) -> str | None:
    tokens = job.batch_size * job.max_seq_len * job.sequences_per_example
    if job.grpo is not None:   # each prompt's completions: the prompt (up to max_seq_len) and max_new_tokens
        tokens = job.batch_size * job.grpo.num_generations * (job.max_seq_len + job.grpo.max_new_tokens)
        if tokens <= step_tokens:
            return None
        return (f"batch_size {job.batch_size} prompts * grpo.num_generations {job.grpo.num_generations} * (max_seq_len "
                f"{job.max_seq_len} + grpo.max_new_tokens {job.grpo.max_new_tokens}) = {tokens} tokens per micro-batch "
                f"exceeds step_tokens {step_tokens} (a micro-batch must fit in one fused step); lower batch_size, "
                f"num_generations, max_seq_len or max_new_tokens, or raise step_tokens to at least {tokens}")
    if tokens <= step_tokens:
        return None
    if job.sequences_per_example > 1:   # a preference pair is two sequences
        return (f"batch_size {job.batch_size} * 2 sequences per preference pair * max_seq_len {job.max_seq_len} = "
                f"{tokens} tokens per micro-batch exceeds step_tokens {step_tokens} (a micro-batch must fit in one "
                f"fused step); lower batch_size or max_seq_len, or raise step_tokens to at least {tokens}")
    return (f"batch_size {job.batch_size} * max_seq_len {job.max_seq_len} = {tokens} tokens per micro-batch exceeds "
            f"step_tokens {step_tokens} (a micro-batch must fit in one fused step); lower batch_size or max_seq_len, "
            f"or raise step_tokens to at least {tokens}")


def step_limit_problem(job: JobSpec, step_tokens: int, *, named: bool = True) -> str | None:
    """Why `job`'s largest micro-batch (`batch_size` sequences of up to `max_seq_len` tokens) cannot fit
    in one fused step of `step_tokens` tokens, naming the job (unless `named` is False: the caller's message
    names it already), the three numbers and the fix; or None when it fits. A run checks its jobs against
    its own `step_tokens`; the service checks a submitted job against its trainers'."""
    problem = _micro_batch_overflow(job, step_tokens)
    if problem is None or not named:
        return problem
    return f"job '{job.name}': {problem}"


class RunSpec(StrictModel):
    """A `jobs.yaml` file: one base model and the jobs that share it."""

    base_model: str = Field("smollm2-135m", description="an alias (smollm2-135m), a Hugging Face folder, a .gguf "
                                                        "file or a hub id already in the local cache")
    quantization: Quantization = Field("none", description="the frozen base's linear layers "
                                                                           "(bitsandbytes: the `quant` extra)")
    dtype: Dtype = Field(
        "auto", description="auto: float32 on CPU, bfloat16 on CUDA")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N (in-process runs)")
    seed: Seed = Field(0, description="seeds data order, adapter initialisation and dropout")
    output_dir: Location = Field(Path("runs/example"), description="one folder per job under it: a path, or a storage "
                                                                  "URI (s3://bucket/prefix, gs://...) where "
                                                                  "checkpoints, adapters and metrics are uploaded")
    step_tokens: StepTokensSetting = Field("auto", description=STEP_TOKENS_DESCRIPTION)
    layout: Layout = Field(
        "packed", description="packed (no padding), padded (each job's rows to its longest) or padded_fused "
                              "(mLoRA: every row to the step's longest)")
    recompute: Recompute = Field(
        "none", description="layers: recompute each decoder layer's activations in backward (less memory, "
                            "more time; the same adapters)")
    compile: Compile = Field(
        "none", description="default: the decoder layers of each fused step under torch.compile (inductor), the "
                            "token stream padded to one of a few bucket lengths (not with recompute: layers or a "
                            "quantized base)")
    kernels: Kernels = Field("auto", description=KERNELS_DESCRIPTION)
    stages: Stages = Field(1, description=STAGES_DESCRIPTION)
    stage_split: StageSplit = Field("measured", description=STAGE_SPLIT_DESCRIPTION)
    policy: str = Field("adaptive", description="the scheduling policy of `aspen run`'s own service")
    tracking: TrackingConfig | None = Field(None, description="TensorBoard and MLflow tracking of every job that "
                                                              "sets none of its own")
    jobs: list[JobSpec] = Field(min_length=1, description="the jobs (at least one)")

    @model_validator(mode="after")
    def _compile_combination(self) -> RunSpec:
        problem = (compile_problem(self.compile, recompute=self.recompute, quantization=self.quantization)
                   or pipeline_problem(self.stages, self.stage_split, quantization=self.quantization, dtype=self.dtype,
                                       layout=self.layout, compile=self.compile, kernels=self.kernels))
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> RunSpec:
        seen: set[str] = set()
        for job in self.jobs:
            if job.name in seen:
                raise ValueError(f"two jobs are named '{job.name}'; job names must be unique")
            seen.add(job.name)
        return self

    @model_validator(mode="after")
    def _micro_batches_fit_a_step(self) -> RunSpec:
        problems = []
        for index, job in enumerate(self.jobs):
            problem = _micro_batch_overflow(job, step_tokens_floor(self.step_tokens))
            if problem is None:
                continue
            # the location names the job (jobs[i]); point at batch_size where only it was written
            fields_set = job.model_fields_set
            field = "batch_size" if "batch_size" in fields_set and "max_seq_len" not in fields_set else "max_seq_len"
            error = PydanticCustomError("step_limit", "{problem}", {"problem": problem})
            problems.append(InitErrorDetails(type=error, loc=("jobs", index, field), input=getattr(job, field)))
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        return self

    @model_validator(mode="after")
    def _adapters_fit_the_base(self) -> RunSpec:
        if self.quantization != "none":
            for job in self.jobs:
                problem = needs_full_precision_base(job.lora)
                if problem is not None:
                    raise ValueError(f"job '{job.name}': {problem} (quantization is {self.quantization})")
        return self

    def _with_tracking(self, job: JobSpec) -> JobSpec:
        """The job, with the run's tracking where it sets none of its own."""
        if job.tracking is not None or self.tracking is None:
            return job
        return job.model_copy(update={"tracking": self.tracking})

    def job_seed(self, job: JobSpec) -> int:
        return self.seed if job.seed is None else job.seed

    def submissions(self) -> list[JobSubmission]:
        """The run's jobs as the service takes them (each carries the run-level settings)."""
        return [JobSubmission(job=self._with_tracking(job), base_model=self.base_model, quantization=self.quantization,
                              dtype=self.dtype, seed=self.job_seed(job), output_dir=self.output_dir / job.name)
                for job in self.jobs]


class JobSubmission(StrictModel):
    """One job as submitted to the service: the job and the base model it trains on."""

    job: JobSpec
    base_model: str = "smollm2-135m"
    quantization: Quantization = "none"
    dtype: Dtype = "auto"
    seed: Seed = 0
    output_dir: Location | None = Field(None, description="the job's own folder, a path or a storage URI (default: "
                                                          "under the service's output root or state folder)")
    user: str | None = Field(None, pattern=USER_NAME_PATTERN, description="who submitted it: set by the HTTP API from "
                                                                         "the request's token (none: an operator, "
                                                                         "through Ray)")

    @field_validator("base_model")
    @classmethod
    def _canonical(cls, value: str) -> str:
        return canonical_base_model(value)

    @model_validator(mode="after")
    def _adapter_fits_the_base(self) -> JobSubmission:
        problem = needs_full_precision_base(self.job.lora) if self.quantization != "none" else None
        if problem is not None:
            raise ValueError(f"job '{self.job.name}': {problem} (quantization is {self.quantization})")
        return self


def planned_steps(spec: JobSpec, num_train_examples: int) -> int:
    """Optimizer steps the job will take: `max_steps`, or what `epochs` of its data gives, the smaller."""
    steps: list[int] = []
    if spec.max_steps is not None:
        steps.append(spec.max_steps)
    if spec.epochs is not None:
        micro_batches = math.ceil(num_train_examples * spec.epochs / spec.batch_size)
        steps.append(max(1, math.ceil(micro_batches / spec.grad_accum)))
    return min(steps)


def cursor_epochs(spec: JobSpec) -> int | None:
    """Epochs the data cursor runs for: bounded by `epochs` unless `max_steps` bounds the job."""
    return math.ceil(spec.epochs) if spec.epochs is not None and spec.max_steps is None else None


def slug(text: str) -> str:
    """A job-name-safe version of any text."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")
    return cleaned[:64] or "job"
