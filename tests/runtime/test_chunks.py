"""build_layout: params laid into aligned chunks in group order, big params alone, ties once."""

from __future__ import annotations

import torch
from torch import nn

from autooffload.runtime.chunks.host import HostArena, power_of_two_pieces
from autooffload.runtime.chunks.layout import ALIGN, aligned_bytes, build_layout


def _params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]


def _named(prefix: str, params: list[nn.Parameter]) -> list[tuple[str, nn.Parameter]]:
    return [(f"{prefix}.{i}", p) for i, p in enumerate(params)]


def test_params_keep_group_order_and_every_offset_is_64_byte_aligned():
    # 15 floats = 60 bytes: the next param must start at 64, not 60.
    first = _params((15,), (3, 5), (7,))
    second = _params((4, 4), (1,))
    layout = build_layout([(0, _named("a", first)), (1, _named("b", second))], chunk_size=1 << 20)
    assert len(layout.chunks) == 1
    slots = layout.chunks[0].slots
    assert [s.param for s in slots] == first + second
    assert [s.name for s in slots] == ["a.0", "a.1", "a.2", "b.0", "b.1"]
    assert all(s.offset % ALIGN == 0 for s in slots)
    assert [s.offset for s in slots] == [0, 64, 128, 192, 256]
    assert [s.nbytes for s in slots] == [60, 60, 28, 64, 4]
    assert layout.chunks[0].nbytes == 320 == aligned_bytes(first + second)
    assert all(s.shape == s.param.shape and s.dtype == s.param.dtype for s in slots)


def test_a_param_that_does_not_fit_starts_the_next_chunk():
    params = _params((16,), (16,), (16,), (16,))  # 64 bytes each
    layout = build_layout([(0, _named("p", params))], chunk_size=128)
    assert [[s.param for s in c.slots] for c in layout.chunks] == [params[:2], params[2:]]
    assert [c.index for c in layout.chunks] == [0, 1]
    assert all(c.nbytes <= 128 for c in layout.chunks)


def test_a_param_larger_than_the_chunk_size_gets_a_chunk_of_its_own():
    small_a, big, small_b = _params((8,), (100,), (8,))
    layout = build_layout([(0, _named("p", [small_a, big, small_b]))], chunk_size=128)
    assert [[s.param for s in c.slots] for c in layout.chunks] == [[small_a], [big], [small_b]]
    assert layout.chunks[1].nbytes == 448 > layout.chunk_size


def test_chunks_of_group_lists_every_chunk_a_group_needs_in_order():
    block_0 = _params((16,), (16,), (16,))
    block_1 = _params(
        (16,),
    )
    layout = build_layout([(0, _named("b0", block_0)), (1, _named("b1", block_1))], 128)
    assert layout.chunks_of_group == {0: [0, 1], 1: [1]}
    assert layout.chunks[1].groups == {0, 1}


def test_tied_weight_is_stored_once_and_its_chunk_serves_both_users(make_llama):
    model = make_llama(tied=True)
    embed = model.model.embed_tokens
    groups = [
        (0, list(embed.named_parameters())),
        (1, list(model.model.norm.named_parameters())),
        (2, list(model.lm_head.named_parameters())),
    ]
    # The embedding fills a chunk exactly, so the norm starts the next one.
    chunk_size = aligned_bytes([embed.weight])
    layout = build_layout(groups, chunk_size=chunk_size)
    stored = [s for c in layout.chunks for s in c.slots if s.param is embed.weight]
    assert len(stored) == 1
    assert len(layout.chunks) == 2
    assert layout.chunks[0].groups == {0, 2}
    assert layout.chunks[1].groups == {1}
    assert layout.chunks_of_group == {0: [0], 1: [1], 2: [0]}
    assert layout.total_bytes == aligned_bytes([embed.weight, model.model.norm.weight])


def test_trainable_slots_follow_requires_grad():
    trainable, frozen = _params((4,), (4,))
    frozen.requires_grad_(False)
    layout = build_layout([(0, _named("p", [trainable, frozen]))], chunk_size=1 << 20)
    chunk = layout.chunks[0]
    assert [s.param for s in chunk.trainable_slots] == [trainable]
    assert chunk.trainable_bytes == 16


