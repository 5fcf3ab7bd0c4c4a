"""The Plan: what the runtime executes (chunk residency and per-block activation policy)."""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30

# Where checkpointed blocks keep their input (AUTOOFFLOAD_CHECKPOINT_INPUTS; auto: searched).
CHECKPOINT_INPUTS = ("auto", "gpu", "cpu")


@dataclass(frozen=True)
class Knobs:
    """The searched knobs for one chunk layout (the chunk size is fixed by the layout's profile).

    ``n_swap`` / ``n_checkpoint`` count blocks; which blocks get which policy is
    ``plan.configuration.assign_block_policies`` (swap the first blocks, checkpoint the next ones).
    """

    n_persist: int
    n_buffer: int
    n_swap: int = 0
    n_checkpoint: int = 0


@dataclass(frozen=True)
class UpdatePlacement:
    """Where a plan runs the optimizer's update and gradient accumulation's sums, as the cost
    model predicted them (``cost_time.predict_step_time``)."""

    gpu_update_chunks: int = 0
    """Offloaded chunks updated on the GPU at ``step()``, the last ones
    (``plan/update_split.py``)."""
    gpu_backward_chunks: int = 0
    """Offloaded chunks updated on the GPU in the backward, the lowest ones
    (``update_split.backward_split``)."""
    accumulate_on_gpu: bool = False
    """Gradient accumulation sums offloaded gradients on the GPU
    (``cost_time.accumulation_terms``)."""
    update_in_backward: bool = False
    """Offloaded chunks are updated in the backward, as their gradients arrive."""
    persistent_at_step: bool = False
    """Under the update in the backward, persistent chunks still step at ``step()`` (data
    parallelism)."""
    micro_batches: int = 1
    """Backward passes per step (gradient accumulation) the prediction assumed."""


