"""Service configuration: where the service keeps its state, which trainers it runs (each with its base
model) and which policy assigns jobs to them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from actors.spec.base_settings import Compile, Dtype, Kernels, Layout, Quantization, Recompute
from actors.spec.field_types import INT64_MAX, Bounds, Location, StrictModel
from actors.spec.job_submission import canonical_base_model
from actors.spec.run_spec import RunSpec
from actors.spec.trainer_settings import (
    COMPILE_DESCRIPTION,
    KERNELS_DESCRIPTION,
    STAGE_SPLIT_DESCRIPTION,
    STAGES_DESCRIPTION,
    STEP_TOKENS_DESCRIPTION,
    Stages,
    StageSplit,
    StepTokensSetting,
    compile_problem,
    pipeline_problem,
)
from actors.spec.user_functions import check_allowed_entry
from actors.storage.s3_settings import S3Settings, endpoint_problem
from actors.storage.storage_uri import is_uri

Port = Annotated[int, Bounds(0, 65535)]

SCHEDULER_NAME = "aspen-scheduler"
NAMESPACE = "aspen"


class TrainerConfig(StrictModel):
    """One kind of trainer: `count` of them (or one per GPU with `gpus_per_trainer: 1`)."""

    base_model: str = Field("smollm2-135m", description="the base model this kind of trainer holds (as in a jobs file)")
    quantization: Quantization = Field("none", description="of the frozen base (the `quant` extra)")
    dtype: Dtype = Field(
        "auto", description="auto: float32 on CPU, bfloat16 on CUDA")
    step_tokens: StepTokensSetting = Field("auto", description=STEP_TOKENS_DESCRIPTION)
    layout: Layout = Field("packed", description="token layout of its fused steps")
    recompute: Recompute = Field(
        "none", description="layers: keep only each decoder layer's input for backward and recompute the layer "
                            "there (less activation memory; a frozen base's backward computes input gradients only, "
                            "so the forward again is about half more of the step's matrix products)")
    compile: Compile = Field("none", description=COMPILE_DESCRIPTION)
    kernels: Kernels = Field("auto", description=KERNELS_DESCRIPTION)
    stages: Stages = Field(1, description=STAGES_DESCRIPTION)
    stage_split: StageSplit = Field("measured", description=STAGE_SPLIT_DESCRIPTION)
    stage_placement: Literal["pack", "strict_pack", "spread"] = Field(
        "pack", description="with stages >= 2 on Ray: how the other stages' actors are placed (a placement group "
                            "of one bundle per stage, num_cpus / num_gpus each): pack (together where they fit), "
                            "strict_pack (all on one node) or spread (over nodes)")
    count: Annotated[int, Bounds(1, 1024)] = Field(
        1, description="trainers of this kind (nodes: each: on every node, GPU kinds at most one per num_gpus "
                       "of the node's GPUs)")
    nodes: Literal["any", "each"] = Field(
        "any", description="any: `count` trainers spread over the cluster's nodes that have their resources (one "
                           "whose node is lost starts again on a live node); each: on every node, following the "
                           "cluster as nodes join and leave")
    num_gpus: Annotated[float, Bounds(0, 1024)] = Field(
        0, description="GPUs per trainer (1 on a GPU machine); with stages >= 2 on Ray, per stage")
    num_cpus: Annotated[float, Bounds(0, 65536)] = Field(
        1, description="CPUs Ray reserves per trainer; with stages >= 2, per stage")
    threads: Annotated[int, Bounds(1, 4096)] | None = Field(
        None, description="torch CPU threads (default: its node's CPUs / the CPU trainers on that node)")
    memory_budget_bytes: Annotated[int, Bounds(1, INT64_MAX)] | None = Field(
        None, description="default: 90% of the GPU (times num_gpus where it is below 1: trainers sharing a GPU), or "
                          "half the RAM (divided among the CPU trainers' processes on one node)")
    max_jobs: Annotated[int, Bounds(1, 100_000)] | None = Field(
        None, description="at most this many jobs at once (default: as many as fit)")
    interactive_window_s: Annotated[float, Bounds(0, 10)] = Field(
        0.005, description="how long an interactive model's call (the Tinker API's) waits for other models' calls "
                           "to share its pass over the base")
    interactive_in_steps: bool = Field(
        True, description="an interactive model's forward_backward calls waiting as a job's step starts share that "
                          "step where they fit (throughput: one pass less; a call then waits for the whole step); "
                          "false: they always run in passes of their own between the jobs' steps")
    interactive_sample_slice_s: Annotated[float, Bounds(0.01, 3600)] | None = Field(
        1.0, description="how long a Tinker sampling batch decodes before the trainer's other work (jobs' steps, "
                         "other models' calls, the calls it answers) has its turn; its KV cache is kept, and counted "
                         "in the steps' memory meanwhile (null: a batch decodes whole, the trainer busy till its end)")
    interactive_checkpoint_every: Annotated[int, Bounds(0, 10**9)] = Field(
        10, description="optimizer steps between an interactive model's checkpoints, from which it resumes where its "
                        "trainer is lost (0: none)")
    interactive_heartbeat_timeout_s: Annotated[float, Bounds(1, 10**7)] = Field(
        300.0, description="an interactive model whose HTTP server stopped beating for it this long ends (its final "
                           "adapter kept), as when its session ends")
    prefetch: Annotated[int, Bounds(1, 1024)] = Field(
        4, description="micro-batches each job keeps on their way to the trainer")
    step_log: Path | None = Field(None, description="where its per-step rows go (default: "
                                                    "<state_dir>/trainers/<trainer id>.jsonl); a kind of several "
                                                    "trainers (count > 1 or nodes: each) gives each its own "
                                                    "<name>.<trainer id>.jsonl next to it")
    data_grace_s: Annotated[float, Bounds(0, 3600)] = Field(
        10.0, description="how long a step waits for a job's late micro-batch before it runs without that job "
                          "(once per delay; the other jobs go on)")
    staging_dir: Path | None = Field(
        None, description="node-local folder where the jobs whose output_dir is a storage URI (s3://...) are written "
                          "before their checkpoints, adapters and metrics are uploaded (default: <state_dir>/staging)")
    data_timeout_s: Annotated[float, Bounds(1, 10**6)] = Field(
        120.0, description="a job whose data has not arrived for this long (its job actor hung) is checkpointed "
                           "and started again with a new job actor")
    upload_timeout_s: Annotated[float, Bounds(0, 10**6, low_open=True)] = Field(
        600.0, description="a job leaving this trainer (completed, paused, moved, ...) whose output_dir is a storage "
                           "URI is reported ended once its adapter, metrics and checkpoint are uploaded; one whose "
                           "upload has not ended after this long fails with that reason (its checkpoint stays on the "
                           "node). A trainer shutting down waits at most this long (and 120 s) for uploads")

    @field_validator("base_model")
    @classmethod
    def _canonical(cls, value: str) -> str:
        return canonical_base_model(value)

    @model_validator(mode="after")
    def _compile_combination(self) -> TrainerConfig:
        problem = (compile_problem(self.compile, recompute=self.recompute, quantization=self.quantization,
                                   layout=self.layout)
                   or pipeline_problem(self.stages, self.stage_split, quantization=self.quantization, dtype=self.dtype,
                                       layout=self.layout, compile=self.compile, kernels=self.kernels))
        if problem is None and self.stages > 1 and 0 < self.num_gpus < 1:
            problem = (f"stages: {self.stages} with num_gpus: {self.num_gpus:g}: num_gpus is per stage and each stage "
                       "needs a GPU of its own (NCCL: one rank per device); set num_gpus: 1 (stages sharing one GPU: "
                       "`aspen run --in-process`)")
        if problem is not None:
            raise ValueError(problem)
        return self


def trainer_step_log(config: TrainerConfig, state_dir: Path, trainer_id: str) -> Path:
    """Where trainer `trainer_id` of kind `config` writes its step rows: `step_log` where the kind runs one
    trainer, `<stem>.<trainer id><suffix>` beside it where it runs several (they would share one file),
    `<state_dir>/trainers/<trainer id>.jsonl` without one."""
    if config.step_log is None:
        return Path(state_dir) / "trainers" / f"{trainer_id}.jsonl"
    if config.count == 1 and config.nodes == "any":
        return Path(config.step_log)
    return Path(config.step_log).with_name(f"{Path(config.step_log).stem}.{trainer_id}{Path(config.step_log).suffix}")


class MetricsConfig(StrictModel):
    """The Prometheus scrape endpoint the service serves (`/metrics`)."""

    enabled: bool = Field(True, description="serve /metrics")
    host: str = Field("127.0.0.1", description="address to listen on (127.0.0.1: this machine only)")
    port: Port = Field(9464, description="0: any free port (the service reports which)")


class EventsConfig(StrictModel):
    """Job events over MQTT: an embedded broker started with the service, or an external one."""

    enabled: bool = Field(True, description="publish job events over MQTT")
    broker: str = Field("embedded", description="'embedded' (amqtt on 127.0.0.1:embedded_port) or a URL "
                                                "mqtt://host:1883 / mqtts://host:8883")
    embedded_port: Port = Field(1883, description="0: any free port")
    username: str | None = Field(None, description="an external broker's account (the embedded one generates its own)")
    password: str | None = Field(None, description="that account's password")
    ca_file: Path | None = Field(None, description="CA certificate for mqtts:// (default: the system's)")
    topic_prefix: str = Field("aspen/v1", description="topics are <prefix>/service/status, <prefix>/jobs/<job>/...")
    retain_finished_s: Annotated[float, Bounds(0, 10**9)] | None = Field(
        7 * 24 * 3600.0, description="seconds after a job finished (completed, stopped early, failed, cancelled) "
                                     "that its retained state is cleared from the broker (null: kept until the job "
                                     "is deleted; a deleted job's is cleared at once)")


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class StorageConfig(StrictModel):
    """How every process of the service (scheduler, trainers, job actors, on every node) reaches storage URIs
    (s3://...): given here, they need no S3 settings in their environment. Credentials never go in this file:
    the `*_env` fields name the environment variables each process reads them from (default: the AWS SDK's
    own chain: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws, instance roles). A value given here wins
    over the environment's (AWS_ENDPOINT_URL_S3, AWS_REGION), which is used where none is given."""

    endpoint_url: str | None = Field(
        None, description="an S3-compatible store's endpoint, http://host:port or https://host (MinIO, Ceph, ...; "
                          "default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS S3 itself)")
    region: str | None = Field(None, description="the S3 region (default: AWS_REGION / AWS_DEFAULT_REGION)")
    access_key_env: str | None = Field(
        None, description="the NAME of the environment variable holding the access key id (with secret_key_env; "
                          "default: the AWS SDK's credential chain)")
    secret_key_env: str | None = Field(
        None, description="the NAME of the environment variable holding the secret access key")
    session_token_env: str | None = Field(
        None, description="the NAME of the environment variable holding a session token (temporary credentials)")

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            problem = endpoint_problem(value.strip())
            if problem:
                raise ValueError(f"storage.endpoint_url: {problem}")
            return value.strip().rstrip("/")
        return value

    @field_validator("access_key_env", "secret_key_env", "session_token_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not ENV_NAME.match(value):
            raise ValueError(f"{value!r} is not an environment variable name (letters, digits, _): these fields name "
                             "the variable that holds the credential, e.g. MINIO_ACCESS_KEY, never the credential")
        return value

    @model_validator(mode="after")
    def _key_pair(self) -> StorageConfig:
        if (self.access_key_env is None) != (self.secret_key_env is None):
            raise ValueError("storage: give both access_key_env and secret_key_env (the names of the variables holding "
                             "the access key id and the secret key), or neither (the AWS SDK's credential chain)")
        if self.session_token_env is not None and self.access_key_env is None:
            raise ValueError("storage: session_token_env goes with access_key_env and secret_key_env")
        return self

    def settings(self) -> S3Settings:
        return S3Settings(self.endpoint_url, self.region, self.access_key_env, self.secret_key_env,
                          self.session_token_env)


class ServiceConfig(StrictModel):
    state_dir: Path = Field(Path("~/.aspen").expanduser(), description="the job table, trainer logs, MQTT accounts, "
                                                                    "default job folders")
    trainers: list[TrainerConfig] = Field(
        default_factory=list, description="default: one per GPU of every node with GPUs; on a cluster without "
                                          "GPUs, cpu_trainers_per_node on every node (following the cluster)")
    cpu_trainers_per_node: Annotated[int, Bounds(1, 1024)] = Field(
        1, description="CPU trainers per node where `trainers` is left to its default on a cluster without GPUs")
    cluster_poll_s: Annotated[float, Bounds(0, 3600, low_open=True)] = Field(
        2.0, description="seconds between looks at the cluster's nodes (trainers start on nodes that join; a lost "
                         "node's jobs resume elsewhere)")
    policy: str = Field("adaptive", description="fifo | sjf | priority | adaptive | minpad | module:Class | an entry "
                                                 "point name in the group aspen.policies")
    tick_seconds: Annotated[float, Bounds(0, 3600, low_open=True)] = Field(
        0.25, description="seconds between scheduling rounds")
    policy_timeout_s: Annotated[float, Bounds(0, 3600, low_open=True)] = Field(
        5.0, description="how long a round waits for the policy's decisions: a round whose policy takes longer is "
                         "decided by FIFO (said in the log and the service's info), and a policy that does so 3 "
                         "rounds in a row is replaced by FIFO (docs/scheduling.md)")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="the Prometheus endpoint")
    events: EventsConfig = Field(default_factory=EventsConfig, description="job events over MQTT")
    trainer_timeout_s: Annotated[float, Bounds(0, 10**7, low_open=True)] = Field(
        600.0, description="a trainer that does not answer a poll this long (a hung process; a dead one is "
                           "noticed at once) is replaced")
    output_root: Location | None = Field(
        None, description="where submitted jobs may write, a path or a storage URI (s3://bucket/prefix, gs://...: "
                          "every job's checkpoints, adapter and metrics are uploaded there): a job's relative "
                          "output_dir is taken under it, an absolute one must lie in it, and a job without one "
                          "writes to <output_root>/<job id>. None: anywhere the service can write (a service of the "
                          "user's own, `aspen run`); "
                          "`aspen serve` sets <state_dir>/outputs unless the config names a root")
    fair_share_window_s: Annotated[float, Bounds(1, 10**8)] = Field(
        3600.0, description="the users' fair share counts the tokens their jobs trained over this many seconds")
    data_roots: list[str] | None = Field(
        None, description="where jobs may read data: folders (and everything under them, links resolved) and "
                          "storage URI prefixes (s3://bucket/prefix); a user's jobs may also read their own "
                          "(`aspen user add --data-root`). None: an operator's and an admin's jobs read anywhere, "
                          "a user's only under their own roots. No job reads the state folder or another user's "
                          "outputs")
    user_functions: list[Annotated[str, AfterValidator(check_allowed_entry)]] = Field(
        default_factory=list, description="functions that users' jobs may name as a grpo reward or a generation "
                                          "metric besides the built-in ones: module:function, or module:* for every "
                                          "function of a module (users' jobs run them on the trainers: allow only "
                                          "code you trust). Operators' and admins' jobs may name any")
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="S3 settings every process of the service uses for storage URIs "
                                                   "(the endpoint, the region, which environment variables hold "
                                                   "the credentials)")
    resume_on_start: bool = Field(
        True, description="jobs that were running when the service stopped resume at its start (false: they are "
                          "held as paused until resumed; `aspen run` decides per job)")
    job_processes_per_node: Annotated[int, Bounds(1, 100_000)] | None = Field(
        None, description="running jobs a node holds at most (each has a job actor: a process of its own, ~200 MB "
                          "resident); jobs beyond wait queued, without a process. None: from the node's memory "
                          "(job_host_share of what Ray counts as its memory, job_process_bytes each)")
    job_process_bytes: Annotated[int, Bounds(1, INT64_MAX)] = Field(
        256 * 2**20, description="host memory one running job's actor costs its node (measured: ~200 MB resident "
                                 "on CPython 3.11 with Ray 2.60 and a tokenizer)")
    job_host_share: Annotated[float, Bounds(0, 1, low_open=True)] = Field(
        0.35, description="the share of a node's memory (Ray's `memory` resource) its job actors may take")

    def job_slots(self, memory_bytes: float) -> int:
        """Running jobs a node with `memory_bytes` (Ray's memory resource) holds: `job_processes_per_node`, or
        from its memory (at least 1)."""
        if self.job_processes_per_node is not None:
            return self.job_processes_per_node
        return max(1, int(self.job_host_share * memory_bytes // self.job_process_bytes))


def run_local_dir(spec: RunSpec) -> Path:
    """Where a run's own service keeps its state (`<here>/.aspen`) and step log: the run's output folder, or
    for one that is a storage URI, `~/.aspen/runs/<bucket-and-prefix>` on this machine."""
    if is_uri(spec.output_dir):
        where = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(spec.output_dir).split("://", 1)[1]).strip("_")
        return Path("~/.aspen/runs").expanduser() / where
    return Path(spec.output_dir)


def run_service_config(spec: RunSpec, *, state_dir: Path | None = None, **fields: Any) -> ServiceConfig:
    """The service configuration that runs a jobs file, the one translation every way of running it uses
    (`aspen run`, its in-process mode, the demo, the benchmarks): one trainer with the run's base model,
    quantization, dtype, step budget, layout, recompute mode and kernels, on the GPU where the run's device is
    (or, with `auto`, where there is one), its step log in `<output_dir>/trainer.jsonl` (with
    `trainer={"count": n}`, each trainer's in `<output_dir>/trainer.<trainer id>.jsonl`); the run's policy; the state in
    `<output_dir>/.aspen` unless `state_dir` says otherwise. A run whose output_dir is a storage URI keeps its
    state and step log on this machine instead, in `~/.aspen/runs/<bucket-and-prefix>` (its job table must be
    a local file). `fields`: further ServiceConfig fields; `trainer` (a dict): further TrainerConfig fields."""
    output_dir = run_local_dir(spec)
    trainer_fields = dict(fields.pop("trainer", {}))
    if spec.device == "auto":
        from actors.service.scheduler.cuda_devices import cuda_device_count

        gpus = 1 if cuda_device_count() else 0
    else:
        gpus = 1 if spec.device.startswith("cuda") else 0
    trainer = TrainerConfig(**{"base_model": spec.base_model, "quantization": spec.quantization, "dtype": spec.dtype,
                               "step_tokens": spec.step_tokens, "layout": spec.layout, "recompute": spec.recompute,
                               "compile": spec.compile, "kernels": spec.kernels, "stages": spec.stages,
                               "stage_split": spec.stage_split,
                               "num_gpus": gpus,
                               "step_log": output_dir / "trainer.jsonl", **trainer_fields})
    return ServiceConfig(**{"state_dir": state_dir or output_dir / ".aspen", "trainers": [trainer],
                            "policy": spec.policy, **fields})
