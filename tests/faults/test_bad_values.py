"""Every bad value gets a clear answer: a number out of range (inf and nan included), a template that
would build huge strings, a micro-batch no step can hold. Each is refused at load or submit time, with
the file, line, job, field and the allowed range named, instead of overflowing or crashing later."""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from actors.data.formats import STORED
from actors.service.scheduler.config import EventsConfig, MetricsConfig, ServiceConfig, TrainerConfig
from actors.service.table.job_table import JobTable, read_jobs
from actors.spec.job_spec import JobSpec, step_limit_problem
from actors.spec.job_submission import JobSubmission
from actors.spec.run_spec import RunSpec
from orchestrator.jobs_file import SpecError, load_run_spec

GOOD = """\
base_model: smollm2-135m
seed: 0
output_dir: runs/example
step_tokens: 4096
jobs:
  - name: gsm8k-r8
    data: data/gsm8k.jsonl
    format: {type: prompt_response, prompt: "Question: {question}\\nAnswer:", response: " {answer}"}
    lora: {r: 8, alpha: 16}
    batch_size: 4
    lr: 3.0e-4
    max_steps: 50
    epochs: 2
    max_seq_len: 512
    checkpoint_every_s: 300
    priority: 0
    seed: 1
"""
PROMPT = "Question: {question}\\nAnswer:"

PRIORITY = r"must be between -100 and 100"
LR = r"must be (a finite number )?greater than 0 and at most 10\b"
SEED = r"must be at least 0 and less than 2\*\*63"
BATCH_SIZE = r"must be between 1 and 65536"
MAX_SEQ_LEN = r"must be between 8 and 1_048_576"
EPOCHS = r"must be a finite number greater than 0 and at most 10000"
CHECKPOINT_EVERY_S = r"must be between 1 and 10_000_000"
STEP_TOKENS = r"must be auto or a whole number between 16 and 16_777_216"

# (job field, YAML value, the same value in Python, what the message must say)
JOB_VALUES = [
    ("priority", "600", 600, PRIORITY + r" \(got 600\)"),
    ("priority", "-600", -600, PRIORITY + r" \(got -600\)"),
    ("priority", str(2**70), 2**70, PRIORITY + rf" \(got {2**70}\)"),
    ("lr", ".inf", math.inf, LR + r" \(got inf\)"),
    ("lr", ".nan", math.nan, LR + r" \(got nan\)"),
    ("lr", "-1", -1, LR),
    ("seed", str(2**64), 2**64, SEED),
    ("seed", "-1", -1, SEED),
    ("batch_size", "1000000000000", 10**12, BATCH_SIZE + r" \(got 1000000000000\)"),
    ("max_seq_len", "0", 0, MAX_SEQ_LEN + r" \(got 0\)"),
    ("epochs", ".inf", math.inf, EPOCHS + r" \(got inf\)"),
    ("checkpoint_every_s", "0", 0, CHECKPOINT_EVERY_S + r" \(got 0"),
]
TEMPLATES = [
    ("{question:>999999999}", r"format spec '>999999999' has width 999999999, over the limit of 1000"),
    ("{question:{width}}", r"nested replacement fields in a format spec .*\(at most 1000\)"),
    ("{question!x}", r"conversion '!x' is not one of !s, !r, !a"),
]


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "gsm8k.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    path = tmp_path / "jobs.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def line_of(text: str, start: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(start))


def with_line(text: str, start: str, replacement: str) -> str:
    lines = text.splitlines()
    index = line_of(text, start) - 1
    lines[index] = replacement
    return "\n".join(lines) + "\n"


def job_field(text: str, field: str, value: str) -> str:
    return with_line(text, f"    {field}:", f"    {field}: {value}")


def good_submission() -> dict:
    job = yaml.safe_load(GOOD)["jobs"][0]
    return {"job": job, "base_model": "smollm2-135m", "seed": 3}


