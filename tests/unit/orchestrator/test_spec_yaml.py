"""A job's spec as the console shows it and clones it (orchestrator/http/console.py `spec_answer`): YAML as a
person writes a jobs file (a prompt with line breaks as a literal block, a count of rows as a whole number)
that reads back as the same submission."""

from __future__ import annotations

import pytest
import yaml

from actors.spec.job_submission import JobSubmission
from actors.spec.run_spec import RunSpec
from orchestrator.http.console import spec_answer
from tests.helpers.service import job_dict

pytestmark = pytest.mark.unit


def test_the_spec_reads_as_written_and_submits_the_same_job(tmp_path):
    job = job_dict("qa", tmp_path / "qa.jsonl", 12, eval_split=16, eval_every=4)
    job["format"]["prompt"] = "Question: {question}\nThink step by step.\nAnswer:"
    submission = JobSubmission.model_validate({"job": job, "base_model": "smollm2-135m"})
    text = spec_answer(submission)["yaml"]
    assert "\n  eval_split: 16\n" in text                       # a count, not 16.0
    assert "    prompt: |-\n      Question: {question}\n      Think step by step.\n      Answer:\n" in text
    again = RunSpec.model_validate(yaml.safe_load(text)).submissions()[0]
    assert again.job.model_dump(exclude={"output_dir"}) == submission.job.model_dump(exclude={"output_dir"})
    assert again.base_model == submission.base_model
