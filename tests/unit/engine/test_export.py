"""`aspen export`: a trained job's adapter handed off. The PEFT folder names a base that resolves by its id
(a tiny model laid out as a Hugging Face cache, offline), and PEFT, loading it onto that base by itself
(AutoPeftModelForCausalLM), gives the engine's logits of base + adapter; the merged transformers folder gives
them too; a job that is unknown, has no final adapter, or an output folder that exists are refused with
what to do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM

from actors.checkpoint.peft_io import load_adapter_weights
from actors.engine.adapter_surgery import add_adapter
from actors.engine.models import load_base_model
from actors.engine.trainer import FusedTrainer
from actors.service.scheduler.local_run import train_locally
from actors.service.table.job_table import JobTable
from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission
from orchestrator.cli import main
from orchestrator.export import export_job
from tests.helpers.hub import REVISION, offline, sample_ids
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.snippets import peft_lines, run_printed_peft_lines

HUB_ID = "aspen-tests/tiny-llama"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def hub_cache(tiny_model_dirs, tmp_path_factory) -> Path:
    """An offline Hugging Face cache holding the tiny Llama as the hub model `aspen-tests/tiny-llama`."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(tiny_model_dirs["llama"], repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return cache


@pytest.fixture(scope="module")
def trained(hub_cache, tmp_path_factory) -> tuple[Path, JobSpec]:
    """A job trained in this process on the cached snapshot's folder: the run's output folder and its spec."""
    base = hub_cache / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / REVISION
    folder = tmp_path_factory.mktemp("run")
    data = write_task_data(folder / "data", "add", rows=24)
    job = job_dict("add", data, 3, lr=2e-2, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj",
                                                                                         "down_proj"]})
    spec = run_spec(str(base), folder / "out", [job], step_tokens=1024)
    (summary,) = train_locally(spec, base=load_base_model(str(base), dtype="float32", device="cpu"), progress=False)
    assert summary.state == "completed", summary.reason
    return folder / "out", spec.jobs[0]


def engine_logits(base_model: str, adapter_dir: Path, spec: JobSpec, ids: torch.Tensor,
                  **load: str) -> torch.Tensor:
    """aspen's own base + adapter: the engine's fused LoRA layers with the saved weights."""
    base = load_base_model(base_model, device="cpu", **load)
    handle = add_adapter(base.model, "exported", spec.lora, seed=0)
    load_adapter_weights(handle, adapter_dir)
    with torch.no_grad():
        return FusedTrainer(base).logits("exported", ids)


def test_peft_resolves_the_recorded_base_id_and_gives_the_engines_logits(trained, hub_cache, tmp_path, monkeypatch):
    out_dir, spec = trained
    exported = export_job(str(out_dir / "add"), tmp_path / "add-lora")
    assert sorted(p.name for p in exported.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                           "aspen.json"]
    config = json.loads((exported / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == HUB_ID
    recorded = json.loads((exported / "aspen.json").read_text())["base_model"]
    assert recorded["local_path"].endswith(REVISION) and recorded["id"] == HUB_ID

    offline(monkeypatch)
    model = AutoPeftModelForCausalLM.from_pretrained(str(exported), cache_dir=str(hub_cache), local_files_only=True,
                                                     dtype=torch.float32).eval()
    adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A) > 0]
    assert len(adapted) == 3 * 2   # q, v, down of both layers
    ids = sample_ids()
    with torch.no_grad():
        peft_logits = model(input_ids=ids).logits
    reference = engine_logits(recorded["local_path"], out_dir / "add", spec, ids, dtype="float32")
    base_only = AutoModelForCausalLM.from_pretrained(recorded["local_path"], dtype=torch.float32)(input_ids=ids).logits
    assert (reference - base_only).abs().max() > 1e-3   # the adapter changes the logits
    assert (peft_logits - reference).abs().max() <= 1e-5


