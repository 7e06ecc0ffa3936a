"""The committed calibration data (calibration.json, beside this file): the figures measured on the H200 leases
(2026-11-28, main 70c0645; 2026-12-04, main f1d6eda) that the model is compared with, the card's parameters read
off the last lease's profile (`profile_fit.py` wrote them) and each lease machine's host costs. Nothing under
../shared is read at run time.

The host is a machine's, not the card's: the same step's Python and launches cost 1.5-2x more per operation on the
2026-12-04 lease's machine than on 2026-11-28's. "host" holds the last profiled machine's costs (the default);
"hosts" keeps earlier machines' by name, so that a measurement is predicted with the host it ran on. A machine's
host probe (bench/host_probe.py, unprofiled, each kind of operation timed on its own) adds that machine's host
(`with_probe`): how a lease machine's host-bound steps are predicted before they are measured."""

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


def host_from_probe(probe: dict, base: Host) -> dict:
    """A host section (as calibration.json's "hosts" hold them) from a machine's host probe (bench/host_probe.py's
    JSON): each launching operation the probe timed at its own cost (`Host.kernels`), any other at the median of
    theirs, views, autograd's nodes, Python functions and synchronisations as the probe timed them, unprofiled
    (scale 1); a launch beyond an operation's first and the launch queue from `base`, which the probe does not time.

    The probe times small Python methods and tiny operations in bursts: the step's own Python (comprehensions,
    loops, lookups) costs more a function than its small method, so a step priced by it is a lower bound of the
    host's time, by what the next lease's host-bound steps measure (docs/cost_model.md)."""
    machine = f"probe:{probe['machine']}"
    what = f"host probe ({probe['machine']}, {probe['device']}, unprofiled)"
    section = {
        "python": probe["python"]["s"], "call": 0.0, "view": probe["summary"]["view_median_s"],
        "kernel": probe["summary"]["kernel_median_s"],
        "kernels": {name: value["s"] for name, value in probe["kernels"].items()},
        "launch": base.launch, "node": probe["node"]["s"], "scale": 1.0,
        "sync": probe["sync"]["s"] if "sync" in probe else base.sync, "queue": base.queue,
    }
    section["_sources"] = {
        "python": f"{what}: a small method's call", "call": "in each operation's probed cost",
        "view": f"{what}: median of view, t, slice", "kernel": f"{what}: median of the probed kinds",
        "kernels": f"{what}: each kind's own", "launch": f"{base.sources.get('launch', 'the default host')} "
                                                        "(not probed)",
        "node": f"{what}: mul with a gradient less without", "scale": "1: no profiler to take out",
        "sync": f"{what}" if "sync" in probe else f"{base.sources.get('sync', 'the default host')} (not probed)",
        "queue": base.sources.get("queue", "CUDA's launch queue"),
    }
    section["_machine"] = machine
    return section


def with_probe(calibration: dict, probe: dict) -> tuple[dict, str]:
    """`calibration` with the probed machine's host added to its "hosts" (built on the default host), and that
    host's name (`host_for(result, name)` gives it)."""
    section = host_from_probe(probe, host_for(calibration))
    machine = section["_machine"]
    return {**calibration, "hosts": {**calibration.get("hosts", {}), machine: section}}, machine