def test_the_good_spec_still_validates(tmp_path):
    spec = load_run_spec(write(tmp_path, GOOD))
    job = spec.jobs[0]
    assert (job.priority, job.seed, job.epochs, job.checkpoint_every_s) == (0, 1, 2.0, 300.0)
    assert step_limit_problem(job, spec.step_tokens) is None
    submission = JobSubmission.model_validate_json(json.dumps(good_submission()))
    assert submission.job.max_seq_len == 512


def test_checkpoint_every_s_defaults_to_ten_minutes_and_can_be_turned_off(tmp_path):
    minimal = {"name": "a", "data": "x.jsonl", "format": {"type": "text"}}
    assert JobSpec.model_validate(minimal).checkpoint_every_s == 600.0
    assert JobSpec.model_validate({**minimal, "checkpoint_every_s": None}).checkpoint_every_s is None
    assert "wall time" in JobSpec.model_fields["checkpoint_every_s"].description


@pytest.mark.parametrize("field, text, _value, expected", JOB_VALUES, ids=[f"{f}={t}" for f, t, _, _ in JOB_VALUES])
def test_a_bad_job_value_names_line_job_field_and_range(tmp_path, field, text, _value, expected):
    source = job_field(GOOD, field, text)
    line = line_of(source, f"    {field}:")
    with pytest.raises(SpecError, match=rf"jobs.yaml:{line}: job 'gsm8k-r8' \(jobs\[0\]\), field {field}: {expected}"):
        load_run_spec(write(tmp_path, source))


@pytest.mark.parametrize("field", ["prompt", "response"])
@pytest.mark.parametrize("template, expected", TEMPLATES, ids=[t for t, _ in TEMPLATES])
def test_a_dangerous_template_names_line_job_field_and_limit(tmp_path, field, template, expected):
    fmt = (f'    format: {{type: prompt_response, prompt: "{template}", response: " {{answer}}"}}' if field == "prompt"
           else f'    format: {{type: prompt_response, prompt: "{PROMPT}", response: "{template}"}}')
    source = with_line(GOOD, "    format:", fmt)
    line = line_of(source, "    format:")
    quoted = template.replace("{", r"\{").replace("}", r"\}")
    with pytest.raises(SpecError, match=rf"jobs.yaml:{line}: job 'gsm8k-r8' \(jobs\[0\]\), field format.{field}: "
                                        rf".*template '{quoted}', field 'question': {expected}"):
        load_run_spec(write(tmp_path, source))


@pytest.mark.parametrize("text, expected", [
    ("0", STEP_TOKENS + r" \(got 0\)"),
    (str(2**40), STEP_TOKENS),
    (".inf", r"must be auto or a whole number between 16 and 16_777_216 \(got inf\)"),
])
def test_a_bad_step_tokens_names_line_field_and_range(tmp_path, text, expected):
    source = with_line(GOOD, "step_tokens:", f"step_tokens: {text}")
    with pytest.raises(SpecError, match=rf"jobs.yaml:4: step_tokens: {expected}"):
        load_run_spec(write(tmp_path, source))


@pytest.mark.parametrize("text", [str(2**64), "-1", ".nan"])
def test_a_bad_run_seed_is_named(tmp_path, text):
    source = with_line(GOOD, "seed:", f"seed: {text}")
    with pytest.raises(SpecError, match=r"jobs.yaml:2: seed: "):
        load_run_spec(write(tmp_path, source))


