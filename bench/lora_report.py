"""bench/lora_mfu.py's printed report: per shape each side's figures, the ratios, issue 47's goals beside
them, the cost model's predictions beside what was measured (with the ratio), the profile's summary, and
fusion efficiency."""

from __future__ import annotations

from lora_bench import GOALS, SIDE_NAMES


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _gb(value: float | None) -> str:
    return "n/a" if not value else f"{value / 1e9:.1f} GB"


def _met(value: float | None, goal: float) -> str:
    if value is None:
        return "not measured"
    return "met" if value >= goal else "not met"


def side_line(name: str, side: dict, ceiling: float | None) -> str:
    label = SIDE_NAMES.get(name, name)
    if side.get("status") != "passed" and "tokens_per_s" not in side:
        return f"  {label:<36} {side.get('status', 'not run')}" + (f" ({side['reason']})" if side.get("reason") else "")
    of_ceiling = side["flops_per_s"] / ceiling if ceiling and side.get("flops_per_s") else None
    per_token = side.get("step_bytes_per_token")
    memory = (_gb(side.get("peak_memory_bytes")) + (f" ({per_token / 1e6:.1f} MB/token)" if per_token else "")
              + _allocator(side))
    status = "" if side.get("status") == "passed" else f"  [{side.get('status')}]"
    return (f"  {label:<36} {side['tokens_per_s']:>9,.0f} {side['median_step_s']:>8.3f} s "
            f"({side['p10_step_s']:.3f}-{side['p90_step_s']:.3f}) {_pct(side.get('lora_mfu')):>6} / "
            f"{_pct(of_ceiling):>6}  {memory}{status}")


def predicted_efficiency(prediction: dict | None) -> dict | None:
    """The cost model's fusion efficiencies ({adapters: ratio}): a dict under a key naming efficiency, at the
    top level or one level down (bench/gpu_cost_model.py --fusion)."""
    def found(mapping: dict) -> dict | None:
        return next((v for k, v in mapping.items() if "efficien" in k and isinstance(v, dict) and v
                     and all(isinstance(x, int | float) for x in v.values())), None)
    if not prediction:
        return None
    return found(prediction) or next((found(v) for v in prediction.values() if isinstance(v, dict) and found(v)),
                                     None)


def prediction_for(prediction: dict | None, shape: str) -> dict | None:
    if not prediction:
        return None
    named = prediction.get("shape")
    return prediction if named in (None, shape) else None


def card_label(prediction: dict, device: str | None) -> str:
    """Which card the cost model priced (its --card), and whether it is the one measured (`device`: the GPU's
    name): a prediction for another card is a guide, not a check of the model."""
    card = str(prediction.get("card") or "h200")
    if device and card.lower() in device.lower():
        return f"--card {card}"
    return f"--card {card}: a prediction for the {card.upper()}, not this {device or 'device'}, a guide only"


def beside(label: str, predicted: float | None, measured: float | None, unit: str = "") -> str | None:
    if predicted is None:
        return None
    if measured is None:
        return f"    {label}: predicted {predicted:.4g}{unit}, not measured"
    ratio = predicted / measured
    within = abs(ratio - 1) <= GOALS["cost_model_error"]
    return (f"    {label}: predicted {predicted:.4g}{unit}, measured {measured:.4g}{unit}, predicted/measured "
            f"{ratio:.2f} ({'within' if within else 'outside'} {GOALS['cost_model_error']:.0%})")


def peer_lines(peers: dict, sides: dict) -> list[str]:
    """The cost model's PEFT sides (`gpu_cost_model.py --peers`) beside the measured (a) and (b) (the better
    of (b)'s two adapter dtypes on each side)."""
    lines = []
    if "peft" in peers:
        lines.append(beside("(a)'s tokens/s", peers["peft"]["predicted_tokens_per_s"],
                            sides.get("peft", {}).get("tokens_per_s")))
    packed = [peers[name]["predicted_tokens_per_s"] for name in ("packed-bf16", "packed-float32") if name in peers]
    if packed:
        lines.append(beside("(b)'s tokens/s", max(packed), sides.get("packed", {}).get("tokens_per_s")))
    return [line for line in lines if line]