def test_the_lines_export_prints_run_as_shown(trained, tmp_path, capsys):
    """`aspen export` prints PEFT lines that load the adapter onto this machine's copy of the base (no hub, no
    aspen import): run as printed, in a process of their own, they give the engine's logits; the vLLM line names
    that folder and a rank vLLM accepts; where to change them for another machine is said."""
    out_dir, spec = trained
    assert main(["export", "add", "--from", str(out_dir), "--out", str(tmp_path / "add-lora")]) == 0
    printed = capsys.readouterr().out
    recorded = json.loads((out_dir / "add" / "aspen.json").read_text())["base_model"]["local_path"]
    vllm = next(line.strip() for line in printed.splitlines() if line.strip().startswith("vllm serve"))
    assert vllm == (f"vllm serve {recorded} --enable-lora --max-lora-rank 8 "
                    f"--lora-modules add-lora={(tmp_path / 'add-lora').resolve()}")
    assert f"On another machine, load the base by the id the adapter records, {HUB_ID}" in printed
    code = peft_lines(printed)
    assert not any(module in code for module in ("actors", "orchestrator", "policies"))   # plain PEFT
    ids = sample_ids()
    reference = engine_logits(recorded, out_dir / "add", spec, ids, dtype="float32")
    assert (run_printed_peft_lines(code, ids, tmp_path) - reference).abs().max() <= 1e-5