def test_a_micro_batch_larger_than_a_step_names_job_numbers_and_fix(tmp_path):
    source = with_line(GOOD, "step_tokens:", "step_tokens: 1024")
    line = line_of(source, "    max_seq_len:")
    with pytest.raises(SpecError, match=rf"jobs.yaml:{line}: job 'gsm8k-r8' \(jobs\[0\]\), field max_seq_len: .*"
                                        r"batch_size 4 \* max_seq_len 512 = 2048 tokens .* exceeds step_tokens 1024 .*"
                                        r"lower batch_size or max_seq_len, or raise step_tokens"):
        load_run_spec(write(tmp_path, source))
    # only batch_size written: the error points at it
    small_step = with_line(GOOD, "step_tokens:", "step_tokens: 1024")
    source = with_line(small_step, "    max_seq_len:", "    train_on_prompt: false")
    line = line_of(source, "    batch_size:")
    with pytest.raises(SpecError, match=rf"jobs.yaml:{line}: job 'gsm8k-r8' \(jobs\[0\]\), field batch_size: "):
        load_run_spec(write(tmp_path, source))
    # every job that does not fit is named, not just the first
    two = small_step + GOOD[GOOD.index("  - name"):].replace("gsm8k-r8", "second")
    with pytest.raises(SpecError) as error:
        load_run_spec(write(tmp_path, two))
    assert "job 'gsm8k-r8'" in str(error.value) and "job 'second'" in str(error.value)
    # exactly a step's worth fits
    assert load_run_spec(write(tmp_path, with_line(GOOD, "step_tokens:", "step_tokens: 2048"))).step_tokens == 2048
    # submitted to a service, the file's step_tokens bounds nothing: the service checks its trainers' steps
    assert load_run_spec(write(tmp_path, two), for_a_service=True).jobs[1].name == "second"


def test_step_limit_problem_is_what_the_service_checks_at_submit():
    job = JobSpec(name="big", data="x.jsonl", format={"type": "text"}, batch_size=8, max_seq_len=1024)
    assert step_limit_problem(job, 8192) is None
    problem = step_limit_problem(job, 4096)
    assert problem is not None
    for part in ("'big'", "batch_size 8", "max_seq_len 1024", "8192", "step_tokens 4096",
                 "lower batch_size or max_seq_len, or raise step_tokens"):
        assert part in problem, (part, problem)
    with pytest.raises(ValidationError, match="exceeds step_tokens 4096"):
        RunSpec(step_tokens=4096, jobs=[job])


@pytest.mark.parametrize("field, _text, value, expected", JOB_VALUES, ids=[f"{f}={t}" for f, t, _, _ in JOB_VALUES])
def test_the_service_path_refuses_the_same_job_values(field, _text, value, expected):
    submission = good_submission()
    submission["job"][field] = value
    with pytest.raises(ValidationError, match=rf"job\.{field}\n\s+{expected}"):
        JobSubmission.model_validate_json(json.dumps(submission))


@pytest.mark.parametrize("field", ["prompt", "response"])
@pytest.mark.parametrize("template, expected", TEMPLATES, ids=[t for t, _ in TEMPLATES])
def test_the_service_path_refuses_the_same_templates(field, template, expected):
    submission = good_submission()
    submission["job"]["format"][field] = template
    with pytest.raises(ValidationError, match=rf"job\.format\.prompt_response\.{field}\n.*{expected}"):
        JobSubmission.model_validate_json(json.dumps(submission))


@pytest.mark.parametrize("value", [2**63, 2**64, -1])
def test_the_service_path_refuses_a_submission_seed_outside_64_bits(value):
    submission = {**good_submission(), "seed": value}
    with pytest.raises(ValidationError, match=rf"seed\n\s+{SEED}"):
        JobSubmission.model_validate_json(json.dumps(submission))
    assert JobSubmission.model_validate_json(json.dumps({**submission, "seed": 2**63 - 1})).seed == 2**63 - 1


