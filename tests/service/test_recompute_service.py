"""Recomputation on the service: a trainer actor on Ray with `recompute: layers` against the in-process driver."""

from __future__ import annotations

from actors.engine.models import load_base_model
from actors.service.scheduler.config import run_service_config
from actors.service.scheduler.local_run import train_locally
from tests.helpers.service import adapter_tensors, job_dict, run_spec, write_task_data


def test_the_service_trains_with_recomputation_as_the_in_process_driver_without(ray_session, tiny_model_dirs,
                                                                                 tmp_path):
    """The service on Ray with `recompute: layers` in its trainer config ends with the adapters the in-process
    driver trains without recomputation."""
    from orchestrator.client import Client
    from tests.helpers.service import max_relative_difference

    base_dir = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "task")
    jobs = [job_dict("one", data, 4, lora={"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": "all-linear"}),
            job_dict("two", data, 4)]
    local = run_spec(base_dir, tmp_path / "local", jobs, step_tokens=512)
    train_locally(local, base=load_base_model(base_dir, dtype="float32", device="cpu"), progress=False)
    on_ray = run_spec(base_dir, tmp_path / "service", jobs, step_tokens=512)
    client = Client.local(run_service_config(on_ray, tick_seconds=0.1,
                                             trainer={"num_cpus": 0.5, "threads": 1, "recompute": "layers"}))
    try:
        handles = client.submit_run(on_ray)
        records = client.wait_all([h.id for h in handles], timeout=300)
    finally:
        client.shutdown()
    assert [r.state for r in records] == ["completed", "completed"]
    for name in ("one", "two"):
        assert max_relative_difference(adapter_tensors(tmp_path / "local" / name),
                                       adapter_tensors(tmp_path / "service" / name)) <= 1e-6, name
