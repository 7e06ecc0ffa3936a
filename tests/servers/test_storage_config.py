"""The service configuration's `storage:` (S3 endpoint, region, the names of the credential variables), against
a real S3-compatible server (moto_server): a run configured by it alone trains a job whose data and output are
s3:// URIs while the process's environment points at a dead endpoint and holds no AWS credentials; a job
actor on Ray reads its data through the configured endpoint (and, given no configuration, fails on its
environment's); bad values are refused when the configuration is loaded, naming the field and the fix."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest
from pydantic import ValidationError

from actors.engine.models import load_base_model
from actors.service.scheduler.config import ServiceConfig, StorageConfig
from actors.service.scheduler.local_run import train_locally
from actors.storage.checkpoint_mirror import POINTER_NAME
from actors.storage.s3_settings import S3Settings, configured_storage
from tests.helpers.ports import free_port
from tests.helpers.service import job_dict, run_spec, write_task_data

AWS_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION")
CREDENTIALS = {"STORE_KEY_ID": "testing", "STORE_SECRET": "testing"}   # moto takes any


def _raw_s3(server) -> pafs.S3FileSystem:
    """The server reached without aspen's storage module (what is there, seen independently)."""
    return pafs.S3FileSystem(endpoint_override=server.endpoint.split("://", 1)[1], scheme="http", access_key="testing",
                             secret_key="testing", region="us-east-1", request_timeout=60)


def _storage(server) -> dict:
    return {"endpoint_url": server.endpoint, "region": "us-east-1", "access_key_env": "STORE_KEY_ID",
            "secret_key_env": "STORE_SECRET"}


@pytest.fixture()
def environment_without_s3(monkeypatch):
    """No AWS settings in this process's environment but a dead endpoint (a configured one must win), and the
    credentials under names of the test's choosing."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)


def test_a_run_configured_by_storage_alone_trains_to_s3(s3_server, s3_bucket, tmp_path, tiny_model_dirs,
                                                        environment_without_s3):
    raw = _raw_s3(s3_server)
    data = write_task_data(tmp_path / "data", "configured")
    with raw.open_output_stream(f"{s3_bucket}/sets/configured.jsonl") as stream:
        stream.write(data.read_bytes())
    spec = run_spec(str(tiny_model_dirs["llama"]), f"s3://{s3_bucket}/out",
                    [job_dict("configured", f"s3://{s3_bucket}/sets/configured.jsonl", 3, checkpoint_every=2)])
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    (summary,) = train_locally(spec, base=base, progress=False, storage=_storage(s3_server))
    assert summary.state == "completed" and summary.steps == 3, summary.reason
    assert summary.adapter_dir == f"s3://{s3_bucket}/out/configured"
    prefix = f"{s3_bucket}/out/configured"
    names = {info.base_name for info in raw.get_file_info(pafs.FileSelector(prefix))}
    assert {"adapter_model.safetensors", "adapter_config.json", "metrics.jsonl", POINTER_NAME} <= names, names
    with raw.open_input_stream(f"{prefix}/{POINTER_NAME}") as stream:
        pointer = json.loads(stream.read())
    assert pointer["step"] == 3
    uploaded = {info.base_name for info in raw.get_file_info(pafs.FileSelector(f"{prefix}/{pointer['upload']}"))}
    assert uploaded == set(pointer["files"]) and "state.json" in uploaded
    assert configured_storage() == S3Settings(), "the run's storage settings outlived it"


def test_a_job_actor_on_ray_reads_its_data_through_the_configured_endpoint(ray_session, s3_server, s3_bucket,
                                                                          tmp_path, tiny_model_dirs):
    from actors.job_actor import JobActor
    from actors.storage.storage_errors import StorageUnreachable

    with _raw_s3(s3_server).open_output_stream(f"{s3_bucket}/sets/remote.jsonl") as stream:
        stream.write(write_task_data(tmp_path / "data", "remote").read_bytes())
    (submission,) = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out",
                             [job_dict("remote", f"s3://{s3_bucket}/sets/remote.jsonl", 3)]).submissions()
    # the actor's environment (as its node's `ray start` would give it): a dead endpoint, credentials by other names
    env = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", **CREDENTIALS}
    storage = StorageConfig.model_validate(_storage(s3_server))
    configured = JobActor.options(runtime_env={"env_vars": env}).remote(
        "remote-1", submission, str(tmp_path / "cache"), storage=storage)
    unconfigured = JobActor.options(runtime_env={"env_vars": env}).remote(
        "remote-2", submission, str(tmp_path / "cache"))
    try:
        summary, _ = ray_session.get(configured.prepare.remote(), timeout=120)
        assert summary.total_steps == 3
        with pytest.raises(ray_session.exceptions.RayTaskError) as caught:
            ray_session.get(unconfigured.prepare.remote(), timeout=120)
        assert isinstance(caught.value.cause, StorageUnreachable), caught.value
    finally:
        ray_session.kill(configured)
        ray_session.kill(unconfigured)


@pytest.mark.parametrize(("storage", "message"), [
    ({"endpoint_url": "minio.local:9000"}, "storage.endpoint_url: 'minio.local:9000' is not an endpoint URL: write "
                                           "http://host:port"),
    ({"endpoint_url": "http://key:secret@minio.local:9000"}, "holds no credentials"),
    ({"endpoint_url": "http://minio.local:99999"}, "port"),
    ({"access_key_env": "MINIO_KEY"}, "give both access_key_env and secret_key_env"),
    ({"access_key_env": "wJalr/XUtnFEMI+K7MDENG", "secret_key_env": "S"}, "not an environment variable name"),
])
def test_bad_storage_values_are_refused_when_the_configuration_loads(storage, message):
    with pytest.raises(ValidationError) as caught:
        ServiceConfig.model_validate({"storage": storage})
    assert message in str(caught.value)
    assert "storage" in str(caught.value).splitlines()[1]   # the field's place in the file
