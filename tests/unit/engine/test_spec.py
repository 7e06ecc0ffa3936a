"""jobs.yaml validation: errors name the file, line, job and field."""

from __future__ import annotations

import textwrap

import pytest

from orchestrator.jobs_file import SpecError, load_run_spec, parse_run_spec

GOOD = """\
base_model: smollm2-135m
quantization: none
seed: 0
output_dir: runs/example
step_tokens: 4096
layout: packed
jobs:
  - name: gsm8k-r8
    data: data/gsm8k.jsonl
    format: {type: prompt_response, prompt: "Question: {question}\\nAnswer:", response: " {answer}"}
    lora: {r: 8, alpha: 16, dropout: 0.05, target_modules: [q_proj, k_proj, v_proj, o_proj]}
    batch_size: 4
    grad_accum: 1
    lr: 3.0e-4
    max_steps: 50
    max_seq_len: 512
"""


def write(tmp_path, text, data=True):
    (tmp_path / "data").mkdir(exist_ok=True)
    if data:
        (tmp_path / "data" / "gsm8k.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    path = tmp_path / "jobs.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_the_issue_example_is_valid_and_paths_are_relative_to_the_file(tmp_path):
    spec = load_run_spec(write(tmp_path, GOOD))
    job = spec.jobs[0]
    assert job.data == tmp_path / "data" / "gsm8k.jsonl"
    assert spec.output_dir == tmp_path / "runs" / "example"
    assert job.lora.r == 8 and job.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert job.format.type == "prompt_response"


@pytest.mark.parametrize("change, expected", [
    (("    lora: {r: 8", "    lora: {rank: 8"),
     r"jobs.yaml:11: job 'gsm8k-r8' \(jobs\[0\]\), field lora.rank: unknown field"),
    (("    lr: 3.0e-4", "    lr: -1"), r"jobs.yaml:14: job 'gsm8k-r8' \(jobs\[0\]\), field lr: .*greater than 0"),
    (("layout: packed", "layout: diagonal"), r"jobs.yaml:6: layout: Input should be 'packed'"),
    (("  - name: gsm8k-r8", "  - name: gsm8k/r8"),
     r"jobs.yaml:8: job 'gsm8k/r8' \(jobs\[0\]\), field name: 'gsm8k/r8' is not a name aspen takes: 1 to 64 letters"),
    (("response: \" {answer}\"", "respons: \" {answer}\""), r"field format.respons: unknown field"),
    (("    max_seq_len: 512", "    max_seq_len: 512\n    colour: red"), r"jobs.yaml:17: .*field colour: unknown field"),
    (("    max_seq_len: 512", "    max_seq_len: 512\n    priority: 600"),
     r"jobs.yaml:17: job 'gsm8k-r8' \(jobs\[0\]\), field priority: must be between -100 and 100 \(got 600\)"),
    (("    lr: 3.0e-4", "    lr: .inf"),
     r"jobs.yaml:14: job 'gsm8k-r8' \(jobs\[0\]\), field lr: must be a finite number greater than 0 and at most 10 "),
    (("step_tokens: 4096", "step_tokens: 1024"),
     r"jobs.yaml:16: job 'gsm8k-r8' \(jobs\[0\]\), field max_seq_len: batch_size 4 \* max_seq_len 512 = 2048 tokens "
     r".*exceeds step_tokens 1024"),
    (("{question}\\nAnswer:", "{question:>999999999}"),
     r"jobs.yaml:10: job 'gsm8k-r8' \(jobs\[0\]\), field format.prompt: template 'Question: \{question:>999999999\}', "
     r"field 'question': .*over the limit of 1000"),
])
def test_bad_values_name_line_job_and_field(tmp_path, change, expected):
    with pytest.raises(SpecError, match=expected):
        load_run_spec(write(tmp_path, GOOD.replace(*change)))


def test_missing_data_file_is_named(tmp_path):
    with pytest.raises(SpecError, match=r"jobs.yaml:9: job 'gsm8k-r8' \(jobs\[0\]\), field data: file .*gsm8k.jsonl "
                                        r"does not exist"):
        load_run_spec(write(tmp_path, GOOD, data=False))


def test_duplicate_job_names_and_empty_jobs_are_rejected(tmp_path):
    doubled = GOOD + GOOD[GOOD.index("  - name"):]
    second = len(GOOD.splitlines()) + 1   # the second job's name line (it was the file's top)
    with pytest.raises(SpecError, match=rf"jobs.yaml:{second}: job 'gsm8k-r8' \(jobs\[1\]\), field name: two jobs "
                                        r"are named 'gsm8k-r8'; job names must be unique"):
        load_run_spec(write(tmp_path, doubled))
    with pytest.raises(SpecError, match="jobs"):
        parse_run_spec({"base_model": "x", "jobs": []}, check_files=False)


def test_epochs_default_when_no_budget_given():
    spec = parse_run_spec({"jobs": [{"name": "a", "data": "x.jsonl", "format": {"type": "text"}}]}, check_files=False)
    assert spec.jobs[0].epochs == 1.0 and spec.jobs[0].max_steps is None
