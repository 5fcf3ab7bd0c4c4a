#!/usr/bin/env bash
# One bench command run alternately on two source trees of autooffload (before, after, before,
# after, ...), so a change's throughput and peaks are compared on the same machine in one go.
#
#   git archive COMMIT autooffload | tar -x -C out/before          # the tree to compare with
#   BEFORE=out/before OUT=dir ROUNDS=2 bash benchmarks/ab_trees.sh NAME -- BENCH ARGS...
#
# AFTER defaults to this checkout. Each run writes $OUT/NAME-{before,after}-{round}.json; the
# table at the end lists every run's median step, tokens/s and peaks, and each tree's median.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
BEFORE=${BEFORE:?set BEFORE to a folder holding the autooffload package to compare with}
AFTER=${AFTER:-$PWD}
OUT=${OUT:-benchmarks/results/ab-$(date +%Y%m%d-%H%M%S)}
ROUNDS=${ROUNDS:-2}
BEFORE=$(cd "$BEFORE" && pwd) AFTER=$(cd "$AFTER" && pwd)
name=${1:?usage: ab_trees.sh NAME -- BENCH ARGS...}
shift
[[ ${1:-} == -- ]] && shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

for ((round = 1; round <= ROUNDS; round++)); do
    for side in before after; do
        tree=$BEFORE
        [[ $side == after ]] && tree=$AFTER
        # From the tree's own folder: ``python -m`` puts the working directory first on the path.
        (
            cd "$tree" || exit 1
            export PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH}
            echo "== $name $side $round: $("$PY" -c 'import autooffload; print(autooffload.__file__)')"
            "$PY" -m autooffload.bench "$@" --out "$OUT/$name-$side-$round.json" \
                >"$OUT/$name-$side-$round.md" 2>&1 || tail -5 "$OUT/$name-$side-$round.md"
        )
    done
done

"$PY" - "$OUT" "$name" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

out, name = Path(sys.argv[1]), sys.argv[2]
rows = {"before": [], "after": []}
print(f"| {name} | run | peer | step ms | tok/s | peak alloc / reserved GiB | status |")
print("|---|---|---|---|---|---|---|")
for path in sorted(out.glob(f"{name}-*.json")):
    side, run = path.stem.rsplit("-", 2)[-2:]
    for r in json.loads(path.read_text()).get("runs", []):
        step = statistics.median(r["step_s"]) if r.get("step_s") else None
        tokens = r["bs"] * r["seq"] * r.get("nproc", 1)
        if step and r.get("peer") != "vanilla":
            rows[side].append((step, r.get("peak_timed_reserved_gib")))
        peaks = f"{r.get('peak_timed_allocated_gib') or 0:.2f} / {r.get('peak_timed_reserved_gib') or 0:.2f}"
        print(
            f"| {side} | {run} | {r.get('peer_label', r.get('peer'))} |"
            f" {step * 1e3 if step else float('nan'):.0f} | {tokens / step if step else 0:,.0f} |"
            f" {peaks} | {r.get('status')} |"
        )
for side, values in rows.items():
    if values:
        steps = [s for s, _ in values]
        print(f"{side}: median step {statistics.median(steps) * 1e3:.0f} ms over {len(steps)} runs")
EOF
