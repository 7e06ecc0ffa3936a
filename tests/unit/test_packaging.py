"""The distribution as users install it: its name on PyPI, the license, the extras and the `aspen` command
(metadata of a wheel built from this tree), and what a missing extra says."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from actors.engine.extras import MissingExtraError, require

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the distribution's files (building in the tree would leave build/ there)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    for package in ("orchestrator", "actors", "policies"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (found,) = out.glob("*.whl")
    return found


def test_the_wheel_is_aspen_lora_under_apache_2_with_extras_and_the_aspen_command(wheel):
    assert wheel.name.startswith("aspen_lora-")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n.rsplit("/", 1)[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert metadata["Name"] == "aspen-lora"
    assert metadata["License-Expression"] == "Apache-2.0" and "Apache License" in license_text
    assert set(metadata.get_all("Provides-Extra")) >= {"quant", "broker", "all", "dev", "gpu"}
    requires = metadata.get_all("Requires-Dist")
    assert any(r.startswith("bitsandbytes") and 'extra == "quant"' in r for r in requires)
    assert any(r.startswith("amqtt") and 'extra == "broker"' in r for r in requires)
    # Liger-Kernel (and with it Triton) only through the gpu extra: not in all, nor in dev
    assert [r for r in requires if r.startswith("liger-kernel")] == ['liger-kernel<0.9,>=0.8.5; extra == "gpu"']
    assert not any(r.startswith(("bitsandbytes", "amqtt")) and "extra ==" not in r for r in requires)
    assert "aspen = orchestrator.cli:main" in entry_points
    for package in ("orchestrator/cli/main.py", "actors/engine/extras.py", "policies/base.py"):
        assert package in names
    assert not any(n.startswith("tests/") for n in names)


def test_a_missing_extra_names_what_needs_it_and_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)   # as if not installed: importing it fails
    with pytest.raises(MissingExtraError) as caught:
        require("bitsandbytes", "quant", "quantization: nf4")
    message = str(caught.value)
    assert "quantization: nf4 needs bitsandbytes" in message and "pip install 'aspen-lora[quant]'" in message


def test_quantizing_without_bitsandbytes_fails_before_training(monkeypatch, tiny_model_dirs):
    from actors.engine.models import load_base_model

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(MissingExtraError, match=r"aspen-lora\[quant\]"):
        load_base_model(str(tiny_model_dirs["llama"]), quantization="nf4", device="cpu")


def test_without_the_broker_extra_the_service_runs_with_events_off_and_says_why(monkeypatch, tmp_path):
    from actors.service.scheduler.config import EventsConfig
    from orchestrator.mqtt.listener import MqttListener
    from tests.helpers.mqtt import job_record

    monkeypatch.setitem(sys.modules, "amqtt", None)   # as if the [broker] extra were not installed
    listener = MqttListener(EventsConfig(embedded_port=0), state_dir=tmp_path)
    try:
        error = listener.describe()["events_error"]
        assert "the embedded MQTT broker" in error and "pip install 'aspen-lora[broker]'" in error
        assert "events.broker" in error and "off" in error
        listener.job_changed(job_record("job-1", "running"), None)   # hears the service as before, publishes nothing
    finally:
        listener.close()
