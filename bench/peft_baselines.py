"""The single-job PEFT setups bench/lora_mfu.py measures aspen against, as users write them.

(a) `padded_steps`: a careful PEFT loop: a job's sequences sorted by length, 8 a step padded to the longest
    (an attention mask), PEFT's default adapters (float32 on a bf16 base: `autocast_adapter_dtype`), fused
    AdamW, the model's own loss.
(b) `packed_steps`: PEFT over packed sequences: one row a step, position ids restarting at each sequence, and
    a varlen attention: `PACKED_ATTENTION`, registered with transformers' AttentionInterface, derives the
    sequences' boundaries (cu_seqlens) from the position ids as transformers' flash-attention packing does and
    runs torch.nn.attention.varlen.varlen_attn on them (CUDA, half precision); elsewhere scaled-dot-product
    attention per sequence. Liger's kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) where
    liger_kernel imports; adapters in bf16 or float32.

Both return per-step seconds and real tokens (StepClock: CUDA events between steps)."""

from __future__ import annotations

import gc
import importlib.util
import inspect
import itertools
import random
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from lora_bench import LORA, StepClock, log, sync
from profile_step import profile_steps
from transformers import AttentionInterface

PACKED_ATTENTION = "bench_packed_varlen"
try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:   # torch < 2.10
    varlen_attn = None
VARLEN_OPTIONS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()

_boundaries: dict = {"of": lambda: None}   # the position ids (a weak reference) the cu_seqlens below are of


def _cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Where each sequence starts in the packed row (position 0), as flash-attention's cu_seqlens, and the
    longest sequence: computed once per forward (one host sync), reused by every layer, which all get the same
    position-ids tensor (held alive by the caller meanwhile: the identity test cannot match another step's)."""
    if _boundaries["of"]() is not position_ids:
        flat = position_ids.reshape(-1)
        starts = torch.nonzero(flat == 0).reshape(-1)
        ends = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)])
        _boundaries.update(of=weakref.ref(position_ids), cu=ends.to(torch.int32),
                           longest=int((ends[1:] - ends[:-1]).max()))
    return _boundaries["cu"], _boundaries["longest"]


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, heads, T, dim), key/value (1, kv_heads, T, dim) of one packed row; each sequence attends
    causally to itself. Returns (1, T, heads, dim)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[0] != 1:
        raise ValueError(f"{PACKED_ATTENTION} needs one packed row and its position_ids")
    cu, longest = _cu_seqlens(position_ids)
    groups = query.shape[1] // key.shape[1]
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and varlen_attn is not None:
        options = {}
        if groups > 1 and "enable_gqa" in VARLEN_OPTIONS:
            options["enable_gqa"] = True
        elif groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        if "window_size" in VARLEN_OPTIONS:
            options["window_size"] = (-1, 0)   # causal
        elif "is_causal" in VARLEN_OPTIONS:
            options["is_causal"] = True
        out = varlen_attn(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, cu,
                          longest, longest, scale=scaling, **options)
        return out.unsqueeze(0), None
    bounds = cu.tolist()
    outputs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                              scale=scaling, enable_gqa=groups > 1)
               for a, b in zip(bounds, bounds[1:], strict=False)]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def probe_step(model, device: torch.device) -> None:
    """One packed step of two short sequences through a throwaway adapter (does the patched model train?)."""
    from peft import get_peft_model
    model.train()
    peft_model = get_peft_model(model, lora_config())
    batch = [(list(range(3, 40)), list(range(3, 40))), (list(range(5, 30)), list(range(5, 30)))]
    peft_model(**packed_tensors(batch, device), use_cache=False).loss.backward()
    peft_model.unload()


def apply_liger(model) -> str | None:
    """Liger's kernels on a Llama model where liger_kernel imports (and the device is CUDA); the reason not."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed"
    if not next(model.parameters()).is_cuda:
        return "Liger's Triton kernels need CUDA"
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=model)
    except Exception as error:  # noqa: BLE001 - the baseline runs without Liger and says why
        return f"liger_kernel failed to patch the model: {type(error).__name__}: {error}"
    return None


def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], target_modules="all-linear",
                      bias="none", task_type="CAUSAL_LM")


def sorted_batches(sequences: list[tuple[list[int], list[int]]], per_step: int, seed: int) -> list[list]:
    """Sorted by length, `per_step` a batch, the batches in a shuffled order (a length-grouped sampler)."""
    ordered = sorted(sequences, key=lambda s: len(s[0]))
    batches = [ordered[i:i + per_step] for i in range(0, len(ordered), per_step)]
    random.Random(seed).shuffle(batches)
    return batches


def padded_tensors(batch, device: torch.device) -> dict:
    longest = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([i + [0] * (longest - len(i)) for i, _ in batch])
    labels = torch.tensor([label + [-100] * (longest - len(label)) for _, label in batch])
    mask = torch.tensor([[1] * len(i) + [0] * (longest - len(i)) for i, _ in batch])
    return {k: v.to(device, non_blocking=True) for k, v in
            {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


def packed_tensors(batch, device: torch.device) -> dict:
    """One row: the sequences one after another, position ids restarting at each, and no label at a
    sequence's first token (the shifted loss would otherwise predict it from the sequence before)."""
    ids, positions, labels = [], [], []
    for tokens, targets in batch:
        ids += tokens
        positions += range(len(tokens))
        labels += [-100] + list(targets[1:])
    return {k: torch.tensor([v]).to(device, non_blocking=True) for k, v in
            {"input_ids": ids, "position_ids": positions, "labels": labels}.items()}


