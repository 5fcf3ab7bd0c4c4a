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
    remove_policy,
    restore_hf_gradient_checkpointing,
    take_over_hf_gradient_checkpointing,
)
from autooffload.runtime.activations.tiled_mlp import set_mlp_tiles
from autooffload.runtime.blocks import Group

# The profiling steps keep the checkpointed blocks' inputs in host memory when, one input per
# block, they would take more than this share of the budget (``host_inputs_for_profiling``).
PROFILING_INPUTS_SHARE = 0.25


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
    ) -> None:
        self.model = model
        # Whether checkpointed blocks may keep their inputs in host memory (the search's
        # ``checkpoint_inputs`` is not "gpu" and the policies are the planner's).
        self.host_inputs = host_inputs and mode == "auto"
        self.groups = groups
        self.device = device
        # Settings.activation_mode: "off" leaves the blocks (and HF's checkpointing) alone.
        self.mode = mode
        self._position = position
        # Made at the first block swapped or checkpointed with its inputs on the host.
        self.swapper: ActivationSwapper | None = None
        self.hf_checkpointing_taken = False

    def blocks_in_order(self) -> list[Group]:
        """The blocks in the order the last forward ran them."""
        blocks = [g for g in self.groups if g.is_block]
        return sorted(blocks, key=lambda g: self._position(g.index))

    def start(self) -> None:
        """Conservative start: every block checkpointed (or under the mode's fixed policy) until
        the plan from the real batch, HF gradient checkpointing taken over."""
        if self.mode == "off" or not any(g.is_block for g in self.groups):
            return
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

    def host_inputs_for_profiling(self, input_bytes: int, budget: int | None) -> int:
        """In a profiling step, at a block's forward: when the checkpointed blocks' inputs
        (``input_bytes`` per block) would take more than ``PROFILING_INPUTS_SHARE`` of the
        budget, every checkpointed block keeps its input in host memory for the profiling steps
        (``checkpoint_cpu``), the block entering its forward included. A long batch's inputs
        would otherwise fill the device beside the block being recomputed (Llama-3-8B at seq
        65536: 32 x 512 MiB). The blocks' profiles come from the block probe, which runs each
        block alone, so they do not depend on this. Returns how many blocks it switched."""
        blocks = [g for g in self.groups if g.is_block]
        if not self.host_inputs or budget is None:
            return 0
        if len(blocks) * input_bytes <= PROFILING_INPUTS_SHARE * budget:
            return 0
        if self.swapper is None:
            self.swapper = ActivationSwapper(self.device)
        switched = sum(keep_checkpoint_input_on_host(g.module, self.swapper) for g in blocks)
        if switched:
            logger.info(
                "profiling steps: %d checkpointed blocks keep their inputs in host memory"
                " (%d x %.0f MiB would take over a quarter of the budget)",
                switched,
                len(blocks),
                input_bytes / 2**20,
            )
        return switched

    def apply_plan(self, plan: Plan) -> None:
        """The block policies and MLP tiles of ``plan``."""
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
        """At detach: every block's forward as before attach, no MLP tiles, HF gradient
        checkpointing back where it was taken over."""
        for group in self.groups:
            if group.is_block:
                remove_policy(group.module)
        set_mlp_tiles((g.module for g in self.groups if g.is_block), 0)
        if self.hf_checkpointing_taken:
            restore_hf_gradient_checkpointing(self.model)

    def release_swapper(self) -> None:
        """At detach: the swapper's device tensors in flight and its host buffers freed."""
        if self.swapper is not None:
            self.swapper.release_in_flight()
            self.swapper.pool.clear()
