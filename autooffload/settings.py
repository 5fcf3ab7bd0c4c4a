"""Every knob of autooffload in one place: its env var, default, valid values and error text."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autooffload.errors import SettingsError
from autooffload.plan.types import CHECKPOINT_INPUTS
from autooffload.setting_values import (
    ACCUMULATE_ON,
    CHUNK_POOLS,
    check_roles,
    enum_of,
    parse_bool,
    parse_boundaries,
    parse_count,
    parse_optional_bool,
    parse_optional_bytes,
    parse_path,
    parse_roles,
    parse_size,
    parse_size_or_fraction,
    parse_threads,
    parse_threshold,
)

ENV_PREFIX = "AUTOOFFLOAD"

ACTIVATION_MODES = ("auto", "keep", "checkpoint", "checkpoint_cpu", "swap", "off")
EOS_MODES = ("turn", "last", "all", "none")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEVICES = ("cuda", "cpu")
DATA_PARALLEL_MODES = ("auto", "off")
SHARD_OPTIMIZER_MODES = ("auto", "on", "off")
CPU_BINDING_MODES = ("auto", "off")


def _knob(
    default: Any, env: str, parser: Callable[[Any, str], Any], help: str, shown: str | None = None
) -> Any:
    """A Settings field; ``shown`` is how the default reads in docs when not derivable."""
    metadata = {"env": env, "parser": parser, "help": help, "shown": shown}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Settings:
    """Every knob of autooffload; each has one env var ``AUTOOFFLOAD_<NAME>`` and kwargs win.

    Build it with ``Settings.from_env(**overrides)`` (what ``enable()`` does) or directly with
    keyword arguments; either way every value is validated and normalized, and a bad one raises
    ``autooffload.errors.SettingsError`` naming the setting, the value and the valid values.

    Args:
        enabled: Master switch (env ``AUTOOFFLOAD``). ``False`` makes ``enable()`` validate the
            settings and do nothing else, so ``AUTOOFFLOAD=0`` turns the product off without
            editing the script.
        offload: Offload weights (chunks of parameters, their grads and optimizer state) to pinned
            CPU memory. ``False`` keeps everything on the device but still manages activations
            and masking.
        budget: Device memory the runtime may use: a size with a unit (``12GiB``, ``12GB``,
            ``12000MB``), a byte count (an ``int``, or a bare number of at least 1 MiB), or a
            fraction of the device in (0, 1] (``0.5``; ``1`` and ``1.0`` are the whole device).
            A bare number between 1 and 1 MiB is refused. ``None``/``auto``: the free device
            memory minus a calibrated margin. A budget below what the model's weights take in
            the smallest plan is refused at attach.
        host_budget: Pinned host memory the runtime may use, as bytes or a fraction of host
            memory; ``None``: as much as the model needs.
        chunk_size: Bytes per parameter chunk; ``None``: the plan search picks it.
        n_persist: Chunks kept resident on the device; ``None``: the plan search picks it.
        n_buffer: Device buffers that offloaded chunks stream through; ``None``: searched.
        n_swap: Blocks whose activations are swapped to host memory; ``None``: searched.
        n_checkpoint: Blocks whose activations are recomputed in backward; ``None``: searched.
        activation_mode: ``auto`` (the plan decides per block), or one policy for every block:
            ``keep``, ``checkpoint``, ``checkpoint_cpu`` (checkpoint with the block input in host
            memory), ``swap``; ``off`` leaves activations to the script.
        checkpoint_inputs: Where checkpointed blocks keep their input: ``gpu``, ``cpu`` (copied
            to pinned host memory in the forward, prefetched back for the recompute), or
            ``auto`` (default): the plan search tries both on a CUDA device (``gpu`` elsewhere).
        attach_threshold: Models smaller than this many bytes of parameters are not attached
            automatically (they fit anyway); default 1 GiB.
        force_attach: Attach every trained model whatever its size.
        offload_frozen: Frozen models (nothing requires grad: a DPO reference model, a
            distillation teacher) moved to the GPU attach too, every chunk streamed through the
            buffers by default (an eval-only model is never profiled), so the model that trains
            keeps the GPU. ``None``/``auto`` (the default): when the model is over
            ``attach_threshold`` and takes at least a quarter of the GPU budget (or with
            ``force_attach``); ``True``: whenever over ``attach_threshold``; ``False``: never
            (such a model moves to the GPU whole, and the trained model's plan counts it).
        master_weights: Keep fp32 master weights (and fp32 optimizer state) for offloaded
            low-precision (bf16/fp16) parameters in the CPU optimizer. Off by default: the script's
            own optimizer updates bf16 parameters in bf16, and so does the CPU twin, so an
            attached run trains like the unchanged script (and the CPU update moves 3x fewer
            bytes). On: better numerics for the offloaded part, at that CPU cost.
        update_in_backward: Update each offloaded chunk on the CPU as soon as its gradients
            arrive in the backward (ProTrain's overlap), instead of from ``optimizer.step()``
            on, and step each persistent chunk on the GPU with the user's optimizer as soon as
            the backward is past it, dropping its gradients (the plan counts on that; under
            data parallelism persistent chunks are stepped at ``step()``, once averaged). Exact
            only for loops that step after every backward without clipping, a GradScaler,
            reading the gradients or changing hyperparameters between backward and step.
            ``None``/``auto`` (the default): when both profiling steps showed such a loop (on
            every rank; not with the GPU update path at step), the first search is run with and
            without it, and it is on from the first planned step if its plan is predicted 5%
            faster (a fixed plan: on); the CPU part is off for a step whose batch is larger
            than any trained so far (its OOM retry stays possible); ``True``: on without looking
            (no OOM retry); ``False``: off. Once on, a loop that later clips,
            accumulates, reads the gradients or changes hyperparameters between backward and
            step gets ``UpdateInBackwardError``.
        gpu_update_chunks: Offloaded chunks whose update at ``optimizer.step()`` runs on the
            GPU beside the CPU's, their optimizer state streamed from pinned memory over the
            PCIe link the CPU-bound step leaves idle (torch.optim.Adam/AdamW, no fp32 masters,
            unsharded state). 0 (the default): every offloaded chunk on the CPU; ``None``
            (``auto``): as many as the cost model finds fastest on a CUDA device; n: the last n
            offloaded chunks (on a CPU device too, where the path runs on CPU tensors: tests).
            Opt-in until the cost model charges the link it shares with the chunk gathers: at
            3.6B full FT under 16 GiB auto ran 1.21-1.26x faster, but the 1.1B planner test's
            step came out 35% slower than predicted (docs/architecture.md).
        gpu_update_in_backward: Under the update in the backward: the lowest offloaded chunks
            (the last whose gradients arrive, the first the next forward needs) are updated on
            the GPU as their backward ends, while their weights and gradients are still there;
            only their optimizer state comes in from pinned memory (one block ahead) and goes
            back with the new weights, in place of the gradients (torch.optim.Adam/AdamW, no
            fp32 masters; under data parallelism sharded state, each chunk on its owner once
            its gradients are averaged). The CPU updates the rest, which the next forward
            needs later. ``None`` (``auto``, the default): as many as the cost model finds
            leave the next forward no wait for the CPU, on a CUDA device; 0: every offloaded
            chunk on the CPU; n: the lowest n (on a CPU device too: tests). Moot when the
            update runs at ``step()``.
        accumulate_on: Where gradient accumulation sums an offloaded chunk's gradients over
            the micro-batches of a step. ``cpu``: each micro-batch's gradients come to pinned
            memory and the CPU worker adds them onto the earlier ones' (the CPU then does one
            pass per micro-batch beside the update). ``gpu``: the running sum goes back to the
            GPU just before the chunk's gradients leave it, is added there and returns in their
            place, so the CPU adds nothing (one more host-to-device copy of the gradients per
            later micro-batch, and a 32 MiB scratch); one process, host gradients in the
            model's dtype (no fp32 masters). ``None`` (``auto``, the default): the cost model
            picks the faster per plan on a CUDA device, ``cpu`` elsewhere. The sums are the
            same either way (one rounding per add in the gradients' dtype).
        cpu_threads: Threads of the CPU optimizer's updates; ``None`` (auto): one fewer than
            torch's intra-op threads on a GPU run, so the thread launching the GPU's kernels
            keeps a core (16 OpenMP threads on 16 cores stalled both: see docs/architecture.md).
        expandable_segments: Switch the CUDA caching allocator to expandable segments while a
            model is attached (the last detach restores it): an offloaded step frees and
            reallocates large blocks in plan-dependent orders, and fixed segments fragment
            under a tight cap (0.2-0.9 GiB unusable at measured OOMs). ``None`` (auto): on,
            unless ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` sets
            ``expandable_segments`` (then the user's value stands); ``False``: leave the
            allocator alone. The planner's fragmentation prior follows (1.03 vs 1.10).
        chunk_pool: Which CUDA stream's allocator pool holds the streamed chunks' device
            storage: ``compute`` (default; one pool with the activations, a freed buffer is
            reused at once and the copy waits for the compute queued before it) or ``copy``
            (the copy stream's own pool: copies start without waiting, but
            under a tight cap the two pools' peaks add up and the allocator empties its cache;
            see docs/planner.md, "Pools").
        chunked_loss: Compute transformers' causal-LM loss (``ForCausalLMLoss``, what every HF
            ``*ForCausalLM`` uses when given ``labels``) over chunks of rows, upcasting one chunk
            at a time instead of copying all the logits to fp32: same loss and gradients (fp32
            math), peak memory no longer grows with seq x vocab in fp32. ``outputs.logits`` is
            unchanged. Applies to every model while enabled, attached or not; ``False`` keeps
            transformers' loss.
        saved_upcasts: Where a PEFT layer of an attached model upcasts its input to its
            adapters' dtype (a bf16 base with fp32 LoRA adapters), save the input in place of
            the fp32 copy its ``lora_A`` keeps for the backward, and cast it again there: the
            same gradients bit for bit, one bf16 input saved where each layer reading it kept
            an fp32 copy (``runtime/activations/saved_upcasts.py``). ``False`` keeps PEFT's
            copies.
        fused_head: Fuse an attached causal LM's ``lm_head`` with its loss in training steps
            given ``labels``: the loss is computed over chunks of rows and the logits are never
            made whole (``runtime/activations/fused_head.py``); ``outputs.logits`` is None in
            those steps. ``None`` (auto): where the step's logits would take a quarter of the
            budget or more; ``True``: every such step (an error at attach for a model whose
            forward transforms the logits before its loss); ``False``: never.
        device: ``cuda`` or ``cpu`` (the CPU simulation used by tests); ``None``: cuda when
            available.
        mask: Turn chat data labels into assistant-only labels in collators and processors.
        train_on_inputs: With masking on, also train on the prompt (user/system) tokens.
        roles_to_train: Roles whose turns keep their labels (comma list or JSON list in env).
        train_on_eos: Which end-of-turn tokens keep their labels: ``turn`` (each trained turn's),
            ``last`` (the final one only), ``all``, ``none``.
        role_boundaries: Custom role markers for chat templates autooffload does not know: a list
            of ``{role, start, end, include_start, include_end}`` dicts (markers are strings or
            token-id lists), JSON text, or the path of a .json/.yaml file holding that list.
        log: Level of the ``autooffload`` logger: ``debug``, ``info``, ``warning``, ``error``.
        cache_dir: Directory of the per-machine hardware measurements cache.
        reprofile: Ignore the hardware cache and measure again.
        print_plan: Print the plan summary to stdout when the plan is searched, then exit (a
            dry run: the profiling steps and the search, no training).
        oom_retry: After a device OOM in the attached model's forward, or in ``backward()`` of
            its own loss, re-plan under a smaller budget (a batch more than twice the profiled
            size: profile it again) and retry the step once. ``None``/``auto``: on, except with
            ``update_in_backward=True`` (a retried backward would update twice); ``False``: a device
            OOM is raised as torch raises it, after the usual clean-up.
        data_parallel: ``auto``: when a ``torch.distributed`` process group of several ranks
            exists (torchrun, accelerate launch), every rank's attached replica averages its
            gradients across ranks chunk by chunk; ``off``: leave gradients local (the script
            reduces them itself).
        shard_optimizer: Under data parallelism, ``auto`` and ``on``: each rank keeps the host
            weights (frozen chunks' too) and, for trainable chunks, the fp32 masters, optimizer
            state and host gradients of only the offloaded chunks it owns (ownership balanced
            by bytes: ``sharding.balanced_owners``), receives their gradients by ``reduce`` and
            updates them alone; the others get the chunk's weights by ``broadcast`` when they
            gather it. Host memory, H2D copies and CPU update time per rank fall ~N-fold;
            saving then needs :func:`autooffload.consolidate` on every rank (HF ``Trainer`` and
            accelerate's ``save_state`` do it). ``off``: every rank keeps and updates all of it.
        cpu_binding: Under data parallelism with several ranks on a host of several NUMA
            nodes, ``auto``: each rank binds its threads to an exclusive share of the cores of
            its GPU's node (its host store and optimizer state then live there) and runs its
            CPU optimizer on that many threads, unless the launcher bound it already
            (``runtime/parallel/affinity.py``); ``off``: threads stay where the launcher put
            them, each rank taking cores // local ranks threads.
    """

    enabled: bool = _knob(True, "AUTOOFFLOAD", parse_bool, "master switch; 0 turns everything off")
    offload: bool = _knob(
        True, "AUTOOFFLOAD_OFFLOAD", parse_bool, "offload weight chunks to pinned CPU memory"
    )
    budget: int | float | None = _knob(
        None,
        "AUTOOFFLOAD_BUDGET",
        parse_size_or_fraction,
        "device memory to use: size (12GiB) or fraction (0.5); auto = free memory minus margin",
    )
    host_budget: int | float | None = _knob(
        None,
        "AUTOOFFLOAD_HOST_BUDGET",
        parse_size_or_fraction,
        "pinned host memory to use: size or fraction; auto = as needed",
    )
    chunk_size: int | None = _knob(
        None, "AUTOOFFLOAD_CHUNK_SIZE", parse_optional_bytes, "bytes per chunk; auto = searched"
    )
    n_persist: int | None = _knob(
        None, "AUTOOFFLOAD_N_PERSIST", parse_count, "chunks resident on device; auto = searched"
    )
    n_buffer: int | None = _knob(
        None, "AUTOOFFLOAD_N_BUFFER", parse_count, "device chunk buffers; auto = searched"
    )
    n_swap: int | None = _knob(
        None, "AUTOOFFLOAD_N_SWAP", parse_count, "blocks with swapped activations; auto = searched"
    )
    n_checkpoint: int | None = _knob(
        None,
        "AUTOOFFLOAD_N_CHECKPOINT",
        parse_count,
        "blocks with recomputed activations; auto = searched",
    )
    activation_mode: str = _knob(
        "auto",
        "AUTOOFFLOAD_ACTIVATION_MODE",
        enum_of(ACTIVATION_MODES),
        "auto, keep, checkpoint, checkpoint_cpu, swap or off",
    )
    checkpoint_inputs: str = _knob(
        "auto",
        "AUTOOFFLOAD_CHECKPOINT_INPUTS",
        enum_of(CHECKPOINT_INPUTS),
        "auto, gpu or cpu",
    )
    attach_threshold: int = _knob(
        1 << 30,
        "AUTOOFFLOAD_ATTACH_THRESHOLD",
        parse_threshold,
        "smaller models are not attached automatically",
    )
    force_attach: bool = _knob(
        False, "AUTOOFFLOAD_FORCE_ATTACH", parse_bool, "attach whatever the model size"
    )
    offload_frozen: bool | None = _knob(
        None,
        "AUTOOFFLOAD_OFFLOAD_FROZEN",
        parse_optional_bool,
        "attach frozen models (reference, teacher) and stream them; auto = when over the"
        " threshold and at least a quarter of the GPU budget",
    )
    master_weights: bool = _knob(
        False, "AUTOOFFLOAD_MASTER_WEIGHTS", parse_bool, "fp32 masters for offloaded bf16 params"
    )
    update_in_backward: bool | None = _knob(
        None,
        "AUTOOFFLOAD_UPDATE_IN_BACKWARD",
        parse_optional_bool,
        "update offloaded chunks during backward; auto = when the profiling steps show no"
        " clipping, accumulation, gradient or weight reads or hyperparameter changes before step()",
    )
    gpu_update_chunks: int | None = _knob(
        0,
        "AUTOOFFLOAD_GPU_UPDATE_CHUNKS",
        parse_count,
        "offloaded chunks updated on the GPU at step(), state streamed from pinned memory"
        " (Adam/AdamW); 0 = CPU only; auto = the cost model's split (opt-in for now)",
    )
    gpu_update_in_backward: int | None = _knob(
        None,
        "AUTOOFFLOAD_GPU_UPDATE_IN_BACKWARD",
        parse_count,
        "under the update in the backward, the lowest offloaded chunks updated on the GPU as"
        " their backward ends (Adam/AdamW); 0 = CPU only; auto = as the cost model finds",
    )
    accumulate_on: str | None = _knob(
        None,
        "AUTOOFFLOAD_ACCUMULATE_ON",
        enum_of(ACCUMULATE_ON, optional=True),
        "cpu or gpu: where gradient accumulation sums offloaded chunks' gradients; auto = the"
        " cost model's choice on a CUDA device",
    )
    cpu_threads: int | None = _knob(
        None,
        "AUTOOFFLOAD_CPU_THREADS",
        parse_threads,
        "CPU optimizer threads; auto = intra-op threads - 1 on a GPU",
    )
    expandable_segments: bool | None = _knob(
        None,
        "AUTOOFFLOAD_EXPANDABLE_SEGMENTS",
        parse_optional_bool,
        "CUDA allocator expandable segments while attached; auto = on unless"
        " PYTORCH_CUDA_ALLOC_CONF sets them",
    )
    chunk_pool: str = _knob(
        "compute",
        "AUTOOFFLOAD_CHUNK_POOL",
        enum_of(CHUNK_POOLS),
        "compute or copy: the stream whose allocator pool holds streamed chunks",
    )
    chunked_loss: bool = _knob(
        True,
        "AUTOOFFLOAD_CHUNKED_LOSS",
        parse_bool,
        "causal-LM loss over row chunks, no fp32 copy of all the logits",
    )
    saved_upcasts: bool = _knob(
        True,
        "AUTOOFFLOAD_SAVED_UPCASTS",
        parse_bool,
        "a PEFT layer's upcast input saved as the input itself (no fp32 copy per layer)",
    )
    fused_head: bool | None = _knob(
        None,
        "AUTOOFFLOAD_FUSED_HEAD",
        parse_optional_bool,
        "LM head fused with the loss (no whole logits); auto = where they take 1/4 of the budget",
    )
    device: str | None = _knob(
        None,
        "AUTOOFFLOAD_DEVICE",
        enum_of(DEVICES, optional=True),
        "cuda or cpu (CPU simulation); auto = cuda if available",
    )
    mask: bool = _knob(True, "AUTOOFFLOAD_MASK", parse_bool, "assistant-only loss masking")
    train_on_inputs: bool = _knob(
        False, "AUTOOFFLOAD_TRAIN_ON_INPUTS", parse_bool, "also train on prompt tokens"
    )
    roles_to_train: tuple[str, ...] = _knob(
        ("assistant",),
        "AUTOOFFLOAD_ROLES_TO_TRAIN",
        parse_roles,
        "roles whose turns are trained (comma list or JSON list)",
    )
    train_on_eos: str = _knob(
        "turn", "AUTOOFFLOAD_TRAIN_ON_EOS", enum_of(EOS_MODES), "turn, last, all or none"
    )
    role_boundaries: list[dict[str, Any]] | None = _knob(
        None,
        "AUTOOFFLOAD_ROLE_BOUNDARIES",
        parse_boundaries,
        "custom role markers: JSON list or path to a .json/.yaml file",
        shown="none (detected from the chat template)",
    )
    log: str = _knob(
        "info", "AUTOOFFLOAD_LOG", enum_of(LOG_LEVELS), "debug, info, warning or error"
    )
    cache_dir: str = _knob(
        "~/.cache/autooffload", "AUTOOFFLOAD_CACHE_DIR", parse_path, "hardware measurement cache"
    )
    reprofile: bool = _knob(
        False, "AUTOOFFLOAD_REPROFILE", parse_bool, "ignore the hardware cache, measure again"
    )
    print_plan: bool = _knob(
        False, "AUTOOFFLOAD_PRINT_PLAN", parse_bool, "print the plan summary to stdout and exit"
    )
    oom_retry: bool | None = _knob(
        None,
        "AUTOOFFLOAD_OOM_RETRY",
        parse_optional_bool,
        "retry a step once under a smaller plan after a device OOM; auto = on unless"
        " AUTOOFFLOAD_UPDATE_IN_BACKWARD=1 (auto keeps it)",
    )

    @property
    def oom_retry_on(self) -> bool:
        """Whether the OOM retry runs: the setting, else on unless ``update_in_backward`` is
        forced on (its auto mode keeps the retry: ``Runtime.note_forward``)."""
        if self.oom_retry is not None:
            return self.oom_retry
        return self.update_in_backward is not True

    data_parallel: str = _knob(
        "auto",
        "AUTOOFFLOAD_DATA_PARALLEL",
        enum_of(DATA_PARALLEL_MODES),
        "auto (average gradients across torch.distributed ranks) or off",
    )
    shard_optimizer: str = _knob(
        "auto",
        "AUTOOFFLOAD_SHARD_OPTIMIZER",
        enum_of(SHARD_OPTIMIZER_MODES),
        "auto/on (each data-parallel rank owns 1/N of the host weights and optimizer state) or off",
    )
    cpu_binding: str = _knob(
        "auto",
        "AUTOOFFLOAD_CPU_BINDING",
        enum_of(CPU_BINDING_MODES),
        "auto (each data-parallel rank on its share of its GPU's NUMA node's cores) or off",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["parser"](getattr(self, f.name), f.name))
        check_roles(self.roles_to_train, self.role_boundaries, "roles_to_train")

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Read ``AUTOOFFLOAD_*`` env vars, apply ``overrides`` on top, validate, return Settings.

        Unknown kwargs and unknown ``AUTOOFFLOAD_*`` env vars are errors (with a suggestion), so a
        typo never silently falls back to a default. An env var set to the empty string is unset.
        """
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        for name, value in overrides.items():
            if name not in by_name:
                raise SettingsError(
                    f"Unknown setting {name}={value!r}{_suggest(name, list(by_name))};"
                    f" valid settings: {', '.join(by_name)}."
                )
        env_names = [f.metadata["env"] for f in by_name.values()]
        for key, value in os.environ.items():
            if key.startswith(ENV_PREFIX + "_") and key not in env_names:
                raise SettingsError(
                    f"Unknown environment variable {key}={value!r}{_suggest(key, env_names)};"
                    f" valid variables: {', '.join(env_names)}."
                )
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, f in by_name.items():
            env = f.metadata["env"]
            if name in overrides:
                raw, sources[name] = overrides[name], name
            elif os.environ.get(env, "").strip():
                raw, sources[name] = os.environ[env], env
            else:
                continue
            values[name] = f.metadata["parser"](raw, sources[name])
        if "roles_to_train" in values:
            check_roles(
                values["roles_to_train"],
                values.get("role_boundaries"),
                sources["roles_to_train"],
            )
        return cls(**values)

    @staticmethod
    def resolve_bytes(value: int | float | str | None, total_bytes: int) -> int | None:
        """Turn a size or a fraction (of ``total_bytes``) into bytes; ``None`` stays ``None``."""
        parsed = parse_size(value, "value", fraction=True, optional=True)
        if parsed is None:
            return None
        if isinstance(parsed, float):
            return int(parsed * total_bytes)
        return parsed


def _suggest(name: str, candidates: list[str]) -> str:
    """The "did you mean X?" clause for the closest candidate, ignoring the shared env prefix."""
    prefix = ENV_PREFIX + "_"
    if name.startswith(prefix) and name[len(prefix) :] in ("ENABLE", "ENABLED"):
        return f"; did you mean {ENV_PREFIX}?"
    by_key = {c.removeprefix(prefix): c for c in candidates}
    close = difflib.get_close_matches(name.removeprefix(prefix), list(by_key), n=1, cutoff=0.6)
    return f"; did you mean {by_key[close[0]]}?" if close else ""


def env_vars() -> list[tuple[str, str, str]]:
    """``(env var, default as written in env, help)`` for every setting, in field order."""
    rows = []
    for f in dataclasses.fields(Settings):
        shown = f.metadata["shown"] or _env_text(f.default)
        rows.append((f.metadata["env"], shown, f.metadata["help"]))
    return rows


def _env_text(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 30}GiB" if value % (1 << 30) == 0 else f"{value >> 20}MiB"
    return str(value)


def markdown_env_table() -> str:
    """The README's env var table, generated so that it cannot drift from ``Settings``."""
    lines = ["| env var | default | what it does |", "| --- | --- | --- |"]
    lines += [f"| `{env}` | `{default}` | {doc} |" for env, default, doc in env_vars()]
    return "\n".join(lines)


_current: Settings | None = None


def current() -> Settings | None:
    """The active Settings (set by ``autooffload.enable()``), or ``None`` when disabled."""
    return _current


def _set_current(settings: Settings | None) -> None:
    """Record the active Settings; only ``enable()`` and ``disable()`` call this."""
    global _current
    _current = settings
