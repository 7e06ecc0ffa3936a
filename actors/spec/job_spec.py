"""One fine-tuning job as a user writes it (`JobSpec`), and its budget: the optimizer steps it plans, the
epochs of its data cursor, and whether its largest micro-batch fits a fused step."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from actors.data import DataFormat
from actors.data.formats import STORED
from actors.data.locations import hub_id_problem
from actors.spec.evaluation_config import GENERATION_METRICS, EarlyStopConfig, GenerationEval
from actors.spec.field_types import JOB_NAME_PATTERN, Bounds, Location, Priority, Seed, StepCount, StrictModel
from actors.spec.lora_config import LoraConfig
from actors.spec.method_config import PREFERENCE_METHODS, REWARDS, GrpoConfig, PreferenceConfig
from actors.spec.saved_adapter import AdapterSource
from actors.spec.tracking_config import TrackingConfig
from actors.storage.storage_uri import StorageURI


class JobSpec(StrictModel):
    """One fine-tuning job: its data, its adapter and its optimisation."""

    name: str = Field(pattern=JOB_NAME_PATTERN, description="the job's name: its folder and MQTT topic level")
    data: Location | None = Field(None, description="the dataset: a JSONL file or one JSON array of rows, a "
                                                    ".csv or .tsv file with a header row, a .parquet or .arrow file, "
                                                    "a folder saved by datasets' "
                                                    "save_to_disk, or a folder of such files; a path or a storage URI "
                                                    "(s3://bucket/train.parquet, gs://..., file:///...); no hub ids "
                                                    "(nothing is downloaded); required (but by an interactive model)")
    format: DataFormat | None = Field(None, description="how rows become prompt and target tokens (by `type`, "
                                                        "below); required (but by an interactive model)")
    split: str = Field("train", min_length=1, description="the split of a saved DatasetDict or of a folder whose "
                                                         "file names name splits (train-*.parquet, test.jsonl)")
    columns: dict[str, str] | None = Field(
        None, description="the format's field names mapped to the dataset's column names, e.g. {instruction: "
                          "question, output: answer}; a dotted path reaches a value nested in a column (an object's "
                          "key, a list's index: {output: answers.text.0})")
    streaming: bool = Field(False, description="read and tokenize the data a window of rows at a time instead of "
                                               "whole (data larger than memory); eval_split must then be a count "
                                               "(the first rows)")
    shuffle_window: Annotated[int, Bounds(0, 10**7)] = Field(
        1000, description="streaming: rows shuffled together (each window of this many rows is permuted with the "
                          "job's seed and epoch; at least the data's rows: the non-streaming order); 0: in order")
    lora: LoraConfig = Field(LoraConfig(), description="the adapter")
    init_adapter: AdapterSource | None = Field(
        None, description="start the adapter from saved weights instead of its initialisation (SFT, then DPO or "
                          "GRPO from that adapter, which is then their reference model; continued training): a "
                          "folder in PEFT's format (adapter_config.json + adapter_model.safetensors: PEFT's "
                          "save_pretrained, an aspen job's adapter/ or checkpoint folder), a path or a storage URI; or "
                          "job:<name>, the adapter another job of the same jobs file ends with (this job starts once "
                          "that one has); `lora` must agree with its config (kind, r, alpha, use_rslora, use_dora, the "
                          "same modules); the optimizer and the schedule start afresh; a job resumed from a checkpoint "
                          "of its own continues from that instead")
    batch_size: Annotated[int, Bounds(1, 65536)] = Field(
        4, description="sequences per micro-batch (preference pairs for dpo / orpo / cpo)")
    grad_accum: Annotated[int, Bounds(1, 65536)] = Field(1, description="micro-batches per optimizer step")
    lr: Annotated[float, Bounds(0, 10, low_open=True)] = Field(3e-4, description="peak learning rate (AdamW)")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "linear", description="decay after warm-up (linear, cosine: toward 0 at the end of the budget, as "
                              "transformers' get_*_schedule_with_warmup)")
    warmup_steps: Annotated[int, Bounds(0, 10**9)] = Field(
        0, description="optimizer steps of linear warm-up: the k-th at lr * k / warmup_steps, the first at "
                       "lr / warmup_steps (transformers' first is at 0, its warm-up one step behind), the peak at "
                       "the last")
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
    keep_best: Literal["eval_loss", "eval_score"] | None = Field(
        None, description="the adapter the job ends with (its folder, what export, serving and job:<name> take) is "
                          "that of its best evaluation, not its last step's, as transformers' load_best_model_at_end: "
                          "eval_loss (the lowest) or eval_score (eval_generate's, the highest); its checkpoint keeps "
                          "the last step's weights (a resume continues from them) and the best's; needs eval_split "
                          "and eval_every (null: the last step's adapter)")
    priority: Priority = Field(0, description="higher runs first under priority-aware policies")
    seed: Seed | None = Field(None, description="the job's own seed (default: the run's)")
    tracking: TrackingConfig | None = Field(None, description="TensorBoard and MLflow tracking of this job "
                                                              "(default: the run's `tracking`)")
    method: Literal["sft", "dpo", "orpo", "cpo", "grpo", "interactive"] = Field(
        "sft", description="sft: learn the targets; dpo (Direct Preference Optimization; its reference is the "
                           "base, the adapter off, or the init_adapter it starts from), orpo (odds-ratio preference "
                           "optimization) or cpo (Contrastive Preference Optimization, no reference): learn from "
                           "preference pairs (format type preference); grpo (Group Relative Policy Optimization): "
                           "learn from the rewards of completions the adapter samples for each row's prompt (`grpo`); "
                           "interactive: a model of the Tinker API (docs/tinker.md), trained by its user's own loop, a "
                           "step at a time: created by the API, never submitted")
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
    def _not_a_hub_uri(cls, value: Path | StorageURI | None) -> Path | StorageURI | None:
        problem = hub_id_problem(str(value)) if isinstance(value, StorageURI) else None
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _initial_adapter(self) -> JobSpec:
        if self.init_adapter is None:
            return self
        if self.method == "interactive":
            raise ValueError("an interactive model starts from a saved state of its own (the API's "
                             "create_training_client_from_state), not init_adapter: remove init_adapter")
        if self.lora.init_lora_weights != "default":
            raise ValueError(f"lora.init_lora_weights: '{self.lora.init_lora_weights}' initialises the adapter, and "
                             "init_adapter starts it from saved weights instead: remove one of them (a saved PiSSA "
                             "or OLoRA adapter is PEFT's conversion to a plain LoRA: continue it with the r and alpha "
                             "of its adapter_config.json)")
        return self

    @model_validator(mode="after")
    def _has_data(self) -> JobSpec:
        if self.method == "interactive":   # its data are its user's calls
            if self.data is not None or self.format is not None:
                raise ValueError("an interactive model (method interactive) takes its data from its user's calls: "
                                 "remove data and format")
            return self
        missing = [name for name in ("data", "format") if getattr(self, name) is None]
        if missing:
            raise PydanticCustomError("missing", "job '{name}' needs {fields} (the dataset and how its rows become "
                                      "tokens)", {"name": self.name, "fields": " and ".join(missing)})
        return self

    @model_validator(mode="after")
    def _data_options(self) -> JobSpec:
        if self.format is None:
            return self
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
    def _method_fits_format(self, info: ValidationInfo) -> JobSpec:
        if self.format is None:
            return self
        pairs = self.format.type == "preference"
        text = self.format.type == "text" and not (info.context or {}).get(STORED)   # refused since 2026-12-06
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
        if self.method == "grpo" and (pairs or text):
            raise ValueError("method grpo samples its own completions for each row's prompt: use a format with a "
                             f"prompt and a target text (alpaca, prompt_response, chat), not {self.format.type}"
                             + (" (a text row has no prompt: its first token would be one)"
                                if self.format.type == "text" else ""))
        if self.eval_generate is not None and self.method not in ("sft", "grpo"):
            raise ValueError(f"eval_generate scores generations against an sft job's target text; method "
                             f"'{self.method}' has none (remove eval_generate)")
        if self.eval_generate is not None and text:
            raise ValueError("eval_generate continues each held-out row's prompt and scores it against the row's "
                             "target text; format text has no prompt (every token is a target): use alpaca, "
                             "prompt_response or chat, or remove eval_generate")
        if self.eval_generate is not None and not self.eval_split:
            raise ValueError("eval_generate scores the held-out rows, and eval_split holds none: set eval_split "
                             "(e.g. 64 rows)")
        if self.method == "dpo" and self.train_on_prompt:
            raise ValueError("train_on_prompt does not apply to method dpo (its loss compares the completions); "
                             "remove it (with orpo or cpo it adds the prompt to the chosen sequence's "
                             "language-modelling term)")
        return self

    @field_validator("keep_best")
    @classmethod
    def _has_evaluations(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        missing = " and ".join(name for name in ("eval_split", "eval_every") if not info.data.get(name))
        if missing:
            raise ValueError(f"'{value}' keeps the adapter of the job's best evaluation, and the job has no "
                             f"{missing}: set {missing} (e.g. eval_split: 64, eval_every: 50), or remove keep_best")
        if value == "eval_score" and info.data.get("eval_generate") is None:
            raise ValueError("'eval_score' keeps the adapter of the best eval_generate score, and the job has "
                             "no eval_generate: add eval_generate, or keep the lowest eval loss (keep_best: eval_loss)")
        return value

    @property
    def sequences_per_example(self) -> int:
        """Sequences one example adds to a micro-batch: 2 for a preference pair, a grpo job's
        num_generations completions, else 1."""
        if self.grpo is not None:
            return self.grpo.num_generations
        return 2 if self.method in PREFERENCE_METHODS else 1

    @property
    def reference_adapter(self) -> bool:
        """Whether the job's reference model is its starting adapter, `init_adapter`, held frozen beside it: a dpo
        job, or a grpo job with a KL term (beta > 0), that starts from a saved adapter (TRL's trainers take such a
        PEFT model's reference as a frozen copy of its adapter, "ref"). Other jobs' reference is the base with the
        adapter off, which is what a new adapter starts as."""
        return self.init_adapter is not None and (
            self.method == "dpo" or (self.grpo is not None and self.grpo.beta > 0))

    def user_functions(self) -> list[tuple[str, str]]:
        """The functions of the user's that the job calls (actors/spec/user_functions.py), each as (its field, its
        reference): the grpo rewards (`grpo.reward`, or `grpo.reward.1` in a list) and a generation metric that
        are not built in."""
        named = [("eval_generate.metric", self.eval_generate.metric if self.eval_generate else None,
                  GENERATION_METRICS)]
        if self.grpo is not None:
            single = isinstance(self.grpo.reward, str)
            named = [("grpo.reward" if single else f"grpo.reward.{index}", reference, REWARDS)
                     for index, reference in enumerate(self.grpo.rewards)] + named
        return [(field, reference) for field, reference, built_in in named
                if reference is not None and reference not in built_in]

    @model_validator(mode="after")
    def _has_budget(self) -> JobSpec:
        if self.max_steps is None and self.epochs is None:
            object.__setattr__(self, "epochs", 1.0)
        if self.warmup_steps and self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds max_steps ({self.max_steps})")
        return self


def _micro_batch_overflow(job: JobSpec, step_tokens: int, limit: str | None = None) -> str | None:
    limit = limit or f"step_tokens {step_tokens}"
    tokens = job.batch_size * job.max_seq_len * job.sequences_per_example
    if job.grpo is not None:   # each prompt's completions: the prompt (up to max_seq_len) and max_new_tokens
        tokens = job.batch_size * job.grpo.num_generations * (job.max_seq_len + job.grpo.max_new_tokens)
        if tokens <= step_tokens:
            return None
        return (f"batch_size {job.batch_size} prompts * grpo.num_generations {job.grpo.num_generations} * (max_seq_len "
                f"{job.max_seq_len} + grpo.max_new_tokens {job.grpo.max_new_tokens}) = {tokens} tokens per micro-batch "
                f"exceeds {limit} (a micro-batch must fit in one fused step); lower batch_size, "
                f"num_generations, max_seq_len or max_new_tokens, or raise step_tokens to at least {tokens}")
    if tokens <= step_tokens:
        return None
    if job.sequences_per_example > 1:   # a preference pair is two sequences
        return (f"batch_size {job.batch_size} * 2 sequences per preference pair * max_seq_len {job.max_seq_len} = "
                f"{tokens} tokens per micro-batch exceeds {limit} (a micro-batch must fit in one "
                f"fused step); lower batch_size or max_seq_len, or raise step_tokens to at least {tokens}")
    return (f"batch_size {job.batch_size} * max_seq_len {job.max_seq_len} = {tokens} tokens per micro-batch exceeds "
            f"{limit} (a micro-batch must fit in one fused step); lower batch_size or max_seq_len, "
            f"or raise step_tokens to at least {tokens}")


def step_limit_problem(job: JobSpec, step_tokens: int, *, named: bool = True, limit: str | None = None) -> str | None:
    """Why `job`'s largest micro-batch (`batch_size` sequences of up to `max_seq_len` tokens) cannot fit
    in one fused step of `step_tokens` tokens, naming the job (unless `named` is False: the caller's message
    names it already), the three numbers and the fix; or None when it fits. A run checks its jobs against
    its own `step_tokens`; the service checks a submitted job against its trainers'."""
    problem = _micro_batch_overflow(job, step_tokens, limit)
    if problem is None or not named:
        return problem
    return f"job '{job.name}': {problem}"