@pytest.mark.parametrize("field, value", [
    ("lora", {"r": 8, "alpha": math.inf}), ("lora", {"r": 8, "alpha": 10**9}), ("lora", {"r": 8, "dropout": 1.0}),
    ("lora", {"r": 8, "dropout": math.nan}), ("lora", {"r": 0}), ("lora", {"r": 10**6}),
    ("grad_accum", 0), ("grad_accum", 10**7), ("warmup_steps", -1), ("warmup_steps", 2**63),
    ("weight_decay", math.nan), ("weight_decay", -0.1), ("weight_decay", 1e300),
    ("max_grad_norm", math.inf), ("max_grad_norm", 0), ("max_steps", 10**9 + 1), ("max_steps", 0),
    ("epochs", 0), ("epochs", 1e6), ("epochs", math.nan), ("eval_split", -0.5), ("eval_split", math.inf),
    ("eval_split", 10**10), ("eval_split", 2.5), ("eval_every", 0), ("eval_every", 2**70),
    ("checkpoint_every", 0), ("checkpoint_every", 2**63), ("checkpoint_every_s", math.inf),
    ("checkpoint_every_s", 10**8), ("checkpoint_every_s", -5), ("lr", 11), ("lr", 1e308 * 10),
    ("early_stop", {"min_improvement": math.nan}), ("early_stop", {"min_improvement": 101}),
    ("early_stop", {"patience": 0}), ("early_stop", {"patience": 10**9}),
])
def test_every_other_job_number_is_finite_and_bounded(field, value):
    submission = good_submission()
    submission["job"][field] = value
    with pytest.raises(ValidationError, match=r"must be|Input should be"):
        JobSubmission.model_validate_json(json.dumps(submission))


@pytest.mark.parametrize("field, value", [("eval_split", 0.25), ("eval_split", 8), ("lr", 10), ("priority", -100),
                                          ("priority", 100), ("seed", 2**63 - 1), ("max_steps", 10**9),
                                          ("checkpoint_every_s", None), ("checkpoint_every_s", 1)])
def test_the_ends_of_each_range_are_accepted(field, value):
    submission = good_submission()
    submission["job"][field] = value
    assert getattr(JobSubmission.model_validate_json(json.dumps(submission)).job, field) == value


@pytest.mark.parametrize("model, field, value", [
    (ServiceConfig, "tick_seconds", math.inf), (ServiceConfig, "tick_seconds", math.nan),
    (ServiceConfig, "tick_seconds", 0), (ServiceConfig, "tick_seconds", -1), (ServiceConfig, "tick_seconds", 10**6),
    (ServiceConfig, "trainer_timeout_s", math.inf), (ServiceConfig, "trainer_timeout_s", math.nan),
    (ServiceConfig, "trainer_timeout_s", -600), (ServiceConfig, "trainer_timeout_s", 10**12),
    (TrainerConfig, "step_tokens", 0), (TrainerConfig, "step_tokens", 2**40), (TrainerConfig, "step_tokens", math.inf),
    (TrainerConfig, "count", 0), (TrainerConfig, "count", 10**6),
    (TrainerConfig, "num_gpus", math.nan), (TrainerConfig, "num_gpus", math.inf), (TrainerConfig, "num_gpus", -1),
    (TrainerConfig, "num_gpus", 10**6), (TrainerConfig, "num_cpus", math.inf), (TrainerConfig, "num_cpus", -0.5),
    (TrainerConfig, "threads", 0), (TrainerConfig, "threads", 10**6),
    (TrainerConfig, "memory_budget_bytes", 0), (TrainerConfig, "memory_budget_bytes", 2**64),
    (TrainerConfig, "memory_budget_bytes", math.inf),
    (TrainerConfig, "max_jobs", 0), (TrainerConfig, "max_jobs", 2**63), (TrainerConfig, "prefetch", 0),
    (TrainerConfig, "prefetch", 10**9),
    (MetricsConfig, "port", -1), (MetricsConfig, "port", 65536), (EventsConfig, "embedded_port", 2**70),
])
def test_service_and_trainer_config_refuse_non_finite_negative_and_oversized_values(model, field, value):
    with pytest.raises(ValidationError, match=rf"{field}\n\s+(must be|Input should be)"):
        model.model_validate({field: value})
    with pytest.raises(ValidationError, match=rf"{field}\n\s+(must be|Input should be)"):
        model.model_validate_json(json.dumps({field: value}))