def test_merged_model_gives_base_plus_adapter(trained, tmp_path):
    out_dir, spec = trained
    merged = export_job(str(out_dir / "add"), tmp_path / "add-merged", merge=True)
    names = {p.name for p in merged.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert model.dtype == torch.float32   # the base's own
    assert not any("lora" in name for name, _ in model.named_parameters())
    ids = sample_ids()
    with torch.no_grad():
        merged_logits = model(input_ids=ids).logits
    base = json.loads((out_dir / "add" / "aspen.json").read_text())["base_model"]["local_path"]
    reference = engine_logits(base, out_dir / "add", spec, ids, dtype="float32")
    assert (merged_logits - reference).abs().max() <= 1e-4



def test_a_checkpoint_exports_and_merges_onto_the_base_it_was_trained_on(trained, tmp_path, capsys):
    """`aspen export --checkpoint` (and `--merge`) found the base by the hub id the adapter's config names, which
    the machine may not hold (the embedded smollm2's hub id never is): a checkpoint now records its base as the
    final adapter does (aspen.json), and one saved before (none there) takes the job's final adapter's record.
    Either way the lines name this machine's base and the merged model gives the engine's logits of the
    checkpoint's weights on that base."""
    out_dir, spec = trained
    final = json.loads((out_dir / "add" / "aspen.json").read_text())
    saved = json.loads((out_dir / "add" / "checkpoint" / "aspen.json").read_text())
    assert saved == {**final, "step": 3}
    recorded = final["base_model"]["local_path"]
    before = tmp_path / "before"   # a checkpoint written before checkpoints recorded their base
    shutil.copytree(out_dir / "add", before)
    (before / "checkpoint" / "aspen.json").unlink()
    ids = sample_ids()
    for folder in (out_dir / "add", before):
        assert main(["export", str(folder), "--checkpoint", "--out", str(tmp_path / f"{folder.name}-lora")]) == 0
        printed = capsys.readouterr().out
        assert "its base is not on this machine" not in printed
        assert f"vllm serve {recorded} --enable-lora" in printed
        merged = export_job(str(folder), tmp_path / f"{folder.name}-merged", merge=True, checkpoint=True)
        model = AutoModelForCausalLM.from_pretrained(merged).eval()
        with torch.no_grad():
            got = model(input_ids=ids).logits
        reference = engine_logits(recorded, folder / "checkpoint", spec, ids, dtype="float32")
        assert (got - reference).abs().max() <= 1e-4


def test_the_merge_hint_for_an_adapter_vllm_cannot_serve_runs_as_printed(trained, tmp_path, monkeypatch):
    """Where vLLM cannot serve an exported adapter (DoRA, VeRA, a GGUF base), the lines say which `aspen export`
    merges it: for an exported folder that is the folder itself (its bare name, which the hint gave, is no job)."""
    import shlex

    from actors.checkpoint import serving_lines

    out_dir, _ = trained
    exported = export_job("add", tmp_path / "add-lora", run_dir=str(out_dir))
    monkeypatch.setattr(serving_lines, "vllm_cannot_serve", lambda config: "vLLM cannot serve this kind")
    hint = serving_lines.adapter_serving_lines(exported).elsewhere
    command = hint[hint.index("`aspen export ") + 1:hint.index("` writes")]
    assert command == f"aspen export {shlex.quote(str(exported.resolve()))} --merge"
    monkeypatch.chdir(tmp_path)
    assert main([*shlex.split(command)[1:], "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()

def test_export_merge_prints_only_what_the_user_needs(trained, tmp_path):
    """`aspen export --merge` as a user runs it (its own process, output not a terminal): its result and the
    lines to use it, without bitsandbytes' notice about the `kernels` package, transformers' FutureWarning
    that PEFT triggers, or progress bars redrawn as text."""
    out_dir, _ = trained
    result = subprocess.run([sys.executable, "-m", "orchestrator.cli", "export", "add", "--from", str(out_dir),
                             "--merge", "--out", str(tmp_path / "merged")], capture_output=True, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"merged model (transformers, safetensors) in {tmp_path / 'merged'}")
    for noise in ("kernels", "FutureWarning", "is_gradient_checkpointing", "Loading weights", "Writing model"):
        assert noise not in result.stderr, result.stderr


def test_export_refuses_with_what_to_do(trained, tmp_path, capsys):
    out_dir, _ = trained
    # an unknown job
    assert main(["export", "nope", "--from", str(out_dir)]) == 2
    assert f"no job 'nope' in {out_dir}" in capsys.readouterr().err
    # an output folder that exists: refused, then replaced with --force
    (tmp_path / "taken").mkdir()
    assert main(["export", str(out_dir / "add"), "--out", str(tmp_path / "taken")]) == 2
    assert "taken exists; give --force" in capsys.readouterr().err
    assert main(["export", "add", "--from", str(out_dir), "--out", str(tmp_path / "taken"), "--force"]) == 0
    assert "--lora-modules taken=" in capsys.readouterr().out
    assert (tmp_path / "taken" / "adapter_model.safetensors").is_file()
    # a job folder without its final adapter: named, with what to do; its checkpoint exports
    partial = tmp_path / "partial"
    shutil.copytree(out_dir / "add", partial)
    (partial / "adapter_model.safetensors").unlink()
    assert main(["export", str(partial), "--out", str(tmp_path / "x")]) == 2
    error = capsys.readouterr().err
    assert "job 'partial'" in error and "no final adapter" in error and "--checkpoint" in error
    assert main(["export", str(partial), "--checkpoint", "--out", str(tmp_path / "from-checkpoint")]) == 0
    assert (tmp_path / "from-checkpoint" / "adapter_model.safetensors").read_bytes() == \
        (partial / "checkpoint" / "adapter_model.safetensors").read_bytes()
    # a job the service's table holds as still running: its state and step, and to wait or use --checkpoint
    state = tmp_path / "state"
    table = JobTable(state / "jobs.sqlite")
    submission = JobSubmission(job=JobSpec(name="busy", data="unused.jsonl", format={"type": "text"}, max_steps=9))
    with table.transaction():
        table.add("busy-1a2b3c", submission, tmp_path / "busy")
        table.set_state("busy-1a2b3c", "running", "training", step=4, total_steps=9)
    table.close()
    assert main(["export", "busy", "--from", str(state), "--out", str(tmp_path / "y")]) == 2
    error = capsys.readouterr().err
    assert "job 'busy' is running (step 4 of 9) and has no final adapter" in error
    assert "wait until it completes" in error


def test_export_says_what_is_wrong_with_the_job_before_what_is_wrong_with_out(trained, tmp_path, capsys):
    """A job with nothing to export, and --out a folder that exists: the job's problem is said (a new --out would not
    help with it); it said "--out exists; give --force", and with --force then the job's. --out's own check follows
    once the job has an adapter."""
    out_dir, _ = trained
    (tmp_path / "taken").mkdir()
    partial = tmp_path / "partial"
    shutil.copytree(out_dir / "add", partial)
    (partial / "adapter_model.safetensors").unlink()
    shutil.rmtree(partial / "checkpoint")
    assert main(["export", str(partial), "--out", str(tmp_path / "taken")]) == 2
    error = capsys.readouterr().err
    assert "job 'partial'" in error and "no final adapter" in error and "exists" not in error, error
    assert main(["export", str(partial), "--checkpoint", "--out", str(tmp_path / "taken")]) == 2
    error = capsys.readouterr().err
    assert f"job 'partial' has no checkpoint in {partial / 'checkpoint'}" in error and "exists" not in error, error
    assert main(["export", "nope", "--from", str(out_dir), "--out", str(tmp_path / "taken")]) == 2
    error = capsys.readouterr().err
    assert f"no job 'nope' in {out_dir}" in error and "exists" not in error, error
    assert main(["export", "add", "--from", str(out_dir), "--out", str(tmp_path / "taken")]) == 2
    assert f"{tmp_path / 'taken'} exists; give --force" in capsys.readouterr().err
    assert list((tmp_path / "taken").iterdir()) == []


def test_a_job_is_found_by_id_or_name_in_the_service(trained, tmp_path):
    """Without a folder or --from, the service's record of the job (its `status`) says where its folder is."""
    out_dir, _ = trained
    table = JobTable(tmp_path / "jobs.sqlite")   # what the service's `status` reads (SchedulerActor.status)
    submission = JobSubmission(job=JobSpec(name="add", data="unused.jsonl", format={"type": "text"}, max_steps=3))
    with table.transaction():
        table.add("add-4d5e6f", submission, out_dir / "add")
        table.set_state("add-4d5e6f", "completed", "trained 3 of 3 steps", step=3, total_steps=3)
    exported = export_job("add", tmp_path / "via-service", service=table.find)
    weights = "adapter_model.safetensors"
    assert (exported / weights).read_bytes() == (out_dir / "add" / weights).read_bytes()
    with pytest.raises(KeyError, match="no job with id or name 'other'"):
        export_job("other", tmp_path / "other", service=table.find)
    table.close()


def test_a_running_service_without_the_job_says_which_run_has_it(trained, tmp_path, monkeypatch, capsys):
    """`aspen status JOB` and `aspen export JOB` while a service runs that has no JOB (the user's long-lived one, or
    another cluster's that Ray found) but a run this machine started has it: the service's "no job" says which
    run's table has it and to add --from; the command so completed answers."""
    from orchestrator.recent_runs import RecentRuns, state_folder

    trained_dir, _ = trained
    out_dir = tmp_path / "run"   # an ended `aspen run`: its table in <output folder>/.aspen, remembered as it does
    table = JobTable(out_dir / ".aspen" / "jobs.sqlite")
    submission = JobSubmission(job=JobSpec(name="add", data="unused.jsonl", format={"type": "text"}, max_steps=3))
    with table.transaction():
        table.add("add-4d5e6f", submission, trained_dir / "add")
        table.set_state("add-4d5e6f", "completed", "trained 3 of 3 steps", step=3, total_steps=3)
    table.close()
    monkeypatch.setenv("ASPEN_RECENT_RUNS", str(tmp_path / "runs.json"))
    RecentRuns().remember(tmp_path / "jobs.yaml", str(out_dir), state_folder(out_dir))
    service_table = JobTable(tmp_path / "service" / "jobs.sqlite")   # the running service's: not this job

    class RunningService:   # its status as the scheduler answers it (SchedulerActor.status: the table's find)
        status = staticmethod(service_table.find)

    monkeypatch.setattr("orchestrator.cli.service_commands.connect_service", lambda args: RunningService())
    monkeypatch.setattr("orchestrator.client.Client.connect", classmethod(lambda cls, *a, **k: RunningService()))
    hint = f"the run in {out_dir} has a job 'add' in its table: add --from {out_dir}"
    assert main(["status", "add"]) == 2
    error = capsys.readouterr().err
    assert "no job with id or name 'add' on the running service" in error and hint in error, error
    assert main(["export", "add", "--out", str(tmp_path / "x")]) == 2
    assert hint in capsys.readouterr().err
    assert main(["status", "add", "--from", str(out_dir)]) == 0
    assert "completed" in capsys.readouterr().out
    assert main(["export", "add", "--from", str(out_dir), "--out", str(tmp_path / "x")]) == 0
    assert (tmp_path / "x" / "adapter_model.safetensors").is_file()
    assert main(["status", "other"]) == 2   # a job no run has: the service's message as it is
    assert capsys.readouterr().err.strip().endswith("no job with id or name 'other'")
    service_table.close()
