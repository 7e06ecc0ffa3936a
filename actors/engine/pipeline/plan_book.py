"""The pipeline head's book of its plans: each plan it sent, the results stage 0 hands back as the operations run,
booked in plan order into the jobs' losses, accumulations and histories, each once its closing jobs' gradient
norms are known (stage 0's backward); a report per plan."""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.job import OptimizerStepRecord, StepAccumulator
from actors.engine.optim import lr_factor
from actors.engine.pipeline.head_jobs import HeadJob
from actors.engine.pipeline.pipeline_schedule import MicroBatchPlan


@dataclass(kw_only=True)
class PlanReport:
    index: int
    jobs: list[str]
    tokens: int
    padding_tokens: int
    losses: dict[str, float]


class PlanBook:
    """`sent` as each plan goes to the stages, `on_result` as its result comes back, `book` after every message;
    `reports`: the booked plans' reports, in order. `jobs` and `norms` are the head's (a job removed meanwhile has
    its losses reported, not booked)."""

    def __init__(self, jobs: dict[str, HeadJob], norms: dict[tuple[str, int], float]):
        self.jobs = jobs
        self.norms = norms   # stage 0's total gradient norm of each closing (job, plan), until booked
        self.plans: dict[int, MicroBatchPlan] = {}
        self.results: dict[int, dict] = {}
        self.booked = -1
        self.next_index = 0
        self.reports: list[PlanReport] = []

    def sent(self, plan: MicroBatchPlan) -> None:
        """The plan (`next_index`'s) sent to every stage."""
        assert plan.index == self.next_index, (plan.index, self.next_index)
        self.plans[plan.index] = plan
        self.next_index += 1

    def on_result(self, result: dict) -> None:
        self.results[result["index"]] = result

    def book(self) -> None:
        """Book results in plan order, each once its closing jobs' norms are known (stage 0's backward)."""
        while (index := self.booked + 1) in self.results:
            plan = self.plans[index]
            if any((job, index) not in self.norms for job in plan.closes):
                return
            result = self.results.pop(index)
            del self.plans[index]
            losses = {}
            for position, name in enumerate(result["jobs"]):
                job = self.jobs.get(name)
                loss = result["losses"][position]
                losses[name] = loss
                if job is None:
                    continue
                job.losses.append(loss)
                job.accumulator.add(loss, result["tokens"][position], result["counts"][position],
                                    result["metrics"][position])
                job.tokens_seen += result["tokens"][position]
                if position in result["generations"]:   # a GRPO generation's, to replay against
                    job.generation_booked(result["generations"][position])
                if name in plan.closes:
                    self._close_step(job, self.norms.pop((name, index)))
            self.reports.append(PlanReport(index=index, jobs=list(result["jobs"]), tokens=result["stream"],
                                           padding_tokens=result["padding"], losses=losses))
            self.booked = index

    @staticmethod
    def _close_step(job: HeadJob, norm: float) -> None:
        """The job's accumulation closed as one optimizer step of its history, at its schedule's learning rate."""
        step = len(job.history)
        factor = lr_factor(step, schedule=job.spec.lr_schedule, warmup_steps=job.spec.warmup_steps,
                           total_steps=job.total_steps)
        job.history.append(OptimizerStepRecord(step=step + 1, loss=job.accumulator.loss, tokens=job.accumulator.tokens,
                                               lr=job.spec.lr * factor, grad_norm=norm,
                                               metrics=job.accumulator.metrics))
        job.accumulator = StepAccumulator()
