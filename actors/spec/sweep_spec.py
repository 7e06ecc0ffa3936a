"""A sweep: one job's settings searched over a space, its trials as ordinary jobs (issue 34).

    name: lr-rank
    base_model: smollm2-135m
    output_dir: runs/lr-rank
    job: {name: qa, data: qa.jsonl, format: {type: alpaca}, max_steps: 400, eval_split: 64, eval_every: 20}
    space: {lr: {loguniform: [1.0e-5, 1.0e-3]}, lora.r: {choice: [8, 16, 32]}}
    search: random            # grid | a Ray Tune searcher (optuna, hyperopt, ...) | module:Class
    trials: 12
    max_concurrent: 4
    objective: eval_loss      # or train_loss, or a generation metric: {metric: exact_match, max_new_tokens: 32}
    stopping: {asha: {grace_steps: 20, reduction: 3}, predictive: {min_delta: 0.01}}
    seed: 0

Everything a trial may be is checked before anything starts: each path of the space is a field of the job
(`lora.rank` is refused, suggesting `lora.r`), each end of a range and each option of a choice makes a valid
job (`lora.r: {choice: [2048]}` is refused with the job field's own bound), the objective can be measured
(eval_loss and a generation metric need `eval_split` and `eval_every`), successive halving's grace period lies
within `max_steps`. A generation metric (actors/engine/generation_eval.py) becomes every trial's `eval_generate`
and is maximised; a loss is minimised. Trial i is the job with the i-th drawn settings, named `<job>-t<i>`
(policies/sweep/: search_space.py draws them; searchers.py suggests them; successive_halving.py stops
the weak ones)."""

from __future__ import annotations

import difflib
import itertools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from actors.spec.evaluation_config import GENERATION_METRICS, GenerationEval
from actors.spec.field_types import JOB_NAME_PATTERN, USER_NAME_PATTERN, Bounds, Location, Seed, StrictModel
from actors.spec.job_spec import JobSpec
from actors.spec.saved_adapter import JobAdapter
from actors.spec.trainer_settings import STEP_TOKENS_DESCRIPTION, StepTokensSetting
from policies.sweep.search_space import Dimension, grid_trials, parse_space, random_trials
from policies.sweep.searchers import BUILT_IN, TUNE_SEARCHERS, check_search

UNSEARCHABLE = ("name", "data", "format", "split", "columns", "seed", "tracking")
"""Job fields a space may not vary: the trials' names and seeds are the sweep's, and the data is the one task
being tuned (several datasets are several sweeps, or one run)."""


ROW_FIELDS = ("data", "split", "columns", "streaming", "format", "max_seq_len", "train_on_prompt", "eval_split")
"""Job fields that change how its rows read (actors/data/row_check.py: the rows, their tokens, what truncation
leaves, the held-out split): a space over any of them is checked for each of its values (`SweepSpec.row_jobs`)."""


ALIASES = {"rank": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "learning_rate": "lr",
           "per_device_train_batch_size": "batch_size", "gradient_accumulation_steps": "grad_accum"}
"""Other tools' names of job fields (PEFT's, transformers' TrainingArguments'), suggested where a path uses them."""


class AshaConfig(StrictModel):
    grace_steps: Annotated[int, Bounds(1, 10**9)] = Field(description="optimizer steps before the first rung")
    reduction: Annotated[float, Bounds(1, 100, low_open=True)] = Field(
        3.0, description="keep the best 1/reduction of the trials at each rung")


class PredictiveConfig(StrictModel):
    min_delta: Annotated[float, Bounds(0, 1e6)] = Field(
        0.0, description="stop a trial whose forecast final objective cannot beat the best finished trial's by this")
    min_points: Annotated[int, Bounds(4, 10**6)] = Field(5, description="objectives a trial reports before it is "
                                                                        "forecast (the curve has 3 parameters)")


class StoppingConfig(StrictModel):
    asha: AshaConfig | None = Field(None, description="asynchronous successive halving")
    predictive: PredictiveConfig | None = Field(None, description="stop trials whose loss-curve forecast cannot beat "
                                                                  "the best finished trial")


