#!/usr/bin/env bash
# The planner sweep in one command: predicted vs measured peak and step time,
# and throughput vs budget with the planner's feasible set, for 1.1B / 3.6B full FT, 8B LoRA and
# a Qwen2-VL-7B LoRA over a range of GPU memory caps (autooffload; vanilla last, time allowing).
#
#   bash benchmarks/planner_sweep.sh            # writes into $OUT (default: a dated results dir)
#   PARTS="vlm vanilla" bash benchmarks/planner_sweep.sh     # only some of the bench commands
#
# Runs start only while fewer than STOP_S seconds have passed (the rest are recorded "skipped"),
# each run is killed after RUN_TIMEOUT_S, so the whole command ends within
# STOP_S + RUN_TIMEOUT_S + ~15 s (merge and plots). All parts take ~17 min on an H100 (8 warm-up
# steps each run): split them over commands with PARTS ("1b 8b-lora", "3.6b vlm", "vanilla"),
# each under a device command's 10 minutes. Results of two commands merge with
# `python -m autooffload.bench --from-json A.json,B.json --out AB.json --plot`. In $OUT (5 files):
#   planner-sweep.json            every run (merged), summary rows, candidates per autooffload run
#   planner-sweep.md              the table and the predicted-vs-measured summary
#   planner-sweep.png             tokens/s vs cap per workload
#   planner-sweep.frontier.png    throughput vs memory: feasible set, frontier, plan, measured
#   parts-and-logs.tar.gz         each bench command's own JSON and every worker's log
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
OUT=${OUT:-benchmarks/results/planner-sweep-$(date +%Y%m%d-%H%M%S)}
PARTS=${PARTS:-1b 3.6b vlm 8b-lora vanilla} # which of the bench commands below to run
STOP_S=${STOP_S:-450}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-120}
STEPS=${STEPS:-4}
WARMUP=${WARMUP:-8} # autooffload: steps 1-2 profile, 3 switches, 7 calibrates, 8 may re-plan
WORK=$(mktemp -d "${TMPDIR:-/tmp}/planner-sweep.XXXXXX")
mkdir -p "$OUT" "$WORK/parts" "$WORK/logs"
START=$(date +%s)

bench() { # NAME WORKLOADS CAPS PEERS: one bench command, if there is time left to start it
    local name=$1 workloads=$2 caps=$3 peers=$4
    local left=$((STOP_S - ($(date +%s) - START)))
    [[ " $PARTS " == *" $name "* ]] || return 0
    echo "== [$(($(date +%s) - START)) s] $name: $workloads at $caps ($peers)"
    if ((left <= 0)); then
        echo "   not started: STOP_S=$STOP_S s passed"
        return
    fi
    "$PY" -m autooffload.bench --workload "$workloads" --cap "$caps" --peers "$peers" \
        --steps "$STEPS" --warmup "$WARMUP" --timeout "$RUN_TIMEOUT_S" --deadline "$left" \
        --out "$WORK/parts/$name.json" --log-dir "$WORK/logs/$name" 2>&1 |
        tr '\r' '\n' | grep -v -e '^bench:' -e '^|' -e '^\s*$'
    [ -f "$WORK/parts/$name.json" ] && parts+=("$WORK/parts/$name.json")
    tar czf "$OUT/parts-and-logs.tar.gz" -C "$WORK" parts logs
}
parts=()

bench 1b llama-1b-full 8GiB,12GiB,16GiB,24GiB,48GiB autooffload
bench 3.6b llama-3.6b-full 8GiB,12GiB,16GiB,24GiB,48GiB autooffload
bench vlm qwen2vl-7b-lora 12GiB,16GiB,24GiB autooffload
bench 8b-lora llama-8b-lora 8GiB,12GiB,16GiB,24GiB,48GiB autooffload
bench vanilla llama-1b-full,llama-3.6b-full,qwen2vl-7b-lora,llama-8b-lora 48GiB vanilla

merged=$(IFS=,; echo "${parts[*]}")
echo "== [$(($(date +%s) - START)) s] merge: $merged"
if [ -n "$merged" ]; then
    "$PY" -m autooffload.bench --from-json "$merged" --out "$OUT/planner-sweep.json" \
        --plot "$OUT/planner-sweep.png" | grep -v -e '^results: ' -e '^plot: ' >"$OUT/planner-sweep.md"
    cat "$OUT/planner-sweep.md"
fi
echo "== [$(($(date +%s) - START)) s] done: $OUT"
rm -rf "$WORK"
