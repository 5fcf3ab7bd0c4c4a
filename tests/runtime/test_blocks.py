"""discover_groups: one group per repeated block, and one per module around the blocks."""

from __future__ import annotations

from torch import nn

from autooffload.runtime.blocks import discover_groups


def test_llama_has_one_group_per_decoder_layer_plus_embed_norm_and_head(make_llama):
    model = make_llama(tied=False, n_layers=4)
    groups = discover_groups(model)
    assert [g.name for g in groups] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.layers.3",
        "model.norm",
        "lm_head",
    ]
    assert [g.index for g in groups] == list(range(len(groups)))
    blocks = [g for g in groups if g.is_block]
    assert [g.block_index for g in blocks] == [0, 1, 2, 3]
    assert all(g.module is model.model.layers[g.block_index] for g in blocks)
    assert groups[0].module is model.model.embed_tokens and not groups[0].is_block
    assert groups[-1].module is model.lm_head and not groups[-1].is_block


def test_every_parameter_belongs_to_exactly_one_group(make_llama):
    model = make_llama(tied=False)
    owned = []
    for group in discover_groups(model):
        owned += [id(p) for p in group.module.parameters(recurse=group.is_block)]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())


def test_tied_head_is_still_a_group_of_its_own(make_llama):
    """The head runs last and needs the shared weight again, so it must be gathered there too."""
    model = make_llama(tied=True)
    groups = discover_groups(model)
    head = [g for g in groups if g.name == "lm_head"]
    assert len(head) == 1
    assert head[0].module.weight is model.model.embed_tokens.weight


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


class _BlockWithExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([_Expert() for _ in range(4)])
        self.norm = nn.LayerNorm(8)


class _ModelWithNestedLists(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_BlockWithExperts() for _ in range(3)])
        self.head = nn.Linear(8, 16)


def test_a_module_list_nested_inside_a_block_is_not_a_block_list():
    model = _ModelWithNestedLists()
    groups = discover_groups(model)
    assert [g.name for g in groups] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert [g.is_block for g in groups] == [False, True, True, True, False]
    # The experts are gathered with their block, not as groups of their own.
    assert not any("experts" in g.name for g in groups)


def test_a_list_of_mixed_classes_is_not_a_block_list():
    model = nn.Sequential()
    model.add_module("stages", nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)]))
    groups = discover_groups(model)
    assert [(g.name, g.is_block) for g in groups] == [("stages.0", False), ("stages.1", False)]


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)


def test_blocks_in_a_sequential_are_found():
    """timm's ``self.blocks = nn.Sequential(*blocks)``: each layer is a block, so activation
    modes act on them (they were one module's computation, never checkpointed)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 8)
            self.blocks = nn.Sequential(*(_Layer() for _ in range(3)))
            self.mlp = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # bare layers: not blocks

    groups = discover_groups(Net())
    blocks = [g for g in groups if g.is_block]
    assert [g.name for g in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [g.block_index for g in blocks] == [0, 1, 2]
    assert {g.name for g in groups if not g.is_block} == {"embed", "mlp.0", "mlp.1"}


def test_a_nested_sequential_gives_blocks_of_its_outer_level():
    net = nn.Sequential(*(nn.Sequential(_Layer(), _Layer()) for _ in range(2)))
    blocks = [g for g in discover_groups(net) if g.is_block]
    assert [g.name for g in blocks] == ["0", "1"]
    assert all(g.module is net[g.block_index] for g in blocks)


def test_a_one_layer_hf_model_has_one_block(make_llama):
    model = make_llama(tied=False, n_layers=1)
    blocks = [g for g in discover_groups(model) if g.is_block]
    assert [g.name for g in blocks] == ["model.layers.0"]
    # One module of any other class in a list is not a block.
    holder = nn.Module()
    holder.only = nn.ModuleList([_Layer()])
    assert not any(g.is_block for g in discover_groups(holder))
