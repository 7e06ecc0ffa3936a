"""Composing a fused step: which jobs join it (round-robin within the step's tokens and a memory budget, or
a policy's step composer, its answer checked and its failure contained), each job's micro-batch as the step
will hold it (a GRPO job's prompts as their longest completions), and the step's tokens, padding included.
`FusedTrainer` (actors/engine/trainer.py) composes its steps so: it holds a `StepComposition` over its jobs."""

from __future__ import annotations

import logging
from collections.abc import Callable

from actors.data import Example
from actors.engine.compiled import bucket_length
from actors.engine.job import TrainingJob
from actors.engine.packing import JobMicroBatch
from actors.spec.base_settings import Layout
from policies.base import NextBatch, StepComposer

log = logging.getLogger(__name__)


class StepComposition:
    """The composition of one trainer's steps (`compose`, `planned`, `step_cost`) over its jobs (`jobs`: the
    trainer's, in the order they were added), its layout, whether its steps are compiled (`bucketed`), its step
    composer, and what composing keeps from step to step (`rotation`, `last_joined`, `composer_failed`)."""

    def __init__(self, jobs: dict[str, TrainingJob], composer: StepComposer | None, *, layout: Layout,
                 bucketed: bool):
        self.jobs = jobs                          # the trainer's (the same dict)
        self.composer = composer
        self.layout = layout
        self.bucketed = bucketed
        self.composer_failed = False             # its last answer was unusable: round-robin meanwhile
        self.last_joined: dict[str, int] = {}   # job -> the last step it took part in
        self.rotation = 0

    def compose(self, candidates: list[TrainingJob], step_tokens: int, step_count: int,
                fits: Callable[[list[JobMicroBatch]], bool] | None = None) -> list[tuple[TrainingJob, list[Example]]]:
        """Which of `candidates` join the next step (the trainer's `step_count`-th), each with its next
        micro-batch. With a `composer` (a policy's `compose_step`, e.g. MinPad), it chooses; otherwise
        round-robin from where the last step left off, each job's next micro-batch taken while the step stays
        within `step_tokens` and, with `fits`, within what `fits` allows (e.g. a memory budget); the first
        always joins."""
        candidates = [job for job in candidates if job.peek() is not None]
        if not candidates:
            return []
        start = self.rotation % len(candidates)
        ordered = candidates[start:] + candidates[:start]
        self.rotation += 1
        chosen = None
        if self.composer is not None:
            try:
                chosen = self._composed(ordered, step_tokens, step_count, fits)
            except Exception as error:  # a policy's step composer is plug-in code: contained
                if not self.composer_failed:
                    log.exception("step composer %s failed (%r); composing round-robin until it works again",
                                  self.composer_name, error)
                self.composer_failed = True
            else:
                self.composer_failed = False
        if chosen is None:
            chosen = self._round_robin(ordered, step_tokens, fits)
        for job, _ in chosen:
            self.last_joined[job.name] = step_count
        # Keep the stream grouped in a stable order (the order jobs were added).
        order = {name: i for i, name in enumerate(self.jobs)}
        chosen.sort(key=lambda pair: order[pair[0].name])
        return [(job, job.take()) for job, _ in chosen]

    @property
    def composer_name(self) -> str:
        """The composer's class (the policy's, where it is held apart from its `decide`: HeldComposer)."""
        return getattr(self.composer, "composer_name", type(self.composer).__name__)

    def forget(self, name: str) -> None:
        """A job left the trainer."""
        self.last_joined.pop(name, None)

    def _round_robin(self, ordered: list[TrainingJob], step_tokens: int,
                     fits: Callable[[list[JobMicroBatch]], bool] | None) -> list[tuple[TrainingJob, list[Example]]]:
        """Each job's next micro-batch in `ordered`'s order, taken while the step stays within `step_tokens` (its
        cost kept as running totals, `StepTokens`: the same count as `step_cost` of the jobs so far and this one,
        without counting them all again for each job) and what `fits` allows; the first always joins."""
        chosen: list[tuple[TrainingJob, list[Example]]] = []
        planned: list[JobMicroBatch] = []
        tokens = StepTokens(self.layout, bucketed=self.bucketed)
        for job in ordered:
            batch = job.peek()
            micro_batch = self.planned(JobMicroBatch(job.name, batch))
            if chosen and (tokens.cost_with(micro_batch) > step_tokens
                           or (fits is not None and not fits([*planned, micro_batch]))):
                continue
            chosen.append((job, batch))
            planned.append(micro_batch)
            tokens.add(micro_batch)
        return chosen

    def _composed(self, ordered: list[TrainingJob], step_tokens: int, step_count: int,
                  fits: Callable[[list[JobMicroBatch]], bool] | None) -> list[tuple[TrainingJob, list[Example]]]:
        """Ask the composer; check that its answer is a non-empty set of these jobs within the budget."""
        by_name = {job.name: job for job in ordered}
        batches = {job.name: job.peek() for job in ordered}
        views = [NextBatch(job.name, tuple(len(e) for e in batches[job.name]),
                           step_count - self.last_joined.get(job.name, -1) - 1, job.spec.priority)
                 for job in ordered]

        def micro(chosen: list[NextBatch]) -> list[JobMicroBatch]:
            return [self.planned(JobMicroBatch(v.job, batches[v.job])) for v in chosen]

        names = self.composer.compose_step(views, lambda chosen: self.step_cost(micro(chosen)), step_tokens,
                                           lambda chosen: fits is None or fits(micro(chosen)))
        unknown = [name for name in names if name not in by_name]
        if not names or unknown or len(set(names)) != len(names):
            raise ValueError(f"step composer {self.composer_name} chose {names!r}: it must return a "
                             f"non-empty list of distinct jobs from {sorted(by_name)}")
        if len(names) > 1 and self.step_cost(micro([v for v in views if v.job in names])) > step_tokens:
            raise ValueError(f"step composer {self.composer_name} chose {names!r}, which exceeds the "
                             f"step's {step_tokens} tokens")
        return [(by_name[name], batches[name]) for name in names]

    def planned(self, micro_batch: JobMicroBatch) -> JobMicroBatch:
        """The micro-batch as the step will hold it: a GRPO job's prompts each as `num_generations` sequences of
        the prompt's row and `max_new_tokens` more (the most its completions take), the others as they are."""
        job = self.jobs.get(micro_batch.job)
        config = job.spec.grpo if job is not None else None
        if config is None or not micro_batch.examples or not isinstance(micro_batch.examples[0], Example):
            return micro_batch
        stand_ins = [Example((0,) * (len(e) + config.max_new_tokens), (0,) * (len(e) + config.max_new_tokens))
                     for e in micro_batch.examples for _ in range(config.num_generations)]
        return JobMicroBatch(micro_batch.job, stand_ins)

    def step_cost(self, micro_batches: list[JobMicroBatch]) -> int:
        """Tokens a step of these micro-batches processes, padding included (with `compile`, the bucket's)."""
        longest = max(len(e) for mb in micro_batches for e in mb.rows)
        tokens = sum(mb.padded_tokens(self.layout, longest) for mb in micro_batches)
        return bucket_length(tokens) if self.bucketed else tokens


