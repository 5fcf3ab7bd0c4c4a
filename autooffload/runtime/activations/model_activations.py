"""``ModelActivations``: the activation policies of one attached model's blocks (checkpointed from
attach, the plan's after each switch, removed at detach), their MLP tiles, the swapper, and HF
gradient checkpointing taken over meanwhile."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autooffload.log import logger
from autooffload.plan.types import Plan
from autooffload.runtime.activations.policies import (
    ActivationSwapper,
    apply_policy,
    keep_checkpoint_input_on_host,
    policy_of,
    remove_policy,
    restore_hf_gradient_checkpointing,
    take_over_hf_gradient_checkpointing,
)
from autooffload.runtime.activations.tiled_mlp import (
    find_final_norm,
    set_mlp_tiles,
    tile_mlp,
    untile_mlp,
)
from autooffload.runtime.blocks import Group

# A batch is long when its checkpointed blocks' inputs, one per block, or one block's untiled
# forward would take more than this share of the budget (``long_batch``): its profiling steps
# keep those inputs in host memory and tile the MLPs (``fit_long_batch_for_profiling``), and the
# block probe runs on slices of it (``control/probe.py``).
PROFILING_INPUTS_SHARE = 0.25
# Hidden states a position holds in one block's untiled forward: a Llama MLP's intermediates
# (3.5 hidden states each for Llama-3-8B) and PEFT's fp32 copy of the down projection's input.
# A shallow model at a long batch is long by these, not by its few inputs (two Llama-3-8B blocks
# at 524288 tokens: 2 x 4 GiB of inputs, a 28 GiB fp32 copy in one MLP).
BLOCK_FORWARD_HIDDEN_STATES = 16
# Tokens per MLP tile in a long batch's profiling steps (the smallest tile the search tries).
PROFILING_MLP_TILE_TOKENS = 8192
# Tokens per tile of a causal LM's final norm, tiled from attach on for batches of more tokens
# (``ModelActivations.start``): untiled, a bf16 RMSNorm saves an fp32 copy of the last hidden
# state and its backward holds several more; tiled, it saves its input and the backward one
# tile's fp32 temporaries. The profile measures it as it runs, whatever the plan.
FINAL_NORM_TILE_TOKENS = 8192


def long_batch(n_blocks: int, input_bytes: int, budget: int | None) -> bool:
    """Whether ``n_blocks`` checkpointed inputs of ``input_bytes`` each, or one block's untiled
    forward (``BLOCK_FORWARD_HIDDEN_STATES`` inputs), would take more than
    ``PROFILING_INPUTS_SHARE`` of ``budget``."""
    held = max(n_blocks, BLOCK_FORWARD_HIDDEN_STATES) * input_bytes
    return budget is not None and held > PROFILING_INPUTS_SHARE * budget


class ModelActivations:
    """The runtime's ``activations``: which policy each block runs under, in the order the last
    forward ran them (``position``: a group's index to its place in that forward)."""

    def __init__(
        self,
        model: nn.Module,
        groups: list[Group],
        device: torch.device,
        mode: str,
        position: Callable[[int], int],
        host_inputs: bool = False,
        host_room: Callable[[int], int | None] = lambda held: None,
    ) -> None:
        self.model = model
        # Whether checkpointed blocks may keep their inputs in host memory (the search's
        # ``checkpoint_inputs`` is not "gpu").
        self.host_inputs = host_inputs
        # Host bytes the inputs may take, given those the swapper holds (None: unknown).
        self.host_room = host_room
        # The input bytes of the long batch the profiling policies were last fitted to.
        self._fitted_batch = 0
        self.groups = groups
        self.device = device
        # Settings.activation_mode: "off" leaves the blocks (and HF's checkpointing) alone.
        self.mode = mode
        self._position = position
        # Made at the first block swapped or checkpointed with its inputs on the host.
        self.swapper: ActivationSwapper | None = None
        self.hf_checkpointing_taken = False
        # The causal LM's final norm, tiled from ``start`` to ``remove``.
        self.final_norm: nn.Module | None = None

    def blocks_in_order(self) -> list[Group]:
        """The blocks in the order the last forward ran them."""
        blocks = [g for g in self.groups if g.is_block]
        return sorted(blocks, key=lambda g: self._position(g.index))

    def start(self) -> None:
        """Conservative start: every block checkpointed (or under the mode's fixed policy) until
        the plan from the real batch, HF gradient checkpointing taken over, the final norm tiled
        (``FINAL_NORM_TILE_TOKENS``)."""
        if self.mode == "off" or not any(g.is_block for g in self.groups):
            return
        self.final_norm = find_final_norm(self.model)
        if self.final_norm is not None:
            tile_mlp(self.final_norm, FINAL_NORM_TILE_TOKENS)
        self.hf_checkpointing_taken = take_over_hf_gradient_checkpointing(self.model)
        if self.hf_checkpointing_taken:
            logger.info("activation management takes over HF gradient checkpointing per block")
        policy = "checkpoint" if self.mode == "auto" else self.mode
        for group in self.blocks_in_order():
            self.apply_block_policy(group.module, policy)

    def apply_block_policy(self, block: nn.Module, policy: str) -> None:
        """Give ``block`` the activation ``policy``, numbered by its place in the forward."""
        if policy in ("swap", "checkpoint_cpu") and self.swapper is None:
            self.swapper = ActivationSwapper(self.device)
        index = next(g.block_index for g in self.groups if g.module is block)
        order = [g.module for g in self.blocks_in_order()]
        apply_policy(
            block,
            policy,  # type: ignore[arg-type]
            self.swapper,
            block_index=order.index(block) if block in order else index,
        )

    def fit_long_batch_for_profiling(self, input_bytes: int, budget: int | None) -> bool:
        """In a profiling step, at a block's forward: for a long batch (``long_batch``), every
        checkpointed block keeps its input in host memory (``checkpoint_cpu``, where host-side
        inputs are allowed; the first blocks only, where the host has room for no more), the
        block entering its forward included, and every MLP runs in
        tiles of ``PROFILING_MLP_TILE_TOKENS``. A long batch's inputs and one block's MLP
        intermediates would otherwise fill the device (Llama-3-8B at seq 65536: 32 x 512 MiB of
        inputs, 4 x 1.75 GiB of MLP intermediates). The blocks' profiles come from the block
        probe, which runs each block alone, untiled, so they do not depend on this. Returns
        whether the batch is long (the policies are the planner's: activation mode ``auto``)."""
        blocks = [g for g in self.groups if g.is_block]
        if self.mode != "auto" or not long_batch(len(blocks), input_bytes, budget):
            return False
        if self._fitted_batch == input_bytes:
            return True  # fitted at this batch's first block (the policies stay for its steps)
        self._fitted_batch = input_bytes
        switched = 0
        room = self.host_room(self.swapper.pool.allocated_bytes if self.swapper else 0)
        fits = len(blocks) if room is None else min(len(blocks), room // max(1, input_bytes))
        if self.host_inputs and fits < len(blocks):
            logger.info(
                "profiling a long batch: the host has room for %d of its %d blocks' inputs"
                " (%.2f GiB of %.2f): the rest stay on the device",
                fits,
                len(blocks),
                room / 2**30 if room is not None else 0.0,
                len(blocks) * input_bytes / 2**30,
            )
        if self.host_inputs and fits:
            if self.swapper is None:
                self.swapper = ActivationSwapper(self.device)
            first = self.blocks_in_order()[:fits]  # their inputs wait longest for the backward
            for group in first:
                keep_checkpoint_input_on_host(group.module, self.swapper)
            # Counted after the switch: a re-fit (an OOM retry's) finds them switched already.
            switched = sum(policy_of(g.module) == "checkpoint_cpu" for g in first)
        tiled = set_mlp_tiles((g.module for g in blocks), PROFILING_MLP_TILE_TOKENS)
        if switched or tiled:
            logger.info(
                "profiling a long batch (%d blocks' inputs of %.0f MiB): %d blocks keep their"
                " inputs in host memory, %d MLPs run in tiles of %d tokens",
                len(blocks),
                input_bytes / 2**20,
                switched,
                tiled,
                PROFILING_MLP_TILE_TOKENS,
            )
        return True

    def apply_plan(self, plan: Plan) -> None:
        """The block policies and MLP tiles of ``plan``."""
        self._fitted_batch = 0  # a later profiling step fits its batch again
        if plan.block_policies and self.mode != "off":
            for group, policy in zip(self.blocks_in_order(), plan.block_policies, strict=False):
                self.apply_block_policy(group.module, policy)
        set_mlp_tiles((g.module for g in self.blocks_in_order()), plan.mlp_tile_tokens)

    def take_over_late_hf_checkpointing(self) -> None:
        """HF gradient checkpointing turned on after attach (HF ``Trainer`` does it in
        ``train()``, after its move): the block policies take it over, as at attach. Left on,
        HF's reentrant checkpoint would wrap the policies and break the profiling probe."""
        if self.mode == "off":
            return  # HF's checkpointing stays in charge, as at attach
        if any(
            getattr(g.module, "gradient_checkpointing", None) is True
            for g in self.groups
            if g.is_block
        ) and take_over_hf_gradient_checkpointing(self.model):
            if not self.hf_checkpointing_taken:
                logger.info("activation management takes over HF gradient checkpointing per block")
            self.hf_checkpointing_taken = True

    def remove(self) -> None:
        """At detach: every block's forward as before attach, no MLP or final-norm tiles, HF
        gradient checkpointing back where it was taken over, no callback into the runtime."""
        for group in self.groups:
            if group.is_block:
                remove_policy(group.module)
        set_mlp_tiles((g.module for g in self.groups if g.is_block), 0)
        if self.final_norm is not None:
            untile_mlp(self.final_norm)
            self.final_norm = None
        if self.hf_checkpointing_taken:
            restore_hf_gradient_checkpointing(self.model)
        # The runtime's ``position``: a cycle through the runtime, keeping a dropped model alive
        # until a cyclic gc.
        del self._position

    def free_idle_host_buffers(self) -> None:
        """The swapper's host buffers no saved tensor holds now go (``HostBufferPool.clear``)."""
        if self.swapper is not None:
            self.swapper.pool.clear()

    def release_swapper(self) -> None:
        """At detach: the swapper's device tensors in flight and its host buffers freed."""
        if self.swapper is not None:
            self.swapper.release_in_flight()
            self.swapper.pool.clear()
