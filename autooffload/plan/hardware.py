"""Measure the machine (copy bandwidths, optimizer throughput, memory) and cache it per machine.

``measure_hardware`` times pinned H2D, D2H and both-at-once copies with CUDA events, the CPU
optimizer's update rate at the thread count in use (and the device optimizer's, for persistent
chunks), and reads free/total device memory. The result is cached as JSON in the cache dir, keyed
by hostname, device name, driver, torch version, CPU thread count, optimizer and the number of
ranks sharing the host; free memory is re-read on every call. With ``device="cpu"`` (CPU
simulation) the copies are host memcpy and the memory is host RAM: still measured, never
constants.

Data-parallel ranks on one host share its memory bandwidth, its PCIe switches and its cores, so
each rank alone would measure a machine it never gets. With ``barrier`` (a collective every rank
calls alike) every probe starts on all ranks at once: the copy and optimizer rates are each
rank's share while all of them copy and update, as they do in training.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from autooffload.atomic import atomic_write
from autooffload.log import logger
from autooffload.plan.profile_types import HardwareProfile

MiB = 1 << 20
CACHE_VERSION = 3
DEFAULT_CACHE_DIR = "~/.cache/autooffload"
COPY_REPEATS = 3
# Optimizer probe sizes (elements): past the CPU's last-level cache, so the rate is the
# memory-bound one a model's update sees (1 << 23 fp32 ran ~1.5x too fast in place); on a GPU
# large enough that the per-step Python and launch overhead of torch.optim (~0.1 ms) is under
# 10% (8M bf16 params measured the H100's fused AdamW at a fraction of the 1.1B model's rate).
CPU_OPTIM_NUMEL = 1 << 24
DEVICE_OPTIM_NUMEL = 1 << 27
OPTIM_SECONDS = 0.25


def measure_hardware(
    device: str | torch.device = "cuda",
    cache_dir: str | os.PathLike[str] | None = None,
    reprofile: bool = False,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    copy_bytes: int = 256 * MiB,
    cpu_optim_dtype: torch.dtype = torch.float32,
    device_optim_dtype: torch.dtype = torch.bfloat16,
    pinned: bool = True,
    local_ranks: int = 1,
    barrier: Callable[[], None] | None = None,
) -> HardwareProfile:
    """The machine's HardwareProfile: from the cache when its key matches, else measured (~1-3 s).

    ``reprofile=True`` or ``AUTOOFFLOAD_REPROFILE=1`` forces a measurement. A cache file that
    cannot be read or parsed is ignored and rewritten (atomically). ``cpu_optim_dtype`` is the
    dtype the CPU optimizer updates (fp32 master weights); ``device_optim_dtype`` the dtype of
    persistent parameters updated on the device. ``pinned=False`` times pageable copies (the
    run's host store could not be pinned); it is cached under its own key. ``local_ranks``:
    data-parallel ranks measuring on this host at once, each calling ``barrier`` before every
    probe (see the module docstring); the ranks must agree on ``reprofile`` (``cached_hardware``
    tells each whether it would read the cache).
    """
    device = _normalise(torch.device(device))
    key = cache_key(device, optimizer_cls, pinned, local_ranks)
    path = cache_path(cache_dir, key)
    if not (reprofile or reprofile_forced()):
        cached = read_cache(path, key)
        if cached is not None:
            free, total = _memory(device)
            logger.debug("hardware profile from %s", path)
            return replace(cached, gpu_free_bytes=free, gpu_total_bytes=total)
    together = barrier or (lambda: None)
    started = time.perf_counter()
    phases = [started]
    if device.type == "cuda":
        h2d, d2h, duplex = _cuda_bandwidths(device, copy_bytes, pinned, together)
        torch.cuda.empty_cache()  # give the copy buffers back before anything else allocates
    else:
        together()
        h2d, d2h, duplex = _host_bandwidths(copy_bytes)
    phases.append(time.perf_counter())
    together()
    cpu_rate, optim_name = optimizer_rate(optimizer_cls, torch.device("cpu"), cpu_optim_dtype)
    phases.append(time.perf_counter())
    device_rate, _ = optimizer_rate(optimizer_cls, device, device_optim_dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's param and states
    phases.append(time.perf_counter())
    free, total = _memory(device)
    context, method = _context_bytes(device, free, total)
    phases.append(time.perf_counter())
    logger.debug(
        "hardware phases: copies %.2f s, CPU optimizer %.2f s, device optimizer %.2f s,"
        " memory and context %.2f s",
        *(b - a for a, b in zip(phases, phases[1:])),
    )
    profile = HardwareProfile(
        h2d_bps=h2d,
        d2h_bps=d2h,
        duplex_bps=duplex,
        cpu_optim_params_per_s=cpu_rate,
        gpu_optim_params_per_s=device_rate,
        gpu_free_bytes=free,
        gpu_total_bytes=total,
        cuda_context_bytes=context,
        device_name=key["device_name"],
        device_type=device.type,
        optimizer_name=optim_name,
        cpu_threads=key["cpu_threads"],
        torch_version=key["torch_version"],
        driver_version=key["driver_version"],
        hostname=key["hostname"],
        context_method=method,
        measure_s=time.perf_counter() - started,
    )
    write_cache(path, key, profile)
    logger.debug("hardware measured in %.2f s: %s", profile.measure_s, profile)
    return profile


def reprofile_forced() -> bool:
    """``AUTOOFFLOAD_REPROFILE=1``: measure, whatever the cache holds."""
    return os.environ.get("AUTOOFFLOAD_REPROFILE", "").lower() in ("1", "true")


def cached_hardware(
    device: str | torch.device,
    cache_dir: str | os.PathLike[str] | None,
    optimizer_cls: type[torch.optim.Optimizer],
    pinned: bool = True,
    local_ranks: int = 1,
) -> HardwareProfile | None:
    """The cached profile ``measure_hardware`` would return with these arguments, or None."""
    device = _normalise(torch.device(device))
    key = cache_key(device, optimizer_cls, pinned, local_ranks)
    return read_cache(cache_path(cache_dir, key), key)


def cache_key(
    device: torch.device, optimizer_cls: type, pinned: bool = True, local_ranks: int = 1
) -> dict[str, Any]:
    """What a cached profile must match: machine, device, driver, torch, threads, optimizer,
    whether host memory is pinned, and how many ranks share the host."""
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu:{platform.processor() or platform.machine()}"
    return {
        "version": CACHE_VERSION,
        "hostname": socket.gethostname(),
        "device_name": device_name,
        "driver_version": _driver_version() if device.type == "cuda" else "",
        "torch_version": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "optimizer": f"{optimizer_cls.__module__}.{optimizer_cls.__qualname__}",
        "pinned": pinned,
        "local_ranks": local_ranks,
    }


def cache_path(cache_dir: str | os.PathLike[str] | None, key: dict[str, Any]) -> Path:
    """``<cache_dir>/hardware-<hash of key>.json``."""
    root = Path(os.path.expanduser(str(cache_dir or DEFAULT_CACHE_DIR)))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"hardware-{digest}.json"


def read_cache(path: Path, key: dict[str, Any]) -> HardwareProfile | None:
    """The cached profile, or None if absent, unreadable, corrupted or for another key."""
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        return HardwareProfile.from_dict(data["profile"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.debug("ignoring unreadable hardware cache %s: %s", path, error)
        return None


def write_cache(path: Path, key: dict[str, Any], profile: HardwareProfile) -> None:
    """Write atomically (temp file + os.replace); a read-only cache dir only logs at DEBUG."""
    try:
        with atomic_write(path) as file:
            json.dump({"key": key, "profile": profile.to_dict()}, file, indent=1)
    except OSError as error:
        logger.debug("could not write hardware cache %s: %s", path, error)


def optimizer_rate(
    optimizer_cls: type[torch.optim.Optimizer],
    device: torch.device,
    dtype: torch.dtype,
    numel: int | None = None,
    seconds: float = OPTIM_SECONDS,
) -> tuple[float, str]:
    """Parameters per second ``optimizer_cls`` updates on ``device`` (fused where it supports it),
    and the variant's name, e.g. ``"AdamW(fused)"``. ``numel`` defaults to ``CPU_OPTIM_NUMEL`` on
    the CPU and to ``DEVICE_OPTIM_NUMEL`` on a GPU (capped at 1/64 of its free memory: param,
    grad and two states at 4 bytes each fit 4 times over)."""
    if numel is None:
        numel = CPU_OPTIM_NUMEL
        if device.type == "cuda":
            numel = max(1 << 20, min(DEVICE_OPTIM_NUMEL, torch.cuda.mem_get_info(device)[0] // 64))
    while True:
        try:
            param = torch.zeros(numel, dtype=dtype, device=device, requires_grad=True)
            param.grad = torch.full_like(param, 1e-3)
            optimizer, name = _make_optimizer(optimizer_cls, param)
            optimizer.step()  # allocates the state; not timed
            break
        except torch.OutOfMemoryError:
            # A per-process memory cap (set_per_process_memory_fraction) that free memory does
            # not show: measure on less.
            param = optimizer = None
            torch.cuda.empty_cache()
            if numel <= 1 << 20:
                raise
            numel //= 4
    _sync(device)
    steps, started = 0, time.perf_counter()
    while True:
        optimizer.step()
        steps += 1
        _sync(device)
        elapsed = time.perf_counter() - started
        if elapsed >= seconds or steps >= 1000:
            return numel * steps / elapsed, name


def _make_optimizer(
    optimizer_cls: type[torch.optim.Optimizer], param: torch.Tensor
) -> tuple[torch.optim.Optimizer, str]:
    """The fused variant if the class has one that runs here, else foreach, else the default."""
    accepted = inspect.signature(optimizer_cls.__init__).parameters
    for variant in ("fused", "foreach"):
        if variant not in accepted:
            continue
        try:
            optimizer = optimizer_cls([param], **{variant: True})
            optimizer.step()
            return optimizer, f"{optimizer_cls.__name__}({variant})"
        except (RuntimeError, TypeError, ValueError) as error:
            logger.debug("%s(%s=True) unavailable: %s", optimizer_cls.__name__, variant, error)
    return optimizer_cls([param]), optimizer_cls.__name__


def _cuda_bandwidths(
    device: torch.device,
    nbytes: int,
    pinned: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> tuple[float, float, float]:
    """(H2D, D2H, both-at-once aggregate) bytes/s of host copies (pinned unless ``pinned`` is
    False, or pinning fails here too), median of CUDA-event timings; each direction starts
    after ``barrier``."""
    nbytes = int(min(nbytes, torch.cuda.mem_get_info(device)[0] // 8))
    try:
        host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    except RuntimeError as error:
        logger.debug("pinning the bandwidth probe failed (%s); timing pageable copies", error)
        host_in = torch.empty(nbytes, dtype=torch.uint8)
        host_out = torch.empty(nbytes, dtype=torch.uint8)
    device_in = torch.empty(nbytes, dtype=torch.uint8, device=device)
    device_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d_stream = torch.cuda.Stream(device)
    d2h_stream = torch.cuda.Stream(device)

    def h2d() -> None:
        device_in.copy_(host_in, non_blocking=True)

    def d2h() -> None:
        host_out.copy_(device_out, non_blocking=True)

    def timed(copies: list[tuple[torch.cuda.Stream, Callable[[], None]]]) -> float:
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        ends = []
        for stream, copy in copies:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                copy()
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            ends.append(end)
        torch.cuda.synchronize(device)
        return max(start.elapsed_time(end) for end in ends) / 1e3

    def median_seconds(copies: list[tuple[torch.cuda.Stream, Callable[[], None]]]) -> float:
        barrier()
        timed(copies)  # warm-up
        return sorted(timed(copies) for _ in range(COPY_REPEATS))[COPY_REPEATS // 2]

    h2d_s = median_seconds([(h2d_stream, h2d)])
    d2h_s = median_seconds([(d2h_stream, d2h)])
    both_s = median_seconds([(h2d_stream, h2d), (d2h_stream, d2h)])
    return nbytes / h2d_s, nbytes / d2h_s, 2 * nbytes / both_s


def _host_bandwidths(nbytes: int) -> tuple[float, float, float]:
    """CPU simulation: memcpy rate one way, the other way, and two copies at once on two threads."""
    source = [torch.ones(nbytes, dtype=torch.uint8) for _ in range(2)]
    target = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]

    def median_seconds(copies: int) -> float:
        def once() -> float:
            barrier = threading.Barrier(copies + 1)

            def copy(index: int) -> None:
                barrier.wait()
                target[index].copy_(source[index])

            threads = [threading.Thread(target=copy, args=(i,)) for i in range(copies)]
            for thread in threads:
                thread.start()
            started = time.perf_counter()
            barrier.wait()
            for thread in threads:
                thread.join()
            return time.perf_counter() - started

        once()  # warm-up (first touch of the pages)
        return sorted(once() for _ in range(COPY_REPEATS))[COPY_REPEATS // 2]

    one_way = nbytes / median_seconds(1)
    other_way = nbytes / median_seconds(1)
    return one_way, other_way, 2 * nbytes / median_seconds(2)


def _memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device; host RAM in CPU simulation."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, int(total)
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")), int(total)


def _context_bytes(device: torch.device, free: int, total: int) -> tuple[int, str]:
    """Device bytes this process holds outside the caching allocator (CUDA context, handles).

    NVML's per-process usage when available; else device used minus reserved, an upper bound
    that also counts other processes on the device.
    """
    if device.type != "cuda":
        return 0, "none"
    reserved = torch.cuda.memory_reserved(device)
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory:
                return max(0, int(process.usedGpuMemory) - reserved), "nvml"
    except Exception as error:  # noqa: BLE001 - NVML is optional; any failure means "not there"
        logger.debug("NVML unavailable for the context size: %s", error)
    return max(0, total - free - reserved), "used_minus_reserved"


def _driver_version() -> str:
    """The NVIDIA driver version, or "unknown"."""
    try:
        with open("/proc/driver/nvidia/version") as version:
            for word in version.readline().split():
                if word[:1].isdigit() and "." in word:
                    return word
    except OSError:
        pass
    return "unknown"


def _normalise(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