def test_bf16_params_take_their_own_element_size():
    params = _params((10,), (10,), dtype=torch.bfloat16)
    layout = build_layout([(0, _named("p", params))], chunk_size=1 << 20)
    assert [s.nbytes for s in layout.chunks[0].slots] == [20, 20]
    assert [s.offset for s in layout.chunks[0].slots] == [0, 64]


def test_companions_share_their_params_chunk_and_count_their_bytes():
    """A quantized weight's quant state is laid right after it, in the same chunk, even when
    the param alone would still fit the current chunk and its companions would not."""
    filler = nn.Parameter(torch.zeros(48, dtype=torch.uint8), requires_grad=False)
    weight = nn.Parameter(torch.zeros(8, dtype=torch.uint8), requires_grad=False)
    absmax = torch.zeros(16)
    layout = build_layout(
        [(0, [("filler", filler), ("weight", weight)])],
        chunk_size=128,
        companions={id(weight): [("quant_state.absmax", absmax)]},
    )
    assert [[s.name for s in c.slots] for c in layout.chunks] == [
        ["filler"],
        ["weight", "weight.quant_state.absmax"],
    ]
    second = layout.chunks[1]
    assert [s.offset for s in second.slots] == [0, ALIGN]
    assert second.nbytes == ALIGN + 64
    assert second.trainable_slots == []


def test_an_oversized_embedding_and_head_do_not_set_the_size_of_other_chunks(make_llama):
    # Llama-3-8B QLoRA in small: a bf16 vocabulary far above the nf4 blocks' chunk size. The
    # embedding and the untied head each get a chunk of exactly their size; everything else,
    # including the params right after them, is packed into chunks of at most chunk_size.
    model = make_llama(tied=False)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    groups = [(0, list(model.model.embed_tokens.named_parameters()))]
    groups += [
        (1 + i, list(layer.named_parameters())) for i, layer in enumerate(model.model.layers)
    ]
    groups += [(10, list(model.model.norm.named_parameters()))]
    groups += [(11, list(model.lm_head.named_parameters()))]
    chunk_size = aligned_bytes([embed]) // 2
    layout = build_layout(groups, chunk_size=chunk_size)
    first, last = layout.chunks[0], layout.chunks[-1]
    assert [s.param for s in first.slots] == [embed] and first.nbytes == aligned_bytes([embed])
    assert [s.param for s in last.slots] == [head] and last.nbytes == aligned_bytes([head])
    assert all(c.nbytes <= chunk_size for c in layout.chunks[1:-1])
    assert layout.chunk_size == chunk_size and layout.chunks_of_group[0] == [0]
    assert layout.total_bytes == aligned_bytes(list(model.parameters()))


def test_the_host_arena_is_laid_out_in_pieces_torch_pins_without_rounding_waste():
    mib = 1 << 20
    pieces, place = power_of_two_pieces([416 * mib] * 24)  # Llama-3-8B's offloaded blocks
    # torch rounds each pinned allocation up to a power of two: one 9.75 GiB arena pins 16 GiB.
    pinned = sum(1 << (n - 1).bit_length() for n in pieces)
    assert pinned == (8 + 2 + 0.5) * 1024 * mib and sum(pieces) == 24 * 416 * mib
    # Every chunk lies whole in one piece, in order, no two overlapping.
    spans = sorted((piece, start, start + 416 * mib) for piece, start in place)
    for (p1, _, end), (p2, start, _) in zip(spans, spans[1:]):
        assert p1 < p2 or end <= start
    assert all(start + 416 * mib <= pieces[piece] for piece, start in place)
    # Chunks another rank owns (0 bytes) take no room; views and aliases read the right bytes.
    sizes = [12, 0, 40, 0, 8, 20]
    arena = HostArena(sizes, pin=False)
    assert sum(p.numel() for p in arena.pieces) == sum(sizes) and len(arena.pieces) > 1
    for index in range(len(sizes)):
        arena.view(index).fill_(index)
    for index, size in enumerate(sizes):
        view = arena.view(index)
        assert view.numel() == size and bool((view == index).all())
        if size:
            assert arena.contains(view)
            alias = arena.alias(index, 4, 4, torch.int32, torch.Size([1]))
            assert alias.item() == int.from_bytes(bytes([index] * 4), "little")