def planned_steps(spec: JobSpec, num_train_examples: int) -> int:
    """Optimizer steps the job will take: `max_steps`, or what `epochs` of its data gives (a GRPO job's each
    generation trained for num_iterations steps), the smaller."""
    steps: list[int] = []
    if spec.max_steps is not None:
        steps.append(spec.max_steps)
    if spec.epochs is not None:
        micro_batches = math.ceil(num_train_examples * spec.epochs / spec.batch_size)
        iterations = spec.grpo.num_iterations if spec.grpo is not None else 1
        steps.append(max(1, math.ceil(micro_batches / spec.grad_accum)) * iterations)
    return min(steps)


def continued_steps(spec: JobSpec, num_train_examples: int, step: int, position: dict[str, Any]) -> int | None:
    """The optimizer steps of a job continued from a checkpoint at its data cursor's end (`position`, the cursor's
    state there: its last epoch's every example trained, the last batch short where they are not a multiple of
    batch_size), its `epochs` raised since: `step` and those that every example of its further epochs once more
    takes, in batches from the next epoch's first example (not as a run given those epochs from the start, whose
    batches ran on across that epoch's end). None where the checkpoint is not at its cursor's end: `planned_steps`
    holds. A streamed job's position and `num_train_examples` count rows."""
    if cursor_epochs(spec) is None or spec.epochs is None or num_train_examples < 1:
        return None
    if int(position.get("position", 0)) < num_train_examples:
        return None
    seen = (int(position["epoch"]) + 1) * num_train_examples
    micro_batches = max(0, math.ceil((num_train_examples * spec.epochs - seen) / spec.batch_size))
    iterations = spec.grpo.num_iterations if spec.grpo is not None else 1
    return step + math.ceil(micro_batches / spec.grad_accum) * iterations


def cursor_epochs(spec: JobSpec) -> int | None:
    """Epochs the data cursor runs for: bounded by `epochs` unless `max_steps` bounds the job."""
    return math.ceil(spec.epochs) if spec.epochs is not None and spec.max_steps is None else None


def slug(text: str) -> str:
    """A job-name-safe version of any text."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")
    return cleaned[:64] or "job"
