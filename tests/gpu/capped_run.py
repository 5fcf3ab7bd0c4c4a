"""Run a script as ``__main__`` with this process's GPU memory hard-capped, as on a smaller GPU.

    python tests/gpu/capped_run.py CAP_BYTES script.py [script args...]

``torch.cuda.set_per_process_memory_fraction`` makes the caching allocator raise an OOM past the
cap whatever the device has free, and autooffload's budget reads the same cap. The script gets the
``sys.argv`` and ``sys.path[0]`` it would get from ``python script.py``; after it returns, one line
says which cap is still in force, so a caller can check nothing lifted it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch


def main() -> None:
    cap_bytes, script, *script_args = sys.argv[1:]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(int(cap_bytes) / total)
    sys.argv = [script, *script_args]
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")
    fraction = torch.cuda.get_per_process_memory_fraction(0)
    print(f"capped_run: cap in force at exit {int(fraction * total)} bytes", flush=True)


if __name__ == "__main__":
    main()
