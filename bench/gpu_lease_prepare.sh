#!/usr/bin/env bash
# Run HERE, where there is a network, before a GPU lease (docs/gpu_lease.md), in the checkout the lease sends
# (the device tool sends the session's own checkout): fills the three folders bench/gpu_lease.sh reads there,
# each ignored through .git/info/exclude, checks that what travels stays under the 64 MiB a call carries, and
# prints the one `run` call to make.
#   .whl/        the wheels the GPU machine's image (Python 3.12) lacks: pydantic and its needs (aspen's engine),
#                liger-kernel (bench/lora_mfu.py's baseline (b)), Ray's needs and tensorboardX (Ray Tune), and
#                transformers, PEFT and their needs at this checkout's versions (the image's 5.17 is below pyproject's)
#   .gpu-carry/  Ray stripped to fit (../shared/gpu/pack-ray.sh): the sweep and overhead parts
#   .gpu/        smollm2-135m's config and tokenizer (its parts run on random weights of that shape), GSM8K rows
#                for the sweep, and prediction.json / prediction-h100.json: bench/gpu_cost_model.py's prediction
#                for an H200 / an H100 where it exists (the suite shows the one of the card it runs on)
#
#   bash bench/gpu_lease_prepare.sh [--no-ray] [--no-prediction]
# Environment: PYTHON (default: this checkout's .venv, else the main checkout's, else python3), SHARED (../shared)
set -euo pipefail
cd "$(dirname "$0")/.."
ray=1 predict=1
for argument in "$@"; do
    case $argument in
        --no-ray) ray=0 ;;
        --no-prediction) predict=0 ;;
        *) echo "gpu_lease_prepare.sh: unknown argument $argument" >&2; exit 2 ;;
    esac
done
python=${PYTHON:-}
common=$(git rev-parse --path-format=absolute --git-common-dir)
for candidate in .venv/bin/python "$(dirname "$common")/.venv/bin/python" python3; do
    [[ -z $python && -x $(command -v "$candidate" || true) ]] && python=$candidate
done
shared=${SHARED:-../shared}
exclude=$(git rev-parse --path-format=absolute --git-path info/exclude)
for folder in /.whl/ /.gpu-carry/ /.gpu/; do
    grep -qxF "$folder" "$exclude" 2>/dev/null || echo "$folder" >> "$exclude"
done
rm -rf .whl .gpu-carry .gpu
mkdir -p .whl .gpu-carry .gpu/data
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux1_x86_64)
download() { "$python" -m pip download -q --no-deps "${platform[@]}" -d .whl "$@"; }

