"""The jobs' gradient norms over a pipeline's stages, summed as one device sums them.

When a micro-batch closes a job's accumulation, each stage divides the job's gradients by its step's target
count and adds its tensors' squared norms to the partial sum the next stage passed back (`joint_steps.chained_sum`,
last stage first), so stage 0 ends with the same float64 sum a single device computes; it sends the total to
every stage, and each takes it for the job's optimizer step there (clip by the total)."""

from __future__ import annotations

import math
from collections import deque

from actors.engine.joint_steps import chained_sum, gradient_squares
from actors.engine.pipeline.pipeline_schedule import MicroBatchPlan
from actors.engine.pipeline.stage_jobs import StageJob
from actors.engine.pipeline.stage_messages import PlanMessage
from actors.engine.pipeline.stage_model import StageModel
from actors.engine.pipeline.transport import TAG_PARTIAL, TAG_TOTAL, StageLinks


class GradientNormChain:
    """One stage's part in the chain: its shares passed back (`add_share`), the totals taken for its steps
    (`total`); at stage 0 also the totals the head books (`for_head`)."""

    def __init__(self, model: StageModel, links: StageLinks):
        self.links = links
        self.stage, self.stages, self.last = model.stage, model.stages, model.last
        self.for_head: dict[tuple[str, int], float] = {}   # stage 0: each closing step's total, until booked
        self.for_step: dict[tuple[str, int], float] = {}   # stage 0: the same, until its own step takes it
        self.order: deque[tuple[str, int]] = deque()      # the order stage 0 sends totals in
        self.received: dict[tuple[str, int], float] = {}  # a later stage: totals received before their step

    def expect(self, plan: MicroBatchPlan) -> None:
        """The plan's closing jobs' totals come in plan order (fed as each plan is)."""
        self.order.extend((job, plan.index) for job in plan.closes)

    def add_share(self, message: PlanMessage, jobs: dict[str, StageJob]) -> None:
        """The closing jobs' gradient norms after the plan's backward here: this stage's share added to the
        partial sum from the next; stage 0 sends the totals on."""
        for name in message.plan.closes:
            job = jobs[name]
            squares = gradient_squares([job.optimizer], [message.step_targets[name]])[0] if job.optimizer else []
            start = self.links.recv_float(self.stage + 1, TAG_PARTIAL) if not self.last else 0.0
            partial = chained_sum(squares, start)
            if self.stage > 0:
                self.links.send_float(partial, self.stage - 1, TAG_PARTIAL)
                continue
            total = math.sqrt(partial)
            self.for_head[(name, message.plan.index)] = self.for_step[(name, message.plan.index)] = total
            for stage in range(1, self.stages):
                self.links.send_float(total, stage, TAG_TOTAL)

    def total(self, job: str, index: int) -> float:
        """The total norm of `job`'s step closed by micro-batch `index` (a later stage: received from stage 0,
        those of earlier steps kept meanwhile)."""
        if self.stage == 0:
            return self.for_step.pop((job, index))
        while (job, index) not in self.received:
            self.received[self.order.popleft()] = self.links.recv_float(0, TAG_TOTAL)
        return self.received.pop((job, index))