class SweepSpec(StrictModel):
    """One sweep file (`aspen sweep FILE`)."""

    name: str = Field(pattern=JOB_NAME_PATTERN, description="the sweep's name: the prefix of its folder")
    base_model: str = Field("smollm2-135m", description="the base every trial trains on")
    output_dir: Location = Field(description="the sweep's folder: one folder per trial in it")
    step_tokens: StepTokensSetting = Field("auto", description=STEP_TOKENS_DESCRIPTION)
    job: JobSpec = Field(description="the job every trial is, but for the settings the space gives it")
    space: dict[str, Any] = Field(description="job field (dotted: lora.r) -> {loguniform | uniform | randint | "
                                              "choice: ...}")
    search: str = Field("random", description="how trials are drawn: random, grid, a Ray Tune searcher "
                                              f"({', '.join(TUNE_SEARCHERS)}) or module:Class (a "
                                              "ray.tune.search.Searcher)")
    search_options: dict[str, Any] = Field({}, description="keyword arguments of a Ray Tune searcher's constructor "
                                                           "(the sweep gives space, metric, mode and seed)")
    trials: Annotated[int, Bounds(1, 100_000)] | None = Field(
        None, description="trials to run (random and searchers: required; grid: at most the grid's size, default "
                          "all of it)")
    max_concurrent: Annotated[int, Bounds(1, 100_000)] = Field(4, description="trials training at once")
    objective: Literal["eval_loss", "train_loss"] | GenerationEval = Field(
        "eval_loss", description="what ranks the trials: eval_loss or train_loss (minimised), or a generation metric "
                                 "of the eval rows, {metric: exact_match | contains | regex | module:function, "
                                 "pattern, max_new_tokens, rows} (maximised; each trial's eval_generate)")
    stopping: StoppingConfig | None = Field(None, description="stopping weak trials early")
    seed: Seed = Field(0, description="the random search's seed (and the trials' run seed)")
    user: str | None = Field(None, pattern=USER_NAME_PATTERN, description="who submitted it, and so its trials (set "
                                                                         "by the HTTP API from the request's token)")

    @field_validator("objective", mode="before")
    @classmethod
    def _objective_kind(cls, value: Any) -> Any:
        if isinstance(value, str) and value in GENERATION_METRICS:
            raise ValueError(f"'{value}' is a generation metric: write objective: {{metric: {value}}} (with "
                             "max_new_tokens, and pattern for regex, as you need)")
        if isinstance(value, str) and value not in ("eval_loss", "train_loss"):
            raise ValueError(f"'{value}' is not an objective: give eval_loss, train_loss or {{metric: ...}}")
        if isinstance(value, dict | GenerationEval):
            return GenerationEval.model_validate(value)   # its own errors, named under objective
        return value

    @model_validator(mode="before")
    @classmethod
    def _objective_scores_the_kept(cls, data: Any) -> Any:
        """job.keep_best: eval_score keeps the adapter of the best eval_generate score, and the job's own check
        refuses it without eval_generate; a sweep whose objective is a generation metric gives every trial that
        eval_generate (`_objective_into_job`), so the job is checked with it. With no such objective nothing would
        score the trials: refused, saying what would."""
        job = data.get("job") if isinstance(data, dict) else None
        if not isinstance(job, dict) or job.get("keep_best") != "eval_score" or job.get("eval_generate") is not None:
            return data
        objective = data.get("objective", "eval_loss")
        if isinstance(objective, dict | GenerationEval):
            try:
                metric = GenerationEval.model_validate(objective)
            except ValidationError:
                return data   # the objective's own errors say what is wrong with it
            return {**data, "job": {**job, "eval_generate": metric.model_dump(mode="json", exclude_unset=True)}}
        if objective not in ("eval_loss", "train_loss"):
            return data   # not an objective: its field says so
        fits = "keep_best: eval_loss" if objective == "eval_loss" else "no keep_best (the train loss has no evaluation)"
        raise ValueError("job.keep_best: eval_score keeps each trial's adapter by its eval_generate score, and nothing "
                         f"scores the trials: the job has no eval_generate and the sweep's objective is {objective}; "
                         "make the objective a generation metric (e.g. objective: {metric: exact_match}), which "
                         f"every trial then scores and the sweep ranks by, or use {fits}")

    @property
    def mode(self) -> Literal["min", "max"]:
        """"min" for a loss, "max" for a generation metric's score."""
        return "max" if isinstance(self.objective, GenerationEval) else "min"

    @property
    def objective_column(self) -> str:
        """The job table's progress column that holds the objective."""
        if isinstance(self.objective, GenerationEval):
            return "eval_score"
        return "eval_loss" if self.objective == "eval_loss" else "loss"

    @property
    def keeps_best(self) -> bool:
        """Whether each trial ends with its best evaluation's adapter by the sweep's own objective (job.keep_best):
        the trial's objective is then that evaluation's, not its last."""
        return self.job.keep_best is not None and self.job.keep_best == self.objective_column

    @model_validator(mode="after")
    def _check(self) -> SweepSpec:
        if self.job.keep_best is not None and not self.keeps_best:
            ranks = "a generation metric" if self.mode == "max" else self.objective
            fits = ("keep_best: eval_score" if self.mode == "max" else "keep_best: eval_loss"
                    if self.objective == "eval_loss" else "no keep_best (the train loss has no evaluation to keep)")
            raise ValueError(f"job.keep_best: {self.job.keep_best} would keep each trial's adapter by its "
                             f"{self.job.keep_best.replace('_', ' ')}, and the sweep ranks trials by {ranks}: the "
                             f"leaderboard would rank adapters the trials do not keep; use {fits}")
        if isinstance(self.job.init_adapter, JobAdapter):
            raise ValueError(f"job.init_adapter: {self.job.init_adapter} names another job, and a sweep's trials are "
                             "its only jobs; give the folder of that job's adapter")
        space = parse_space(self.space)
        for path, dimension in space.items():
            _check_path(path)
            _check_values(self.job, path, dimension)
            if self.job.init_adapter is not None and path in ADAPTER_SHAPE:
                raise ValueError(f"space.{path}: every trial starts from job.init_adapter, whose {path} is fixed; "
                                 f"leave {path} out of the space (or init_adapter out of the job)")
        check_search(self.search)
        if self.search != "grid" and self.trials is None:
            raise ValueError(f"trials: search {self.search} needs a number of trials")
        if self.search_options and self.search in BUILT_IN:
            raise ValueError(f"search_options: the built-in {self.search} search takes none (they are a Ray Tune "
                             "searcher's constructor arguments)")
        if self.search == "grid":
            size = len(grid_trials(space))
            if self.trials is not None and self.trials > size:
                raise ValueError(f"trials: {self.trials} is more than the grid's {size} combinations; give at most "
                                 f"{size} or leave trials out")
        if self.objective != "train_loss" and (not self.job.eval_split or self.job.eval_every is None):
            what = "eval_loss" if self.objective == "eval_loss" else "a generation metric"
            raise ValueError(f"objective: {what} needs job.eval_split (held-out rows) and job.eval_every; set "
                             "both" + (", or objective: train_loss" if what == "eval_loss" else ""))
        if isinstance(self.objective, GenerationEval):
            self._objective_into_job(self.objective)
        if self.stopping is not None and self.stopping.predictive is not None and self.mode == "max":
            raise ValueError("stopping.predictive forecasts a falling loss curve; with a generation metric as the "
                             "objective use stopping.asha")
        if self.stopping is not None and self.stopping.predictive is not None and self.job.max_steps is None:
            raise ValueError("stopping.predictive: a forecast is made for the trials' last step; give job.max_steps")
        if self.stopping is not None and self.stopping.asha is not None:
            if self.job.max_steps is None:
                raise ValueError("stopping.asha: successive halving counts optimizer steps; give job.max_steps")
            if self.stopping.asha.grace_steps > self.job.max_steps:
                raise ValueError(f"stopping.asha.grace_steps: {self.stopping.asha.grace_steps} is past job.max_steps "
                                 f"{self.job.max_steps}; give fewer")
        return self

    def _objective_into_job(self, objective: GenerationEval) -> None:
        """Every trial scores the generation metric at its evaluations: the job's eval_generate is the objective."""
        if self.job.eval_generate is not None and self.job.eval_generate != objective:
            raise ValueError("job.eval_generate differs from the sweep's objective metric; leave it out of the job "
                             "(the sweep sets it from objective)")
        if self.job.method != "sft":
            raise ValueError(f"objective: a generation metric scores an sft job's target text; job.method is "
                             f"{self.job.method} (use objective: eval_loss)")
        raw = self.job.model_dump(exclude_unset=True, mode="json")
        raw["eval_generate"] = objective.model_dump(mode="json", exclude_unset=True)
        object.__setattr__(self, "job", JobSpec(**raw))

    def parsed_space(self) -> dict[str, Dimension]:
        return parse_space(self.space)

    def trial_settings(self) -> list[dict[str, Any]]:
        """Each trial's settings, in trial order: the same for the same file and seed (random and grid only: a
        searcher's depend on the results)."""
        if self.search not in BUILT_IN:
            raise ValueError(f"a {self.search} search's trials are known only as the sweep runs")
        space = self.parsed_space()
        if self.search == "grid":
            return grid_trials(space)[:self.trials]
        return random_trials(space, self.trials or 0, self.seed)

    def row_jobs(self) -> list[tuple[dict[str, Any], JobSpec]]:
        """The jobs whose data rows stand for every trial's, each with the space's settings that make it: one per
        distinct combination of the values (both ends of a range, every option) that the space gives the fields the
        row check reads (ROW_FIELDS: max_seq_len, eval_split, ...); the sweep's own job alone (settings {}) where
        the space varies none of them."""
        reading = {path: dimension for path, dimension in self.parsed_space().items()
                   if path.split(".")[0] in ROW_FIELDS}
        if not reading:
            return [({}, self.job)]
        jobs: dict[str, tuple[dict[str, Any], JobSpec]] = {}
        for values in itertools.product(*(dimension.corners() for dimension in reading.values())):
            settings = dict(zip(reading, values, strict=True))
            job = trial_job(self.job, settings, self.job.name)
            jobs.setdefault(job.model_dump_json(include=set(ROW_FIELDS)), (settings, job))
        return list(jobs.values())

    def trial_jobs(self) -> list[JobSpec]:
        """Each trial as a job: the sweep's job with the trial's settings, named `<job>-t<index>`."""
        return [trial_job(self.job, settings, trial_name(self.job.name, index))
                for index, settings in enumerate(self.trial_settings())]