def profile_lines(profile: dict) -> list[str]:
    busy = profile.get("gpu_busy_of_unprofiled_step")
    lines = [f"  profile ({profile.get('steps')} steps, {profile.get('out')}): GPU busy "
             f"{_pct(busy)} of the unprofiled median step (goal >= {GOALS['gpu_busy']:.0%}: "
             f"{_met(busy, GOALS['gpu_busy'])}), {_pct(profile.get('gpu_busy_of_profiled_span'))} of the profiled "
             f"span; {profile.get('kernels_per_step', 'n/a')} kernels, {profile.get('launches_per_step', 'n/a')} "
             f"launches and {profile.get('syncs_per_step', 'n/a')} syncs a step; {profile.get('kernel_s_per_step')} s "
             "of kernels a step"]
    for kernel in profile.get("top_kernels", [])[:8]:
        lines.append(f"    {kernel['share']:6.1%} {kernel['seconds_per_step'] * 1e3:8.1f} ms/step "
                     f"{kernel['calls_per_step']:6.0f}x  {kernel['name'][:90]}")
    return lines


def shape_lines(shape: str, result: dict, prediction: dict | None, device: str | None) -> list[str]:
    sides = result["sides"]
    frozen = sides.get("frozen", {})
    ceilings = frozen.get("matmul_ceilings") or {}
    ceiling = ceilings.get("8192^3")
    measured_as = result.get("measured_shape", shape)
    peak = next((s["peak_flops"] for s in sides.values() if s.get("peak_flops")), None)
    lines = [f"== {shape}{f' (measured as {measured_as})' if measured_as != shape else ''} on {device} ==",
             "  matmul ceiling (bf16 on a GPU): "
             + (", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in ceilings.items()) if ceilings else "not measured")
             + (f"; datasheet peak {peak / 1e12:.0f} TFLOP/s" if peak else ""),
             f"  {'side':<36} {'tokens/s':>9} {'median step (p10-p90)':>26} {'LoRA-MFU peak / ceiling':>16}  memory"]
    lines += [side_line(name, side, ceiling) for name, side in sides.items()]
    ratio = result.get("ratios", {})
    small = shape.startswith("smollm2")
    goals = {"peft": GOALS["small_over_peft"] if small else GOALS["over_peft"],
             "packed": None if small else GOALS["over_packed"]}
    parts = []
    for name in ("peft", "packed", "concurrent", "frozen"):
        value = ratio.get(f"aspen_over_{name}")
        if value is not None:
            goal = goals.get(name)
            parts.append(f"aspen/{name} {value:.2f}x" + (f" (goal >= {goal}: {_met(value, goal)})" if goal else ""))
    if parts:
        lines.append("  " + "; ".join(parts))
    aspen = sides.get("aspen", {})
    if not small and aspen.get("lora_mfu") is not None:
        lines.append(f"  LoRA-MFU {_pct(aspen['lora_mfu'])} of the datasheet peak: goal >= {GOALS['lora_mfu']:.0%} "
                     f"{_met(aspen['lora_mfu'], GOALS['lora_mfu'])}, then >= {GOALS['lora_mfu_next']:.0%} "
                     f"{_met(aspen['lora_mfu'], GOALS['lora_mfu_next'])}")
    if sides.get("packed", {}).get("pieces"):
        packed = sides["packed"]
        lines.append("  (b)'s pieces: " + "; ".join(f"{k}: {v}" for k, v in packed["pieces"].items())
                     + "; adapters: " + ", ".join(f"{k} {v['tokens_per_s']:,.0f} tokens/s"
                                                  for k, v in packed.get("variants", {}).items()))
    if not small and aspen.get("step_bytes_per_token"):
        lines.append(f"  aspen's step: {aspen['step_bytes_per_token'] / 1e6:.1f} MB a token over what it holds "
                     "(the float32-adapter path took ~13 MB on an H100, 2026-11-27; the bf16 path's aim ~8 MB)")
    peft = sides.get("peft", {})
    if peft.get("sequences_per_step_asked", 0) > peft.get("sequences_per_step", 0):
        lines.append(f"  (a): {peft['sequences_per_step']} sequences a step ({peft['sequences_per_step_asked']} ran "
                     "out of the card's memory on its longest sequences, as a user would find)")
    if sides.get("concurrent", {}).get("sequences_per_step"):
        lines.append(f"  (c): {sides['concurrent']['sequences_per_step']} sequences a step per process (what fits 4 "
                     "copies of the base and their steps on the card)")
    if aspen.get("engine_defaults"):
        lines.append(f"  aspen's engine settings: {aspen['engine_defaults']}")
    predicted = prediction_for(prediction, shape)
    if predicted:
        lines.append(f"  the cost model (bench/gpu_cost_model.py, {card_label(predicted, device)}) beside the "
                     "measurement:")
        for label, key, measured in (("step", "predicted_step_s", aspen.get("median_step_s")),
                                     ("tokens/s", "predicted_tokens_per_s", aspen.get("tokens_per_s")),
                                     ("LoRA-MFU", "predicted_lora_mfu", aspen.get("lora_mfu"))):
            line = beside(label, predicted.get(key), measured)
            if line:
                lines.append(line)
        lines += peer_lines(predicted.get("peers", {}), sides)
    if aspen.get("profile"):
        lines += profile_lines(aspen["profile"])
    for name in ("peft", "packed"):   # --profile-peers: the PEFT sides' steps profiled too
        if sides.get(name, {}).get("profile"):
            lines += [f"  ({'a' if name == 'peft' else 'b'}) {name}:", *profile_lines(sides[name]["profile"])]
    return lines


def _allocator(row: dict) -> str:
    """The allocator's waits over the timed steps (retries, cudaMalloc / cudaFree calls), where any happened."""
    events = {name: count for name, count in row.get("allocator_events_in_timed_steps", {}).items() if count}
    return ("; allocator in the timed steps: " + ", ".join(f"{name} {count}" for name, count in events.items())
            if events else "")


def fusion_lines(fusion: dict, prediction: dict | None, device: str | None = None) -> list[str]:
    efficiency = fusion.get("efficiency", {})
    lines = [f"== fusion at equal total tokens ({fusion.get('sequences')} x {fusion.get('length')} tokens a step) "
             f"[{fusion.get('status')}] ==",
             "  " + ", ".join(f"{n}: {v:.3f}" for n, v in efficiency.items())
             + f"  (goal >= {GOALS['fusion_8']} at 8: {_met(efficiency.get('8'), GOALS['fusion_8'])}; >= "
               f"{GOALS['fusion_32']} at 32: {_met(efficiency.get('32'), GOALS['fusion_32'])})"]
    for n, row in fusion.get("per_adapters", {}).items():
        lines.append(f"    {n:>2} adapters: median step {row['median_step_s']:.3f} s ({row['p10_step_s']:.3f}-"
                     f"{row['p90_step_s']:.3f}), {row['tokens_per_s_at_median']:,.0f} tokens/s, "
                     f"{_gb(row.get('peak_memory_bytes'))}{_allocator(row)}")
    predicted = predicted_efficiency(prediction)
    if predicted:
        lines.append(f"  predicted by the cost model ({card_label(prediction, device)}): " + ", ".join(
            f"{n}: {float(p):.3f}" + (f" (measured {efficiency[str(n)]:.3f}, {float(p) / efficiency[str(n)]:.2f}x)"
                                      if str(n) in efficiency else "") for n, p in predicted.items()))
    if fusion.get("profile"):
        lines.append(f"  {fusion['profile'].get('adapters')} adapters' step:")
        lines += profile_lines(fusion["profile"])
    return lines + growth_lines(fusion.get("profile_growth"), prediction, device)


def growth_lines(measured: dict | None, prediction: dict | None, device: str | None) -> list[str]:
    """Where the step's GPU time grew from the fewest to the most adapters: the profiles' kernels that grew most
    (`profile_growth`, bench/fusion_side.py) and, beside them, the cost model's operations that did (its --fusion's
    `operation_seconds` at the same two counts, where the prediction has them): which kernel the model misprices."""
    lines = []
    if measured and measured.get("grew_most"):
        fewest, most = measured["adapters"]
        lines.append(f"  measured, grew most from {fewest} to {most} adapters (GPU ms a step): " + ", ".join(
            f"{row['name'][:48]} {row['seconds_per_step'][0] * 1e3:.2f} -> {row['seconds_per_step'][1] * 1e3:.2f}"
            for row in measured["grew_most"][:6]))
    fusion = (prediction or {}).get("fusion") or {}
    counts = sorted(int(key.removeprefix("adapters_")) for key in fusion if key.startswith("adapters_"))
    if measured and measured.get("adapters"):
        counts = [n for n in counts if n in measured["adapters"]]
    try:
        from gpu_cost.report import growth
    except ImportError:   # the cost model's package absent: its line left out
        return lines
    grown = growth(fusion.get(f"adapters_{counts[0]}", {}), fusion.get(f"adapters_{counts[-1]}", {})) \
        if len(counts) > 1 else []
    if grown:
        lines.append(f"  predicted ({card_label(prediction, device)}), grew most from {counts[0]} to {counts[-1]} "
                     "adapters (GPU ms a step): "
                     + ", ".join(f"{name} {old * 1e3:.2f} -> {new * 1e3:.2f}" for name, old, new in grown))
    return lines


def report_lines(results: dict) -> list[str]:
    lines = []
    device = results.get("gpu") or results.get("device")
    for shape, result in results.get("shapes", {}).items():
        lines += shape_lines(shape, result, results.get("prediction"), device)
    if results.get("fusion"):
        lines += fusion_lines(results["fusion"], results.get("prediction"), device)
    return lines
