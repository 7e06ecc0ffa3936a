"""What the trainer loop steps (`StepEngine`): one device's `FusedTrainer` (actors/engine/trainer.py) or a
pipeline trainer's `PipelineEngine` (actors/service/pipeline/pipeline_engine.py), each a whole implementation of it,
so that the loop never asks which one it holds.

Where an engine lacks a feature, it says so in data, not by a missing method: `generation_refusal` (why it
cannot continue a prompt, or None; both engines decode: `decode`, and sample GRPO jobs' completions:
`rollouts`), `lost` and `rebuild` (one device never loses a stage: None,
nothing to rebuild), `fuses_calls` (whether interactive models' calls can share its steps), `held_adapters` (who
holds a finished job's saved adapter for a "try it" call: None on one device, whose base takes it directly)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from actors.engine.generation_eval import GenerationEvaluation
from actors.engine.models import BaseModel
from actors.engine.step_report import StepReport


@runtime_checkable
class StepEngine(Protocol):
    step_tokens: int
    step_count: int
    jobs: dict[str, Any]
    lost: Exception | None                 # a pipeline's stage lost (until `rebuild`); None on one device

    @property
    def base(self) -> BaseModel: ...

    @property
    def generation_refusal(self) -> str | None:
        """Why this engine cannot continue a prompt ("try it"), or None."""

    @property
    def fuses_calls(self) -> bool:
        """Whether interactive models' forward_backward calls can share its steps (`run_step`'s `calls`)."""

    @property
    def held_adapters(self) -> Any:
        """Who holds a finished job's saved adapter for a decoding call (`try_adapter.HeldAdapters`: a pipeline's
        stages), or None (one device: its base takes the adapter itself)."""

    def compose(self, jobs: list[Any], fits: Any = None) -> list[tuple[Any, list[Any]]]: ...

    def rollouts(self, chosen: list[tuple[Any, list[Any]]]) -> tuple[list[tuple[Any, list[Any]]],
                                                                    list[tuple[Any, Exception]]]: ...

    def run_step(self, chosen: list[tuple[Any, list[Any]]], *, measure: bool = False,
                 meanwhile: Callable[[], None] | None = None, calls: Any = None) -> StepReport: ...

    def remove_job(self, name: str) -> Any: ...

    def evaluate(self, job: Any, examples: list[Any] | None = None, batch_size: int = 8) -> float: ...

    def evaluate_generation(self, jobs: list[Any]) -> list[GenerationEvaluation]: ...

    def decode(self, requests: list[Any], choose: Callable, finished: Callable) -> None:
        """`generate.decode` on this engine: one device's base, or over a pipeline's stages."""

    def rebuild(self) -> None: ...

    def close(self) -> None: ...
