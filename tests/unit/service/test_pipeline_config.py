"""`stages:` settings a pipeline trainer cannot take are refused when the YAML or jobs file is read, naming the
field and what to set instead (actors/spec/trainer_settings.py `pipeline_problem`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from actors.service.scheduler.config import TrainerConfig
from actors.spec.run_spec import RunSpec

JOB = {"name": "a", "data": "a.jsonl", "format": {"type": "text"}}


@pytest.mark.parametrize("fields,message", [
    ({"stages": 2, "quantization": "nf4"}, "stages: 2 with quantization: nf4 is not offered"),
    ({"stages": 2, "dtype": "float16"}, "stages >= 2 with dtype: float16 is not offered .*; set dtype: bfloat16"),
    ({"stages": 2, "layout": "padded"}, "set layout: packed"),
    ({"stages": 2, "compile": "default"}, "set compile: none"),
    ({"stages": 3, "stage_split": [2, 2]}, "stage_split lists 2 stages' layer counts and stages is 3"),
])
def test_a_jobs_file_and_a_trainer_kind_refuse_what_stages_cannot_take(fields, message):
    with pytest.raises(ValidationError, match=message):
        RunSpec.model_validate({"jobs": [JOB], **fields})
    with pytest.raises(ValidationError, match=message):
        TrainerConfig(**fields)


def test_a_fraction_of_a_gpu_per_stage_is_refused_and_sound_settings_pass():
    with pytest.raises(ValidationError, match="num_gpus is per stage and each stage needs a GPU of its own"):
        TrainerConfig(stages=2, num_gpus=0.5)
    assert TrainerConfig(stages=2, stage_split=[1, 3], num_gpus=1).stages == 2
    assert RunSpec.model_validate({"jobs": [JOB], "stages": 2, "stage_split": "even"}).stage_split == "even"


def test_stages_on_cpus_fork_from_the_server_and_a_cuda_stage_is_spawned():
    """A forked process cannot use CUDA once its parent initialised it: a pipeline with any CUDA stage spawns its
    stages (as checked on the GPU leases); CPU stages fork from the fork server that imported the engine once."""
    from actors.service.pipeline.pipeline_processes import stage_context

    assert stage_context(["cpu", "cpu", "cpu"]).get_start_method() == "forkserver"
    assert stage_context(["cpu", "cuda:0"]).get_start_method() == "spawn"
    assert stage_context(["cuda:0", "cuda:1"]).get_start_method() == "spawn"