def test_config_errors_name_the_range():
    with pytest.raises(ValidationError, match=r"must be a finite number greater than 0 and at most 3600 \(got inf\)"):
        ServiceConfig(tick_seconds=math.inf)
    with pytest.raises(ValidationError, match=r"must be auto or a whole number between 16 and 16_777_216 \(got 0\)"):
        TrainerConfig(step_tokens=0)
    with pytest.raises(ValidationError, match=r"trainers\.0\.num_gpus\n\s+must be a finite number between 0 and 1024"):
        ServiceConfig(trainers=[{"num_gpus": math.nan}])
    config = ServiceConfig(tick_seconds=0.1, trainer_timeout_s=5,
                           trainers=[{"step_tokens": 512, "num_cpus": 0.5, "threads": 1, "max_jobs": 2}])
    assert config.trainers[0].step_tokens == 512


def test_bounds_reach_the_json_schema():
    schema = JobSpec.model_json_schema()["properties"]
    assert (schema["priority"]["minimum"], schema["priority"]["maximum"]) == (-100, 100)
    assert schema["lr"]["exclusiveMinimum"] == 0 and schema["lr"]["maximum"] == 10


def test_a_response_template_naming_no_field_is_refused_with_its_line_yet_a_stored_one_still_loads(tmp_path):
    """`response: answer` (the field's name without braces) would train every row towards the same word: the jobs file
    names its line, job and field and the braced field to write, and the service path refuses it too; a job an
    earlier version accepted with it, kept in a job table, still loads from that table (the service's and
    `aspen run`'s read of an earlier run), instead of the whole table failing to open."""
    fmt = f'    format: {{type: prompt_response, prompt: "{PROMPT}", response: answer}}'
    source = with_line(GOOD, "    format:", fmt)
    line = line_of(source, "    format:")
    with pytest.raises(SpecError, match=rf"jobs.yaml:{line}: job 'gsm8k-r8' \(jobs\[0\]\), field format.response: "
                                        r".*template 'answer' names no row field, so every row's target would be this "
                                        r"same text; put the row field that holds the target in braces, e.g. "
                                        r"' \{answer\}'"):
        load_run_spec(write(tmp_path, source))
    submission = good_submission()
    submission["job"]["format"]["response"] = "answer"
    with pytest.raises(ValidationError, match=r"job\.format\.prompt_response\.response\n.*names no row field"):
        JobSubmission.model_validate_json(json.dumps(submission))
    kept = JobSubmission.model_validate(submission, context={STORED: True})   # as an earlier version accepted it
    table = JobTable(tmp_path / "jobs.sqlite")
    job_id = table.add("gsm8k-r8-1", kept, tmp_path / "out").id
    table.close()
    assert JobTable(tmp_path / "jobs.sqlite").submission(job_id).job.format.response == "answer"
    assert [sub.job.format.response for _, sub in read_jobs(tmp_path / "jobs.sqlite")] == ["answer"]


def test_a_jobs_file_not_in_utf8_names_its_line_and_column(tmp_path):
    """A jobs file saved as Latin-1 (`Frage` with an e-acute): its line and column and the fix, where the bare
    decoding error named neither the file nor the line."""
    source = with_line(GOOD, "    format:", '    format: {type: prompt_response, prompt: "Fr\u00e9ge: {question}", '
                                          'response: " {answer}"}').encode("latin-1")
    path = tmp_path / "jobs.yaml"
    path.write_bytes(source)
    line = source[:source.index(b"\xe9")].count(b"\n") + 1
    column = source.index(b"\xe9") - source.rfind(b"\n", 0, source.index(b"\xe9"))
    with pytest.raises(SpecError, match=rf"^{re.escape(str(path))}:{line}: byte 0xe9 at column {column} is not UTF-8 "
                                        r"\(the file was saved in another encoding, e.g. Latin-1\); save it as UTF-8$"):
        load_run_spec(path)
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())   # a byte-order mark, as some editors write: taken
    assert load_run_spec(path, check_files=False).jobs[0].name == "gsm8k-r8"


