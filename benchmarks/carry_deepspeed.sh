#!/usr/bin/env bash
# Build a folder of wheels that installs DeepSpeed (and PEFT) on a GPU machine with no network.
#
#   bash benchmarks/carry_deepspeed.sh                 # -> .whl-deepspeed/ (ignored by git)
#   WITH_BNB=1 bash benchmarks/carry_deepspeed.sh      # + bitsandbytes (CUDA 13.0 library only)
#
# The wheels are for CPython 3.12 on x86_64 manylinux (the GPU machines' Python). DeepSpeed is
# published as a source distribution only: it is built here into a pure-Python wheel with the
# local (CPU) torch and DS_BUILD_OPS=0, so its CUDA/C++ ops are JIT-compiled where it runs
# (DeepSpeedCPUAdam: g++ and ninja, about a minute on first use, cached in
# ~/.cache/torch_extensions). Its pure-Python needs (hjson, py-cpuinfo, msgpack, einops, ninja,
# psutil, pydantic with pydantic-core, annotated-types, typing-inspection) are downloaded as
# binary wheels with their dependencies resolved; torch, numpy, packaging and tqdm are expected on
# the machine. PEFT and wrapt come along for the LoRA workloads. On the GPU machine:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-deepspeed/*.whl
#   export PYTHONPATH=/tmp/site DS_ACCELERATOR=cuda
#   python -m autooffload.bench --workload llama-3.6b-full --cap 16GiB --vanilla-cap none \
#       --peers vanilla,fsdp2_offload,deepspeed,autooffload
#
# DS_ACCELERATOR=cuda stops DeepSpeed from probing for other accelerators (it picks the CPU
# accelerator when it cannot tell). The folder is about 10 MiB (60 MiB more with WITH_BNB=1 before
# the other CUDA versions' libraries are stripped, 20 MiB after).
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
DEST=${1:-.whl-deepspeed}
DS_VERSION=${DS_VERSION:-0.19.8}
BNB_VERSION=${BNB_VERSION:-0.50.2}
BNB_CUDA=${BNB_CUDA:-cuda130}
TARGET=(
    --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
)
# Already on the GPU machines' image: pulling them in would shadow the image's versions.
ON_MACHINE='^(torch|numpy|packaging|tqdm|typing_extensions|nvidia_|triton|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec|setuptools)-'

mkdir -p "$DEST"
"$PY" -c 'import torch' || { echo "building DeepSpeed's wheel needs torch here" >&2; exit 1; }
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" \
    "deepspeed==$DS_VERSION"
"$PY" -m pip download -q "${TARGET[@]}" -d "$DEST" \
    hjson py-cpuinfo msgpack einops ninja psutil pydantic annotated-types typing-inspection
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DEST" peft wrapt
if [[ "${WITH_BNB:-0}" == 1 ]]; then
    "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DEST" "bitsandbytes==$BNB_VERSION"
    # Keep the one native library the machine's torch (CUDA 13.0) loads.
    for wheel in "$DEST"/bitsandbytes-*.whl; do
        mapfile -t others < <("$PY" -m zipfile -l "$wheel" | awk '{print $1}' \
            | grep -E '^bitsandbytes/libbitsandbytes_.*\.so$' | grep -v "_$BNB_CUDA\.so$" || true)
        if ((${#others[@]})); then
            zip -q -d "$wheel" "${others[@]}"
        fi
    done
fi
for wheel in "$DEST"/*.whl; do
    if [[ "$(basename "$wheel")" =~ $ON_MACHINE ]]; then
        rm -f "$wheel"
    fi
done
ls -1 "$DEST"
du -sh "$DEST"
