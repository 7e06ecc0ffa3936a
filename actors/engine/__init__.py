"""Ray-free compute core: base model loading, fused multi-LoRA layers, packing, per-job loss and
optimisation, PEFT-format adapters and memory measurement. Everything here runs in-process."""
