"""Helpers shared by the service tests: small datasets, run specs and adapter comparison."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from actors.service.scheduler.config import ServiceConfig, TrainerConfig
from actors.spec.run_spec import RunSpec


def write_task_data(folder: Path, name: str, rows: int = 32, offset: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    with path.open("w") as f:
        for i in range(rows):
            a, b = i + offset, 3 * i + 7 * offset
            f.write(json.dumps({"question": f"{name} {a} and {b}", "answer": f"{a + b} {name}"}) + "\n")
    return path


def job_dict(name: str, data: Path, steps: int, **extra) -> dict:
    return {"name": name, "data": str(data), "batch_size": 4, "max_seq_len": 128, "max_steps": steps, "lr": 1e-3,
            "format": {"type": "prompt_response", "prompt": "Q: {question}\nA:", "response": " {answer}"},
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, **extra}


def run_spec(base_model: str, output_dir: Path, jobs: list[dict], step_tokens: int | str | None = None) -> RunSpec:
    """A jobs file's spec; without `step_tokens` the file's default (`auto`), as users leave it."""
    return RunSpec.model_validate({"base_model": base_model, "output_dir": str(output_dir), "jobs": jobs,
                                   **({} if step_tokens is None else {"step_tokens": step_tokens})})


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / "adapter_model.safetensors"))


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    worst = 0.0
    for key in a:
        scale = max(float(b[key].abs().max()), 1e-8)
        worst = max(worst, float((a[key] - b[key]).abs().max()) / scale)
    return worst


def wait_for(predicate, timeout: float = 120, what: str = "condition", *, every: float = 0.2, state=None):
    """Poll `predicate` every `every` seconds until it returns something truthy (returned), or fail after
    `timeout` seconds, with `state()` (what the service shows) in the message where given."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {state()}" if state else ""))


NO_LISTENERS = {"events": {"enabled": False}, "metrics": {"enabled": False}}   # no MQTT events, no metrics port


def service_config(state_dir: Path, base: Path, *, listeners: dict | None = None, **trainer) -> ServiceConfig:
    """A service of one CPU trainer on `base` (512-token steps, half a CPU, one thread), ticking every 0.1 s;
    `listeners`: its `events` / `metrics` settings (their defaults where not given); `trainer`: more of the
    trainer's settings."""
    trainer = {"base_model": str(base), "step_tokens": 512, "num_cpus": 0.5, "threads": 1, **trainer}
    return ServiceConfig(state_dir=state_dir, trainers=[TrainerConfig(**trainer)], tick_seconds=0.1,
                         **(listeners or {}))


def ray_actor_logs(*classes: str, tail: int = 6000) -> str:
    """What this Ray session's workers that ran one of `classes` (e.g. "TrainerActor") logged last, and where
    each of those still running is now (py-spy, installed with ray[default]): what a service test that timed
    out shows, since its actors' logs do not reach the test's output."""
    import subprocess
    import sys

    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    out = []
    for path in sorted(logs.glob("worker-*.err")):
        text = path.read_text(errors="replace")
        if not any(f"actor_name:{name}" in text for name in classes):
            continue
        lines = [line[:400] for line in text.splitlines()]
        out.append(f"===== {path.name}\n" + "\n".join(lines)[-tail:])
        pid = path.stem.rsplit("-", 1)[-1]
        spy = Path(sys.executable).parent / "py-spy"
        if pid.isdigit() and Path(f"/proc/{pid}").exists() and spy.exists():
            dump = subprocess.run([str(spy), "dump", "--pid", pid], capture_output=True, text=True, timeout=60)
            out.append(f"----- py-spy dump of {pid}\n{dump.stdout[-tail:]}{dump.stderr[-500:]}")
    return "\n".join(out) or f"no log of {classes} in {logs}"


def run_again(spec: RunSpec, state: Path | None = None, **run) -> list:
    """`aspen run --in-process` again on the same folder: its plan (the lines it prints, printed once its row checks
    passed, as the run does), then the jobs it carries (done, resumed, continued to a raised budget), trained by
    `train_locally` with `run` (its base, its trainer settings); the summaries. `state`: the run's state folder
    (`run_local_dir`'s `.aspen`; by default the output folder's)."""
    from actors.service.scheduler.local_run import train_locally
    from actors.service.table.recorded_run import CarriedJobs
    from orchestrator.cli.run_commands import _plan_in_process, saved_step

    state = state or spec.output_dir / ".aspen"
    plan = _plan_in_process(spec, state, overwrite=False)
    assert plan is not None and not plan.changed and not plan.submit, plan
    for line in plan.lines(saved_step=saved_step):
        print(line)
    carry = CarriedJobs([r.id for r in plan.done], [r.id for r in plan.resume],
                        {r.id: submission for r, submission in plan.extend})
    return train_locally(spec, progress=False, record_in=state, carry=carry, **run)


def alice_with_quotas(tmp_path: Path, quotas: dict, policy: str = "adaptive"):
    """A scheduler core on a real job table and users file whose one user, alice, has `quotas` and a data root with
    one task's data: (core, table, users, data, state)."""
    from actors.service.accounts.users import UserBook
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.table.job_table import JobTable
    from policies.registry import load_policy

    state = tmp_path / "state"
    data = write_task_data(tmp_path / "data", "q")
    users = UserBook.in_state_dir(state)
    users.add("alice", data_roots=[str(tmp_path / "data")], quotas=quotas)
    table = JobTable(state / "jobs.sqlite")
    return SchedulerCore(table, load_policy(policy), state), table, users, data, state
