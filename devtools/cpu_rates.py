"""Per-step CPU worker rates of autooffload runs in bench JSON files (dev tool).

python devtools/cpu_rates.py results.json [...]
"""

import json
import sys

for path in sys.argv[1:]:
    with open(path) as f:
        data = json.load(f)
    for run in data.get("runs", []):
        if not run.get("cpu_per_step"):
            continue
        steps = run["cpu_per_step"]
        rows = [
            f"{s['busy_s'] * 1e3:.0f}ms/{(s.get('kernel_s') or 0) * 1e3:.0f}ms"
            f" {(s['params_per_s'] or 0) / 1e9:.2f}/{(s.get('kernel_params_per_s') or 0) / 1e9:.2f}"
            for s in steps
        ]
        print(
            path.split("/")[-1],
            run.get("peer"),
            f"step {run.get('step_s_median', 0) * 1e3:.0f} ms",
            f"pred {(run.get('predicted_step_s') or 0) * 1e3:.0f} ms",
        )
        print("   busy/kernel ms, Gparam/s busy/kernel:", "; ".join(rows))
