"""Generation metrics of an evaluation: each held-out row's prompt continued greedily through the job's
adapter, the continuation scored against the row's target text, the score averaged over the rows.

A row is its tokenized example: the prompt is every token before its first target token, the reference is
the text of its first run of target tokens (the tokenizer's special tokens, e.g. the EOS the format
appends, left out). Continuations end at the tokenizer's EOS (left out of the prediction's text too) or
after `max_new_tokens`. Several jobs' rows decode in one batch (actors/engine/generate.py); a job's
rows decoded with its own `max_new_tokens` are a prefix of those decoded with a larger one (greedy), so one
batch serves every length."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from actors.data import Example
from actors.data.tokenize import IGNORE_INDEX
from actors.engine.generate import Decoder, greedy_generate_many
from actors.engine.models import BaseModel
from actors.engine.user_calls import CallFailed, FunctionWorker
from actors.spec.evaluation_config import GENERATION_METRICS, GenerationEval

Metric = Callable[[str, dict], float]


class MetricError(ValueError):
    """A user's metric function could not be loaded, raised, returned something that is not a number, ran past
    its deadline or ended its process."""


@dataclass(frozen=True)
class ScoredRow:
    """One row's prompt tokens and the text its continuation is scored against."""

    prompt: tuple[int, ...]
    reference: str
    prompt_text: str


def _answer(pattern: re.Pattern[str], text: str) -> str | None:
    match = pattern.search(text)
    if match is None:
        return None
    return (match.group(1) if pattern.groups else match.group(0)).strip()


def metric_function(config: GenerationEval) -> Metric:
    """A built-in `config.metric` as a function(prediction, row) -> float (a user's runs in the trainer's
    `FunctionWorker`: `generation_evaluations`)."""
    if config.metric == "exact_match":
        return lambda prediction, row: float(prediction.strip() == row["reference"].strip())
    if config.metric == "contains":
        return lambda prediction, row: float(row["reference"].strip() in prediction)
    if config.metric == "regex":
        pattern = re.compile(config.pattern or "")

        def regex(prediction: str, row: dict) -> float:
            expected = _answer(pattern, row["reference"])
            return float(expected is not None and _answer(pattern, prediction) == expected)

        return regex
    raise ValueError(f"eval_generate metric '{config.metric}' is a function of the user's: it runs in a "
                     "FunctionWorker (actors/engine/user_calls.py)")


def generation_scores_of(config: GenerationEval, predictions: list[str], rows: list[dict],
                         worker: FunctionWorker | None) -> list[float]:
    """The metric of each prediction against its row; MetricError naming the row where it fails."""
    if config.metric in GENERATION_METRICS:
        metric = metric_function(config)
        return [float(metric(prediction, row)) for prediction, row in zip(predictions, rows, strict=True)]
    if worker is None:
        raise ValueError(f"eval_generate metric '{config.metric}' is a function of the user's: pass the trainer's "
                         "FunctionWorker")
    try:
        return [float(value) for value in worker.call(config.metric, "eval_generate.metric", "rows",
                                                      [predictions, rows], config.timeout_s)]
    except CallFailed as failed:
        named = f"eval_generate metric '{config.metric}'"
        if failed.kind == "load":
            raise MetricError(failed.message) from None
        if failed.kind == "timeout":
            raise MetricError(f"{named} did not score {len(rows)} eval rows within {config.timeout_s:g} s "
                              "(eval_generate.timeout_s) and was stopped; make it faster or raise "
                              "eval_generate.timeout_s") from None
        if failed.kind == "ended":
            raise MetricError(f"{named}: {failed.message} while scoring {len(rows)} eval rows") from None
        row = failed.row or 0
        raise MetricError(f"{named} failed on eval row {row} (prediction {predictions[row][:80]!r}): "
                          f"{failed.message}; it must return a number for any text") from None


