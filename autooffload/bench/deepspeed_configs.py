"""The DeepSpeed offload configurations the bench runs, and which ones a sweep can leave out.

A :class:`DeepSpeedConfig` is one ZeRO-Offload setup (stage 2: optimizer state and step on the
CPU, weights on the GPU) or ZeRO-Infinity-on-CPU setup (stage 3: weights offloaded too), with
the knobs that trade GPU memory for speed. :data:`SWEEP` is the small list the ``deepspeed`` peer
tries for every workload and cap, fastest first, and :func:`sweep_order` puts the ones likely to
fit the cap first; :func:`skip_reason` says when the outcome of configurations already run makes
another one pointless (it would run out of memory, or it cannot be faster than one that fits).
:func:`host_need` is the host memory a configuration takes, from DeepSpeed's own buffers, so that
one the host cannot hold is never started. Nothing here imports DeepSpeed or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from autooffload.bench.workloads import Workload

# DeepSpeed's own defaults (deepspeed/runtime/zero/config.py, 0.19).
DS_MAX_LIVE_PARAMETERS = 10**9
DS_PREFETCH_BUCKET_SIZE = 5 * 10**7
DS_PERSISTENCE_THRESHOLD = 10**5
DS_REDUCE_BUCKET_SIZE = 5 * 10**8
DS_SUB_GROUP_SIZE = 10**9  # zero_optimization.sub_group_size (stage 3)
MASTERS = ("fp32", "bf16")


class DeepSpeedOptionError(ValueError):
    """A ``deepspeed[...]`` option the bench does not know, or a value it cannot take."""


@dataclass(frozen=True)
class DeepSpeedConfig:
    """One DeepSpeed offload configuration (the ``deepspeed[k=v,...]`` options of the bench)."""

    stage: int = 3
    """2: ZeRO-Offload (``offload_optimizer`` only: weights and gradients on the GPU, AdamW on
    the CPU with DeepSpeedCPUAdam); 3: ``offload_param`` + ``offload_optimizer``."""
    gc: bool | None = None
    """Activation checkpointing (HF ``gradient_checkpointing_enable``); None: the workload's."""
    pin: bool = True
    """``pin_memory`` of the offloaded weights and optimizer state."""
    live: int = DS_MAX_LIVE_PARAMETERS
    """``stage3_max_live_parameters``: parameters gathered on the GPU at once (stage 3)."""
    prefetch: int = DS_PREFETCH_BUCKET_SIZE
    """``stage3_prefetch_bucket_size``: parameters fetched ahead of use (stage 3)."""
    persist: int = DS_PERSISTENCE_THRESHOLD
    """``stage3_param_persistence_threshold``: tensors smaller than this stay on the GPU."""
    bucket: int = DS_REDUCE_BUCKET_SIZE
    """``reduce_bucket_size`` (and stage 2's ``allgather_bucket_size``), in elements."""
    clip: float = 0.0
    """``gradient_clipping`` (global norm). DeepSpeed clips at 1.0 unless told; the other peers
    do not clip, so 0 (off) unless a run asks for it."""
    masters: str = "fp32"
    """Master weights and AdamW state: "fp32" (DeepSpeed's default with bf16) or "bf16"
    (``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``: pure bf16, like vanilla's
    AdamW on bf16 parameters)."""
    zero_init: bool = True
    """Stage 3: partition the built model with ``deepspeed.zero.Init(module=...)`` before
    ``deepspeed.initialize`` (what ``from_pretrained`` does under ZeRO-3), so the whole model is
    never on the GPU; False: ``deepspeed.initialize`` moves it to the GPU whole first."""

    def __post_init__(self) -> None:
        if self.stage not in (2, 3):
            raise DeepSpeedOptionError(
                f"deepspeed option stage={self.stage!r} is not offered; use stage=2 (ZeRO-Offload)"
                " or stage=3 (weights offloaded too)"
            )
        if self.masters not in MASTERS:
            raise DeepSpeedOptionError(
                f"deepspeed option masters={self.masters!r} is not offered; use masters=fp32 or"
                " masters=bf16"
            )
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or self.clip < 0:
            raise DeepSpeedOptionError(
                f"deepspeed option clip={self.clip!r} must be a gradient norm >= 0 (0: no clipping)"
            )
        for name in ("live", "prefetch", "persist", "bucket"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DeepSpeedOptionError(
                    f"deepspeed option {name}={value!r} must be a whole number of elements >= 0"
                )

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> DeepSpeedConfig:
        """The configuration ``options`` names (unnamed knobs at DeepSpeed's defaults)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            valid = ", ".join(sorted(known))
            raise DeepSpeedOptionError(
                f"unknown deepspeed option(s) {', '.join(unknown)}; valid: {valid}"
            )
        values = dict(options)
        for name in ("live", "prefetch", "persist", "bucket"):
            # 1e9 on the command line parses as a float.
            if isinstance(values.get(name), float) and values[name].is_integer():
                values[name] = int(values[name])
        return cls(**values)

    def options(self) -> dict[str, Any]:
        """The options that differ from the defaults, in field order (the run's label)."""
        default = DeepSpeedConfig()
        out = {k: v for k, v in asdict(self).items() if v != getattr(default, k) or k == "stage"}
        if self.stage == 2:  # the stage-3 knobs do nothing at stage 2
            stage3 = ("live", "prefetch", "persist", "zero_init")
            out = {k: v for k, v in out.items() if k not in stage3}
        return out

    def with_gc(self, workload_gc: bool) -> DeepSpeedConfig:
        """This configuration with ``gc`` resolved against the workload's default."""
        return self if self.gc is not None else replace(self, gc=workload_gc)

    def engine_config(self, bs: int, accum: int, lr: float, bf16: bool) -> dict[str, Any]:
        """The ``deepspeed.initialize(config=...)`` dict: AdamW at ``lr`` with the other peers'
        hyperparameters (DeepSpeedCPUAdam's betas 0.9/0.999, eps 1e-8 and bias correction are
        torch's defaults; weight decay 0), gradient clipping only at ``clip``."""
        offload = {"device": "cpu", "pin_memory": self.pin}
        zero: dict[str, Any] = {
            "stage": self.stage,
            "offload_optimizer": dict(offload),
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": self.bucket,
        }
        if self.stage == 3:
            zero["offload_param"] = dict(offload)
            zero["stage3_max_live_parameters"] = self.live
            zero["stage3_prefetch_bucket_size"] = self.prefetch
            zero["stage3_param_persistence_threshold"] = self.persist
        else:
            zero["allgather_bucket_size"] = self.bucket
        precision: dict[str, Any] = {"enabled": bf16}
        if bf16 and self.masters == "bf16":
            precision["bf16_master_weights_and_grads"] = True
            precision["bf16_optimizer_states"] = True
        return {
            "train_micro_batch_size_per_gpu": bs,
            "gradient_accumulation_steps": accum,
            "bf16": precision,
            "gradient_clipping": float(self.clip),
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
            "steps_per_print": 10**9,
        }

    def residency(self) -> tuple[int, ...]:
        """How much of the model the GPU holds, as a vector ordered componentwise: a stage-2
        configuration holds every weight, so it is above every stage-3 one (and a stage-3 one
        without ``zero_init`` holds them all while it starts)."""
        if self.stage == 2:
            return (1, self.bucket, 0, 0, 0, 0)
        return (0, self.bucket, self.live, self.prefetch, self.persist, int(not self.zero_init))

    def needs_at_least_the_memory_of(self, other: DeepSpeedConfig) -> bool:
        """Whether this configuration holds at least what ``other`` holds on the GPU (pinning
        changes host memory only). Both must have ``gc`` resolved."""
        mine, theirs = self.residency(), other.residency()
        if mine[0] != theirs[0]:
            more_resident = mine[0] > theirs[0] and mine[1] >= theirs[1]
        else:
            more_resident = all(a >= b for a, b in zip(mine[1:], theirs[1:], strict=True))
        keeps_activations = (not self.gc) or bool(other.gc)
        return more_resident and keeps_activations

    def at_least_as_fast_as(self, other: DeepSpeedConfig) -> bool:
        """Whether this configuration is no slower than ``other``: it keeps at least as much on
        the GPU, recomputes no more and pins at least as much."""
        return self.needs_at_least_the_memory_of(other) and (self.pin or not other.pin)


# Fastest first. Stage 2 keeps every weight on the GPU; the stage-3 rows go from "gather a lot,
# keep small tensors resident" down to fetching in small pieces with small buckets.
_Z3_LARGE = dict(stage=3, live=2 * 10**9, prefetch=2 * 10**8, persist=10**6)
_Z3_SMALL = dict(stage=3, live=10**8, prefetch=10**7, persist=10**4, bucket=5 * 10**7)
SWEEP: tuple[DeepSpeedConfig, ...] = (
    DeepSpeedConfig(stage=2, gc=False),
    DeepSpeedConfig(stage=2, gc=True),
    DeepSpeedConfig(**_Z3_LARGE, gc=False),
    DeepSpeedConfig(**_Z3_LARGE, gc=True),
    DeepSpeedConfig(stage=3, gc=True),
    DeepSpeedConfig(**_Z3_SMALL, gc=True),
    DeepSpeedConfig(**_Z3_SMALL, gc=True, pin=False),
)

# A configuration's outcome, as :func:`skip_reason` reads it.
FITS, DEVICE_OOM, HOST_OOM, FAILED = "fits", "device OOM", "host OOM", "failed"


def label(config: DeepSpeedConfig) -> str:
    """``stage=3,gc=True,live=100000000`` (what the bench writes in ``deepspeed[...]``)."""
    return ",".join(f"{k}={v}" for k, v in config.options().items())


def skip_reason(candidate: DeepSpeedConfig, done: list[tuple[DeepSpeedConfig, str]]) -> str | None:
    """Why running ``candidate`` would tell nothing, given the configurations already run on
    the same workload and cap with their outcomes; None when it must run.

    A configuration is left out when one that needs no more GPU memory ran out of it, when one
    at least as fast fits, or when the host ran out of memory (every configuration keeps the
    same fp32 weights and AdamW state in host memory). ``gc`` must be resolved everywhere.
    """
    for config, outcome in done:
        if outcome == HOST_OOM:
            return (
                f"the host ran out of memory with [{label(config)}], and every configuration"
                " keeps the same fp32 weights and AdamW state on the host"
            )
        if outcome == DEVICE_OOM and candidate.needs_at_least_the_memory_of(config):
            return f"needs at least the GPU memory of [{label(config)}], which ran out of it"
        if outcome == FITS and config.at_least_as_fast_as(candidate):
            return f"no faster than [{label(config)}], which fits"
    return None


# --- Host memory -------------------------------------------------------------------------------
# What one rank of DeepSpeed 0.19 allocates on the host. torch's pinned allocator rounds every
# block up to a power of two, so a pinned buffer of n bytes takes 2^ceil(log2 n). P is the rank's
# partition of the trainable elements, m the bytes of a master element (4; 2 with masters=bf16).
# - Stage 2 (runtime/zero/stage_1_and_2.py): the master partition, pinned (m P); its compute-dtype
#   copy-back buffer, pinned (2 P); the fp32 gradient partition, pinned (4 P); the gradient
#   staging buffer of the largest trainable tensor, pinned; DeepSpeedCPUAdam's exp_avg and
#   exp_avg_sq, pageable (2 m P, made at the first step).
# - Stage 3 (runtime/zero/stage3.py, partition_parameters.py): each frozen parameter's partition,
#   pinned one by one; the flat compute-dtype buffer of the trainable partitions, pinned; the
#   master partitions, pageable (m P); one fp32 gradient buffer per sub-group of ~1e9 elements,
#   pinned; the flat fp32 gradient partition, pinned (4 P); the AdamW state (2 m P).
# Every rank also holds the model the bench builds on the CPU before DeepSpeed takes it, and the
# process's runtime (torch, CUDA, NCCL, DeepSpeed: ~1 GiB, what a 1.1B ZeRO-2 run's 31.4 GiB
# peak leaves beside the buffers above and its model). Recorded H100 peaks against this sum:
# 1.1B ZeRO-2 31.4 GiB (31.4 estimated), 3.6B ZeRO-3 84.2 GiB (88.0).
HOST_RUNTIME_BYTES = 1 << 30


@dataclass(frozen=True)
class HostNeed:
    """The host memory a DeepSpeed configuration takes on one host, in bytes."""

    per_rank: int
    ranks: int
    """Ranks on the host (every rank of a ``--nproc`` run)."""
    parts: dict[str, int]
    """``per_rank`` by buffer."""

    @property
    def total(self) -> int:
        return self.per_rank * self.ranks


def _pinned(nbytes: int, pin: bool) -> int:
    return 1 << (nbytes - 1).bit_length() if pin and nbytes > 1 else nbytes


def _sub_groups(partitions: Sequence[int], size: int = DS_SUB_GROUP_SIZE) -> list[int]:
    """Elements per stage-3 sub-group: trainable partitions in order, closed at ``size``."""
    groups, current = [], 0
    for index, numel in enumerate(partitions):
        current += numel
        if current >= size or index == len(partitions) - 1:
            groups.append(current)
            current = 0
    return groups


def _compute_size(workload: Workload) -> int:
    return 2 if workload.dtype in ("bfloat16", "float16") else 4


def host_need(config: DeepSpeedConfig, workload: Workload, ranks: int = 1) -> HostNeed | None:
    """The host memory ``config`` takes for ``workload`` with ``ranks`` ranks on the host (the
    formulas above); None where the workload's parameters are not known without building it."""
    tensors = workload.parameter_tensors()
    if tensors is None:
        return None
    pin, size = config.pin, _compute_size(workload)
    master = 4 if config.masters == "fp32" or size == 4 else 2
    trainable = [math.ceil(t.numel / ranks) for t in tensors if t.trainable]
    partition = sum(trainable)
    parts: dict[str, int] = {}
    if config.stage == 2:
        largest = max((t.numel for t in tensors if t.trainable), default=0)
        parts["master partition (pinned)"] = _pinned(master * partition, pin)
        parts["copy-back buffer (pinned)"] = _pinned(size * partition, pin)
        parts["gradient partition (pinned)"] = _pinned(4 * partition, pin)
        parts["gradient staging (pinned)"] = _pinned(size * largest, pin)
    else:
        frozen = (math.ceil(t.numel / ranks) for t in tensors if not t.trainable)
        parts["frozen partitions (pinned)"] = sum(_pinned(size * numel, pin) for numel in frozen)
        parts["trainable partitions (pinned)"] = _pinned(size * partition, pin)
        parts["master partitions"] = master * partition
        groups = _sub_groups(trainable)
        parts["sub-group gradients (pinned)"] = sum(_pinned(4 * numel, pin) for numel in groups)
        parts["gradient partition (pinned)"] = _pinned(4 * partition, pin)
    parts["AdamW state"] = 2 * master * partition
    parts["model built on the CPU"] = sum(t.numel * t.element_size for t in tensors)
    parts["runtime"] = HOST_RUNTIME_BYTES
    return HostNeed(sum(parts.values()), ranks, parts)


# --- GPU memory, to order the sweep ------------------------------------------------------------
# A rough per-GPU need, in bytes, only to try first the configurations likely to fit (E: bytes of
# the compute dtype; b, s: micro-batch and sequence; h, kv, i, V, L: the Llama dims):
# - weights: stage 2 every parameter (E x all) plus the gradient staging of the largest trainable
#   tensor; stage 3 at most live + prefetch elements gathered (all of them while it starts
#   without zero_init);
# - reduce buckets: two of ``bucket`` elements;
# - activations: per block E b s (6 h + 3 kv + 4 i) kept, or with checkpointing the blocks'
#   inputs (E b s h L) and one block's;
# - logits: b s V (E + 8) (the logits, the loss's fp32 copy and its gradient).


def gpu_need(config: DeepSpeedConfig, workload: Workload) -> int | None:
    """The rough GPU bytes ``config`` (``gc`` resolved) needs for ``workload``; None where its
    parameters are not known without building it."""
    tensors = workload.parameter_tensors()
    if tensors is None:
        return None
    size = _compute_size(workload)
    d = workload.text_dims
    h, i, vocab, layers = (
        d["hidden_size"],
        d["intermediate_size"],
        d["vocab_size"],
        d["num_hidden_layers"],
    )
    kv = d["num_key_value_heads"] * (h // d["num_attention_heads"])
    every = sum(t.numel for t in tensors)
    if config.stage == 2:
        weights = size * (every + max((t.numel for t in tensors if t.trainable), default=0))
    else:
        weights = size * min(every, config.live + config.prefetch)
        if not config.zero_init:
            weights = max(weights, size * every)
    tokens = workload.bs * workload.seq
    block = size * tokens * (6 * h + 3 * kv + 4 * i)
    activations = size * tokens * h * layers + block if config.gc else block * layers
    logits = tokens * vocab * (size + 8)
    return weights + 2 * size * config.bucket + activations + logits


def sweep_order(
    configs: Sequence[DeepSpeedConfig], workload: Workload, cap: int | None
) -> list[DeepSpeedConfig]:
    """``configs`` (fastest first) in the order to try them under ``cap``: those
    :func:`gpu_need` expects to fit, fastest first (one that fits rules out the slower ones),
    then the others, least need first (one that runs out of memory rules out those needing
    more). The rest still run unless :func:`skip_reason` rules them out."""
    needs = {c: gpu_need(c.with_gc(workload.gc), workload) for c in configs}
    if cap is None or any(need is None for need in needs.values()):
        return list(configs)
    fitting = [c for c in configs if needs[c] <= cap]
    return fitting + sorted((c for c in configs if needs[c] > cap), key=lambda c: needs[c])