if (( ray )); then
    bash "$shared/gpu/pack-ray.sh" .gpu-carry >/dev/null   # Ray, and the wheels of pydantic and of Ray's needs
    mv .gpu-carry/*.whl .whl/                              # one folder of wheels: one version of each
    download tensorboardX                                  # Ray Tune's logger
else
    download "pydantic>=2.10,<3" annotated-types typing-inspection "typing-extensions>=4.16"
    core=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\(.*\)$/\1/p')
    download "pydantic-core==$core"
fi
download "liger-kernel==0.8.5"   # pure Python (Triton kernels): torch and triton are on the image
# the transformers this checkout runs on (pyproject: >=5.20; the image has 5.17, whose experts lack attributes aspen
# reads: the lease of 2026-12-04) and the needs the image lacks or holds too old, at this checkout's versions; not
# hf-xet (4.3 MB of the 64 MiB): the image has one, and huggingface-hub calls it only to download, which no part does
stack=$("$python" -c 'from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in ("transformers", "huggingface-hub", "kernels", "tomlkit",
      "httpx2", "httpcore2", "truststore", "regex", "click", "peft")))')
download $stack

# smollm2-135m's config and tokenizer (its weights, 517 MB converted, do not travel)
"$python" - <<'EOF'
import shutil, sys
from pathlib import Path
sys.path.insert(0, ".")
from actors.storage.gguf_cache import converted_source
from actors.storage.sources import resolve_source
source = converted_source(resolve_source("smollm2-135m")).path
target = Path(".gpu/smollm2-shape"); target.mkdir(parents=True, exist_ok=True)
for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "special_tokens_map.json"):
    if (Path(source) / name).exists():
        shutil.copy(Path(source) / name, target / name)
print(f"smollm2-135m's config and tokenizer from {source}")
EOF
head -n 600 "$shared/data/gsm8k_train.jsonl" > .gpu/data/gsm8k_train.jsonl   # bench/sweep.py reads 544 rows

if (( predict )) && [[ -f bench/gpu_cost_model.py ]]; then
    fusion=(); grep -q -- "--fusion" bench/gpu_cost_model.py && fusion=(--fusion)
    grep -q -- "--peers" bench/gpu_cost_model.py && fusion+=(--peers)
    # the lease may land on an H100 (the device tool's default kind) or an H200: a prediction for each, which the
    # suite picks by the GPU's name (gpu_suite.card_prediction); the H100's in the background beside the H200's
    # (each worker mostly one core: ~the same minutes for both), without the calibration run (the H200 profile's,
    # whose error it takes over)
    echo "the cost model's predictions for an H200 and an H100 (bench/gpu_cost_model.py, minutes on a CPU) ..."
    rm -f .gpu/prediction.json .gpu/prediction-h100.json
    PYTHONPATH=$PWD "$python" bench/gpu_cost_model.py --shape llama-3.1-8b --jobs 4 --card h100 --no-calibration \
        "${fusion[@]}" --json .gpu/prediction-h100.json > .gpu/prediction-h100.log 2>&1 &
    h100=$!
    PYTHONPATH=$PWD "$python" bench/gpu_cost_model.py --shape llama-3.1-8b --jobs 4 --card h200 "${fusion[@]}" \
        --json .gpu/prediction.json || echo "no prediction: bench/gpu_cost_model.py failed (the lease runs without)"
    if wait "$h100" && [[ -f .gpu/prediction.json ]]; then
        sed -n '/^GPU cost model/,/^Calibration\|^Parameters/p' .gpu/prediction-h100.log | head -n 20
        "$python" - <<'EOF'
import json
from pathlib import Path
h200, h100 = (Path(f".gpu/{name}.json") for name in ("prediction", "prediction-h100"))
mine, calibrated = json.loads(h100.read_text()), json.loads(h200.read_text())
if "calibration_error" in calibrated:   # the model's error on the profiled H200 step: the same model's
    mine["calibration_error"], mine["calibration_card"] = calibrated["calibration_error"], calibrated["card"]
h100.write_text(json.dumps(mine, indent=2) + "\n")
EOF
    else
        tail -n 20 .gpu/prediction-h100.log
        echo "no H100 prediction (an H100 lease prints the H200's, labelled as such)"
    fi
    rm -f .gpu/prediction-h100.log
fi

# what travels: tracked and untracked-not-ignored files, shared/ inside the checkout, and the carried folders
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
carried=$(du -cb .whl .gpu-carry .gpu | tail -1 | cut -f1)
total=$(( tree + carried ))
printf 'working tree %.1f MiB + carried %.1f MiB = %.1f MiB (limit 64 MiB)\n' \
    "$(echo "$tree / 1048576" | bc -l)" "$(echo "$carried / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
ls -la .whl .gpu-carry
if (( total > 64 * 1024 * 1024 )); then
    echo "over the 64 MiB a call carries: leave Ray out (--no-ray) or ignore large untracked files" >&2
    exit 1
fi
carry='[".whl", ".gpu-carry", ".gpu"]'
(( ray )) || carry='[".whl", ".gpu"]'
cat <<EOF

The call (one command, under 9 minutes; the report lands in the run's files: report.md, report.json, log.txt,
raw.tar.gz):
  run  command: bash bench/gpu_lease.sh
       timeout_s: 600
       carry: $carry
EOF
