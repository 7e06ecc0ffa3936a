"""The job actor's core: a job's data (read, tokenized, split), served to its trainer by position, and
its loss history, from which it decides when the job is done."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.data import DataCursor, Example, split_eval
from actors.data.dataset import load_dataset_examples
from actors.data.digest import data_digest
from actors.data.locations import open_table
from actors.data.streaming import StreamingCursor, open_stream
from actors.data.tables import RowTable
from actors.service.trainer.feed import FeedChunk
from actors.service.trainer.stop_verdicts import VERDICT_LAG
from actors.spec.job_spec import cursor_epochs, planned_steps
from actors.spec.job_submission import JobSubmission
from policies.stopping import LossHistory, StopDecision, Verdict, stop_rule_for

if TYPE_CHECKING:   # transformers takes a second or more to import: the scheduler, which imports this, needs none
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DataSummary:
    train_examples: int
    eval_examples: int
    dropped: int
    total_steps: int
    start: dict[str, Any]        # the cursor position of the job's first micro-batch
    digest: str | None = None    # of the data it read (actors/data/digest.py), kept with its checkpoints


@dataclass
class JobUpdate:
    """What a trainer tells a job after a step: its finished optimizer steps and evaluations, or that it
    resumed from a checkpoint at `resumed_from` (steps after it will be replayed)."""

    steps: list[dict] = field(default_factory=list)       # OptimizerStepRecord rows
    evals: list[tuple[int, float]] = field(default_factory=list)
    scores: list[tuple[int, float]] = field(default_factory=list)   # eval_generate's (step, score)
    resumed_from: int | None = None
    # with `resumed_from`: the steps it trains to from there, as its trainer planned them (a job its epochs raised
    # continues to `job_spec.continued_steps`, not to what a job given them at once plans): its stop rule's budget
    total_steps: int | None = None


class JobData:
    def __init__(self, job_id: str, submission: JobSubmission, tokenizer: PreTrainedTokenizerBase):
        self.job_id = job_id
        self.submission = submission
        self.spec = submission.job
        self.tokenizer = tokenizer
        self.cursor: DataCursor | StreamingCursor | None = None
        self.eval: list[Example] = []
        self.summary: DataSummary | None = None
        self.history = LossHistory()
        self.stop_rule = None   # set once the data (and so the job's budget) is known
        self.decision: StopDecision | None = None
        self.tokens = 0
        self.last_update = time.time()

    def prepare(self) -> DataSummary:
        """Read and tokenize the job's data; a malformed row raises `DataError` naming file, line, field."""
        if self.summary is not None:
            return self.summary
        spec = self.spec
        table = open_table(spec.data, spec.split)
        digest = data_digest(table, streaming=spec.streaming)
        if spec.streaming:
            return self._prepare_stream(table, digest)
        loaded = load_dataset_examples(spec.data, spec.format, self.tokenizer, max_seq_len=spec.max_seq_len,
                                       train_on_prompt=spec.train_on_prompt, split=spec.split, columns=spec.columns,
                                       table=table)
        self._warn_dropped(loaded.dropped, "")
        train, self.eval = split_eval(loaded.examples, spec.eval_split, self.submission.seed)
        self.cursor = DataCursor(train, spec.batch_size, seed=self.submission.seed, epochs=cursor_epochs(spec))
        self.summary = DataSummary(train_examples=len(train), eval_examples=len(self.eval), dropped=loaded.dropped,
                                   total_steps=planned_steps(spec, len(train)), start=self.cursor.state_dict(),
                                   digest=digest)
        self.stop_rule = stop_rule_for(spec.early_stop, spec.eval_every, self.summary.total_steps)
        return self.summary

    def _warn_dropped(self, dropped: int, which: str) -> None:
        if dropped:
            rows, have = ("1 row", "has") if dropped == 1 else (f"{dropped} rows", "have")
            log.warning("job %s: %s of%s %s %s no target token left after truncation to max_seq_len=%d (left out; a "
                        "larger max_seq_len keeps them)", self.job_id, rows, which, self.spec.data, have,
                        self.spec.max_seq_len)

    def _prepare_stream(self, table: RowTable, digest: str) -> DataSummary:
        """A streaming job (actors/data/streaming.py): only its eval rows (the first `eval_split`) are
        read now; `train_examples` counts rows (0 where they are not counted: no `epochs`, no metadata)."""
        spec = self.spec
        stream = open_stream(spec.data, spec.format, self.tokenizer, max_seq_len=spec.max_seq_len,
                             train_on_prompt=spec.train_on_prompt, split=spec.split, columns=spec.columns,
                             batch_size=spec.batch_size, seed=self.submission.seed, epochs=cursor_epochs(spec),
                             eval_rows=int(spec.eval_split), shuffle_window=spec.shuffle_window, table=table)
        self.cursor, self.eval = stream.cursor, stream.eval
        self._warn_dropped(stream.eval_dropped, " its eval split's")   # the training rows' are met as they stream
        rows = stream.train_rows or 0
        self.summary = DataSummary(train_examples=rows, eval_examples=len(self.eval), dropped=stream.eval_dropped,
                                   total_steps=planned_steps(spec, rows), start=self.cursor.state_dict(), digest=digest)
        self.stop_rule = stop_rule_for(spec.early_stop, spec.eval_every, self.summary.total_steps)
        return self.summary

    def fetch(self, position: dict[str, Any], count: int) -> FeedChunk:
        """`count` micro-batches from `position` on (fewer at the end of the data)."""
        cursor = self._cursor()
        cursor.load_state_dict(position)
        batches, positions = [], []
        for _ in range(count):
            before = cursor.state_dict()
            batch = cursor.next_batch()
            if batch is None:
                break
            batches.append(batch)
            positions.append(before)
        return FeedChunk(batches, positions, cursor.state_dict(), cursor.exhausted)

    def eval_examples(self) -> list[Example]:
        self._cursor()
        return self.eval

    def peek_lengths(self, position: dict[str, Any], batches: int = 1) -> list[int]:
        cursor = self._cursor()
        cursor.load_state_dict(position)
        return cursor.peek_lengths(batches)

    def update(self, update: JobUpdate) -> Verdict:
        """Book a trainer's update; answer with a stop decision once the stop rule makes one, and the
        step the rule predicts the job will stop at."""
        self.last_update = time.time()
        if update.resumed_from is not None:
            # the checkpoint's steps and evals are the truth (a new job actor knows none of them, a kept one all)
            self.history.truncate(update.resumed_from)
            if update.steps:
                self.history.train = [(row["step"], row["loss"]) for row in update.steps]
                self.tokens = sum(row["tokens"] for row in update.steps)
            if update.evals:
                self.history.eval = [(step, loss) for step, loss in update.evals if step <= update.resumed_from]
            if update.total_steps is not None and self.stop_rule is not None:
                self.stop_rule = stop_rule_for(self.spec.early_stop, self.spec.eval_every, update.total_steps)
            self.decision = self._decision_on_resume(update.resumed_from)
            return Verdict(self.decision, None)
        for row in update.steps:
            self.history.train.append((row["step"], row["loss"]))
            self.tokens += row["tokens"]
        self.history.eval.extend(update.evals)
        predicted = None
        if self.decision is None and self.stop_rule is not None and (update.steps or update.evals):
            try:
                self.decision = self.stop_rule.decide(self.history)
                if self.decision is None and update.evals and hasattr(self.stop_rule, "predicted_stop_step"):
                    predicted = self.stop_rule.predicted_stop_step(self.history)
            except Exception:  # a stop rule that fails costs this job its early stop, nothing else
                log.exception("job %s: its stop rule failed; it trains to the end of its budget", self.job_id)
                self.stop_rule = None
        return Verdict(self.decision, predicted)

    def _decision_on_resume(self, step: int) -> StopDecision | None:
        """The stop decision of the job's last `VERDICT_LAG` steps up to `step` (its checkpoint), made again
        from the restored history: a pause may have ended the job before the trainer applied them. The
        rule depends on the history alone, so this is the decision those steps' updates got (or would have)."""
        if self.stop_rule is None:
            return None
        for last in range(max(step - VERDICT_LAG + 1, 1), step + 1):
            history = LossHistory(list(self.history.train), list(self.history.eval))
            history.truncate(last)
            try:
                decision = self.stop_rule.decide(history)
            except Exception:  # a stop rule that fails costs this job its early stop, nothing else
                log.exception("job %s: its stop rule failed; it trains to the end of its budget", self.job_id)
                self.stop_rule = None
                return None
            if decision is not None:
                return decision
        return None

    def _cursor(self) -> DataCursor | StreamingCursor:
        if self.cursor is None:
            self.prepare()
        assert self.cursor is not None
        return self.cursor
