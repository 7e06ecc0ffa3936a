"""The printed report of gpu_cost_model.py: the checkout's predictions, every measured figure beside the
model's prediction of it (the 70c0645 calibration run, per category), and the parameters with their
sources."""

from __future__ import annotations

from dataclasses import fields

from gpu_cost.calibration import card_for, default_machine, host_for


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"


def _step_line(step: dict) -> str:
    return (f"GPU kernels {step['gpu_seconds']:.3f} s (busy {step['gpu_busy']:.0%}), gaps {_ms(step['gap_seconds'])}, "
            f"host {step['host_seconds']:.3f} s + {step['wait_seconds']:.3f} s waiting, "
            f"{step['launches']:,} launches, {step['syncs']} syncs, {step['operations']:,} operations")


def _categories(step: dict, limit: int = 9) -> str:
    items = list(step["categories"].items())[:limit]
    return ", ".join(f"{name} {value * 1e3:.0f}" for name, value in items)


def graph_blockers_line(found: dict) -> str:
    """What stands in the way of capturing the recorded steps as CUDA graphs (predict.graphed's `blockers`)."""
    return (f"{found['host_reads_inside']} host reads and {found['host_copies_inside']} host-to-device copies of "
            f"tensors made during the steps inside the captured span, over {found['steps']} steps after the "
            "warm-up; "
            f"{found['steps_needing_their_own_capture']} of them launch kernels of shapes no earlier step did "
            "(each a capture of its own)")


def render(results: dict, calibration: dict) -> str:
    lines = [f"GPU cost model: {results['shape']}, {results['jobs']} jobs, {results['current']['card']}"]
    current = results["current"]
    settings = f" with {'; '.join(current['settings'])}" if current.get("settings") else ""
    lines.append(f"This checkout ({current['checkout']}){settings}:")
    timed = current["timed_steps"]
    lines.append(f"  predicted step {current['predicted_step_s']:.3f} s (the median of {len(timed)} timed steps after "
                 f"{timed[0]} warm-up ones, back to back, as bench/lora_mfu.py times them), "
                 f"{current['predicted_tokens_per_s']:,.0f} tokens/s, LoRA-MFU {current['predicted_lora_mfu']:.1%}")
    if "median_step" in current:
        lines.append(f"  the median step: {_step_line(current['median_step'])}")
        lines.append(f"  its GPU time by category (ms): {_categories(current['median_step'])}")
        phases = current["median_step"].get("host_phases", {})
        if phases:
            lines.append("  its host time (ms): "
                         + ", ".join(f"{name} {value * 1e3:.0f}" for name, value in phases.items()))
    lines.append(f"  tokens per step: {current['tokens']}")
    if current.get("graph_blockers"):
        lines.append(f"  capturing it as CUDA graphs today: {graph_blockers_line(current['graph_blockers'])}")
    if "calibration" in results:
        lines += _calibration(results, calibration)
    if "fusion" in results:
        lines += _fusion(results, calibration)
    if "base" in results:
        base = results["base"]
        measured = calibration["measured"]
        lines.append("The frozen base alone (profile_step.py's second measurement):")
        same = results["shape"] == measured["shape"] and results["card"] == measured["card"]
        known = (f"; measured (70c0645, H200) {measured['base_step_s']:.3f} s, {measured['base_tokens_per_s']:,}"
                 f" tokens/s: {_error(base['predicted_step_s'], measured['base_step_s'])}") if same else ""
        lines.append(f"  predicted step {base['predicted_step_s']:.3f} s, "
                     f"{base['predicted_tokens_per_s']:,.0f} tokens/s{known}")
        if "median_step" in base:
            lines.append(f"  the median step: {_step_line(base['median_step'])}")
    if "peers" in results:
        lines += _peers(results, calibration)
    lines += host_bound_caveat(results, calibration)
    lines += _parameters_lines(results["card"], calibration, results.get("host"))
    unruled = sorted(set(current.get("unruled_operations", [])))
    unknown = sorted(set(current.get("unknown_values", [])))
    lines.append(f"Operations timed by the generic bytes rule (no rule of their own): {', '.join(unruled) or 'none'}")
    lines.append(f"Values the recorder could not know (placeholders used): {', '.join(unknown) or 'none'}")
    return "\n".join(lines)


