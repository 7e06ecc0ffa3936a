#!/usr/bin/env bash
# The GPU suite in one leased-machine command (10 minutes at most): the parts in order of what they tell,
# each with its own limit and all of them under one deadline, into one report.
#
#   bash bench/gpu_lease.sh SECONDS [PARTS]       # e.g. bash bench/gpu_lease.sh 560
#
# The machine's image lacks some of aspen's needs (pydantic): carry them as wheels in .whl/ (the device
# tool's README says how); they are installed into /tmp/site. Ray is not there (its wheel exceeds what a call
# may carry): the `overhead` part needs it and is not in the default list. smollm2-135m's weights are too big
# to carry: where .gpu/smollm2-shape holds its config and tokenizer, the parts run on random weights of its
# shape (bench/random_weights.py). Where .gpu/data holds GSM8K and Code Alpaca, it is the ../shared/data the
# benchmarks read. The report, the parts' JSON files and the log go to $OUT (or runs/gpu-suite/lease when OUT
# is unset) as report.md, log.txt and suite.tar.gz. SUITE_ARGS: more arguments for bench/gpu_suite.py.
set -u
budget=${1:?seconds this command may take}
parts=${2:-tests:60,fusion:150,pipeline:120,mfu:150,peft:90,fusion8b:90,compile:120,memory:120}
deadline=$(( $(date +%s) + budget - 15 ))
out=${OUT:-runs/gpu-suite/lease}
mkdir -p "$out"
suite=/tmp/gpu-suite
log="$out/log.txt"
exec > >(tee -a "$log") 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
python3 - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for name in ("transformers", "peft", "pydantic", "accelerate", "safetensors", "yaml", "gguf"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except ImportError as error:
        print(name, "MISSING:", error)
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
base=()
if [[ -f .gpu/smollm2-shape/config.json ]]; then
    python3 bench/random_weights.py .gpu/smollm2-shape /tmp/smollm2-135m-random && base=(--base-model /tmp/smollm2-135m-random)
fi
if [[ -d .gpu/data && ! -e ../shared/data ]]; then
    mkdir -p ../shared && ln -s "$PWD/.gpu/data" ../shared/data
fi
for entry in ${parts//,/ }; do
    part=${entry%%:*}
    limit=${entry##*:}
    left=$(( deadline - $(date +%s) ))
    if (( left < 20 )); then echo "[lease] $part: not run (no time left)"; continue; fi
    (( limit > left )) && limit=$left
    python3 bench/gpu_suite.py --parts "$part" --out "$suite" --part-timeout "$limit" "${base[@]}" ${SUITE_ARGS:-}
done
cp "$suite/report.md" "$out/report.md" 2>/dev/null
tar -czf "$out/suite.tar.gz" -C "$suite" . 2>/dev/null
echo "[lease] done: $out"
