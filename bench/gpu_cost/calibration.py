"""The committed calibration data (calibration.json, beside this file): the figures measured on the H200 leases
(2026-11-28, main 70c0645; 2026-12-04, main f1d6eda) that the model is compared with, the card's parameters read
off the last lease's profile (`profile_fit.py` wrote them) and each lease machine's host costs. Nothing under
../shared is read at run time.

The host is a machine's, not the card's: the same step's Python and launches cost 1.5-2x more per operation on the
2026-12-04 lease's machine than on 2026-11-28's. "host" holds the last profiled machine's costs (the default);
"hosts" keeps earlier machines' by name, so that a measurement is predicted with the host it ran on."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_cost.card import CARDS, Card
from gpu_cost.timeline import Host

PATH = Path(__file__).resolve().parent / "calibration.json"
CALIBRATION_COMMIT = "70c0645"


def load(path: Path = PATH) -> dict:
    return json.loads(path.read_text())


def card_for(name: str, calibration: dict) -> Card:
    if name not in CARDS:
        raise ValueError(f"unknown card '{name}': one of {', '.join(sorted(CARDS))}")
    profile = {key: value for key, value in calibration.get("card", {}).items() if not key.startswith("_")}
    return CARDS[name](profile)


def default_machine(calibration: dict) -> str | None:
    """The machine of the default host costs (the last profiled lease machine's), None where unnamed."""
    return calibration.get("host", {}).get("_machine")


def host_names(calibration: dict) -> list[str]:
    """The machines whose host costs the calibration holds, the default (the last profiled) first."""
    default = default_machine(calibration)
    return ([default] if default else []) + sorted(calibration.get("hosts", {}))


def host_for(calibration: dict, machine: str | None = None) -> Host:
    """The host costs of `machine` (a name of `host_names`), or the default host's where None."""
    section = calibration.get("host", {})
    if machine is not None and machine != default_machine(calibration):
        hosts = calibration.get("hosts", {})
        if machine not in hosts:
            raise ValueError(f"no host costs for machine '{machine}' in the calibration: known "
                             f"{', '.join(host_names(calibration)) or 'none'} (bench/gpu_cost/profile_fit.py "
                             "--machine NAME writes a lease machine's from its profile)")
        section = hosts[machine]
    values = {key: value for key, value in section.items() if not key.startswith("_")}
    return Host(**values, sources=section.get("_sources", {}))