def optimizer_for(model, device: torch.device):
    parameters = [p for p in model.parameters() if p.requires_grad]
    return parameters, torch.optim.AdamW(parameters, lr=1e-4, fused=device.type == "cuda")


def train_steps(peft_model, batches: list[list], device: torch.device, packed: bool,
                clock: StepClock | None) -> tuple[list[int], list[int]]:
    """One optimizer step a batch; `clock` marks before the first (the optimizer made) and after each (None:
    warm-up). Real and padded tokens a step."""
    parameters, optimizer = optimizer_for(peft_model, device)
    if clock is not None:
        clock.mark()
    real, padded = [], []
    for batch in batches:
        inputs = one_step(peft_model, parameters, optimizer, batch, device, packed)
        if clock is not None:
            clock.mark()
        real.append(sum(len(ids) for ids, _ in batch))
        padded.append(inputs["input_ids"].numel())
    return real, padded


def one_step(peft_model, parameters: list, optimizer, batch: list, device: torch.device, packed: bool) -> dict:
    """One optimizer step over `batch`, as a careful user writes it; the step's input tensors."""
    inputs = packed_tensors(batch, device) if packed else padded_tensors(batch, device)
    loss = peft_model(**inputs, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return inputs


def profile_job(model, sequences: list, device: torch.device, *, per_step: int, packed: bool,
                float32_adapters: bool, out: Path, median_step_s: float | None, steps: int = 2) -> dict:
    """`steps` steps of one more job over `sequences` (a fresh adapter, one untimed step first) under
    torch.profiler into `out` (bench/profile_step.py: tables, trace, summary): the host's work of a side whose
    steps the host bounds, for the cost model's host costs (bench/gpu_cost/profile_fit.py)."""
    from peft import get_peft_model
    peft_model = get_peft_model(model, lora_config(), autocast_adapter_dtype=float32_adapters)
    try:   # the adapter comes off the base however the steps end
        parameters, optimizer = optimizer_for(peft_model, device)
        batches = sorted_batches(sequences, per_step, seed=0)
        one_step(peft_model, parameters, optimizer, batches[0], device, packed)
        chosen = itertools.cycle(batches[1:1 + steps] or batches)
        return profile_steps(lambda: one_step(peft_model, parameters, optimizer, next(chosen), device, packed),
                             device, steps, out, median_step_s=median_step_s)
    finally:
        peft_model.unload()


def fitting_per_step(model, sequences: list, device: torch.device, per_step: int, *, packed: bool,
                     float32_adapters: bool = True):
    """What a careful user on this card sets: `per_step` sequences a step, halved until one step over the
    `per_step` longest of `sequences` (the worst batch) fits the card, tried on a throwaway adapter. (a)'s 8 x 768
    padded tokens on the 8B shape peaked at 86 GB on an H200 (2026-12-04): more than an 80 GB H100 holds.
    (the count, the base model back from the adapter)."""
    if device.type != "cuda":
        return per_step, model
    from peft import get_peft_model
    ordered = sorted(sequences, key=lambda s: len(s[0]))
    while per_step > 1:
        wrapped = get_peft_model(model, lora_config(), autocast_adapter_dtype=float32_adapters)
        try:
            train_steps(wrapped, [ordered[-per_step:]], device, packed, None)
            fits = True
        except torch.cuda.OutOfMemoryError as error:
            fits = False
            log(f"[peft] {per_step} sequences a step ran out of the card's memory ({str(error).splitlines()[0]}); "
                f"trying {per_step // 2}")
        model = wrapped.unload()
        if fits:
            return per_step, model
        gc.collect()   # the failed step's tensors, held by the error's frames until here
        torch.cuda.empty_cache()
        per_step //= 2
    return per_step, model


def run_jobs(model, jobs: dict[int, list], warm: list, device: torch.device, *, per_step: int, packed: bool,
             float32_adapters: bool = True, before_timed=None) -> dict:
    """Each job in turn: a fresh PEFT adapter on `model`, its sequences in steps of `per_step`, the adapter
    removed after. `warm`: sequences for untimed steps first (a throwaway adapter). Steps timed by events."""
    from peft import get_peft_model
    model.train()   # no dropout in these models; Liger's fused loss runs in training mode only

    def wrap():
        wrapped = get_peft_model(model, lora_config(), autocast_adapter_dtype=float32_adapters)
        dtypes.add(str(next(p.dtype for n, p in wrapped.named_parameters() if "lora_A" in n)).replace("torch.", ""))
        return wrapped

    dtypes: set[str] = set()

    peft_model = wrap()
    train_steps(peft_model, sorted_batches(warm, per_step, seed=99), device, packed, None)
    model = peft_model.unload()
    sync(device)
    if before_timed is not None:
        before_timed()
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = StepClock(device)
    real, padded = [], []
    for job, sequences in jobs.items():
        peft_model = wrap()
        r, p = train_steps(peft_model, sorted_batches(sequences, per_step, seed=job), device, packed, clock)
        real += r
        padded += p
        model = peft_model.unload()
    seconds = clock.seconds()
    # a job's first mark opens its steps: drop the gap between one job's last step and the next one's first
    per_job = [len(sorted_batches(s, per_step, 0)) for s in jobs.values()]
    steps, index = [], 0
    for count in per_job:
        steps += seconds[index:index + count]
        index += count + 1
    return {"seconds": steps, "tokens": real, "padded_tokens": padded, "held_bytes": held,
            "adapter_dtype": ",".join(sorted(dtypes))}
