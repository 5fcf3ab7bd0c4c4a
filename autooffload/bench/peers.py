"""The peers the bench compares: how each one sets up the model and optimizer and runs a step.

Every peer runs inside its own worker process (``autooffload.bench._worker``) and trains the
same model (same seed, same batch) with AdamW (lr from the workload, weight decay 0). A peer that
cannot run in this environment raises :class:`PeerUnavailable` (reported as "skipped").
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autooffload.bench.deepspeed_configs import SWEEP, DeepSpeedConfig, HostNeed, host_need
from autooffload.bench.deepspeed_configs import label as deepspeed_label
from autooffload.bench.deepspeed_configs import skip_reason as deepspeed_skip_reason
from autooffload.bench.deepspeed_configs import sweep_order as deepspeed_sweep_order
from autooffload.bench.models import build_model, decoder_blocks
from autooffload.bench.peer_autooffload import (
    fixed_activation_mode,
    setup_autooffload,
)
from autooffload.bench.trainee import (
    PeerContext,
    PeerUnavailable,
    Trainee,
    adamw,
    data_parallel,
)
from autooffload.bench.workloads import UnknownNameError, Workload


def _setup_vanilla(ctx: PeerContext) -> Trainee:
    model = build_model(ctx.workload, seed=ctx.seed)
    model.to(ctx.device)
    optimizer = adamw(model, ctx)
    if data_parallel():  # several GPUs: plain DDP is the reference
        ids = [torch.cuda.current_device()] if ctx.device == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return Trainee(model, optimizer)


def _setup_hf_gc(ctx: PeerContext) -> Trainee:
    # build_model turns on gradient_checkpointing_enable(use_reentrant=False) (+ PEFT input grads).
    model = build_model(replace(ctx.workload, gc=True), seed=ctx.seed)
    model.to(ctx.device)
    return Trainee(model, adamw(model, ctx))


class SaveOnCpuTrainee(Trainee):
    """Every tensor autograd saves goes to (pinned) host memory in forward, back in backward."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, pin: bool) -> None:
        super().__init__(model, optimizer)
        self.pin = pin

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu(pin_memory=self.pin):
            return self.model(**batch).loss


# The input width of each LoRA target of a Llama-like layer, by name: "hidden" or
# "intermediate" (the down projection reads the MLP's wide product).
_LORA_TARGET_INPUT = {
    "q_proj": "hidden",
    "k_proj": "hidden",
    "v_proj": "hidden",
    "o_proj": "hidden",
    "gate_proj": "hidden",
    "up_proj": "hidden",
    "down_proj": "intermediate",
}


