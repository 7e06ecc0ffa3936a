"""The relative paths of a service YAML (`aspen serve --config FILE`, `aspen watch --events --config FILE`)
are read from the file's folder, as a jobs file's are (docs/spec.md): `state_dir`, `output_root` and
`data_roots` (but storage URIs), each trainer kind's `step_log`, `staging_dir` and a `base_model` written as
a path (`./model`, `../model`), and `events.ca_file`. Where the path does not exist there but does from the
current folder (where they were read from before), the current folder's is taken, with a warning saying to
write it relative to the file's folder or absolute."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from actors.storage.storage_uri import is_uri

log = logging.getLogger(__name__)


def _resolved(value: Any, folder: Path, config_file: Path, field: str) -> Any:
    """`value` (a path's text) taken from `folder` where relative; anything else as it is."""
    if not isinstance(value, str) or not value or is_uri(value):
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    beside, here = folder / path, Path.cwd() / path
    if beside.exists() or beside == here or not here.exists():
        return os.path.normpath(beside)
    log.warning("%s: %s: '%s' is not in the file's folder %s but is in the current folder: %s is taken, as before; "
                "a service YAML's relative paths are read from its folder (as a jobs file's): write it relative to "
                "%s or absolute, so that it does not depend on where aspen starts", config_file, field, value, folder,
                here, folder)
    return os.path.normpath(here)


def resolve_service_paths(data: dict, config_file: str | Path) -> dict:
    """The service YAML's `data` (as loaded; changed in place and returned) with its relative paths taken from
    `config_file`'s folder (see the module). Values of the wrong type are left for validation to name."""
    config_file = Path(config_file).expanduser()
    folder = config_file.resolve().parent

    def resolve(owner: dict, key: str, field: str) -> None:
        if key in owner:
            owner[key] = _resolved(owner[key], folder, config_file, field)

    resolve(data, "state_dir", "state_dir")
    resolve(data, "output_root", "output_root")
    if isinstance(data.get("data_roots"), list):
        data["data_roots"] = [_resolved(root, folder, config_file, f"data_roots[{index}]")
                              for index, root in enumerate(data["data_roots"])]
    if isinstance(data.get("events"), dict):
        resolve(data["events"], "ca_file", "events.ca_file")
    for index, trainer in enumerate(data.get("trainers") if isinstance(data.get("trainers"), list) else []):
        if not isinstance(trainer, dict):
            continue
        for key in ("step_log", "staging_dir"):
            resolve(trainer, key, f"trainers[{index}].{key}")
        model = trainer.get("base_model")
        if isinstance(model, str) and model.startswith((".", "~")):   # a path, as in a jobs file; else a model id
            resolve(trainer, "base_model", f"trainers[{index}].base_model")
    return data
