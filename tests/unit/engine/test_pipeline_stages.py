"""Cutting a base into pipeline stages, in one process (no transport): the stages chained compute exactly
the whole decoder's forward and backward (llama, qwen2, mistral with its sliding window), an adapter
attached to a stage is the single-device adapter's share, tensor for tensor; splits are checked, balanced
against every possible split, and what cannot be cut is refused with the reason."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from actors.engine.adapter_surgery import add_adapter, set_adapters_training
from actors.engine.layout import step_layout
from actors.engine.models import from_module
from actors.engine.packing import JobMicroBatch, pack
from actors.engine.pipeline.stage_model import check_stageable, cut_stage
from actors.engine.pipeline.stage_split import LayerCosts, balanced_split, check_split, even_split
from actors.spec.lora_config import LoraConfig
from tests.helpers.models import MODEL_CLASSES, random_examples, tiny_config

VOCAB = 300


def base(arch: str, layers: int = 4, tied: bool = False):
    mixed = arch == "qwen2-mixed"   # full and sliding-window layers alternating: per-layer types
    arch = "qwen2" if mixed else arch
    config = tiny_config(arch, VOCAB)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * layers
    if mixed:
        config.sliding_window = 8
        config.layer_types = ["full_attention", "sliding_attention"] * (layers // 2)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    return from_module(MODEL_CLASSES[arch](config).eval(), None)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-mixed", "mistral"])
@pytest.mark.parametrize("split", [[2, 2], [1, 2, 1]])
def test_stages_chained_compute_the_whole_decoder_exactly(arch, split):
    whole = base(arch)
    stages = [cut_stage(copy.deepcopy(whole), split, stage) for stage in range(len(split))]
    config = LoraConfig(r=4, alpha=8, target_modules="all-linear", dropout=0.0)
    adapters = [add_adapter(stage.base.model, "job", config, seed=3) for stage in stages]
    reference = add_adapter(whole.model, "job", config, seed=3)
    named = dict(reference.named_parameters())
    for adapter in adapters:   # each stage's share is the single-device adapter's, tensor for tensor
        for key, value in adapter.named_parameters():
            assert torch.equal(value, named.pop(key)), key
    assert not named, "every tensor is on some stage"
    for adapter in [reference] + adapters:   # a nonzero update, so that the adapter's path counts
        for _, parameter in adapter.named_parameters():
            torch.nn.init.normal_(parameter.data, std=0.02, generator=torch.Generator().manual_seed(1))
    batch = pack([JobMicroBatch("job", random_examples(1, count=3, vocab=VOCAB, min_len=20, max_len=40))])
    set_adapters_training(whole.model, True)
    with step_layout(batch.layout):
        expected = whole.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                                 attention_mask=None, use_cache=False).last_hidden_state[0]
        expected.sum().backward()
        hidden, inputs = None, []
        for stage in stages:
            if hidden is not None:
                hidden = hidden.detach().requires_grad_(True)
                inputs.append(hidden)
            hidden = stage.forward(position_ids=batch.position_ids, input_ids=batch.input_ids, hidden=hidden)
            outputs = hidden
            if stage is not stages[-1]:
                continue
        assert torch.equal(outputs, expected)
    # backward stage by stage, last first, each from the gradient of its output
    # (recompute the chain with kept graphs)
    with step_layout(batch.layout):
        kept, hidden = [], None
        for stage in stages:
            inp = None if hidden is None else hidden.detach().requires_grad_(True)
            hidden = stage.forward(position_ids=batch.position_ids, input_ids=batch.input_ids, hidden=inp)
            kept.append((inp, hidden))
    gradient = torch.ones_like(kept[-1][1])
    for inp, out in reversed(kept):
        torch.autograd.backward(out, gradient)
        gradient = inp.grad if inp is not None else None
    grads = {key: p.grad for key, p in reference.named_parameters()}
    for adapter in adapters:
        for key, parameter in adapter.named_parameters():
            assert torch.equal(parameter.grad, grads[key]), key


def test_a_cut_stage_frees_the_other_stages_weights_and_keeps_tied_embeddings_where_needed():
    whole = base("llama", layers=4, tied=True)
    total = sum(p.numel() * p.element_size() for p in whole.model.parameters())
    first = cut_stage(copy.deepcopy(whole), [2, 2], 0)
    last = cut_stage(copy.deepcopy(whole), [2, 2], 1)
    middle_free = cut_stage(copy.deepcopy(base("llama", layers=3)), [1, 1, 1], 1)
    assert first.held_bytes() < total and last.held_bytes() < total
    assert not last.base.lm_head.weight.is_meta                     # the tied head is the embedding
    assert middle_free.base.decoder.get_input_embeddings().weight.is_meta
    assert middle_free.base.lm_head.weight.is_meta


def test_splits_are_checked():
    assert check_split([3, 2], 5, 2) == [3, 2]
    with pytest.raises(ValueError, match="holds 4 decoder layers; the model has 5"):
        check_split([2, 2], 5, 2)
    with pytest.raises(ValueError, match="2 entries for 3 stages"):
        check_split([3, 2], 5, 3)
    with pytest.raises(ValueError, match="at least one decoder layer"):
        check_split([5, 0], 5, 2)
    with pytest.raises(ValueError, match="at most one stage per layer"):
        even_split(2, 3)
    assert even_split(5, 3) == [2, 2, 1]


def brute_force(costs: LayerCosts, stages: int) -> tuple[float, int]:
    layers = len(costs.seconds)
    best = (float("inf"), 0)
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = [0, *cuts, layers]
        worst = (0.0, 0)
        for stage in range(stages):
            seconds = sum(costs.seconds[bounds[stage]:bounds[stage + 1]])
            size = sum(costs.bytes[bounds[stage]:bounds[stage + 1]])
            seconds += costs.first_seconds if stage == 0 else 0
            seconds += costs.last_seconds if stage == stages - 1 else 0
            size += costs.first_bytes if stage == 0 else 0
            size += costs.last_bytes if stage == stages - 1 else 0
            worst = (max(worst[0], seconds), max(worst[1], size))
        best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_balanced_split_is_the_best_contiguous_one(seed):
    generator = torch.Generator().manual_seed(seed)
    layers = 9
    seconds = (torch.rand(layers, generator=generator) + 0.5).tolist()
    costs = LayerCosts(seconds=tuple(seconds), bytes=tuple([100] * layers), first_seconds=0.3, last_seconds=2.5,
                       first_bytes=50, last_bytes=80)
    for stages in (2, 3, 4):
        split = balanced_split(costs, stages)
        assert sum(split) == layers and len(split) == stages and min(split) >= 1
        bounds = [0, *itertools.accumulate(split)]
        worst = max(sum(seconds[bounds[s]:bounds[s + 1]]) + (0.3 if s == 0 else 0) + (2.5 if s == stages - 1 else 0)
                    for s in range(stages))
        assert worst == pytest.approx(brute_force(costs, stages)[0], rel=1e-12)
    # a heavy head: the last stage gets fewer layers
    assert balanced_split(LayerCosts(seconds=(1.0,) * 8, bytes=(1,) * 8, last_seconds=3.0), 2) == [5, 3]


def test_what_cannot_be_cut_is_refused_with_the_reason():
    config = tiny_config("llama", VOCAB)
    config.model_type = "gemma"   # its forward scales the embeddings: a later stage would scale again
    whole = base("llama")
    whole.model.config.model_type = "gemma"
    with pytest.raises(ValueError, match="cannot be cut into pipeline stages yet"):
        check_stageable(whole)


def test_measured_costs_cover_every_layer_and_leave_no_probe_behind():
    from actors.engine.fused_linear import FusedLoraLinear
    from actors.engine.pipeline.stage_split import measure_layer_costs
    whole = base("llama", layers=3)
    costs = measure_layer_costs(whole, tokens=64, repeats=1)
    assert len(costs.seconds) == 3 and min(costs.seconds) > 0 and costs.last_seconds > 0
    assert costs.bytes[0] == sum(p.numel() * 4 for p in whole.decoder.layers[0].parameters())
    assert not any(isinstance(m, FusedLoraLinear) for m in whole.model.modules())
    assert len(balanced_split(costs, 2)) == 2


def test_a_stage_that_does_not_fit_its_device_is_refused_with_the_numbers():
    from actors.engine.pipeline.stage_model import check_stage_fits
    check_stage_fits(1, 10 * 2**30, torch.device("cpu"))   # no CUDA memory to check on a CPU
    check_stage_fits(1, 2**30, torch.device("cuda:1"), free=2 * 2**30)
    with pytest.raises(MemoryError, match=r"pipeline stage 2: its weights need 3.00 GiB and cuda:1 has 2.00 GiB free"):
        check_stage_fits(2, 3 * 2**30, torch.device("cuda:1"), free=2 * 2**30)


def test_each_stage_counts_a_jobs_adapters_over_its_own_layers_however_often_asked():
    """A stage's adapter bytes (`StageMemory.adapters`, counted once per stage and LoRA config and kept) are those
    of `adapter_activations.adapter_bytes` over that stage's layers: two stages of different layers asked about the same
    configs in turn, and again, each answer its own."""
    from actors.engine.adapter_activations import adapter_bytes
    from actors.engine.lora_targets import match_targets
    from actors.engine.pipeline.stage_memory import StageActivation, StageMemory

    def stage(index: int, layers: range) -> StageMemory:
        shapes = {f"model.layers.{layer}.self_attn.{name}": shape for layer in layers
                  for name, shape in (("q_proj", (64, 64)), ("k_proj", (64, 32)), ("v_proj", (64, 32)))}
        shapes |= {f"model.layers.{layer}.mlp.up_proj": (64, 128) for layer in layers}
        groups = {name: hash(name.rsplit(".", 2)[0]) for name in shapes}   # q/k/v read one tensor a layer
        activation = StageActivation(saved_constant=0.0, saved_per_token=0.0, step_constant=0.0, step_per_token=0.0,
                                     linear_shapes=shapes, input_groups=groups)
        return StageMemory(stage=index, stages=2, held=0, activation=activation, vocab=300, hidden=64,
                           dtype=torch.float32, loss_chunk=256)

    stages = [stage(0, range(0, 1)), stage(1, range(1, 4))]
    configs = [LoraConfig(r=8, target_modules="all-linear"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
               LoraConfig(r=4, dropout=0.1, target_modules=["up_proj"])]
    plan = [(configs[0], 40), (configs[1], 25), (configs[2], 10)]
    for _ in range(2):
        for memory in stages:
            shapes, groups = memory.activation.linear_shapes, memory.activation.input_groups
            expected = adapter_bytes([(lora, match_targets(list(shapes), lora.target_modules), tokens)
                                      for lora, tokens in plan], shapes, groups, torch.float32)
            assert memory.adapters(plan) == expected > 0
    assert stages[0].adapters(plan) < stages[1].adapters(plan)
