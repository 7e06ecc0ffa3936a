"""A service YAML's relative paths are read from its folder, as a jobs file's are, by `aspen serve --config`
and by `aspen watch --events --config` (the real CLI), run from another folder: a relative events.ca_file
beside the YAML verifies a real mosquitto's TLS certificate for the service's real publisher and for the
watcher; one that exists only in the current folder (where it was read from before) is still taken, with
one warning naming the file, the field and the fix."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from orchestrator.cli.parser import build_parser
from orchestrator.cli.service_commands import _service_config
from orchestrator.mqtt.listener import MqttListener
from tests.helpers.mqtt import start_mosquitto, stop_mosquitto
from tests.helpers.mqtt_tls import tls_broker_settings
from tests.helpers.mqtt_watcher import Watcher
from tests.helpers.ports import free_port
from tests.helpers.service import wait_for


def _yaml(folder: Path, port: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "service.yaml"
    path.write_text(f"state_dir: state\noutput_root: s3://bucket/aspen\ndata_roots: [data, s3://bucket/data]\n"
                    f"trainers:\n  - base_model: ./models/base\n    step_log: logs/trainer.jsonl\n"
                    f"events:\n  broker: mqtts://127.0.0.1:{port}\n  ca_file: ca.pem\n")
    return path


def test_relative_paths_of_the_service_yaml_are_read_from_its_folder(tmp_path, monkeypatch, caplog):
    port = free_port()
    settings, ca_file = tls_broker_settings(tmp_path / "broker", port)
    broker = start_mosquitto(tmp_path / "broker", port, settings)
    service = tmp_path / "svc"
    _yaml(service, port)
    shutil.copy(ca_file, service / "ca.pem")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    listener = None
    watcher = Watcher("watch", "--events", "--config", "../svc/service.yaml", cwd=elsewhere)
    try:
        with caplog.at_level(logging.WARNING, logger="orchestrator.service_yaml"):
            config = _service_config(build_parser().parse_args(["serve", "--config", "../svc/service.yaml"]))
        ours = [record for record in caplog.records if record.name.split(".")[0] in ("orchestrator", "actors")]
        assert not ours, caplog.text   # aspen's own: another test's leftover thread may log here too (CI had one)
        assert (config.state_dir, config.events.ca_file) == (service / "state", service / "ca.pem"), config
        assert str(config.output_root) == "s3://bucket/aspen", config.output_root
        assert config.data_roots == [str(service / "data"), "s3://bucket/data"], config.data_roots
        trainer = config.trainers[0]
        assert (trainer.base_model, trainer.step_log) == (str(service / "models/base"), service / "logs/trainer.jsonl")
        listener = MqttListener(config.events, state_dir=config.state_dir)   # the service's publisher, over TLS
        wait_for(lambda: listener.connection.connected, timeout=30, what="the service's publisher over TLS")
        wait_for(lambda: watcher.said("Ctrl-C to leave"), timeout=30, what=f"the watcher over TLS: {watcher.err}")
    finally:
        code = watcher.end()
        if listener is not None:
            listener.close()
        stop_mosquitto(broker)
    assert code == 0, watcher.err
    assert not [line for line in watcher.err if "WARNING" in line or "Traceback" in line], watcher.err


def test_a_relative_path_found_only_in_the_current_folder_is_taken_from_there_with_a_warning(tmp_path, monkeypatch,
                                                                                            caplog):
    port = free_port()
    settings, ca_file = tls_broker_settings(tmp_path / "broker", port)
    broker = start_mosquitto(tmp_path / "broker", port, settings)
    service = tmp_path / "svc"
    yaml_file = _yaml(service, port)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(ca_file, elsewhere / "ca.pem")   # where it was read from before: the current folder
    monkeypatch.chdir(elsewhere)
    watcher = Watcher("watch", "--events", "--config", str(yaml_file), cwd=elsewhere)
    try:
        with caplog.at_level(logging.WARNING, logger="orchestrator.service_yaml"):
            config = _service_config(build_parser().parse_args(["serve", "--config", str(yaml_file)]))
        assert config.events.ca_file == elsewhere / "ca.pem", config.events
        assert config.state_dir == service / "state", config.state_dir   # in neither: from the file's folder
        wait_for(lambda: watcher.said("Ctrl-C to leave"), timeout=30, what=f"the watcher over TLS: {watcher.err}")
    finally:
        code = watcher.end()
        stop_mosquitto(broker)
    assert code == 0, watcher.err
    said = [r.getMessage() for r in caplog.records]
    expected = (f"{yaml_file}: events.ca_file: 'ca.pem' is not in the file's folder {service} but is in the current "
                f"folder: {elsewhere / 'ca.pem'} is taken, as before; a service YAML's relative paths are read from "
                f"its folder (as a jobs file's): write it relative to {service} or absolute")
    assert len(said) == 1 and said[0].startswith(expected), said
    warned = [line for line in watcher.err if line.startswith("WARNING")]
    assert len(warned) == 1 and warned[0] == f"WARNING orchestrator.service_yaml: {said[0]}\n", watcher.err
