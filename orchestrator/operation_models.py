"""Each service operation's request and response, typed (pydantic): what a caller sends (the arguments of the
Ray client's and the HttpClient's method, the HTTP route's path, query and body) and what it gets back (the
HTTP route's response model, the clients' return type). The catalogue (service_operations.py) names one of
each per operation, and tests/unit/orchestrator/test_service_operations.py holds every surface to them.

A request whose whole body is a spec (a jobs file, a sweep file) is that spec's own model (`RunSpec`,
`JobSpec`, `SweepSpec`): validated once, where the caller builds it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors.service.table.job_record import BestEvaluation, JobRecord


class Open(BaseModel):
    """A response whose named fields are always there; the others a caller may find beside them (a trainer's
    description, a sweep's leaderboard) pass through as they are."""

    model_config = ConfigDict(extra="allow")


# -- requests ------------------------------------------------------------------------------------------------

class JobRef(BaseModel):
    job: str = Field(description="the job's id, or a name only one job has")


class JobsQuery(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    states: list[str] | None = Field(None, alias="state", description="only jobs in these states")
    limit: int | None = Field(None, description="at most this many jobs (a page), oldest first")
    after: str | None = Field(None, description="the jobs after this cursor (`<submitted_at>,<job id>` of the last "
                                                "job of the page before: its next link's `after`)")


MAX_NEW_TOKENS = 256          # as actors/service/trainer/try_adapter.py takes
MAX_PROMPT_CHARS = 4000


class GenerateBody(BaseModel):
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="the text to continue")
    max_new_tokens: int = Field(64, ge=1, le=MAX_NEW_TOKENS, description="how many tokens to generate at most")


class GenerateCall(JobRef, GenerateBody):
    pass


class TryTicket(BaseModel):
    ticket: str = Field(description="the ticket a \"try it\" was sent with (`generate`'s `ticket`)")


class MaxStepsBody(BaseModel):
    max_steps: int = Field(gt=0, description="the job's new budget of optimizer steps, above its present max_steps")


class RaiseMaxSteps(JobRef, MaxStepsBody):
    pass


class BudgetBody(BaseModel):
    max_steps: int | None = Field(None, gt=0, description="the job's new budget of optimizer steps, above its "
                                                           "present max_steps")
    epochs: float | None = Field(None, gt=0, description="the job's new passes over its data, above its present epochs "
                                                         "(it trains on into its next epoch)")

    @model_validator(mode="after")
    def _raises_one(self) -> BudgetBody:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("give max_steps, epochs or both: the job's budget raised")
        return self


class RaiseBudget(JobRef, BudgetBody):
    pass


class ExportCall(JobRef):
    checkpoint: bool = Field(False, description="its last checkpoint instead of its final adapter")


class GenerationsQuery(JobRef):
    step: int | None = Field(None, description="the evaluation after this step (default: the last)")


class GenerationRow(BaseModel):
    step: int
    row: int
    prompt: str
    reference: str
    prediction: str                   # the adapter's greedy continuation
    score: float


class Generations(BaseModel):
    steps: list[int]                  # every step the job was evaluated after with eval_generate
    step: int | None                  # the evaluation shown (None: none yet)
    rows: list[GenerationRow]
    best: BestEvaluation | None = Field(None, description="a keep_best job's best evaluation so far: the step whose "
                                                          "adapter it keeps (null: no keep_best, or not evaluated)")


class SweepRef(BaseModel):
    name: str


class EventsQuery(BaseModel):
    job: str | None = Field(None, description="one job's events only")
    progress: bool = Field(False, description="its steps too, not only its state changes")
    after: int | str | None = Field(None, description="the last event seen (HTTP: the Last-Event-ID header)",
                                    json_schema_extra={"http_header": "Last-Event-ID"})


class AuditQuery(BaseModel):
    user: str | None = None
    after: float | None = None


class TransitionsAfter(BaseModel):
    after: int
    limit: int = 1000


class WaitReady(BaseModel):
    timeout: float = 600


class WaitAll(BaseModel):
    jobs: list[Any]


class ExtendCall(BaseModel):
    job: str = Field(description="the job's id, or a name only one job has")
    submission: Any = Field(description="its JobSubmission with only max_steps raised")


class SubmitRecords(BaseModel):
    submissions: list[Any] = Field(description="JobSubmissions, each validated where it was built")


# -- responses -----------------------------------------------------------------------------------------------

class ServiceInfo(Open):
    state_dir: str
    policy: str
    output_root: str | None
    trainers: list[dict[str, Any]]
    job_slots: dict[str, Any]


class Health(BaseModel):
    status: str
    service: str
    detail: str | None = None


class Whoami(BaseModel):
    name: str
    admin: bool


class AccountRow(BaseModel):
    user: str | None = Field(description="null: jobs submitted through Ray, without a user")
    jobs: int
    tokens: int
    step_seconds: float
    gpu_seconds: float


class AuditRow(Open):
    time: float
    user: str
    action: str
    target: str


class Submitted(BaseModel):
    jobs: list[JobRecord]


class LossRow(BaseModel):
    """One optimizer step of a job, and beside these fields its method's metrics as its metrics.jsonl has them (a
    GRPO job's `reward`, `reward_std`, `rewards/<name>/mean`, `kl`, ...; a preference job's `rewards/margins`,
    ...)."""

    model_config = ConfigDict(extra="allow")

    step: int
    loss: float | None = None
    tokens: int | None = None
    lr: float | None = None
    grad_norm: float | None = None
    eval_loss: float | None = None
    eval_score: float | None = None   # the job's eval_generate metric, where it has one
    time: float


class Transition(BaseModel):
    time: float
    state: str
    reason: str


class Generated(BaseModel):
    job: str
    step: int = Field(description="the job's step whose adapter generated")
    prompt: str
    adapter: str = Field(description="the continuation through the job's adapter")
    base: str = Field(description="the continuation through the base model alone")
    prompt_tokens: int
    new_tokens: list[int]
    seconds: float


class JobSpecText(BaseModel):
    yaml: str = Field(description="a jobs file that submits the job again")
    jobs_file: dict[str, Any] = Field(description="that file's data")


class ServingAnswer(BaseModel):
    base: str
    gguf_file: str | None
    serving_id: str
    peft: str
    vllm: str | None
    elsewhere: str
    written: bool


class SweepStatus(Open):
    name: str
    state: str
    error: str | None = None
    waiting: str | None = Field(None, description="why its next trial waits to be submitted (its user's quota), "
                                                  "tried again as the sweep goes on")
    trials: list[dict[str, Any]]
    best: str | None = Field(None, description="the best trial's name")
