"""The settings of a trainer's fused steps: step tokens, pipeline stages, and which combinations with the
base settings are offered.

A jobs file (`RunSpec`) and a service's trainer (`TrainerConfig`) share them; `compile_problem` and
`pipeline_problem` name the field and the fix of a combination that is not offered."""

from __future__ import annotations

from typing import Annotated, Literal

from actors.spec.field_types import AutoOr, Bounds

MAX_STEP_TOKENS = 16_777_216
"""The largest `step_tokens` a run or trainer may have (16 Mi tokens in one fused step)."""
StepTokens = Annotated[int, Bounds(16, MAX_STEP_TOKENS)]
AUTO_STEP_TOKENS_FLOOR = 4096
"""`step_tokens: auto` is at least this where memory allows (a CPU composes smaller steps, a micro-batch up to this
running alone); a jobs file is checked against it."""

StepTokensSetting = Annotated[int | Literal["auto"], AutoOr(Bounds(16, MAX_STEP_TOKENS))]
STEP_TOKENS_DESCRIPTION = ("token budget of one fused step (padding included); auto: steps of 1024 on CPU (a "
                           "micro-batch of up to 4096 runs alone), on a GPU the largest step up to 8192 tokens that "
                           "the trainer's memory model fits in its budget")


def step_tokens_floor(setting: int | str) -> int:
    """The fewest tokens a step of this setting may hold: itself, or auto's floor."""
    return AUTO_STEP_TOKENS_FLOOR if setting == "auto" else int(setting)


COMPILE_DESCRIPTION = (
    "default: the decoder layers of each fused step under torch.compile (inductor), the token stream padded to one "
    "of a few bucket lengths; graphs (CUDA): each fused step of sft jobs captured once as a CUDA graph and replayed, "
    "each job's tokens padded to a fixed segment (for host-bound steps: a small base on a large GPU; "
    "actors/engine/step_graphs.py). Neither with recompute: layers or a quantized base")


def compile_problem(compile: str, *, recompute: str, quantization: str, layout: str = "packed") -> str | None:
    """Why `compile` cannot go with this recompute mode, quantization or layout, naming the fields and the fix; None
    if it can (`actors.engine.compiled`, `actors.engine.step_graphs`)."""
    if compile == "none":
        return None
    if compile == "graphs" and layout != "packed":
        return (f"compile: graphs with layout: {layout} is not offered (a graphed step lays each job's packed tokens "
                "in a fixed segment of its own); set layout: packed or compile: none")
    if recompute != "none":
        return (f"compile: {compile} with recompute: {recompute} is not offered (the recomputation's checkpoint wraps "
                "the decoder layers that compile compiles, and reruns a forward a graph would have to capture); set "
                "compile: none or recompute: none")
    if quantization != "none":
        return (f"compile: {compile} on a quantized base (quantization: {quantization}) is not offered "
                "(bitsandbytes' layers do not trace under torch.compile); set compile: none or quantization: none")
    return None


Stages = Annotated[int, Bounds(1, 256)]
StageSplit = list[Annotated[int, Bounds(1, 100_000)]] | Literal["even", "measured"]
STAGES_DESCRIPTION = ("pipeline stages the base's decoder is cut into, each a process of its own on its own device "
                      "(in-process: one GPU each where the machine has as many, else all on its first GPU; on Ray a "
                      "stage actor each, with num_gpus / num_cpus per stage; on CPU the cores shared); 1: the "
                      "single-device trainer")
KERNELS_DESCRIPTION = ("liger: Liger-Kernel's fused RMSNorm (each residual addition with the norm after it in one "
                       "kernel), RoPE, SwiGLU and LM-head cross-entropy on a CUDA base (the `gpu` extra); auto: "
                       "those where Liger is installed and the base is on CUDA in bfloat16 / float16; none: the "
                       "model's own operations")
STAGE_SPLIT_DESCRIPTION = ("with stages >= 2: decoder layers per stage (a list), even, or measured (balanced by "
                           "each layer's measured time and memory)")


def pipeline_problem(stages: int, split: list[int] | str, *, quantization: str, dtype: str, layout: str,
                     compile: str, kernels: str = "auto") -> str | None:
    """Why a trainer of `stages` pipeline stages cannot have these settings, naming the field and the fix; None
    if it can (actors/engine/pipeline/)."""
    if stages == 1:
        return None
    if isinstance(split, list) and len(split) != stages:
        return f"stage_split lists {len(split)} stages' layer counts and stages is {stages}: give one count per stage"
    if quantization != "none":
        return (f"stages: {stages} with quantization: {quantization} is not offered (a stage loads its tensors in "
                "full precision); set quantization: none or stages: 1")
    if dtype == "float16":
        return ("stages >= 2 with dtype: float16 is not offered (float16's per-job loss scaling over stages is not "
                "built); set dtype: bfloat16")
    if layout != "packed":
        return f"stages >= 2 packs its micro-batches; set layout: packed (not {layout}) or stages: 1"
    if compile != "none":
        return f"stages >= 2 runs its stages eagerly; set compile: none (not {compile}) or stages: 1"
    if kernels == "liger":
        return ("stages >= 2 runs its stages without fused kernels (each loads its layers on the CPU first); set "
                "kernels: auto or none (not liger) or stages: 1")
    return None