def _calibration(results: dict, calibration: dict) -> list[str]:
    old, measured = results["calibration"], calibration["measured"]
    lines = [f"Calibration: the code of {measured['commit']} against the {measured['card'].upper()} profile of "
             f"2026-11-28 (unprofiled runs unless said), its host's costs those of {old.get('host') or 'the default'}",
             f"  {'figure':44s} {'predicted':>11s} {'measured':>11s} {'error':>8s}"]

    def row(name: str, predicted: float, value: float, text: str = "{:.3f}") -> None:
        lines.append(f"  {name:44s} {text.format(predicted):>11s} {text.format(value):>11s} "
                     f"{_error(predicted, value):>8s}")

    row("step, s (median of steps 2-5): calibration_error", old["predicted_step_s"], measured["step_s"])
    row("tokens/s (steps 2-7)", old["predicted_tokens_per_s"], measured["tokens_per_s"], "{:,.0f}")
    row("LoRA-MFU", old["predicted_lora_mfu"], measured["lora_mfu"], "{:.1%}")
    if "profiled_gpu_s" in old:
        gpu = sum(old["profiled_gpu_s"]) / len(old["profiled_gpu_s"])
        row("GPU time a step, s (profiled steps 6, 7)", gpu, measured["gpu_s_per_step"])
        step = sum(old["profiled_step_s"]) / len(old["profiled_step_s"])
        row("step, s (steps 6, 7, profiled; host at scale 1)", step,
            sum(measured["profiled_step_s"]) / len(measured["profiled_step_s"]))
    median = old.get("median_step", {})
    if median:
        row("kernel launches a step", median["launches"], measured["launches_per_step"], "{:,.0f}")
        row("synchronisations a step", median["syncs"] - 1, measured["syncs_per_step"], "{:.0f}")
    categories = measured.get("categories_ms", {})   # that day's profile's (the calibration's profile may be later)
    predicted = old.get("profiled_categories_ms", {})
    if categories:
        lines.append("  GPU time by category over the profiled steps 6 and 7 (ms; measured: each profiled kernel "
                     "paired with its recorded operation)")
        lines.append(f"  {'category':44s} {'predicted':>11s} {'measured':>11s} {'error':>8s}")
        for name in sorted(set(categories) | set(predicted), key=lambda n: -categories.get(n, 0.0)):
            value, guess = categories.get(name, 0.0), predicted.get(name, 0.0)
            lines.append(f"  {name:44s} {guess:11.1f} {value:11.1f} {_error(guess, value):>8s}")
        lines.append(f"  {'all':44s} {sum(predicted.values()):11.1f} {sum(categories.values()):11.1f} "
                     f"{_error(sum(predicted.values()), sum(categories.values())):>8s}")
    return lines


def _fusion(results: dict, calibration: dict) -> list[str]:
    fusion, measured = results["fusion"], calibration["measured"]
    comparable = results["shape"] == measured["shape"] and results["card"] == measured["card"]
    lines = ["Fusion efficiency (bench/lora_mfu.py's fusion side: 32 x 128 tokens a step over N adapters)"]
    for count, value in fusion["fusion_efficiency"].items():
        rate = fusion["fusion_tokens_per_s"][count]
        known = measured["fusion_efficiency"].get(str(count)) if comparable else None
        extra = f"; measured (70c0645) {known:.3f}" if known is not None else ""
        lines.append(f"  {count:>3} adapters: {rate:,.0f} tokens/s, efficiency {value:.3f}{extra}")
    counts = sorted(fusion["fusion_efficiency"], key=int)
    for count in (counts[0], counts[-1]) if len(counts) > 1 else ():   # what grows: against a lease's profile_growth
        step = fusion.get(f"adapters_{count}", {}).get("median_step") or {}
        if step.get("categories"):
            lines.append(f"  {count:>3} adapters' median step, GPU ms by kind: {_categories(step, limit=12)}")
    if len(counts) > 1:
        grown = growth(fusion.get(f"adapters_{counts[0]}", {}), fusion.get(f"adapters_{counts[-1]}", {}))
        if grown:
            lines.append(f"  grew most from {counts[0]} to {counts[-1]} adapters (GPU ms a step): "
                         + ", ".join(f"{name} {old * 1e3:.2f} -> {new * 1e3:.2f}" for name, old, new in grown))
    return lines