def _save_on_cpu_host_need(workload: Workload, options: dict[str, Any], ranks: int) -> HostNeed:
    """A lower bound of what ``save_on_cpu`` holds on the host at the end of the forward, so a
    length no host holds is skipped instead of the host killing the run (or its neighbours): per
    token and decoder layer, the hidden states a Llama-like layer saves (its input and normed
    input twice, q, the attention output and the projection's input: ~7 ``hidden``; k and v;
    the MLP's gate, up, activation and product: 4 ``intermediate``) in the model's dtype; with
    LoRA on a 16-bit (or 4-bit) base, the fp32 copy of its input each LoRA layer saves (PEFT
    keeps the adapters in fp32 and casts the input for ``lora_A``; ``save_on_cpu`` saves every
    copy, q, k and v's three of one input); and the fp32 log-softmax of the logits the loss
    saves. Unrounded (the pinned allocator rounds each tensor up to a power of two: the real
    figure is higher; the model built on the host has moved to the device by then). Llama-3-8B
    LoRA at seq 16384: 170 GiB (86 of activations, 76 of LoRA copies, 8 of logits; without the
    copies the bound read 90 GiB, and a run on a host with 124 GiB free was killed by its
    out-of-memory killer). A target of another name counts nothing (the bound stays one)."""
    d = workload.text_dims
    h, i, layers = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]
    kv = d["num_key_value_heads"] * (h // d["num_attention_heads"])
    element = 2 if workload.dtype in ("bfloat16", "float16") else 4
    tokens = workload.bs * workload.seq
    parts = {
        "saved activations": tokens * layers * (7 * h + 2 * kv + 4 * i) * element,
        "logits (fp32 log-softmax)": tokens * d["vocab_size"] * 4,
    }
    if workload.mode in ("lora", "qlora") and (element == 2 or workload.mode == "qlora"):
        widths = {"hidden": h, "intermediate": i}
        inputs = sum(
            widths[_LORA_TARGET_INPUT[t]] for t in workload.lora_targets if t in _LORA_TARGET_INPUT
        )
        parts["LoRA inputs' fp32 copies"] = tokens * layers * inputs * 4
    return HostNeed(sum(parts.values()), ranks, parts)


def _setup_save_on_cpu(ctx: PeerContext) -> Trainee:
    model = build_model(replace(ctx.workload, gc=False), seed=ctx.seed)
    model.to(ctx.device)
    # Pinning needs an accelerator; CPU-only runs (tests) use pageable memory.
    return SaveOnCpuTrainee(model, adamw(model, ctx), pin=ctx.device == "cuda")


# --- autooffload -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


class DistributedTrainee(Trainee):
    """A trainee that owns a process group, destroyed on close."""

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _setup_fsdp2(ctx: PeerContext) -> Trainee:
    """FSDP2-offload tuned: the CPU optimizer is torch's fused AdamW (~5 Gparam/s on 16 cores)."""
    return _fsdp2_trainee(ctx, fused=True)


def _setup_fsdp2_default(ctx: PeerContext) -> Trainee:
    """FSDP2-offload as a script writes it: ``AdamW(params, lr=...)``. Torch picks neither fused
    nor foreach for CPU DTensor params, so the update is the per-param for-loop."""
    return _fsdp2_trainee(ctx, fused=None)


def _fsdp2_trainee(ctx: PeerContext, fused: bool | None) -> Trainee:
    reason = _fsdp2_unavailable(ctx.workload, ctx.device)
    if reason:
        raise PeerUnavailable(reason)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        _single_process_env()
        if ctx.device == "cuda":
            torch.cuda.set_device(0)
            dist.init_process_group(backend="cpu:gloo,cuda:nccl", rank=0, world_size=1)
        else:
            dist.init_process_group(backend="gloo", rank=0, world_size=1)
    mesh = init_device_mesh(ctx.device, (dist.get_world_size(),))
    model = build_model(ctx.workload, seed=ctx.seed)
    if ctx.workload.dtype == "bfloat16":
        # LoRA adapters are fp32 (PEFT's default): compute in bf16, keep fp32 grads and master.
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp_policy = MixedPrecisionPolicy()
    # Pinning needs an accelerator; CPU-only runs (tests) use pageable memory.
    offload = CPUOffloadPolicy(pin_memory=ctx.device == "cuda")
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    # Sharded params live on the CPU, so the optimizer runs there.
    if fused:
        optimizer = adamw(model, ctx, fused=True)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=ctx.workload.lr, weight_decay=0.0)
    return FSDP2Trainee(model, optimizer)


class FSDP2Trainee(DistributedTrainee):
    def sync_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """FSDP2 reduce-scatters every backward unless told not to: the last one only."""
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()


# --- DeepSpeed ZeRO-Offload (stage 2) and stage 3 with weights offloaded -----------------------


class DeepSpeedTrainee(DistributedTrainee):
    """A DeepSpeed engine; its report names the configuration it ran."""

    def __init__(self, model: nn.Module, optimizer: Any, config: DeepSpeedConfig) -> None:
        super().__init__(model, optimizer)
        self.config = config

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The engine scales each loss by 1/accum and steps at the last micro-batch
        # (gradient_accumulation_steps in its config).
        total = None
        for _ in range(self.accum):
            loss = self.model(**batch).loss
            self.model.backward(loss)
            self.model.step()
            total = loss.detach() if total is None else total + loss.detach()
        return total / self.accum

    def report(self, timed_steps: int) -> dict[str, Any]:
        return {"deepspeed_config": deepspeed_label(self.config)}


def _deepspeed_unavailable(workload: Workload, device: str) -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not importable (pip install deepspeed; benchmarks/carry_deepspeed.sh)"
    if workload.mode == "qlora":
        return "DeepSpeed ZeRO cannot partition bitsandbytes 4-bit weights"
    if device != "cuda":
        return "DeepSpeed offload needs a CUDA device"
    return None


def _deepspeed_peer(base: dict[str, Any]) -> Callable[[PeerContext], Trainee]:
    """The DeepSpeed peer whose options default to ``base``."""

    def setup(ctx: PeerContext) -> Trainee:
        config = DeepSpeedConfig.from_options({**base, **ctx.options})
        return _setup_deepspeed(ctx, config.with_gc(ctx.workload.gc))

    return setup


