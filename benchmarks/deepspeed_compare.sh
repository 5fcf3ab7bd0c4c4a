#!/usr/bin/env bash
# Compare autooffload with DeepSpeed's best configuration that fits, vanilla and FSDP2-offload,
# one bench command per workload, on a GPU machine with the wheels of carry_deepspeed.sh.
#
#   OUT=/some/dir bash benchmarks/deepspeed_compare.sh 3.6b 1b    # workloads, in this order
#
# Workloads (issue 50's rows): 3.6b (llama-3.6b-full @ 16 GiB), 1b (llama-1b-full @ 12 GiB),
# 8b (llama-8b-full @ 24 GiB), 8b-lora (llama-8b-lora @ 8 GiB, DeepSpeed also at 12 and 16 GiB to
# find the cap it needs). Vanilla runs uncapped. The wheels (WHEELS, default .whl-deepspeed) are
# installed into a private site folder; DeepSpeedCPUAdam is JIT-built once, in the background
# while the vanilla runs go (about a minute on 16 cores, cached for every later process).
# Runs start only while fewer than STOP_S seconds have passed; each is killed after
# RUN_TIMEOUT_S. In $OUT: one JSON (and table) per workload, and the build log.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-benchmarks/results/deepspeed-compare-$(date +%Y%m%d-%H%M%S)}
WHEELS=${WHEELS:-.whl-deepspeed}
SITE=${SITE:-/tmp/deepspeed-site}
STOP_S=${STOP_S:-480}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-240}
WARMUP=${WARMUP:-8} # autooffload: 2 profiling steps, then its plan is checked and calibrated
STEPS=${STEPS:-4}
PEERS=${PEERS:-vanilla,fsdp2_offload,deepspeed,autooffload}
STARTED=$(date +%s)
mkdir -p "$OUT"

"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
nice -n 10 "$PY" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
    >"$OUT/cpu-adam-build.log" 2>&1 &
BUILD=$!

args_of() {
    case $1 in
    3.6b) echo "--workload llama-3.6b-full --cap 16GiB" ;;
    1b) echo "--workload llama-1b-full --cap 12GiB" ;;
    8b) echo "--workload llama-8b-full --cap 24GiB" ;;
    8b-lora) echo "--workload llama-8b-lora --cap 8GiB" ;;
    *) echo "unknown workload $1 (3.6b, 1b, 8b, 8b-lora)" >&2 && return 1 ;;
    esac
}

bench() { # NAME ARGS...: one bench command, its JSON and table in $OUT
    local name=$1 left
    shift
    left=$((STOP_S - ($(date +%s) - STARTED)))
    ((left > 0)) || { echo "$name: not started, STOP_S passed" && return; }
    echo "== $name: $*"
    "$PY" -m autooffload.bench "$@" --vanilla-cap none --warmup "$WARMUP" --steps "$STEPS" \
        --timeout "$RUN_TIMEOUT_S" --deadline "$left" --out "$OUT/$name.json" |
        tee "$OUT/$name.md"
}

for workload in "$@"; do
    args=$(args_of "$workload") || exit 1
    parts=("$workload-vanilla" "$workload-peers" "$workload-deepspeed")
    if [[ -n ${BUILD:-} ]]; then # vanilla first, while DeepSpeedCPUAdam builds
        # shellcheck disable=SC2086
        bench "$workload-vanilla" $args --peers vanilla
        wait "$BUILD" || { echo "DeepSpeedCPUAdam build failed:" && tail -20 "$OUT/cpu-adam-build.log"; }
        BUILD=
        # shellcheck disable=SC2086
        bench "$workload-peers" $args --peers "${PEERS/vanilla,/}"
    else
        # shellcheck disable=SC2086
        bench "$workload-peers" $args --peers "$PEERS"
    fi
    if [[ $workload == 8b-lora ]]; then # the caps where DeepSpeed may fit, for its need
        bench "$workload-deepspeed" --workload llama-8b-lora --cap 12GiB,16GiB --peers deepspeed
    fi
    jsons=()
    for part in "${parts[@]}"; do
        [[ -f $OUT/$part.json ]] && jsons+=("$OUT/$part.json")
    done
    if ((${#jsons[@]})); then # one results file and table per workload
        list=$(IFS=, && echo "${jsons[*]}")
        "$PY" -m autooffload.bench --from-json "$list" --out "$OUT/$workload.json" >"$OUT/$workload.md"
        for part in "${parts[@]}"; do rm -f "$OUT/$part.json" "$OUT/$part.md"; done
    fi
done
cat "$OUT"/*.md 2>/dev/null | grep -v '^$' | tail -60