def growth(fewest: dict, most: dict, limit: int = 6) -> list[tuple[str, float, float]]:
    """The operations whose GPU time a step grew most from one fusion count to another (`operation_seconds` of
    each, predict.py): (name, seconds before, seconds after), the largest growth first, only those that grew."""
    before, after = fewest.get("operation_seconds") or {}, most.get("operation_seconds") or {}
    grown = sorted(((name, before.get(name, 0.0), value) for name, value in after.items()
                    if value > before.get(name, 0.0)), key=lambda row: row[1] - row[2])
    return grown[:limit]


PACKED_PEERS = ("packed-bf16", "packed-float32")   # bench/lora_mfu.py's side (b): the faster of the two counts


def ratios(results: dict) -> dict:
    """aspen's predicted tokens/s over each PEFT side's, and over (a) and the best (b) (issue 47's goals: 2x and
    1.2x on the 8B shape; 1.3x over PEFT on smollm2's)."""
    aspen = results["current"]["predicted_tokens_per_s"]
    rates = {peer: side["predicted_tokens_per_s"] for peer, side in results["peers"].items()}
    out = {f"over_{peer}": aspen / rate for peer, rate in rates.items() if rate}
    packed = [rates[peer] for peer in PACKED_PEERS if rates.get(peer)]
    if packed:
        out["over_best_packed"] = aspen / max(packed)
    if "peft" in results["peers"]:
        bound = gpu_bound_tokens_per_s(results["peers"]["peft"])
        if bound:
            out["concurrent_bound_tokens_per_s"] = bound
            out["over_concurrent_at_least"] = aspen / bound
    return out


def gpu_bound_tokens_per_s(side: dict) -> float | None:
    """(c)'s ceiling: 4 PEFT processes on one card take turns on it (time slices; their kernels never run at
    once), so together they train at most (a)'s timed tokens over (a)'s GPU time alone, its host's gaps gone
    (each runs (a)'s loop with 8 sequences a step or fewer: no more work a token than (a)'s)."""
    timed = side.get("timed_steps", [])
    seconds = sum(side["steps"][i]["gpu_seconds"] for i in timed)
    return sum(side["tokens"][i] for i in timed) / seconds if seconds else None


HOST_BOUND = 0.5   # GPU busy below this: the step is the host's, predicted by the host's costs alone
SIDE_LABELS = {"aspen": "aspen", "peft": "(a)", "packed": "(b)"}


def host_bound_caveat(results: dict, calibration: dict) -> list[str]:
    """Where a predicted side's median step is the host's: how far the host's costs missed the host-bound steps
    measured on a lease (calibration.json "host_bound_checks"), so that such a prediction is read as that rough."""
    sides = {"aspen": results["current"], **results.get("peers", {})}
    bound = [name for name, side in sides.items() if side.get("median_step", {}).get("gpu_busy", 1.0) < HOST_BOUND]
    if not bound:
        return []
    lines = [f"Host-bound (GPU busy < {HOST_BOUND:.0%} of the median step): {', '.join(bound)}. Such a step is "
             "predicted by the host's costs alone, which missed the host-bound steps measured on a lease:"]
    for check in calibration.get("host_bound_checks", []):
        errors = ", ".join(f"{SIDE_LABELS.get(side, side)} {_error(check['predicted_tokens_per_s'][side], measured)}"
                           for side, measured in check["measured_tokens_per_s"].items()
                           if side in check["predicted_tokens_per_s"])
        lines.append(f"  {check['shape']}, {check['jobs']} jobs, {check['commit']}'s code on {check['machine']}'s "
                     f"host, tokens/s predicted against measured: {errors} (docs/cost_model.md)")
    return lines