@dataclass(frozen=True)
class Plan:
    """One configuration of the runtime, chosen by the search or fixed by the user.

    ``n_persist`` chunks (the first ones in execution order) stay on the GPU; the other chunks
    stream through at most ``n_buffer`` GPU chunk buffers. ``block_policies[i]`` is the activation
    policy of block ``i`` ("keep", "checkpoint", "checkpoint_cpu" or "swap"). ``update`` is
    None for a plan the cost model did not predict (the profiling step's, one fixed by the
    user, a re-profile's): the runtime then places the update as the settings say.
    ``breakdown`` holds the cost model's terms, for diagnostics only.
    """

    chunk_size: int
    n_chunks: int
    n_persist: int
    n_buffer: int
    block_policies: tuple[str, ...] = ()
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_step_s: float | None = None
    bottleneck: str = "unknown"
    source: str = "search"
    update: UpdatePlacement | None = None
    mlp_tile_tokens: int = 0
    """Tokens per tile of the blocks' MLPs (``runtime/activations/tiled_mlp.py``); 0: untiled."""
    host_input_blocks: int = 0
    """Leading blocks whose checkpointed inputs the plan's variant keeps on the host
    (``ModelProfile.host_input_blocks``; 0: the inputs stay on the device)."""
    host_activation_bytes: int = 0
    """Host bytes the activations take at the end of the forward: swapped blocks' saved tensors
    and host-kept checkpoint inputs (``configuration.host_activation_bytes``)."""
    host_served_chunks: tuple[int, ...] = ()
    """Chunks served from the host store, never gathered whole (``runtime/host_vocab.py``: a
    frozen embedding's rows, a frozen head's tiles); neither persistent nor streamed, whatever
    ``n_persist`` says."""
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def n_swap(self) -> int:
        return sum(p == "swap" for p in self.block_policies)

    @property
    def n_checkpoint(self) -> int:
        return sum(p in ("checkpoint", "checkpoint_cpu") for p in self.block_policies)

    @property
    def predicted(self) -> bool:
        """Whether the cost model predicted this plan (and so placed its update)."""
        return self.update is not None

    @property
    def gpu_update_chunks(self) -> int:
        """Offloaded chunks updated on the GPU at ``step()`` (0 for a plan not predicted)."""
        return self.update.gpu_update_chunks if self.update else 0

    @property
    def gpu_backward_chunks(self) -> int:
        """Offloaded chunks updated on the GPU in the backward (0 for a plan not predicted)."""
        return self.update.gpu_backward_chunks if self.update else 0

    @property
    def accumulates_on_gpu(self) -> bool:
        """Whether gradient accumulation sums offloaded gradients on the GPU (False for a plan
        not predicted)."""
        return self.update.accumulate_on_gpu if self.update else False

    @property
    def knobs(self) -> Knobs:
        return Knobs(self.n_persist, self.n_buffer, self.n_swap, self.n_checkpoint)

    def configures_like(self, other: Plan) -> bool:
        """Same knobs, block policies, GPU-updated chunks, place of the accumulation's sums,
        MLP tiles and chunks served from the host: switching between the two changes nothing
        the runtime does (a checkpoint block and a checkpoint_cpu one count alike in
        ``knobs``). The GPU update split follows
        from the rates, so a calibration can change it alone."""
        return (
            self.knobs == other.knobs
            and self.block_policies == other.block_policies
            and self.gpu_update_chunks == other.gpu_update_chunks
            and self.gpu_backward_chunks == other.gpu_backward_chunks
            and self.accumulates_on_gpu == other.accumulates_on_gpu
            and self.mlp_tile_tokens == other.mlp_tile_tokens
            and self.host_served_chunks == other.host_served_chunks
        )

    def summary(self, device_type: str = "cuda") -> str:
        """A short multi-line human summary (logged once per attach). ``device_type`` "cpu"
        words it for the CPU simulation, where host memory plays the device."""
        n_off = self.n_chunks - self.n_persist
        simulated = device_type == "cpu"
        dev = "device" if simulated else "GPU"
        host = "host memory" if simulated else "pinned CPU"
        lines = [
            f"plan ({self.source}): {self.n_chunks} chunks of {format_bytes(self.chunk_size)}"
            + (" (CPU simulation: host memory plays the device)" if simulated else ""),
            f"  persistent on {dev}: {self.n_persist} chunks; offloaded to {host}: {n_off} chunks"
            f" through {self.n_buffer} {dev} buffers",
        ]
        update = self.update or UpdatePlacement()
        k = update.gpu_update_chunks
        if update.update_in_backward and (n_off or self.n_persist):
            kb = self.gpu_backward_chunks
            parts = ["offloaded chunks updated on the CPU as their gradients arrive"] * bool(n_off)
            if kb:
                parts = [
                    f"the lowest {kb} offloaded chunks updated on the {dev} as their backward ends"
                    f" (state streamed from pinned memory), {n_off - kb} on the CPU as their"
                    " gradients arrive"
                ]
            parts += [f"persistent chunks stepped on the {dev} as their backward ends"] * bool(
                self.n_persist and not update.persistent_at_step
            )
            lines.append(
                f"  optimizer: in the backward, {' and '.join(parts)}"
                " (AUTOOFFLOAD_UPDATE_IN_BACKWARD)"
            )
        if k:
            lines.append(
                f"  optimizer: {k} offloaded chunks updated on the {dev} (state streamed from"
                f" pinned memory), {n_off - k} on the CPU"
            )
        if self.block_policies:
            n_keep = len(self.block_policies) - self.n_swap - self.n_checkpoint
            on_cpu = "checkpoint_cpu" in self.block_policies
            mixed = on_cpu and "checkpoint" in self.block_policies
            kind = "checkpoint_cpu" if on_cpu else "checkpoint"
            where = ""
            if mixed:  # the host had room for the first blocks' inputs only
                cpu = _block_ranges(self.block_policies, "checkpoint_cpu").strip(" ()")
                gpu = _block_ranges(self.block_policies, "checkpoint").strip(" ()")
                where = f" (inputs on CPU: {cpu}; on the {dev}: {gpu})"
            elif on_cpu:
                where = f" (inputs on CPU){_block_ranges(self.block_policies, kind)}"
            else:
                where = _block_ranges(self.block_policies, kind)
            held = self.host_activation_bytes
            in_host = f"; {format_bytes(held)} of them held on the host" if held else ""
            lines.append(
                f"  activations: {n_keep} blocks keep, {self.n_checkpoint} checkpoint{where},"
                f" {self.n_swap} swap{_block_ranges(self.block_policies, 'swap')}{in_host}"
            )
        if self.mlp_tile_tokens:
            lines.append(
                f"  MLPs: tiled, {self.mlp_tile_tokens} tokens per tile (intermediates of one tile"
                " live at once; the backward runs the MLP forward again)"
            )
        if self.host_served_chunks:
            lines.append(
                f"  served from {host}: chunks {', '.join(map(str, self.host_served_chunks))}"
                f" (frozen embedding rows / head tiles copied as used, never on the {dev} whole)"
            )
        if self.predicted_peak_bytes is not None:
            budget = "unbounded" if self.budget_bytes is None else format_bytes(self.budget_bytes)
            streamed = self.breakdown.get("mem_buffers_max")
            in_flight = (
                f" (streamed chunks: up to {format_bytes(streamed)} at once)" if streamed else ""
            )
            lines.append(
                f"  predicted peak {format_bytes(self.predicted_peak_bytes)} vs budget {budget}"
                + in_flight
            )
        if self.predicted_step_s is not None:
            micro = update.micro_batches
            per = f", {micro} micro-batches of accumulation" if micro > 1 else ""
            lines.append(
                f"  predicted step {self.predicted_step_s * 1e3:.1f} ms"
                f" (bottleneck: {self.bottleneck}{per})"
            )
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB with two decimals from 1 GiB, else in MiB or KiB with at least three
    significant digits."""
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.{0 if value >= 100 else 1 if value >= 10 else 2}f} {unit}"
    return f"{n:.0f} B"


def _block_ranges(policies: tuple[str, ...], policy: str) -> str:
    """Text like ' (blocks 0-9, 12)' naming the blocks that have ``policy``; '' when none do."""
    spans: list[str] = []
    start = None
    for index, name in enumerate((*policies, "")):
        if name == policy and start is None:
            start = index
        elif name != policy and start is not None:
            spans.append(str(start) if start == index - 1 else f"{start}-{index - 1}")
            start = None
    return f" (blocks {', '.join(spans)})" if spans else ""
