"""The on-disk format of a job checkpoint: its file names, and its state.json as pydantic models (formats 1
and 2), read with a one-line refusal that names the file, the field and what is wrong.

The models check structure and types only (strictly: no true for a count, no "3" for a number, no float for
a step); what must agree between fields or files (steps, shapes, digests) is checked by `load`, after.

Unknown keys. At the top level of state.json they are ignored: later aspens add optional keys within a
format (`evals`, `data_digest` were added so), and an aspen one version back must still resume such a
checkpoint; a key that no reader may ignore comes with a new format number instead. Inside the objects below
it (a history record, the accumulator, the optimizer section's own keys, a file entry) an unknown key is
refused: each is restored field by field, where an unknown field has nowhere to go, so it means another
format or damage. (The optimizer's parameter groups and state values hold torch's settings as torch has
them: any keys.)

Non-finite numbers. A loss, gradient norm, eval loss or metric may be inf or NaN in a valid checkpoint: a
float16 job's skipped step records an inf gradient norm, a diverged job NaN losses, and such a job must
still resume as it was. Counts, learning rates and the loss scale are finite, always."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

from actors.checkpoint.peft_names import CONFIG_NAME, WEIGHTS_NAME
from actors.engine.step_records import OptimizerStepRecord, StepAccumulator

STATE_NAME = "state.json"
OPTIMIZER_NAME = "optimizer.safetensors"
REFERENCE_NAME = "reference_model.safetensors"   # a job's frozen reference adapter (JobSpec.reference_adapter)
BEST_NAME = "best_adapter.safetensors"   # the adapter of a keep_best job's best evaluation (engine/kept_best.py)
LEGACY_OPTIMIZER_NAME = "optimizer.pt"  # format 1; read with torch.load(weights_only=True) only
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
MAX_PROBLEMS_SHOWN = 3


class Invalid(Exception):
    """One candidate checkpoint is unusable; the message starts with the offending path."""


def previous_folder(folder: str | Path) -> Path:
    """Where the last complete checkpoint waits while a new one is swapped in."""
    folder = Path(folder)
    return folder.with_name(f".{folder.name}.previous")


Count = Annotated[int, Strict(), Field(ge=0)]
Number = Annotated[float, Strict()]   # an int or a float, never a bool or a string; inf and NaN allowed
Rate = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
Text = Annotated[str, Strict()]
Flag = Annotated[bool, Strict()]


def _parameter_id(key: str) -> str:
    if re.fullmatch(r"[0-9]+", key) is None:
        raise ValueError(f"{json.dumps(key)} is not a parameter id (a whole number)")
    return key


ParamId = Annotated[str, AfterValidator(_parameter_id)]   # torch's parameter index, as a JSON object key
Sha256 = Annotated[str, Strict(), Field(pattern=r"^[0-9a-f]{64}$")]


class _Record(BaseModel):
    """An object inside state.json: its fields exactly (an unknown key is refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class AccumulatorState(_Record):
    """`accumulator`: the micro-batches of the optimizer step in progress (`job.StepAccumulator`)."""

    loss_sum: Number
    micro_batches: Count
    tokens: Count
    targets: Count
    metric_sums: dict[str, Number] = {}   # a preference job's; older checkpoints have none
    metric_weights: dict[str, Number] | None = None   # what each is a sum over; older checkpoints: one for all,
    metric_weight: Number | None = None                # or (older still) their micro-batches' targets

    def restore(self) -> StepAccumulator:
        weights = self.metric_weights
        if weights is None:
            weight = self.targets if self.metric_weight is None else self.metric_weight
            weights = {name: weight for name in self.metric_sums}
        return StepAccumulator(loss_sum=self.loss_sum, micro_batches=self.micro_batches, tokens=self.tokens,
                               targets=self.targets, metric_sums=dict(self.metric_sums), metric_weights=dict(weights))


class HistoryRecord(_Record):
    """One entry of `history`: an optimizer step's metrics (`job.OptimizerStepRecord`)."""

    step: Count
    loss: Number
    tokens: Count
    lr: Rate
    grad_norm: Number   # inf: a float16 step skipped because its gradients overflowed
    metrics: dict[str, Number] = {}   # a preference job's; older checkpoints have none

    def restore(self) -> OptimizerStepRecord:
        return OptimizerStepRecord(step=self.step, loss=self.loss, tokens=self.tokens, lr=self.lr,
                                   grad_norm=self.grad_norm, metrics=dict(self.metrics))


class FileEntry(_Record):
    """The size and sha256 of a checkpoint file when it was saved."""

    bytes: Count
    sha256: Sha256


class ListedFiles(_Record):
    """`files`: every file of a format-2 checkpoint but state.json itself."""

    optimizer: FileEntry = Field(alias=OPTIMIZER_NAME)
    weights: FileEntry = Field(alias=WEIGHTS_NAME)
    config: FileEntry = Field(alias=CONFIG_NAME)
    reference: FileEntry | None = Field(default=None, alias=REFERENCE_NAME)   # jobs with a reference adapter only

    def by_name(self) -> dict[str, FileEntry]:
        listed = {OPTIMIZER_NAME: self.optimizer, WEIGHTS_NAME: self.weights, CONFIG_NAME: self.config}
        return listed | ({REFERENCE_NAME: self.reference} if self.reference is not None else {})


class LossScaleState(_Record):
    """`optimizer.loss_scale`: a float16 job's dynamic loss scale (`optim.LossScale`)."""

    scale: Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
    clean_steps: Count


class OptimizerSection(_Record):
    """`optimizer` of format 2: the optimizer's non-tensor parts, and which of its tensors optimizer.safetensors
    holds. Setting values are encoded (`optimizer.encode_value`): a tuple as {"tuple": [...]}, a tensor as
    {"tensor": name}."""

    step_count: Count
    micro_count: Count
    param_groups: list[dict[str, Any]]
    state_tensors: dict[ParamId, list[Text]]   # per parameter id: the names of its state tensors
    state_values: dict[ParamId, dict[str, Any]]   # per parameter id: its other state values, encoded
    gradients: list[Flag]   # per parameter: whether a partial gradient is saved
    loss_scale: LossScaleState | None = None   # float16 jobs only

    @model_validator(mode="after")
    def _same_parameter_ids(self) -> OptimizerSection:
        if set(self.state_tensors) != set(self.state_values):
            tensors_only = sorted(set(self.state_tensors) - set(self.state_values), key=int)
            values_only = sorted(set(self.state_values) - set(self.state_tensors), key=int)
            raise ValueError("state_tensors and state_values should list the same parameter ids (only in "
                             f"state_tensors: {tensors_only or 'none'}; only in state_values: {values_only or 'none'})")
        return self


TokenId = Annotated[int, Strict()]   # a token id, or a label (-100: not a target)


class ReplayedRolloutState(_Record):
    """One prompt's completions in a GRPO job's replay (`grpo.Rollout`)."""

    input_ids: list[list[TokenId]]
    labels: list[list[TokenId]]
    prompt_length: Count
    rewards: list[Number]
    scores: list[list[Number]]
    advantages: list[Number]
    truncated: list[Flag]

    @model_validator(mode="after")
    def _one_each(self) -> ReplayedRolloutState:
        counts = {len(self.input_ids), len(self.labels), len(self.rewards), len(self.scores), len(self.advantages),
                  len(self.truncated)}
        if len(counts) != 1:
            raise ValueError("input_ids, labels, rewards, scores, advantages and truncated should have one entry a "
                             "completion")
        if any(len(ids) != len(labels) for ids, labels in zip(self.input_ids, self.labels, strict=True)):
            raise ValueError("each completion's input_ids and labels should be as long")
        return self


class ReplayedBatchState(_Record):
    rollouts: list[ReplayedRolloutState]
    old_logps: list[Number]   # the completion tokens' log-probabilities at their generation, in target order

    @model_validator(mode="after")
    def _one_a_target(self) -> ReplayedBatchState:
        targets = sum(label != -100 for r in self.rollouts for labels in r.labels for label in labels)
        if targets != len(self.old_logps):
            raise ValueError(f"old_logps has {len(self.old_logps)} values for {targets} completion tokens")
        return self


class ReplayState(_Record):
    """`replay`: a GRPO job's generation trained on more than once (num_iterations; `grpo_replay.GrpoReplay`)."""

    iteration: Count
    position: Count
    batches: list[ReplayedBatchState]


class BestState(_Record):
    """`best`: a keep_best job's best evaluation so far (`kept_best.KeptBest`) and the file of its adapter. Listed
    here, not under `files`, so that an aspen that keeps no best adapter resumes such a checkpoint (it ignores
    unknown top-level keys, and would refuse an unknown file entry)."""

    metric: Literal["eval_loss", "eval_score"]
    step: Count
    value: Annotated[float, Strict(), Field(allow_inf_nan=False)]
    file: FileEntry


class CheckpointState(BaseModel):
    """state.json of format 1 (the fields both formats have)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    format: Literal[1, 2]
    job: Annotated[str, Strict(), Field(min_length=1)]
    step: Count
    total_steps: Count | None = None
    tokens_seen: Count
    cursor: dict[str, Any]   # checked by the job's data cursor, which knows its data
    accumulator: AccumulatorState
    history: list[HistoryRecord]
    evals: list[tuple[Count, Number]] = []   # [step, eval loss]; older checkpoints have none
    scores: list[tuple[Count, Number]] = []  # [step, eval_generate score]; older checkpoints have none
    data_digest: Text | None = None   # data/digest.py; older checkpoints, and jobs of unknown data, have none
    replay: ReplayState | None = None   # a GRPO job's generation being replayed; older checkpoints have none


class CheckpointStateV2(CheckpointState):
    """state.json of format 2: the optimizer's non-tensor parts and the files it lists."""

    format: Literal[2]
    optimizer: OptimizerSection
    dropout_rng: Flag   # whether optimizer.safetensors holds the dropout generator's state
    files: ListedFiles
    best: BestState | None = None   # keep_best jobs that have been evaluated; older checkpoints have none


def read_state(path: Path) -> CheckpointState:
    """state.json at `path`, validated (a `CheckpointStateV2` for format 2); raises `Invalid` naming the file,
    the field and what is wrong."""
    data = _read_json(path)
    if not isinstance(data, dict):
        raise Invalid(f"{path}: not a checkpoint state (a JSON object is expected, found {type(data).__name__})")
    version = data.get("format")
    if type(version) is not int:
        raise Invalid(f"{path}: no format version (\"format\": {version!r})")
    if version not in READABLE_FORMATS:
        newer = " (written by a newer aspen; upgrade aspen to resume it)" if version > FORMAT_VERSION else ""
        raise Invalid(f"{path}: format {version} is not one this aspen reads "
                      f"({', '.join(map(str, READABLE_FORMATS))}){newer}")
    model = CheckpointStateV2 if version == 2 else CheckpointState
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise Invalid(f"{path}: {describe(error)}") from None


def _read_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise Invalid(f"{path}: missing (the checkpoint is incomplete)") from None
    except OSError as error:
        raise Invalid(f"{path}: cannot be read ({error})") from error
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Invalid(f"{path}: not UTF-8 text ({error})") from error
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        body = text.rstrip()
        kind = "truncated JSON" if error.pos >= len(body) or not body.endswith("}") else "invalid JSON"
        raise Invalid(f"{path}: {kind} ({error})") from error


def describe(error: ValidationError) -> str:
    """pydantic's errors in one line, the first few of them: `history[3].lr: Input should be a finite number
    (found NaN)`; the keys missing from one object together: `accumulator: keys missing: tokens, targets`."""
    entries: list[str | tuple[int | str, ...]] = []   # a problem, or an object whose missing keys go there
    missing: dict[tuple[int | str, ...], list[str]] = {}
    for item in error.errors():
        loc = tuple(item["loc"])
        if item["type"] == "missing" and loc and isinstance(loc[-1], str):
            if loc[:-1] not in missing:
                missing[loc[:-1]] = []
                entries.append(loc[:-1])
            missing[loc[:-1]].append(loc[-1])
        else:
            entries.append(f"{location(loc)}: {_problem(item)}")
    problems = [entry if isinstance(entry, str) else
                f"{location(entry) + ': ' if entry else ''}keys missing: {', '.join(missing[entry])}"
                for entry in entries]
    more = len(problems) - MAX_PROBLEMS_SHOWN
    return "; ".join(problems[:MAX_PROBLEMS_SHOWN]) + (f" (and {more} more)" if more > 0 else "")


def location(loc: tuple[int | str, ...]) -> str:
    """A field's place in the JSON as a user finds it: `history[3].lr`, `files["adapter_config.json"].bytes`."""
    where = ""
    for part in loc:
        if isinstance(part, int):
            where += f"[{part}]"
        elif part == "[key]":   # pydantic's mark of a problem with a key, not with its value
            where += " (the key)"
        elif part.isidentifier():
            where += f".{part}" if where else part
        else:
            where += f"[{json.dumps(part)}]"
    return where or "(top level)"


def _problem(item: Any) -> str:
    kind, found = item["type"], item.get("input")
    if kind == "missing":
        return "missing"
    if kind == "extra_forbidden":
        return "unknown key (not one this aspen writes here: another format, or damage)"
    message = item["msg"]
    if kind == "value_error":   # a validator's own message: pydantic prefixes "Value error, "
        return message.removeprefix("Value error, ")
    if found is None or isinstance(found, bool | int | float | str):
        shown = json.dumps(found)
        return f"{message} (found {shown if len(shown) <= 60 else shown[:57] + '...'})"
    return f"{message} (found a {type(found).__name__})"


def saved_step(folder: str | Path) -> int | None:
    """The step of the newest checkpoint whose state file is valid (`folder`, else its `.previous`),
    without reading the other files: what to tell a user before a resume (`load_checkpoint` decides what
    is used)."""
    state = _newest_state(Path(folder))
    return None if state is None else state.step


def saved_data_digest(folder: str | Path) -> tuple[int, str | None] | None:
    """The step and data digest (None: an older checkpoint records none) of the newest checkpoint whose
    state file is valid (`folder`, else its `.previous`), without reading the other files; None without one."""
    state = _newest_state(Path(folder))
    return None if state is None else (state.step, state.data_digest)


def saved_cursor(folder: str | Path) -> tuple[int, dict[str, Any]] | None:
    """The step and data cursor's state of the newest checkpoint whose state file is valid (`folder`, else its
    `.previous`), without reading the other files; None without one."""
    state = _newest_state(Path(folder))
    return None if state is None else (state.step, state.cursor)


def _newest_state(folder: Path) -> CheckpointState | None:
    for candidate in (folder, previous_folder(folder)):
        try:
            return read_state(candidate / STATE_NAME)
        except Invalid:
            continue
    return None