def scored_rows(examples: Sequence[Example], base: BaseModel, limit: int | None) -> list[ScoredRow]:
    """The rows a generation metric scores: the first `limit` examples (all: None) that have a prompt
    and a target."""
    rows = []
    tokenizer = base.tokenizer
    for example in examples[:limit] if limit is not None else examples:
        first = next((i for i, label in enumerate(example.labels) if label != IGNORE_INDEX), None)
        if not first:   # no target, or a target at position 0 (nothing to continue from)
            continue
        end = first
        while end < len(example.labels) and example.labels[end] != IGNORE_INDEX:
            end += 1
        prompt = tuple(example.input_ids[:first])
        rows.append(ScoredRow(prompt, tokenizer.decode(list(example.input_ids[first:end]), skip_special_tokens=True),
                              tokenizer.decode(list(prompt), skip_special_tokens=True)))
    return rows


def stop_token_ids(base: BaseModel) -> set[int]:
    """Where a continuation ends: the tokenizer's EOS and the model's generation config's EOS ids."""
    stops: set[int] = set()
    eos = getattr(base.tokenizer, "eos_token_id", None)
    if eos is not None:
        stops.add(int(eos))
    generation = getattr(base.model, "generation_config", None)
    configured = getattr(generation, "eos_token_id", None)
    if configured is not None:
        stops.update(int(t) for t in (configured if isinstance(configured, list | tuple) else [configured]))
    return stops


@dataclass(frozen=True)
class GenerationEvaluation:
    """One job's generation metric at one evaluation: the mean score, and each scored row as
    {prompt, reference, prediction, score} (texts; what the job's generations.jsonl keeps)."""

    score: float
    samples: list[dict]


def generation_jobs(jobs: Sequence[Any]) -> list[tuple[str, GenerationEval, Sequence[Example]]]:
    """`generation_evaluations`' input for a trainer's jobs (each with `name`, `spec.eval_generate`,
    `eval_examples`): ValueError naming a job with no metric or no eval rows."""
    for job in jobs:
        if job.spec.eval_generate is None or not job.eval_examples:
            raise ValueError(f"job '{job.name}' has no eval_generate metric or no eval rows")
    return [(job.name, job.spec.eval_generate, job.eval_examples) for job in jobs]


def generation_evaluations(base: BaseModel, jobs: Sequence[tuple[str, GenerationEval, Sequence[Example]]],
                           worker: FunctionWorker | None = None,
                           decoder: Decoder | None = None) -> list[GenerationEvaluation]:
    """Per `(adapter, config, eval examples)`, its rows' greedy continuations scored (all jobs in one batch; a
    user's metric in `worker`; `decoder`: a pipeline's decoding over its stages, `base` then its stage 0). A job
    with no scorable row raises ValueError naming it; a metric that fails, MetricError naming the row."""
    plans = []
    for adapter, config, examples in jobs:
        rows = scored_rows(examples, base, config.rows)
        if not rows:
            raise ValueError(f"adapter '{adapter}': none of its {len(examples)} eval rows has a prompt and a target "
                             "to score a generation against")
        plans.append((adapter, config, rows))
    if not plans:
        return []
    stops = stop_token_ids(base)
    requests = [(adapter, list(row.prompt)) for adapter, _, rows in plans for row in rows]
    longest = max(config.max_new_tokens for _, config, _ in plans)
    outputs = iter(greedy_generate_many(base, requests, longest, stops, decoder=decoder))
    evaluations = []
    for _, config, rows in plans:
        predictions = []
        for tokens in (next(outputs)[:config.max_new_tokens] for _ in rows):
            for index, token in enumerate(tokens):   # ends at its first stop token, which is not text
                if token in stops:
                    tokens = tokens[:index]
                    break
            predictions.append(base.tokenizer.decode(tokens, skip_special_tokens=True))
        contexts = [{"prompt": row.prompt_text, "reference": row.reference} for row in rows]
        scores = generation_scores_of(config, predictions, contexts, worker)
        samples = [{**context, "prediction": prediction, "score": score}
                   for context, prediction, score in zip(contexts, predictions, scores, strict=True)]
        evaluations.append(GenerationEvaluation(sum(scores) / len(scores), samples))
    return evaluations


def generation_scores(base: BaseModel, jobs: Sequence[tuple[str, GenerationEval, Sequence[Example]]],
                      worker: FunctionWorker | None = None) -> list[float]:
    """Per `(adapter, config, eval examples)`, the mean score of its rows' greedy continuations (all jobs in
    one batch): `generation_evaluations` without the rows."""
    return [evaluation.score for evaluation in generation_evaluations(base, jobs, worker)]
