"""A service call that times out names the connected cluster's own log folder (a cluster started with
`ray start --temp-dir` keeps its logs there, not under /tmp/ray), and Ray's default where the driver knows none."""

from __future__ import annotations

import types

import pytest
import ray
from ray.exceptions import GetTimeoutError

from orchestrator import scheduler_calls
from orchestrator.errors import ServiceError


def test_a_timed_out_call_names_the_clusters_log_folder(monkeypatch, tmp_path):
    def never(ref, timeout):
        raise GetTimeoutError("timed out")

    monkeypatch.setattr(ray, "get", never)
    node = types.SimpleNamespace(get_logs_dir_path=lambda: str(tmp_path / "session_x" / "logs"))
    monkeypatch.setattr(ray._private.worker.global_worker, "node", node, raising=False)
    with pytest.raises(ServiceError, match=rf"did not answer within 5s; .* or {tmp_path}/session_x/logs\)"):
        scheduler_calls._call(object(), timeout=5)
    monkeypatch.setattr(ray._private.worker.global_worker, "node", None, raising=False)
    with pytest.raises(ServiceError, match=r"/tmp/ray/session_latest/logs \(Ray's default temp dir\)"):
        scheduler_calls._call(object(), timeout=5)
