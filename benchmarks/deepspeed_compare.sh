#!/usr/bin/env bash
# Compare autooffload with DeepSpeed's best configuration that fits, vanilla and FSDP2-offload,
# one bench command per part, on a GPU machine with the wheels of carry_deepspeed.sh.
#
#   OUT=/some/dir bash benchmarks/deepspeed_compare.sh 3.6b 1b    # parts, in this order
#
# Parts (issue 50's rows; vanilla runs uncapped; M is autooffload with fp32 master weights for
# every chunk, autooffload[master_weights=1,n_persist=0]):
#   3.6b          llama-3.6b-full @ 16 GiB: vanilla, fsdp2_offload, deepspeed, autooffload, M
#   1b            llama-1b-full @ 12 GiB: the same
#   loss          llama-3.6b-full @ 16 GiB: vanilla, M, and DeepSpeed's 3.6B configuration as it
#                 is, with clip=1.0 (DeepSpeed's own default) and with bf16 masters
#   8b            llama-8b-full @ 24 GiB: vanilla, fsdp2_offload, deepspeed, autooffload
#   8b-lora       llama-8b-lora @ 8 GiB: the same
#   8b-lora-need  llama-8b-lora: deepspeed alone at NEED_CAPS (default 6GiB,12GiB): below 8 GiB
#                 when it fits there, else the cap it needs
#   3b-x2         llama-3b-full @ 24 GiB a GPU on 2 GPUs (bs 4 a GPU): vanilla (DDP),
#                 fsdp2_offload, deepspeed, autooffload
#   8b-x2         llama-8b-full @ 24 GiB a GPU on 2 GPUs: fsdp2_offload, autooffload (vanilla
#                 DDP holds 80 GB of weights, gradients, AdamW state and buckets)
#   8b-x2-ds      the same, deepspeed alone
#   3b-x4, 8b-x4, 8b-x4-ds   as the -x2 parts, on 4 GPUs
# PEERS overrides a part's peers. The deepspeed sweep starts no configuration whose estimated
# host memory exceeds what the host has available (the bench's --host-memory, HOST_MEMORY here).
# The wheels (WHEELS, default .whl-deepspeed) are installed into a private site folder;
# DeepSpeedCPUAdam is JIT-built once, in the background while a part's vanilla run goes (about a
# minute on 16 cores, cached for every later process). A run starts only while fewer than STOP_S
# seconds have passed, and is killed after RUN_TIMEOUT_S or at END_S, whichever comes first. In
# $OUT: one JSON (and table) per part, and the build log.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-benchmarks/results/deepspeed-compare-$(date +%Y%m%d-%H%M%S)}
WHEELS=${WHEELS:-.whl-deepspeed}
SITE=${SITE:-/tmp/deepspeed-site}
STOP_S=${STOP_S:-480}
END_S=${END_S:-560}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-300}
WARMUP=${WARMUP:-8} # autooffload: 2 profiling steps, then its plan is checked and calibrated
STEPS=${STEPS:-4}
NEED_CAPS=${NEED_CAPS:-6GiB,12GiB}
STARTED=$(date +%s)
mkdir -p "$OUT"

"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
nice -n 10 "$PY" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
    >"$OUT/cpu-adam-build.log" 2>&1 &
BUILD=$!

MASTERS='autooffload[master_weights=1,n_persist=0]'
Z3_LARGE='stage=3,gc=True,live=2000000000,prefetch=200000000,persist=1000000'
part_of() { # PART -> "BENCH ARGS|PEERS"
    local full=vanilla,fsdp2_offload,deepspeed,autooffload
    case $1 in
    3.6b) echo "--workload llama-3.6b-full --cap 16GiB|$full,$MASTERS" ;;
    1b) echo "--workload llama-1b-full --cap 12GiB|$full,$MASTERS" ;;
    loss)
        local ds="deepspeed[$Z3_LARGE]"
        echo "--workload llama-3.6b-full --cap 16GiB|vanilla,$MASTERS,$ds,${ds%]},clip=1.0],${ds%]},masters=bf16]"
        ;;
    8b) echo "--workload llama-8b-full --cap 24GiB|$full" ;;
    8b-lora) echo "--workload llama-8b-lora --cap 8GiB|$full" ;;
    8b-lora-need) echo "--workload llama-8b-lora --cap $NEED_CAPS|deepspeed" ;;
    3b-x2) echo "--workload llama-3b-full --cap 24GiB --nproc 2|$full" ;;
    8b-x2) echo "--workload llama-8b-full --cap 24GiB --nproc 2|fsdp2_offload,autooffload" ;;
    8b-x2-ds) echo "--workload llama-8b-full --cap 24GiB --nproc 2|deepspeed" ;;
    3b-x4) echo "--workload llama-3b-full --cap 24GiB --nproc 4|$full" ;;
    8b-x4) echo "--workload llama-8b-full --cap 24GiB --nproc 4|fsdp2_offload,autooffload" ;;
    8b-x4-ds) echo "--workload llama-8b-full --cap 24GiB --nproc 4|deepspeed" ;;
    *)
        echo "unknown part $1 (3.6b, 1b, loss, 8b, 8b-lora, 8b-lora-need, 3b-x2, 8b-x2, 8b-x2-ds," \
            "3b-x4, 8b-x4, 8b-x4-ds)" >&2
        return 1
        ;;
    esac
}

bench() { # NAME ARGS...: one bench command, its JSON and table in $OUT
    local name=$1 elapsed
    shift
    elapsed=$(($(date +%s) - STARTED))
    ((elapsed < STOP_S)) || { echo "$name: not started, STOP_S passed" && return; }
    echo "== $name: $*"
    "$PY" -m autooffload.bench "$@" --vanilla-cap none --warmup "$WARMUP" --steps "$STEPS" \
        --timeout "$RUN_TIMEOUT_S" --deadline $((STOP_S - elapsed)) --end-by $((END_S - elapsed)) \
        ${HOST_MEMORY:+--host-memory "$HOST_MEMORY"} --out "$OUT/$name.json" | tee "$OUT/$name.md"
}

wait_build() {
    [[ -n ${BUILD:-} ]] || return 0
    wait "$BUILD" || { echo "DeepSpeedCPUAdam build failed:" && tail -20 "$OUT/cpu-adam-build.log"; }
    BUILD=
}

for part in "$@"; do
    spec=$(part_of "$part") || exit 1
    args=${spec%%|*}
    peers=${PEERS:-${spec#*|}}
    names=()
    if [[ -n ${BUILD:-} && ,$peers, == *,vanilla,* ]]; then # vanilla first, while it builds
        names+=("$part-vanilla")
        # shellcheck disable=SC2086
        bench "$part-vanilla" $args --peers vanilla
        peers=$(echo ",$peers," | sed 's/,vanilla,/,/; s/^,//; s/,$//')
    fi
    wait_build
    if [[ -n $peers ]]; then
        names+=("$part-peers")
        # shellcheck disable=SC2086
        bench "$part-peers" $args --peers "$peers"
    fi
    jsons=()
    for name in "${names[@]}"; do
        [[ -f $OUT/$name.json ]] && jsons+=("$OUT/$name.json")
    done
    if ((${#jsons[@]})); then # one results file and table per part
        list=$(IFS=, && echo "${jsons[*]}")
        "$PY" -m autooffload.bench --from-json "$list" --out "$OUT/$part.json" >"$OUT/$part.md"
        for name in "${names[@]}"; do rm -f "$OUT/$name.json" "$OUT/$name.md"; done
    fi
done
cat "$OUT"/*.md 2>/dev/null | grep -v '^$' | tail -60
