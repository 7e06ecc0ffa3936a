"""The committed calibration data (calibration.json, beside this file): the figures measured on the H200 on
2026-11-28 (main 70c0645) that the model is compared with, and the parameters read off that profile's
kernels (`profile_fit.py` wrote them) and the host's, fitted. Nothing under ../shared is read at run time."""

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


def host_for(calibration: dict) -> Host:
    values = {key: value for key, value in calibration.get("host", {}).items() if not key.startswith("_")}
    sources = calibration.get("host", {}).get("_sources", {})
    return Host(**values, sources=sources)
