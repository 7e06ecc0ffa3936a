"""A base model's linear layers, from its config alone: the model built on `meta` (no weights, no memory) and laid
out as loading lays it out (GPT-2's Conv1D projections as linear layers), so that a job's `lora.target_modules` is
checked against the layers its trainer will have before anything starts (`aspen run`, `aspen submit`, `aspen sweep`,
the HTTP API: orchestrator/target_layers.py), rather than failing the job once its trainer has loaded the base. A
GGUF file's config is read from its converted folder, which its trainer reads too (built first where it is not yet).
The processes that check (the driver, the HTTP server) import no torch (tests/unit/service/test_light_imports.py):
they run this module in a process of their own, `python -m actors.engine.base_layers BASE`, which prints the base's
layers as JSON."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from actors.engine.adapter_surgery import linear_module_names, unadapted_names
from actors.engine.conv1d_layers import conv1d_as_linear
from actors.storage.gguf_cache import converted_source
from actors.storage.sources import ModelSource, resolve_source


def config_source(base_model: str) -> ModelSource:
    """Where `base_model`'s config is read from: a GGUF file's converted folder (actors/storage/gguf_cache.py), built
    now where it is not yet, as the base's trainer would build it first thing (reading the config from the GGUF file
    itself parses the whole file, 5-10 s for smollm2-135m's, every run); else the base itself. FileNotFoundError
    naming the base where it does not exist (a path that is not there, a hub id not in the local cache)."""
    return converted_source(resolve_source(base_model))


def meta_model(base_model: str) -> nn.Module:
    """`base_model` built from its config on `meta`: its modules, named and shaped as loaded, without weights.
    FileNotFoundError where the base does not exist; OSError or ValueError where its config cannot be read or built
    (a model type this transformers does not know, say)."""
    source = config_source(base_model)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    config = AutoConfig.from_pretrained(source.path, local_files_only=source.local_files_only, **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    conv1d_as_linear(model)
    return model


def layers(base_model: str) -> dict:
    """What `lora.target_modules` is checked against (actors/engine/lora_targets.py:target_problem): the names of
    `base_model`'s linear layers LoRA may adapt, its model type, and the short names of the layers it leaves alone."""
    model = meta_model(base_model)
    return {"linear": linear_module_names(model), "model_type": model.config.model_type,
            "unadapted": list(unadapted_names(model))}


if __name__ == "__main__":   # orchestrator/target_layers.py: the answer is stdout's last line, or why on stderr's
    try:
        print(json.dumps(layers(sys.argv[1])))
    except Exception as error:   # noqa: BLE001 (said in one line, the first of a long message: what is wrong)
        print(f"{type(error).__name__}: {' '.join(str(error).split())[:400]}", file=sys.stderr)
        sys.exit(1)