def _peers(results: dict, calibration: dict) -> list[str]:
    measured = calibration["measured"]
    same = results["shape"] == measured["shape"] and results["card"] == measured["card"]
    lines = ["The single-job PEFT sides of bench/lora_mfu.py (bench/peft_baselines.py), the jobs one after another "
             "over the same sequences, each in its own process:"]
    steps = measured.get("peft_timed_steps")
    for peer, side in results["peers"].items():
        known = measured.get("peft_tokens_per_s") if same and peer == "peft" else None
        check = ""
        if known and results.get("steps") == steps:
            check = (f"; measured (H200, 2026-11-28, {steps} timed steps) {known:,} tokens/s: "
                     f"{_error(side['predicted_tokens_per_s'], known)}")
        elif known:
            check = f"; measured over {steps} timed steps (--steps {steps} compares): {known:,} tokens/s"
        ratio = results["ratios"].get(f"over_{peer}")
        versus = f"; aspen {ratio:.2f}x" if ratio else ""
        lines.append(f"  {side['side']['side']}: step {side['predicted_step_s']:.3f} s, "
                     f"{side['predicted_tokens_per_s']:,.0f} tokens/s, LoRA-MFU {side['predicted_lora_mfu']:.1%}"
                     f"{check}{versus}")
        if "median_step" in side:
            lines.append(f"    the median step: {_step_line(side['median_step'])}")
    if "over_best_packed" in results["ratios"]:
        lines.append(f"  aspen over the best (b): {results['ratios']['over_best_packed']:.2f}x")
    if "concurrent_bound_tokens_per_s" in results["ratios"]:
        lines.append(f"  (c), 4 PEFT processes sharing the card, not modelled; at most (a)'s tokens over its GPU time: "
                     f"{results['ratios']['concurrent_bound_tokens_per_s']:,.0f} tokens/s, so aspen at least "
                     f"{results['ratios']['over_concurrent_at_least']:.2f}x")
    return lines


def parameters(card_name: str, calibration: dict, machine: str | None = None) -> dict:
    card, host = card_for(card_name, calibration), host_for(calibration, machine)
    out = {}
    for item in fields(card):
        if item.name in ("name", "sources"):
            continue
        out[f"card.{item.name}"] = {"value": getattr(card, item.name), "source": card.sources.get(item.name, "")}
    for item in fields(host):
        if item.name == "sources":
            continue
        out[f"host.{item.name}"] = {"value": getattr(host, item.name), "source": host.sources.get(item.name, "")}
    return out


UNITS = {"peak_bf16": (1e-12, "TFLOP/s"), "peak_fp32": (1e-12, "TFLOP/s"), "gemm_bf16": (1e-12, "TFLOP/s"),
         "fp32_skinny": (1.0, "of HBM"), "attention": (1e-12, "TFLOP/s"), "hbm": (1e-12, "TB/s"),
         "pcie": (1e-9, "GB/s"), "kernel_floor": (1e6, "us"), "launch_gap": (1e6, "us"), "serial_add": (1e6, "us"),
         "copy_latency": (1e6, "us"), "vectorised": (1.0, "of HBM"), "generic": (1.0, "of HBM"),
         "transposed": (1.0, "of HBM"), "python": (1e6, "us"), "call": (1e6, "us"), "view": (1e6, "us"),
         "kernel": (1e6, "us"), "launch": (1e6, "us"), "node": (1e6, "us"), "scale": (1.0, ""), "sync": (1e6, "us")}


def _parameters_lines(card_name: str, calibration: dict, machine: str | None = None) -> list[str]:
    trace = calibration.get("profile", {}).get("trace", "the calibration's profile")
    lines = [f"Parameters (datasheet; measured: an independent benchmark; profile: read off {trace}, its kernels and "
             "host class by class; assumed)",
             f"  the host's: machine {machine or default_machine(calibration) or 'the default'}"]
    for key, item in parameters(card_name, calibration, machine).items():
        scale, unit = UNITS.get(key.split(".")[1], (1.0, ""))
        value = item["value"]
        if isinstance(value, dict):   # host.kernels: seconds by kind of operation
            if value:
                lines.append(f"  {key:24s} {'':>18s}  {item['source']}: " + ", ".join(
                    f"{name} {seconds * 1e6:.3g} us" for name, seconds in sorted(value.items(), key=lambda kv: -kv[1])))
            continue
        text = f"{value * scale:.3g} {unit}" if isinstance(value, float) else f"{value} {unit}"
        lines.append(f"  {key:24s} {text:>18s}  {item['source']}")
    return lines