class StepTokens:
    """A step's cost in tokens (`StepComposition.step_cost`: padding included, the bucket's with `compile`) kept as
    running totals while micro-batches join it one by one: the cost with one more is known without counting the
    others again (a step of many jobs is composed in time linear in its jobs)."""

    def __init__(self, layout: Layout, *, bucketed: bool):
        self.layout, self.bucketed = layout, bucketed
        self.rows = self.longest = self.tokens = self.padded = 0

    def cost_with(self, micro_batch: JobMicroBatch) -> int:
        rows, longest, tokens, padded = _sizes(micro_batch)
        if self.layout == "packed":
            total = self.tokens + tokens
        elif self.layout == "padded":   # each micro-batch's rows padded to its own longest
            total = self.padded + padded
        else:                           # padded_fused: every row padded to the step's longest
            total = max(self.longest, longest) * (self.rows + rows)
        return bucket_length(total) if self.bucketed else total

    def add(self, micro_batch: JobMicroBatch) -> None:
        rows, longest, tokens, padded = _sizes(micro_batch)
        self.rows += rows
        self.longest = max(self.longest, longest)
        self.tokens += tokens
        self.padded += padded


def _sizes(micro_batch: JobMicroBatch) -> tuple[int, int, int, int]:
    """(rows, the longest row, real tokens, tokens with its rows padded to its longest)."""
    rows = micro_batch.rows
    longest = max(len(row) for row in rows)
    return len(rows), longest, micro_batch.num_tokens, longest * len(rows)
