"""The Tinker API's parts of a base (actors/spec/model_parts.py: `train_attn`, `train_mlp`), on every model type of
the verified table, against the model's own structure: the linear layers that `target_modules` of attention alone
selects are exactly those inside its token-mixing modules (by their classes: attention under every name, Gated
DeltaNet, LFM2's short convolutions), those of the MLP alone exactly the others, both together every one; on GPT-2,
whose attention and MLP both hold a `c_proj`, by the two last name parts."""

from __future__ import annotations

import pytest
from torch import nn

from actors.engine.adapter_surgery import linear_module_names
from actors.engine.lora_targets import match_targets
from actors.engine.model_support import SUPPORTED
from actors.engine.models import from_module
from actors.spec.model_parts import is_attention, part_targets
from tests.helpers.model_families import build_config, build_model

pytestmark = pytest.mark.unit
MIXERS = ("Attention", "Attn", "GatedDeltaNet", "ShortConv")   # token-mixing module classes, by name


def mixer_layers(model: nn.Module) -> set[str]:
    """The linear layers inside a token-mixing module (by the module's class, not its name in the model)."""
    found = set()
    for name, module in model.named_modules():
        if any(mixer in type(module).__name__ for mixer in MIXERS):
            found.update(f"{name}.{sub}" for sub, child in module.named_modules() if isinstance(child, nn.Linear))
    return found


@pytest.mark.parametrize("model_type", list(SUPPORTED))
def test_attention_and_mlp_targets_select_the_model_s_own_parts(model_type):
    model = from_module(build_model(build_config(model_type)), None).model
    linear = linear_module_names(model)
    attention = sorted(name for name in linear if name in mixer_layers(model))
    assert attention, "no attention layer found"
    mlp = sorted(name for name in linear if name not in attention)
    assert sorted(name for name in linear if is_attention(name)) == attention
    assert sorted(match_targets(linear, part_targets(linear, train_attn=True, train_mlp=False))) == attention
    assert sorted(match_targets(linear, part_targets(linear, train_attn=False, train_mlp=True))) == mlp
    assert sorted(match_targets(linear, part_targets(linear, train_attn=True, train_mlp=True))) == sorted(linear)


def test_a_leaf_shared_by_attention_and_the_mlp_is_named_by_its_parent():
    names = ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
             "transformer.h.0.mlp.c_proj", "lm_head"]
    assert part_targets(names, train_attn=True, train_mlp=False) == ["attn.c_proj", "c_attn"]
    assert part_targets(names, train_attn=False, train_mlp=True) == ["c_fc", "mlp.c_proj"]
    assert part_targets(names, train_attn=True, train_mlp=True) == ["c_attn", "c_fc", "c_proj"]