def _setup_deepspeed(ctx: PeerContext, config: DeepSpeedConfig) -> Trainee:
    reason = _deepspeed_unavailable(ctx.workload, ctx.device)
    if reason:
        raise PeerUnavailable(reason)
    try:
        import deepspeed
    except Exception as exc:
        raise PeerUnavailable(f"deepspeed not importable: {exc!r}") from exc
    # Under torchrun the worker's process group exists already and init_distributed keeps it.
    _single_process_env()
    deepspeed.init_distributed(dist_backend="nccl")
    model = build_model(replace(ctx.workload, gc=bool(config.gc)), seed=ctx.seed)
    workload = ctx.workload
    bf16 = workload.dtype == "bfloat16"
    engine_config = config.engine_config(workload.bs, workload.accum, workload.lr, bf16=bf16)
    if config.stage == 3 and config.zero_init:
        if bf16:  # what deepspeed.initialize casts (LoRA's fp32 adapters) when it partitions
            for param in model.parameters():
                if param.is_floating_point() and param.dtype != torch.bfloat16:
                    param.data = param.data.to(torch.bfloat16)
        # Partitioned one parameter at a time, as under from_pretrained with ZeRO-3.
        deepspeed.zero.Init(module=model, config_dict_or_path=engine_config)
        # deepspeed.initialize leaves a partitioned model where it is: the buffers (rotary
        # inv_freq) go to the GPU here, as they would be made there inside zero.Init.
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, buffer.to(ctx.device))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=params, config=engine_config
    )
    return DeepSpeedTrainee(engine, optimizer, config)


def _check_deepspeed_options(options: dict[str, Any]) -> None:
    DeepSpeedConfig.from_options(options)


def _deepspeed_host_need(base: dict[str, Any]) -> Callable[[Workload, dict[str, Any], int], Any]:
    """The host memory of the DeepSpeed peer whose options default to ``base``."""

    def need(workload: Workload, options: dict[str, Any], ranks: int) -> HostNeed | None:
        config = DeepSpeedConfig.from_options({**base, **options}).with_gc(workload.gc)
        return host_need(config, workload, ranks)

    return need


@dataclass(frozen=True)
class PeerSweep:
    """``candidates(workload, cap)``: the configurations (option dicts) a peer tries for a
    workload and cap, the one likely to fit and fastest first; ``skip_reason(workload, options,
    done)``: why one is pointless given the outcomes (``deepspeed_configs.FITS``,
    ``DEVICE_OOM``, ``HOST_OOM``, ``FAILED``) of those already run, or None."""

    candidates: Callable[[Workload, int | None], tuple[dict[str, Any], ...]]
    skip_reason: Callable[[Workload, dict[str, Any], list[tuple[dict[str, Any], str]]], str | None]


def _deepspeed_skip_reason(
    workload: Workload, options: dict[str, Any], done: list[tuple[dict[str, Any], str]]
) -> str | None:
    def resolve(opts: dict[str, Any]) -> DeepSpeedConfig:
        return DeepSpeedConfig.from_options(opts).with_gc(workload.gc)

    return deepspeed_skip_reason(resolve(options), [(resolve(o), out) for o, out in done])


def _deepspeed_candidates(workload: Workload, cap: int | None) -> tuple[dict[str, Any], ...]:
    return tuple(c.options() for c in deepspeed_sweep_order(SWEEP, workload, cap))


DEEPSPEED_SWEEP = PeerSweep(_deepspeed_candidates, _deepspeed_skip_reason)


# --- test-only peers ---------------------------------------------------------------------------


def _setup_oom(ctx: PeerContext) -> Trainee:
    raise torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB (simulated by the _oom test peer)"
    )


def _setup_error(ctx: PeerContext) -> Trainee:
    raise ValueError("simulated failure of the _error test peer")


def _setup_crash(ctx: PeerContext) -> Trainee:
    os._exit(7)


def _setup_deepspeed_sim(ctx: PeerContext) -> Trainee:
    config = DeepSpeedConfig.from_options(ctx.options).with_gc(ctx.workload.gc)
    if config.stage == 2 or not config.gc:
        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory (simulated for deepspeed[{deepspeed_label(config)}])"
        )
    return _setup_vanilla(replace(ctx, workload=replace(ctx.workload, gc=True)))


def _fsdp2_unavailable(workload: Workload, device: str) -> str | None:
    if workload.mode == "qlora":
        return "FSDP2 cannot shard bitsandbytes 4-bit (Params4bit) weights"
    return None


@dataclass(frozen=True)
class PeerDef:
    """A peer: its setup function, a pre-flight availability check, and a one-line description.

    ``takes_options``: it takes ``name[k=v,...]``; ``check_options`` rejects bad ones before any
    run; ``autooffload_settings``: it also gets ``--autooffload-opt``; ``sweep``: without options
    it runs as several configurations, and the report keeps the best that fits; ``host_need(
    workload, options, ranks)``: the host memory a run takes with ``ranks`` ranks on the host
    (a ``deepspeed_configs.HostNeed``), or None where it is not estimated."""

    setup: Callable[[PeerContext], Trainee]
    description: str
    unavailable: Callable[[Workload, str], str | None] = lambda workload, device: None
    hidden: bool = False
    takes_options: bool = False
    check_options: Callable[[dict[str, Any]], None] = lambda options: None
    autooffload_settings: bool = False
    sweep: PeerSweep | None = None
    host_need: Callable[[Workload, dict[str, Any], int], HostNeed | None] = (
        lambda workload, options, ranks: None
    )


