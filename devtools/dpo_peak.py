"""Where the DPO benchmark's policy plan puts its predicted peak, against the measured one:
``benchmarks/dpo_reference.py``'s step, the plan's memory terms and the profile's static bytes
and post-unit transients, and each step's allocated peak.

    python devtools/dpo_peak.py 3b 24 0      # reference kept whole (offload_frozen=0)
    python devtools/dpo_peak.py 8b 24 auto   # reference streamed
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

GiB = 1 << 30


def main() -> None:
    shape, cap_gib, frozen = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    os.environ["DPO_SHAPE"] = shape
    import dpo_reference as bench

    import autooffload
    from autooffload import runtime as rt

    policy = bench.build(bench.dims()["num_hidden_layers"])
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    cap = int(cap_gib * GiB)
    torch.cuda.set_per_process_memory_fraction(
        cap / torch.cuda.get_device_properties(0).total_memory
    )
    settings = {} if frozen == "auto" else {"offload_frozen": frozen == "1"}
    autooffload.enable(budget=cap, log="info", mask=False, **settings)
    policy.to("cuda")
    reference.to("cuda")
    runtime = rt.runtime_of(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5, fused=True)
    generator = torch.Generator().manual_seed(0)
    for step in range(7):
        ids = torch.randint(0, 128_256, (4, 1024), generator=generator).cuda()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            ref = bench.sequence_logps(reference, ids)
        ref_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ratios = (bench.sequence_logps(policy, ids) - ref).view(2, 2)
        loss = -F.logsigmoid(0.1 * (ratios[:, 0] - ratios[:, 1])).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        print(
            f"step {step}: start {before / GiB:.2f} ref peak {ref_peak / GiB:.2f} policy peak"
            f" {torch.cuda.max_memory_allocated() / GiB:.2f} GiB; plan {runtime.plan.source}"
            f" n_persist {runtime.plan.n_persist}",
            flush=True,
        )
    profile = runtime.profile
    print("static_bytes", profile.static_bytes / GiB, "frag", profile.fragmentation_factor)
    units = profile.units
    for i, unit in enumerate(units):
        if i < 2 or i >= len(units) - 2:
            print(
                i,
                unit.name,
                {
                    k: round(getattr(unit, k) / GiB, 3)
                    for k in (
                        "act_bytes_keep",
                        "act_bytes_checkpoint",
                        "fwd_transient_bytes",
                        "bwd_transient_bytes",
                    )
                },
            )
    for key, value in sorted(runtime.plan.breakdown.items()):
        if key.startswith("mem_"):
            print(key, round(value / GiB, 3) if abs(value) > 1000 else value)


if __name__ == "__main__":
    main()