@pytest.mark.parametrize("field, text, expected", [
    ("max_steps", "true", r"must be a number, not true \(a truth value\)"),
    ("eval_split", "false", r"must be a number, not false \(a truth value\)"),
    ("train_on_prompt", "1", r"must be true or false \(got 1\)"),
    ("streaming", "yes please", r"must be true or false \(got 'yes please'\)"),
])
def test_a_truth_value_for_a_number_or_a_number_for_a_truth_value_is_refused(tmp_path, field, text, expected):
    """pydantic's lax mode took `max_steps: true` as one step and `streaming: 1` or `use_dora: "yes"` as true: each
    is refused at its line, and through the service's path."""
    source = (with_line(GOOD, f"    {field}:", f"    {field}: {text}") if f"    {field}:" in GOOD
              else GOOD + f"    {field}: {text}\n")
    line = line_of(source, f"    {field}:")
    with pytest.raises(SpecError, match=rf"jobs.yaml:{line}: job 'gsm8k-r8' \(jobs\[0\]\), field {field}: {expected}"):
        load_run_spec(write(tmp_path, source), check_files=False)
    submission = good_submission()
    submission["job"][field] = yaml.safe_load(text)
    with pytest.raises(ValidationError, match=rf"job\.{field}\n\s+{expected}"):
        JobSubmission.model_validate_json(json.dumps(submission))
    lora = good_submission()
    lora["job"]["lora"]["use_dora"] = "yes"
    with pytest.raises(ValidationError, match=r"job\.lora\.use_dora\n\s+must be true or false \(got 'yes'\)"):
        JobSubmission.model_validate_json(json.dumps(lora))


def test_a_key_written_twice_in_one_mapping_is_refused_at_its_second_line(tmp_path):
    """YAML loaders keep a repeated key's last value silently (`max_steps: 50` ... `max_steps: 2` trained 2 steps):
    refused, naming both lines, in a job and in a nested mapping; the same key in two jobs is no repetition."""
    source = GOOD + "    max_steps: 2\n"
    first, second = line_of(source, "    max_steps:"), len(source.splitlines())
    with pytest.raises(SpecError, match=rf"jobs.yaml:{second}: 'max_steps' is written twice in one mapping \(lines "
                                        rf"{first} and {second}\), and only the last would count; keep one"):
        load_run_spec(write(tmp_path, source), check_files=False)
    nested = with_line(GOOD, "    lora:", "    lora: {r: 8, alpha: 16, r: 4}")
    with pytest.raises(SpecError, match=r"'r' is written twice in one mapping"):
        load_run_spec(write(tmp_path, nested), check_files=False)
    two_jobs = GOOD + GOOD[GOOD.index("  - name"):].replace("gsm8k-r8", "second")
    assert [job.name for job in load_run_spec(write(tmp_path, two_jobs), check_files=False).jobs] == \
        ["gsm8k-r8", "second"]


@pytest.mark.parametrize("jobs,expected", [
    ("jobs:\n  name: gsm8k-r8\n  data: data/gsm8k.jsonl\n",
     r"jobs.yaml:5: jobs: jobs is a list of jobs, each item starting with '- ', and this gives one mapping: write its "
     r"first key as '- name: \.\.\.' and indent the rest of that job under it"),
    ("jobs: []\n", r"jobs.yaml:5: jobs: jobs lists no job: give at least one"),
    ("jobs:\n", r"jobs.yaml:5: jobs: jobs lists no job: give at least one"),
], ids=["a-mapping", "an-empty-list", "nothing"])
def test_jobs_written_as_one_mapping_or_none_is_refused_saying_how_to_write_them(tmp_path, jobs, expected):
    """`jobs:` holding one job's keys without the '- ' of a list item (read as a list of its keys, it gave three
    "not a dictionary" errors, one per key), or no job at all: one message at its line, saying how to write it."""
    source = GOOD[:GOOD.index("jobs:")] + jobs
    with pytest.raises(SpecError, match=expected) as refused:
        load_run_spec(write(tmp_path, source))
    assert str(refused.value).count("\n") == 0, str(refused.value)