PEERS: dict[str, PeerDef] = {
    "vanilla": PeerDef(_setup_vanilla, "plain PyTorch/HF/PEFT: model.to(device), fused AdamW"),
    "fsdp2_offload": PeerDef(
        _setup_fsdp2,
        "FSDP2 fully_shard per block + root, CPUOffloadPolicy(pin_memory=True), 1 GPU,"
        " fused CPU AdamW",
        unavailable=_fsdp2_unavailable,
    ),
    "fsdp2_offload_default": PeerDef(
        _setup_fsdp2_default,
        "fsdp2_offload with AdamW(params, lr) at torch's defaults, as a script writes it"
        " (the per-param for-loop on CPU)",
        unavailable=_fsdp2_unavailable,
    ),
    "deepspeed": PeerDef(
        _deepspeed_peer({}),
        "DeepSpeed at its best configuration that fits the cap: ZeRO-Offload (stage 2) or"
        " stage 3 with weights offloaded, gc on/off, buckets (deepspeed_configs.SWEEP);"
        " deepspeed[k=v,...] runs one configuration",
        unavailable=_deepspeed_unavailable,
        takes_options=True,
        check_options=_check_deepspeed_options,
        sweep=DEEPSPEED_SWEEP,
        host_need=_deepspeed_host_need({}),
    ),
    "deepspeed_zero2": PeerDef(
        _deepspeed_peer({"stage": 2}),
        "DeepSpeed ZeRO-Offload: ZeRO-2, offload_optimizer to pinned CPU (DeepSpeedCPUAdam)",
        unavailable=_deepspeed_unavailable,
        takes_options=True,
        check_options=_check_deepspeed_options,
        host_need=_deepspeed_host_need({"stage": 2}),
    ),
    "deepspeed_offload": PeerDef(
        _deepspeed_peer({"stage": 3}),
        "DeepSpeed ZeRO-3, offload_param + offload_optimizer to pinned CPU, DeepSpeed's defaults",
        unavailable=_deepspeed_unavailable,
        takes_options=True,
        check_options=_check_deepspeed_options,
        host_need=_deepspeed_host_need({"stage": 3}),
    ),
    "autooffload": PeerDef(
        setup_autooffload,
        "autooffload.enable(budget=cap, **opts) + the vanilla script unchanged",
        takes_options=True,
        autooffload_settings=True,
    ),
    "hf_gc": PeerDef(
        _setup_hf_gc,
        "vanilla + model.gradient_checkpointing_enable(use_reentrant=False), whatever --gc says",
    ),
    "save_on_cpu": PeerDef(
        _setup_save_on_cpu,
        "vanilla (no gc) with forward under torch.autograd.graph.save_on_cpu(pin_memory=True)",
        host_need=_save_on_cpu_host_need,
    ),
    **{
        f"autooffload_{short}": PeerDef(
            fixed_activation_mode(mode),
            f"autooffload with activation_mode={mode} for every block; the rest planned",
            takes_options=True,
            autooffload_settings=True,
        )
        for short, mode in (("keep", "keep"), ("ckpt", "checkpoint"), ("swap", "swap"))
    },
    "_oom": PeerDef(_setup_oom, "test: raises CUDA OOM", hidden=True),
    "_error": PeerDef(_setup_error, "test: raises an error", hidden=True),
    "_crash": PeerDef(_setup_crash, "test: the worker dies", hidden=True),
    "_deepspeed_sim": PeerDef(
        _setup_deepspeed_sim,
        "test: the deepspeed sweep on the CPU; stage 2 and gc off run out of memory",
        hidden=True,
        takes_options=True,
        check_options=_check_deepspeed_options,
        sweep=DEEPSPEED_SWEEP,
        host_need=_deepspeed_host_need({}),
    ),
}


def public_peers() -> list[str]:
    return [name for name, peer in PEERS.items() if not peer.hidden]


def get_peer(name: str) -> PeerDef:
    """The peer called ``name``; a clear error naming the valid peers otherwise."""
    if name not in PEERS:
        raise UnknownNameError(f"unknown peer {name!r}; valid peers: {', '.join(public_peers())}")
    return PEERS[name]
