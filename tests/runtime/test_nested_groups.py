"""A module owning parameters that calls another parameter-owning module keeps its chunks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autooffload
from autooffload import runtime as rt


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class ScaledHead(nn.Module):
    """Owns ``scale`` and reads it after its child ``proj`` (a group of its own) has run."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = ScaledHead(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train(model: nn.Module, attach: bool) -> list[float]:
    if attach:
        autooffload.enable(device="cpu", force_attach=True, n_persist=0, activation_mode="keep")
        model.to("cpu")
        runtime = rt.runtime_of(model)
        assert runtime is not None
        head_chunks = set(runtime.layout.chunks_of_group[_group(runtime, "head")])
        proj_chunks = set(runtime.layout.chunks_of_group[_group(runtime, "head.proj")])
        assert head_chunks & proj_chunks, "the test needs the two groups to share a chunk"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(4):
        x = torch.randn(4, 16, generator=generator)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _group(runtime: rt.Runtime, name: str) -> int:
    return next(g.index for g in runtime.groups if g.name == name)


def test_enclosing_group_keeps_the_chunk_its_child_shares():
    torch.manual_seed(0)
    base = Net()
    plain = _train(copy.deepcopy(base), attach=False)
    attached = _train(copy.deepcopy(base), attach=True)
    assert attached == plain


class _GainedBlocks(nn.Module):
    """Owns ``gain`` and runs a list of blocks: a group whose forward encloses the blocks'."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.layers = nn.ModuleList(Block(width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x * self.gain)
        return x


class _EncoderNet(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.encoder = _GainedBlocks(width)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


@pytest.mark.parametrize("mode", ["keep", "checkpoint", "swap"])
def test_a_group_around_blocks_leaves_their_chunks_to_their_own_backward(mode: str) -> None:
    """The backward of a module owning params around blocks starts before the blocks': their
    chunks, each apart from its neighbours', are neither released nor completed then (the
    blocks' backward read released weights)."""
    torch.manual_seed(0)
    base = _EncoderNet()
    plain = _train(copy.deepcopy(base), attach=False)
    model = copy.deepcopy(base)
    autooffload.enable(
        device="cpu", force_attach=True, n_persist=0, activation_mode=mode, chunk_size=1200
    )
    model.to("cpu")
    runtime = rt.runtime_of(model)
    assert runtime is not None
    chunks = [set(runtime.layout.chunks_of_group[g.index]) for g in runtime.groups if g.is_block]
    assert len(chunks) == 3 and not (chunks[0] & chunks[1]) and not (chunks[1] & chunks[2])
    attached = _train(model, attach=False)
    assert attached == plain
