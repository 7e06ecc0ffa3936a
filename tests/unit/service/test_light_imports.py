"""The processes that train nothing import no torch and no transformers: the driver (`aspen run`, the
client, the CLI) and the scheduler, which creates trainers and job actors from their classes. torch and
transformers take seconds of CPU to import and some 300 MB of memory each time; a scheduler that imported
them (through the actor classes it creates) cost every `aspen run` and every service start that much before
its first step. Checked in a fresh interpreter, as a Ray worker or `aspen` starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.cuda_count import assert_cuda_count_is_torchs
from tests.helpers.service import job_dict, write_task_data

REPO = Path(__file__).resolve().parents[3]

# what the driver and the scheduler's process import: the scheduler actor with the classes it creates, its
# listeners (metrics, MQTT events), its policies, and the client and CLI
SCHEDULER_SIDE = ["actors.scheduler_actor", "actors.job_actor", "actors.trainer_actor", "actors.job_dispatch",
                  "actors.ray_trainers", "orchestrator.observability", "orchestrator.metrics",
                  "orchestrator.mqtt.listener", "orchestrator.client", "orchestrator.cli", "orchestrator.run_plan",
                  "policies.registry", "policies.fifo", "policies.minpad", "policies.ordering"]
HEAVY = ["torch", "transformers", "peft"]


def imported_after(modules: list[str]) -> set[str]:
    code = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return set(json.loads(out))


def test_the_driver_and_the_scheduler_import_neither_torch_nor_transformers():
    loaded = imported_after(SCHEDULER_SIDE)
    assert "actors.scheduler_actor" in loaded and "ray" in loaded
    assert not [name for name in HEAVY if name in loaded], [name for name in HEAVY if name in loaded]


def test_the_http_server_and_aspen_export_start_without_torch():
    """`aspen http` and `aspen export` (a PEFT folder) import torch only to merge a model: the HTTP server's
    job routes imported the exporter, and with it torch (2 s of CPU, ~300 MB), at start."""
    loaded = imported_after(["orchestrator.http.api", "orchestrator.export", "orchestrator.cli.export_commands"])
    assert "orchestrator.http.jobs" in loaded and "actors.checkpoint.adapter_export" in loaded
    assert "torch" not in loaded and "peft" not in loaded


def test_the_check_sees_a_heavy_import_where_there_is_one():
    """The same check on the trainer's set-up, which does import torch: the test above can fail."""
    loaded = imported_after(["actors.service.trainer.trainer_setup"])
    assert "torch" in loaded and "transformers" in loaded


def test_aspen_runs_driver_checks_rows_and_plans_its_trainer_without_torch(tmp_path, tiny_model_dirs):
    """What `aspen run` does before its cluster starts, in a fresh interpreter: the jobs file read, its target modules
    checked against the base (in a process of its own), every data row tokenized (with the base's tokenizer alone:
    through actors.engine.models it imported torch and the model code, 5 s of CPU a run), the trainer planned with
    `device: auto` (torch asked for CUDA before)."""
    write_task_data(tmp_path / "data", "first")
    job = job_dict("first", tmp_path / "data" / "first.jsonl", steps=4)
    (tmp_path / "jobs.yaml").write_text(json.dumps({"base_model": str(tiny_model_dirs["llama"]), "output_dir": "out",
                                                    "jobs": [job]}))
    code = ("import json, sys\nfrom orchestrator.jobs_file import check_data_rows, load_run_spec\n"
            "from actors.service.scheduler.config import run_service_config\n"
            f"spec = load_run_spec({str(tmp_path / 'jobs.yaml')!r})\n"
            "assert spec.device == 'auto', spec.device\n"
            "from orchestrator.base_check import check_target_modules\n"
            f"check_target_modules(spec, {str(tmp_path / 'jobs.yaml')!r})\n"
            "check_data_rows(spec)\nconfig = run_service_config(spec)\n"
            "print(json.dumps([config.trainers[0].num_gpus, sorted(sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    num_gpus, loaded = json.loads(out.stdout)
    assert "torch" not in loaded and "actors.engine.models" not in loaded
    import torch

    assert num_gpus == min(1, torch.cuda.device_count())   # what torch would have said


def test_the_cuda_count_without_torch_is_torchs():
    assert_cuda_count_is_torchs()


def test_a_trainer_imports_peft_with_its_base_not_at_its_first_checkpoint(tmp_path, tiny_model_dirs):
    """A trainer loop imports PEFT (2-3 s with bitsandbytes installed, ~50 MiB) as it starts, before its memory
    admission measures the process's runtime: a job's first checkpoint imported it, stalling that step and adding
    memory the admission had not counted. Checked in a fresh interpreter, before any job or step."""
    code = ("import json, sys\nfrom pathlib import Path\n"
            "from actors.engine.models import load_base_model\n"
            "from actors.service.scheduler.config import TrainerConfig\n"
            "from actors.service.trainer.trainer_loop import TrainerLoop\n"
            f"model = {str(tiny_model_dirs['llama'])!r}\n"
            "before = 'peft' in sys.modules\n"
            "loop = TrainerLoop(load_base_model(model, dtype='float32', device='cpu'), "
            f"TrainerConfig(base_model=model, step_tokens=256), 't', Path({str(tmp_path)!r}))\n"
            "print(json.dumps([before, 'peft' in sys.modules, loop.trainer.step_count]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [False, True, 0]
