"""Service configuration: where the service keeps its state, which trainers it runs (each with its base
model) and which policy assigns jobs to them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from actors.engine.spec import StrictModel, canonical_base_model

SCHEDULER_NAME = "aspen-scheduler"
NAMESPACE = "aspen"


class TrainerConfig(StrictModel):
    """One kind of trainer: `count` of them (or one per GPU with `gpus_per_trainer: 1`)."""

    base_model: str = "smollm2-135m"
    quantization: Literal["none", "int8", "nf4"] = "none"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    step_tokens: int = Field(4096, ge=16)
    layout: Literal["packed", "padded", "padded_fused"] = "packed"
    count: int = Field(1, ge=1)
    num_gpus: float = Field(0, ge=0, description="GPUs per trainer (1 on a GPU machine)")
    num_cpus: float = Field(1, ge=0, description="CPUs Ray reserves per trainer")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: the node's cores / trainers)")
    memory_budget_bytes: int | None = Field(None, ge=1, description="default: 90% of the GPU, or half the RAM")
    max_jobs: int | None = Field(None, ge=1, description="at most this many jobs at once (default: as many as fit)")
    prefetch: int = Field(4, ge=1, description="micro-batches each job keeps on their way to the trainer")
    step_log: Path | None = Field(None, description="where its per-step rows go (default: "
                                                    "<state_dir>/trainers/<trainer id>.jsonl)")

    @field_validator("base_model")
    @classmethod
    def _canonical(cls, value: str) -> str:
        return canonical_base_model(value)


class MetricsConfig(StrictModel):
    """The Prometheus scrape endpoint the service serves (`/metrics`)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(9464, ge=0, le=65535, description="0: any free port (the service reports which)")


class EventsConfig(StrictModel):
    """Job events over MQTT: an embedded broker started with the service, or an external one."""

    enabled: bool = True
    broker: str = Field("embedded", description="'embedded' (amqtt on 127.0.0.1:embedded_port) or a URL "
                                                "mqtt://host:1883 / mqtts://host:8883")
    embedded_port: int = Field(1883, ge=0, le=65535, description="0: any free port")
    username: str | None = None
    password: str | None = None
    ca_file: Path | None = Field(None, description="CA certificate for mqtts:// (default: the system's)")
    topic_prefix: str = "aspen/v1"


class ServiceConfig(StrictModel):
    state_dir: Path = Path("~/.aspen").expanduser()
    trainers: list[TrainerConfig] = Field(default_factory=list, description="default: one per GPU, else one CPU trainer")
    policy: str = Field("adaptive", description="fifo | sjf | priority | adaptive | module:Class | an entry "
                                                 "point name in the group aspen.policies")
    tick_seconds: float = Field(0.25, gt=0)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    trainer_timeout_s: float = Field(600.0, gt=0, description="a trainer that does not answer a poll this long "
                                     "(a hung process; a dead one is noticed at once) is replaced")