def trial_name(job_name: str, index: int) -> str:
    return f"{job_name}-t{index}"


def trial_job(job: JobSpec, settings: dict[str, Any], name: str) -> JobSpec:
    """`job` with `settings` (dotted paths) applied and the name `name`."""
    raw = job.model_dump(exclude_unset=True, mode="json")
    raw["name"] = name
    for path, value in settings.items():
        _set(raw, path.split("."), value)
    return JobSpec(**raw)


ADAPTER_SHAPE = ("lora.kind", "lora.r", "lora.alpha", "lora.use_rslora", "lora.use_dora", "lora.target_modules",
                 "lora.init_lora_weights", "lora")
"""What a saved adapter (`init_adapter`) fixes: a sweep of trials that start from one cannot vary it."""


def _set(raw: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        raw = raw.setdefault(key, {})
    raw[keys[-1]] = value


def _check_path(path: str) -> None:
    keys = path.split(".")
    if keys[0] in UNSEARCHABLE:
        raise ValueError(f"space.{path}: a sweep does not vary job.{keys[0]} (its trials' "
                         f"{'names' if keys[0] == 'name' else keys[0]} are the sweep's); leave it out of the space")
    model: type[BaseModel] | None = JobSpec
    for depth, key in enumerate(keys):
        fields = model.model_fields if model is not None else {}
        if key not in fields:
            where = "job" + "".join(f".{k}" for k in keys[:depth])
            close = [ALIASES[key]] if ALIASES.get(key) in fields else difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {'.'.join([*keys[:depth], close[0]])}?" if close else \
                f" (its fields: {', '.join(fields)})" if fields else " (it has no fields)"
            raise ValueError(f"space.{path}: {where} has no field '{key}'{hint}")
        model = _model_of(fields[key].annotation)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (through `X | None`), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in getattr(annotation, "__args__", ()):
        if isinstance(argument, type) and issubclass(argument, BaseModel):
            return argument
    return None


def _check_values(job: JobSpec, path: str, dimension: Dimension) -> None:
    for value in dimension.corners():
        try:
            trial_job(job, {path: value}, job.name)
        except ValidationError as error:
            problem = error.errors()[0]
            raise ValueError(f"space.{path}.{dimension.kind}: {value!r} does not make a valid job: "
                             f"{'.'.join(map(str, problem['loc']))}: {problem['msg']}") from None
